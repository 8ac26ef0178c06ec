"""One aggregator of a hierarchical parameter server (Rudra-adv, Gupta et al. 2016): an
interior node of the tree (``tree.py``) that sums its children's gradients, pushes the sum
to its parent and hands the weights that come back down to the children.

Both sides speak the parameter-server protocol (``protocol.py``). To its children an
aggregator looks like the S servers of the root: a child's link carries one message per
shard, in shard order, and is answered in that order. To its parent it is a client
(``PSClient``) whose pushes are *tree pushes*: the sum of several workers' gradients with a
members payload naming each one's worker, clock and shard version, so the root applies
every worker gradient exactly once and measures its staleness.

Batching. One forwarder thread owns the uplink. It forwards everything its children have
pushed, as one sum, as soon as the batch holds at least n gradients (the root's n-softsync
group size: the root could not use more at once) or every live child has pushed (nobody
else can add to it). With n = P every aggregator therefore waits for its whole subtree,
and the root sees one push per child per clock: synchronous training. With n = 1 a push
travels up alone unless others arrived while the uplink was busy, which then go together.
Children are summed in their tree order, so a synchronous tree is deterministic.

Faults. A child whose link breaks or whose heartbeat stands still for ``--peer-timeout``
is lost: it stops counting towards a batch, and what it pushed before is still forwarded.
If the lost child was an aggregator, its children re-attach here (``reattach``: the
nearest live ancestor of the dead node adopts them, in the order they register in the
store) and this aggregator does not finish before they have re-attached, finished or died.
A re-attached child's first push is the one the dead node held; it goes up alone, so
that the root can recognise it whole (by its workers' clocks) if it was already applied.
If this aggregator's own parent dies it re-attaches the same way and sends its batch again.

End. When no child is live the aggregator says BYE to its parent, waits until the servers
have drained, forwards the final pulls, and shuts its uplink once every child has shut down.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plexus.cluster.emulation import Emulator
from plexus.cluster.group import Link
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.errors import CommError, ProtocolError
from plexus.ps.client import PSClient
from plexus.ps.heartbeat import Heartbeat, Log, Watch
from plexus.ps.protocol import (HEADER_BYTES, MEMBER_FIELDS, SENTINEL, Header, Op, ShardSpec, Status, check_request,
                                code_dtype, decode, encode, header_buffer)
from plexus.ps.server import KEYS, orphans, recv_payloads, tree_node_ended
from plexus.ps.sharding import RangeSharding
from plexus.ps.tree import ROOT, Node, Tree, adopt_key, node_of
from plexus.cluster.liveness import exited_key

__all__ = ["Aggregator", "reattach"]

logger = logging.getLogger(__name__)

EXPECTED, ACTIVE, FINISHED, CLOSED, LOST = "expected", "active", "finished", "closed", "lost"


def reattach(store: dist.Store, tree: Tree, node: Node, dead: Node, straight_to_root: bool) -> tuple[Node, int]:
    """Where ``node`` re-attaches after its parent ``dead`` died: the nearest ancestor of
    ``dead`` not known to be lost too (or the root, ``straight_to_root``, as adv*'s
    learners do); returns it and ``node``'s sender index there (after its own children,
    in the order the children that re-attach register)."""
    parent = ROOT if straight_to_root else tree.parent(dead)
    while parent != ROOT and (store.check([KEYS.lost(parent.name)]) or store.check([exited_key(parent.name)])):
        parent = tree.parent(parent)
    k = int(store.add(adopt_key(parent), 1)) - 1
    store.set(f"{adopt_key(parent)}/{k}", node.name)
    return parent, len(tree.children(parent)) + k


@dataclass
class _Entry:
    """One child's push waiting to be forwarded."""

    child: int
    op: Op
    grad: torch.Tensor                 # the child's gradient (or sum), the whole flat buffer
    members: list[torch.Tensor]        # per shard: [m, 3] (worker, clock, version)
    done: threading.Event = field(default_factory=threading.Event)
    weights: torch.Tensor | None = None
    versions: list[int] = field(default_factory=list)
    error: str | None = None
    resend: bool = False               # a re-attached child's first push (forwarded alone)

    @property
    def weight(self) -> int:
        return len(self.members[0])


@dataclass
class _Child:
    name: str
    leaves: tuple[int, ...]
    state: str = EXPECTED
    since: float = field(default_factory=time.monotonic)
    beats: int = 0
    heard: float = 0.0
    clock: int = 0
    thread: threading.Thread | None = field(default=None, repr=False)
    # Re-attached here after its parent died: its first push goes up alone, so that the
    # root can recognise it whole if the dead parent had already forwarded it.
    resend: bool = False


class Aggregator:
    """Aggregator ``index`` of the tree over ``cfg.cluster.workers`` workers; ``n`` is the
    root's softsync group size (gradients per update)."""

    def __init__(self, store: dist.Store, index: int, cfg: JobConfig, traffic: Traffic, n: int,
                 push_only: bool = False, emulator: Emulator | None = None, log: Log | None = None) -> None:
        self.store, self.index, self.cfg, self.traffic = store, index, cfg, traffic
        self.n, self.push_only, self.emulator = n, push_only, emulator
        self.node = Node("aggregator", index)
        self.me = self.node.name
        self.tree = Tree(cfg.cluster.workers, cfg.strategy.fanout)
        parent = self.tree.parent(self.node)
        self.parent = None if parent == ROOT else parent.name
        self.position = self.tree.position(self.node)
        self.servers = max(1, cfg.cluster.servers)
        self.timeout, self.peer_timeout = cfg.cluster.timeout, cfg.cluster.peer_timeout
        self.idle_limit = 2 * self.timeout + self.peer_timeout
        self.interval = min(0.25, self.peer_timeout / 4)
        self.log = log   # the metrics log, for long heartbeat gaps
        self.watch = Watch(self.me, self.peer_timeout, self.timeout, self.interval, log=log)
        self.heartbeat: Heartbeat | None = None
        self.children = [_Child(c.name, self.tree.leaves(c)) for c in self.tree.children(self.node)]
        self.cond = threading.Condition()
        self.pending: list[_Entry] = []
        self.uplink = threading.Lock()       # one exchange at a time on the links to the parent
        self.client: PSClient | None = None
        self.specs: list[ShardSpec] = []
        self.weights = torch.empty(0)        # the latest weights from the parent (after INIT)
        self.ready = threading.Event()       # INIT done upstream
        self.drained = threading.Event()     # the servers drained: final pulls may go up
        self.clock = 0                       # pushes forwarded
        self.forwarded: dict[int, int] = {}  # worker -> gradients forwarded
        self.batches: dict[int, int] = {}    # gradients per forwarded push -> pushes
        self.lost: dict[str, str] = {}
        self.protocol_errors = 0
        self.failure: str | None = None
        self.adopted = 0                     # children that re-attached here
        self.awaiting: set[str] = set()      # children of a lost child, which may re-attach here
        self.reattached: list[dict[str, Any]] = []   # this aggregator's own re-attachments

    # --- main loop ----------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Run until every child has shut down; returns the final record."""
        heartbeat = self.heartbeat = Heartbeat(self.store, self.index, self.peer_timeout / 5, role="aggregator",
                                               limit=self.peer_timeout, log=self.log)
        stop = threading.Event()
        monitor = threading.Thread(target=self._monitor, args=(stop,), name=f"{self.me} monitor", daemon=True)
        try:
            for i, child in enumerate(self.children):
                child.thread = threading.Thread(target=self._serve_child, args=(i,), name=f"{self.me} <- "
                                                f"{child.name}", daemon=True)
                child.thread.start()
            monitor.start()
            self._forward()
            if self.client is not None:
                with self.uplink:
                    self.client.signal(Op.BYE, self.clock)
                self.client.wait_drained(self.peer_timeout)
            self.drained.set()
            with self.cond:
                while any(c.state not in (CLOSED, LOST) for c in self.children):
                    self.cond.wait(1.0)
            if self.client is not None:
                with self.uplink:
                    self.client.signal(Op.SHUTDOWN, self.clock)
        finally:
            stop.set()
            heartbeat.stop(self.timeout)
            # A thread still inside a gloo or store call at interpreter exit aborts the process.
            if monitor.is_alive():
                monitor.join(timeout=5 * self.interval + 5)
            for child in self.children:
                if child.thread is not None and child.thread.is_alive():
                    child.thread.join(timeout=5.0)
            if self.client is not None:
                self.client.close()
        return self.record()

    def record(self) -> dict[str, Any]:
        with self.cond:
            return {"children": [c.name for c in self.children], "pushes": self.clock,
                    "forwarded": {str(w): n for w, n in sorted(self.forwarded.items())},
                    "batch_sizes": {str(k): n for k, n in sorted(self.batches.items())},
                    "lost": dict(self.lost),
                    "lost_workers": sorted(w for c in self.children if c.state == LOST for w in c.leaves),
                    "reattached": list(self.reattached),
                    "protocol_errors": self.protocol_errors, "bytes_sent": self.traffic.bytes_sent,
                    "bytes_recv": self.traffic.bytes_recv,
                    "heartbeat": {**self.watch.record(), **(self.heartbeat.record() if self.heartbeat else {})}}

    # --- the uplink -----------------------------------------------------------------------

    def _batch_ready(self) -> bool:
        """Under the lock: forward now (see the module docstring)."""
        if not self.pending:
            return False
        waiting = {e.child for e in self.pending}
        live = [i for i, c in enumerate(self.children) if c.state in (EXPECTED, ACTIVE)]
        return sum(e.weight for e in self.pending) >= self.n or all(i in waiting for i in live)

    def _forward(self) -> None:
        """The forwarder: returns once no child is live and nothing is pending."""
        while True:
            with self.cond:
                while not self._batch_ready():
                    if not self.pending and not self.awaiting and \
                            all(c.state not in (EXPECTED, ACTIVE) for c in self.children):
                        return
                    self.cond.wait(1.0)
                resent = [e for e in self.pending if e.resend]
                batch = resent[:1] or sorted(self.pending, key=lambda e: e.child)
                self.pending = [e for e in self.pending if e not in batch]
            try:
                self._send_up(batch)
            except BaseException as exc:
                why = f"{self.me}: its parent {self.parent or 'the servers'} failed: {exc}"
                for entry in batch:
                    entry.error = why
                    entry.done.set()
                with self.cond:
                    self.failure = why
                    self.cond.notify_all()
                raise

    def _send_up(self, batch: list[_Entry]) -> None:
        grad = batch[0].grad
        if len(batch) > 1:
            grad = grad.clone()
            for entry in batch[1:]:
                grad.add_(entry.grad)
        members = [torch.cat([e.members[s] for e in batch]) for s in range(self.servers)]
        versions = [int(m[:, 2].max()) for m in members]
        weights = None if self.push_only else torch.empty_like(self.weights)
        if self.emulator is not None:
            self.emulator.at_step(self.clock)  # --kill aggregator:K@step=N counts forwarded pushes
        with self.uplink:
            while True:
                try:
                    if self.push_only:
                        self.client.push(grad, self.clock, versions, members)
                    else:
                        self.client.push_pull(grad, weights, self.clock, versions, members)
                    break
                except CommError as exc:
                    if self.parent is None:  # the servers: nothing above them to re-attach to
                        raise
                    self._reattach(exc)
            got = list(self.client.versions)
        with self.cond:
            self.clock += 1
            size = len(members[0])
            self.batches[size] = self.batches.get(size, 0) + 1
            for rank in members[0][:, 0].tolist():
                self.forwarded[rank] = self.forwarded.get(rank, 0) + 1
            if weights is not None:
                self.weights = weights
        for entry in batch:
            entry.weights, entry.versions = weights, got
            entry.done.set()

    def _reattach(self, exc: CommError) -> None:
        """Under the uplink lock, after the link to the parent broke: re-attach to the
        nearest live ancestor (``reattach``) and open the uplink there; the push is then
        sent again."""
        started = time.monotonic()
        dead = node_of(self.parent)
        parent, sender = reattach(self.store, self.tree, self.node, dead, straight_to_root=False)
        logger.warning("%s: lost its parent %s (%s); re-attaching to %s", self.me, dead.name, exc,
                       "the servers" if parent == ROOT else parent.name)
        self.client.close()
        self.parent = None if parent == ROOT else parent.name
        self.client = PSClient(self.store, self.index, self.servers, numel=self.specs[0].total,
                               dtype=self.specs[0].dtype, traffic=self.traffic, timeout=self.timeout,
                               net=self.cfg.cluster.net, transport=self.cfg.cluster.transport, sender=sender,
                               name=self.me, parent=self.parent)
        self.client.connect()
        self.client.init(self.weights.clone(), clock=self.clock)
        self.reattached.append({"node": self.me, "from": dead.name, "to": parent.name, "push": self.clock,
                                "seconds": time.monotonic() - started})

    # --- membership -------------------------------------------------------------------------

    def _monitor(self, stop: threading.Event) -> None:
        """Children's heartbeats, on its own store connection."""
        store = self.watch.attach(self.store.clone())
        while not stop.is_set():
            now = time.monotonic()
            self.watch.tick(now)
            with self.cond:
                watched = [i for i, c in enumerate(self.children) if c.state in (EXPECTED, ACTIVE, FINISHED)]
            for i in watched:
                beats = store.add(KEYS.heartbeat_of(self.children[i].name), 0)
                with self.cond:
                    why = self.watch.judge(self.children[i].name, beats, now, self.children[i].since)
                if why is not None:
                    self._lose(i, why)
            asked = int(store.add(adopt_key(self.node), 0))
            while self.adopted < asked:  # a child of a dead aggregator re-attaches here
                self._adopt(store.get(f"{adopt_key(self.node)}/{self.adopted}").decode())
                self.adopted += 1
            with self.cond:
                awaited = set(self.awaiting)
            ended = {name for name in awaited if tree_node_ended(store, name)}
            if ended:  # finished or lost before it could re-attach: nothing to wait for
                with self.cond:
                    self.awaiting -= ended
                    self.cond.notify_all()
            stop.wait(self.interval)

    def _adopt(self, name: str) -> None:
        """Take ``name`` as one more child (it sends INIT with its next clock)."""
        with self.cond:
            self.awaiting.discard(name)
            self.children.append(_Child(name, self.tree.leaves(node_of(name))))
            i = len(self.children) - 1
            self.cond.notify_all()
        logger.warning("%s: %s re-attaches here", self.me, name)
        thread = threading.Thread(target=self._serve_child, args=(i,), name=f"{self.me} <- {name}", daemon=True)
        self.children[i].thread = thread
        thread.start()

    def _lose(self, i: int, reason: str) -> None:
        with self.cond:
            child = self.children[i]
            if child.state in (CLOSED, LOST):
                return
            if child.state == FINISHED:
                child.state = CLOSED
                self.cond.notify_all()
                return
            child.state = LOST
            self.lost[child.name] = reason
            self.awaiting |= set(orphans(self.tree, child.name))  # its children re-attach here
            self.cond.notify_all()
        logger.warning("%s: lost %s (%s); the gradients of worker(s) %s stop here", self.me, child.name, reason,
                       ", ".join(map(str, child.leaves)))
        try:
            self.store.clone().set(KEYS.lost(child.name), reason)  # for the workers that take over evaluation
        except RuntimeError as exc:  # the store is the launcher's; if it is gone the job is over
            logger.warning("%s: could not announce the loss of %s: %s", self.me, child.name, exc)

    # --- one child ---------------------------------------------------------------------------

    def _serve_child(self, i: int) -> None:
        child = self.children[i]
        try:
            link = Link(self.store.clone(), self.me, child.name, traffic=self.traffic, timeout=self.timeout,
                        net=self.cfg.cluster.net, transport=self.cfg.cluster.transport)
        except CommError as exc:
            self._lose(i, f"its link could not be opened: {exc}")
            return
        buffers = [header_buffer() for _ in range(self.servers)]
        try:
            while self._handle(link, i, self._receive(link, i, buffers)):
                pass
        except ProtocolError as exc:
            with self.cond:
                self.protocol_errors += 1
            logger.error("%s: protocol error from %s: %s; closing its link", self.me, child.name, exc)
            self._reply_status(link, Status.ERROR)
            self._lose(i, f"protocol error: {exc}")
        except CommError as exc:
            self._lose(i, str(exc))
        finally:
            link.close()
            self._lose(i, "its link closed")

    def _receive(self, link: Link, i: int, buffers: list[torch.Tensor]) -> list[tuple[Header, list[torch.Tensor]]]:
        """One request: a header and its payloads per shard, all with the same operation."""
        out = []
        for s, buffer in enumerate(buffers):
            buffer.fill_(SENTINEL)
            link.recv_from_peer(buffer, timeout=self.idle_limit, counted=HEADER_BYTES)
            h = decode(buffer, link.peer)
            if out and h.op != out[0][0].op:
                raise ProtocolError(f"{link.peer} mixed {Op(out[0][0].op).name} and {Op(h.op).name} in one "
                                    f"request", peer=link.peer)
            if h.op == Op.INIT:
                self._layout(h, link.peer)
            if self.specs:
                check_request(h, self.specs[s], i, link.peer)
            elif h.op != Op.INIT:
                raise ProtocolError(f"{link.peer} sent {h.describe()} before INIT", peer=link.peer)
            if h.keys:
                raise ProtocolError(f"{link.peer} sent sparse rows: a tree carries dense models only",
                                    peer=link.peer)
            if h.members > self.cfg.cluster.workers:
                raise ProtocolError(f"{link.peer} announced {h.members} gradients in one push", peer=link.peer)
            out.append((h, recv_payloads(link, h)[0]))
        return out

    def _layout(self, h: Header, peer: str) -> None:
        with self.cond:
            if self.specs:
                return
            if h.total < 0 or h.rows:
                raise ProtocolError(f"{peer} sent an impossible layout in {h.describe()}", peer=peer)
            sharding, dtype = RangeSharding(h.total, self.servers), code_dtype(h.dtype)
            self.specs = [ShardSpec(index=s, start=sharding.range(s)[0], stop=sharding.range(s)[1], dtype=dtype,
                                    total=h.total) for s in range(self.servers)]

    def _handle(self, link: Link, i: int, request: list[tuple[Header, list[torch.Tensor]]]) -> bool:
        child = self.children[i]
        op = Op(request[0][0].op)
        if op == Op.INIT:
            if child.state != EXPECTED:
                raise ProtocolError(f"{link.peer} sent a second INIT", peer=link.peer)
            self._init_upstream(request)
            with self.cond:
                child.state = ACTIVE
                # A child that re-attached here goes on from its own next clock.
                child.clock = request[0][0].clock
                child.resend = child.clock > 0
                self.cond.notify_all()
            self._reply(link, request, self.weights, self._versions())
            return True
        if child.state == EXPECTED:
            raise ProtocolError(f"{link.peer} sent {op.name} before INIT", peer=link.peer)
        if child.state == LOST:  # declared lost (silent too long): it does not come back
            self._reply_status(link, Status.LOST)
            return False
        if op in (Op.PUSH, Op.PUSH_PULL):
            if child.state != ACTIVE:
                raise ProtocolError(f"{link.peer} pushed after BYE", peer=link.peer)
            if (op == Op.PUSH) != self.push_only:
                raise ProtocolError(f"{link.peer} sent {op.name}; this tree takes "
                                    f"{'PUSH' if self.push_only else 'PUSH_PULL'}", peer=link.peer)
            entry = self._entry(i, op, request, link.peer)
            with self.cond:
                self.pending.append(entry)
                self.cond.notify_all()
            if not entry.done.wait(self.timeout + self.idle_limit):
                raise CommError(f"{self.me}: no answer from {self.parent or 'the servers'} for "
                                f"{self.timeout + self.idle_limit:g} s", peer=self.parent or "server 0")
            if entry.error is not None:
                self._reply_status(link, Status.ERROR)
                return False
            self._reply(link, request, entry.weights, entry.versions)
            return True
        if op == Op.PULL:
            weights = torch.empty_like(self.weights)
            with self.uplink:
                self.client.pull(weights, self.clock)
                versions = list(self.client.versions)
            self._reply(link, request, weights, versions)
            return True
        if op == Op.CLOCK:
            self._reply(link, request, None, self._versions())
            return True
        if op == Op.BYE:
            with self.cond:
                if child.state == ACTIVE:
                    child.state = FINISHED
                    self.cond.notify_all()
            self._reply(link, request, None, self._versions())
            # The child now waits on the store until the servers drain; receive nothing meanwhile.
            while not self.drained.wait(1.0):
                with self.cond:
                    if child.state != FINISHED or self.failure:
                        return False
            return True
        if op == Op.SHUTDOWN:
            self._reply(link, request, None, self._versions())
            with self.cond:
                child.state = CLOSED
                self.cond.notify_all()
            return False
        raise ProtocolError(f"{link.peer} sent {op.name}, which an aggregator does not serve", peer=link.peer)

    def _versions(self) -> list[int]:
        return list(self.client.versions) if self.client is not None else [0] * self.servers

    def _init_upstream(self, request: list[tuple[Header, list[torch.Tensor]]]) -> None:
        """The first child's INIT opens the uplink and offers its values (every worker's
        are the same, contract 2); later ones wait for that and get the current weights."""
        with self.uplink:
            if self.ready.is_set():
                return
            spec = self.specs[0]
            values = torch.cat([p[0] if h.count else torch.empty(0, dtype=spec.dtype) for h, p in request])
            self.client = PSClient(self.store, self.index, self.servers, numel=spec.total, dtype=spec.dtype,
                                   traffic=self.traffic, timeout=self.timeout, net=self.cfg.cluster.net,
                                   transport=self.cfg.cluster.transport, sender=self.position, name=self.me, parent=self.parent)
            self.client.connect()
            self.client.init(values)
            self.weights = values
            self.ready.set()

    def _entry(self, i: int, op: Op, request: list[tuple[Header, list[torch.Tensor]]], peer: str) -> _Entry:
        """The child's push as a batch entry: its whole gradient and whose gradients it holds."""
        child = self.children[i]
        parts, members = [], []
        for h, payloads in request:
            if h.clock != child.clock:
                raise ProtocolError(f"{peer} pushed clock {h.clock}, expected clock {child.clock}", peer=peer)
            if h.count:
                parts.append(payloads[0])
            if h.members:
                rows = payloads[-1].view(h.members, MEMBER_FIELDS)
                if not set(rows[:, 0].tolist()) <= set(child.leaves):
                    raise ProtocolError(f"{peer} pushed gradients of workers outside its subtree", peer=peer)
            elif child.name.startswith("worker "):
                rows = torch.tensor([[child.leaves[0], h.clock, h.version]], dtype=torch.int64)
            else:
                raise ProtocolError(f"{peer} pushed without listing whose gradients it sums", peer=peer)
            members.append(rows)
        if len({len(m) for m in members}) != 1:
            raise ProtocolError(f"{peer} listed different gradients for different shards", peer=peer)
        child.clock += 1
        grad = torch.cat(parts) if len(parts) != 1 else parts[0]
        entry = _Entry(i, op, grad, members, resend=child.resend)
        child.resend = False
        return entry

    def _reply(self, link: Link, request: list[tuple[Header, list[torch.Tensor]]], weights: torch.Tensor | None,
               versions: list[int]) -> None:
        """Answer each shard's message in order, with that shard's slice of ``weights``."""
        works = []
        for s, (h, _) in enumerate(request):
            dense = weights is not None and Op(h.op) in (Op.INIT, Op.PULL, Op.PUSH_PULL) and h.count
            reply = Header(op=Op.REPLY, sender=s, shard=s, clock=0, version=versions[s], offset=h.offset,
                           count=h.count if dense else 0, width=h.width, dtype=h.dtype)
            works.append(link.isend(encode(reply), link.peer_index))
            if dense:
                spec = self.specs[s]
                works.append(link.isend(weights[spec.start:spec.stop], link.peer_index))
        for work in works:
            work.wait()

    def _reply_status(self, link: Link, status: Status) -> None:
        try:
            link.send_to_peer(encode(Header(op=Op.REPLY, sender=0, shard=0, status=status)),
                              timeout=min(5.0, self.timeout))
        except CommError:
            pass
