"""One parameter-server process: serves its shard to every worker over that worker's Link.

Loop. Each worker talks to the server over its own ``Link``, a two-member gloo group, so
that a worker's death breaks only its own link and a worker can join a running job
(ARCHITECTURE.md, section 8). ``recv_any`` would need one group holding every worker, which
gives up both properties, so the server runs one thread per link: the thread receives a
header, checks it against the shard (``protocol.check_request``), receives the payloads
the header announced, and answers. Threads share the shard under one lock; gloo and torch
release the GIL while they move or add numbers, so threads overlap their transfers.
``plexus bench ps`` measures the resulting push-pull rate against torch's RPC server.

Consistency. Every push goes to the pure gate of ``consistency.py``, which returns the
groups to apply now; each group is averaged in rank order and applied once with the
server optimizer (``optimizers.py``), which counts one version. With backup workers
(``--backup-workers b`` under bsp) the gate may drop a push that comes after its step was
made; the push is still acknowledged (and counted in the record's ``late``), never applied. A read (a pull, or the
answer to a fused push-and-pull) waits until the gate's ``may_serve`` allows it. An update
writes the new weights into a spare buffer, which then becomes current, so every reply is
sent, without a copy, from the buffer of one version while later updates go elsewhere.

Membership. The initial workers are live from the start (a BSP barrier waits for a worker
that is still starting); a worker that joins later registers through the store
(``ps/joined``) and becomes live when its INIT arrives. A worker leaves when it says BYE
(finished), or is lost: its link broke, it broke the protocol, or its heartbeat counter in
the store stood still for ``--peer-timeout`` seconds (``--timeout`` before its first beat).
Its pushes already received are still applied, so nothing acknowledged is lost; a server
that declares a worker lost writes ``lost/worker <w>`` so the other servers drop it too.

End. Once no worker is live and nothing is pending, the shard is *drained*: the server
writes ``ps/drained/<s>`` (server 0 names there the worker that evaluates the final model),
answers the remaining reads (the final pull), and returns when every remaining link has
been shut down.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from plexus.cluster.checkpoint_files import server_checkpoints
from plexus.cluster.emulation import Emulator
from plexus.cluster.liveness import exited_key
from plexus.cluster.group import Link
from plexus.cluster.rendezvous import lost_key
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig, parse_kill
from plexus.errors import CommError, CommTimeout, ProtocolError
from plexus.ps.consistency import Consistency, Push, SoftSync, make_consistency
from plexus.ps.heartbeat import Log, Watch, beat_key
from plexus.ps.optimizers import ServerOptimizer, make_server_optimizer
from plexus.ps.replication import (Replicator, ShardState, WorkerRow, draining_key, handoff_key, owner_of,
                                   successors)
from plexus.ps.protocol import (HEADER_BYTES, MEMBER_FIELDS, SENTINEL, Header, Op, ShardSpec, Status, check_request,
                                code_dtype, decode, encode, header_buffer, mark_payload, payload_short,
                                request_payloads)
from plexus.ps.sharding import HashRing, RangeSharding
from plexus.ps.tree import ROOT, Tree, adopt_key, node_of
from plexus.ps.staleness import StalenessHistogram, staleness_lr_scale

__all__ = ["ParameterServer", "KEYS", "VNODES", "LEDGER_BASE", "recv_payloads", "silent_for"]

logger = logging.getLogger(__name__)

# Virtual nodes per server on the hash ring of sparse rows.
VNODES = 64
# ``--ledger``: worker w's push of clock t carries w * LEDGER_BASE + t in the first element
# of every shard's range (an integer that float32 holds exactly below 2**24).
LEDGER_BASE = 10 ** 6


class KEYS:
    """Store keys (under the job's namespace) shared by servers and workers."""

    joined = "ps/joined"                      # counter: workers that joined after the start

    @staticmethod
    def heartbeat(role: str, rank: int) -> str:
        return beat_key(role, rank)

    @staticmethod
    def heartbeat_of(name: str) -> str:
        """The heartbeat key of the process called ``name`` (``worker 3``)."""
        role, rank = name.split()
        return KEYS.heartbeat(role, int(rank))

    @staticmethod
    def lost(name: str) -> str:
        return lost_key(name)

    @staticmethod
    def finished(worker: int) -> str:
        """Set by a worker that finished training (before its BYE)."""
        return f"ps/finished/{worker}"

    @staticmethod
    def drained(server: int) -> str:
        return f"ps/drained/{server}"

    # Servers that joined the running job (``plexus server --join``): spares a drain hands
    # its shard to, numbered from --servers on.
    spares = "ps/spares"

    @staticmethod
    def spare_claim(server: int) -> str:
        """Set (compare-and-set) by the drain that takes spare ``server``."""
        return f"ps/spare/{server}/claimed"

    @staticmethod
    def migrations(shard: int) -> str:
        """Counter: the drains that moved ``shard``."""
        return f"ps/migrations/{shard}"

    @staticmethod
    def migration(shard: int, i: int) -> str:
        return f"ps/migrations/{shard}/{i}"

    draining = staticmethod(draining_key)

    @staticmethod
    def ledger_sent(worker: int) -> str:
        """``--ledger``: the sum of the codes worker ``worker`` pushed (to every shard)."""
        return f"ps/ledger/sent/{worker}"

    @staticmethod
    def ledger_acked(shard: int, worker: int) -> str:
        """``--ledger``: the sum of the codes of ``worker``'s pushes that ``shard`` acknowledged."""
        return f"ps/ledger/acked/{shard}/{worker}"


# Worker states on one server.
EXPECTED, ACTIVE, FINISHED, CLOSED, LOST = "expected", "active", "finished", "closed", "lost"


@dataclass
class _Payload:
    dense: torch.Tensor | None
    rows: torch.Tensor | None         # local row indices
    grads: torch.Tensor | None        # [len(rows), width]
    members: list[tuple[int, int]]    # (worker, version) of every gradient summed in ``dense``
    clocks: list[int] = field(default_factory=list)   # each member's clock (its push's sequence number)


@dataclass
class _Worker:
    state: str
    since: float                      # monotonic time of registration
    base: int = 0                     # gate clock at which it started
    beats: int = 0                    # last heartbeat counter seen
    heard: float = 0.0                # monotonic time the counter last moved
    applied: int = 0
    acked: int = 0
    pushed: int = 0
    staleness: int = -1               # staleness of its last applied push
    thread: threading.Thread | None = field(default=None, repr=False)
    rx: torch.Tensor | None = field(default=None, repr=False)    # dense receive buffer, reused


class _ShardMoved(Exception):
    """A reply said MOVED (the shard was drained away): this link's work is done."""


def _running(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive() and thread is not threading.current_thread()


def silent_for(peer: Any, beats: int, now: float, peer_timeout: float, timeout: float) -> str | None:
    """Under the owner's lock: record ``beats``, the peer's heartbeat counter read at
    ``now``, in ``peer.beats``/``peer.heard``; returns why the peer counts as lost (its
    counter stood still for ``peer_timeout``, or for ``timeout`` before its first beat,
    counted from ``peer.since``), or None."""
    if beats != peer.beats:
        peer.beats, peer.heard = beats, now
    silent = now - (peer.heard if peer.beats else peer.since)
    limit = peer_timeout if peer.beats else timeout
    return f"no heartbeat for {silent:.1f} s (limit {limit:g} s)" if silent > limit else None


def recv_payloads(link: Link, header: Header, reuse: torch.Tensor | None = None, borrow: bool = False
                  ) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Receive the payloads ``header`` announced (the dense one into ``reuse`` when it fits);
    ProtocolError if one is shorter than announced (gloo accepts a short message silently:
    its last element keeps our mark) or holds non-finite numbers (a diverged worker must not
    poison the model).

    With ``borrow`` the dense payload may stay in a shared-memory link's ring
    (``Link.recv_view``): no copy, and the caller calls the returned ``release`` as soon as
    it has used it. (A process of the same user could change those bytes after our checks;
    such a process could as well write our memory through /proc, so this gives nothing away.)"""
    out: list[torch.Tensor] = []
    releases: list[Callable[[], None]] = []

    def release() -> None:
        for free in releases:
            free()

    try:
        for i, (numel, dtype) in enumerate(request_payloads(header)):
            dense = i == 0 and header.count == numel and dtype.is_floating_point
            fits = dense and reuse is not None and reuse.numel() == numel and reuse.dtype == dtype
            buf = reuse if fits else torch.empty(numel, dtype=dtype)
            mark_payload(buf)
            if borrow and dense:
                data, free = link.recv_view(buf)
                releases.append(free)
            else:
                link.recv_from_peer(buf)
                data = buf
            if data.numel() != numel or payload_short(data):
                raise ProtocolError(f"{link.peer} sent a payload shorter than {header.describe()} announced",
                                    peer=link.peer)
            # One sum instead of an elementwise test (torch.isfinite(x).all() is 30x slower on
            # a CPU thread): it is non-finite when any element is, or when the elements are
            # so large that they overflow, which a sane gradient never does either.
            if dtype.is_floating_point and not bool(torch.isfinite(data.sum())):
                raise ProtocolError(f"{link.peer} sent non-finite values with {header.describe()}: its training "
                                    f"diverged; lower --lr", peer=link.peer)
            out.append(data)
    except BaseException:
        release()
        raise
    return out, release


def orphans(tree: Tree, name: str) -> list[str]:
    """The children of tree node ``name`` (none for a worker): they re-attach when it dies."""
    node = node_of(name)
    return [c.name for c in tree.children(node)] if node.role == "aggregator" else []


def tree_node_ended(store: dist.Store, name: str) -> bool:
    """Whether tree node ``name`` finished, or was lost, so that it will not re-attach."""
    node = node_of(name)
    done = KEYS.finished(node.rank) if node.role == "worker" else f"stats/aggregator/{node.rank}"
    return store.check([done]) or store.check([KEYS.lost(name)]) or store.check([exited_key(name)])


class ParameterServer:
    """Server ``index`` of ``cfg.cluster.servers``: holds one shard and serves every worker.

    ``children`` names the processes that talk to it, in sender order: by default the
    workers; at the root of a tree (``tree.py``) the root's children, aggregators or
    workers, which may push the sums of several workers' gradients (tree pushes).
    ``readers`` names processes that only read the weights, on links of their own (the
    learners of Rudra-adv*, ``readers.py``): outside the gate, the fan-in and the drain.

    Replication (``replication.py``). ``host`` is the server process that runs this
    shard: ``index`` itself, or a replica that took shard ``index`` over after its primary
    died, starting from the replicated ``state``; ``recovery`` then holds the wall times
    of the takeover (detected, takeover), to which the first update served is added."""

    def __init__(self, store: dist.Store, index: int, cfg: JobConfig, traffic: Traffic,
                 children: list[str] | None = None, readers: list[str] | None = None, log: Log | None = None,
                 host: int | None = None, state: ShardState | None = None,
                 recovery: dict[str, float] | None = None, resumed: bool = False,
                 checkpoints: Path | None = None) -> None:
        self.store, self.index, self.cfg, self.traffic = store, index, cfg, traffic
        self.host = index if host is None else host
        # Links are made between processes: a shard taken over is told apart by its tag.
        self.endpoint = f"server {self.host}"
        self.tag = "" if self.host == index else f"shard {index}"
        self.me = self.endpoint if self.host == index else f"server {self.host} (shard {index})"
        self.servers = max(1, cfg.cluster.servers)
        self.names = list(children) if children is not None else [f"worker {w}" for w in range(cfg.cluster.workers)]
        self.tree = children is not None
        self.workers = len(self.names)
        self.timeout, self.peer_timeout = cfg.cluster.timeout, cfg.cluster.peer_timeout
        # A worker may legitimately be silent between two messages for a store barrier (up to
        # --timeout) plus a step; a gloo receive that times out breaks its pair for good.
        self.idle_limit = 2 * self.timeout + self.peer_timeout
        self.interval = min(0.25, self.peer_timeout / 4)
        # Judges the workers' heartbeats and records their gaps; ``log`` gets the long ones.
        self.watch = Watch(self.me, self.peer_timeout, self.timeout, self.interval, log=log)
        s = cfg.strategy
        # Backup workers (Chen et al. 2016) only where the workers talk to the servers directly.
        backups = s.backup_workers if not self.tree else 0
        self.gate: Consistency = make_consistency(s.consistency, self.workers, s.staleness, s.softsync, backups)
        self.cond = threading.Condition()
        self.spec: ShardSpec | None = None
        # The dense range. Updates are written into a spare buffer that then becomes
        # ``params``, so a reply is sent from the buffer of its version without a copy;
        # ``_sending`` counts the replies still using each buffer (by id), and buffers whose
        # last reply is done return to ``_spare``.
        self.params = torch.empty(0)
        self._spare: list[torch.Tensor] = []
        self._sending: dict[int, int] = {}
        self._retired: dict[int, torch.Tensor] = {}
        self.table = torch.empty(0, 0)
        self.owned_keys = torch.empty(0, dtype=torch.int64)
        self.optimizer: ServerOptimizer | None = None
        self.version = 0
        self.histogram = StalenessHistogram()
        self.last_push = time.monotonic()      # when the gate last received a push
        self.gradients: dict[int, int] = {}    # worker rank -> its gradients applied
        self.fan_in: dict[int, int] = {}       # distinct senders in an update -> updates
        self.protocol_errors = 0
        self.joined: dict[int, int] = {}   # worker -> shard version it started from
        self.lost: dict[int, str] = {}
        self.drained = False
        self._drain_thread: threading.Thread | None = None
        self.evaluator = -1
        self.peers: dict[int, _Worker] = {}
        now = time.monotonic()
        for w in range(self.workers):
            self.peers[w] = _Worker(EXPECTED, now)
            self.gate.join(w, 0)
        self._stop = threading.Event()
        from plexus.ps.readers import ShardReaders  # here: readers.py imports the client, which imports us
        self.readers = ShardReaders(self, readers or [])
        # --kill server:s@step=N: this process dies once its own shard reaches version N.
        self.kill = Emulator(cfg.cluster, "server", index) if self.host == index else None
        self.ledger = 0                        # --ledger: the sum of the codes applied
        self.ledger_seq: dict[int, int] = {}   # worker -> highest clock whose code was applied
        self.duplicates = 0                    # codes applied twice (must stay 0)
        self.resent = 0                        # pushes that came again after a takeover, already applied
        self.seen: dict[int, int] = {}         # tree-ps: worker -> newest clock of its gradients received
        self._adopted = 0                      # tree-ps: children re-attached to the root
        # tree-ps: children of a lost aggregator that may still re-attach (no drain before).
        self.awaiting: set[str] = set()
        self.tree_shape = Tree(cfg.cluster.workers, cfg.strategy.fanout) if self.tree else None
        self.changes = 0                       # state changes, for the replicator
        self.recovery = dict(recovery) if recovery is not None else None
        # A drain (``drain``): ``moving`` once this shard applies nothing more, ``moved_to``
        # once the owner key names the server that took it over.
        self.moving = False
        self._handoff: tuple[ShardState, int] | None = None
        self.moved_to: int | None = None
        self.migration: dict[str, Any] | None = None
        self.drain_at = min((k.step for k in parse_kill(s.drain) if k.rank == index), default=None) \
            if s.drain and self.host == index else None
        self.replicator: Replicator | None = None
        k = s.replication
        if k:
            replicas = [q for q in successors(index, self.servers, k)
                        if q != self.host and not store.check([lost_key(f"server {q}")])]
            self.replicator = Replicator(store, self.host, index, replicas, cfg, traffic, self.cond,
                                         self._snapshot, lambda: self.changes)
        if state is not None:
            self._restore(state)
        if resumed:  # --resume: every worker (a new process) connects again and sends INIT
            for w, peer in self.peers.items():
                if peer.state == LOST:  # lost before the checkpoint: it starts again, from the
                    peer.base = self.gate.join(w)  # slowest live clock, as a worker that joins
                    self.lost.pop(w, None)
                peer.state = EXPECTED
        # --checkpoint-every: the run directory this shard's checkpoints go to, and the
        # newest one written (train/checkpoint.py).
        self.checkpoints, self._checkpointed = checkpoints, 0

    # --- the process's main loop ------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Serve until the job has drained and every link is shut; returns the final record."""
        monitor = threading.Thread(target=self._monitor, name=f"{self.me} monitor", daemon=True)
        for w, peer in sorted(self.peers.items()):
            if peer.state in (EXPECTED, ACTIVE, FINISHED):
                self._start_link(w)
        if self.replicator is not None:
            self.replicator.start()
        monitor.start()
        self.readers.start()
        published = False
        try:
            while True:
                with self.cond:
                    if published or not self.drained:
                        self.cond.wait(0.1)
                    done, drained = self._done(), self.drained
                    record = {"evaluator": self.evaluator, "version": self.version}
                if drained and not published and self.moved_to is not None:
                    published = True  # the shard lives on elsewhere: its new server publishes its end
                if drained and not published:
                    if self.tree:
                        # The root's children are aggregators: the evaluator is the lowest-ranked
                        # worker that finished.
                        record["evaluator"] = next((w for w in range(self.cfg.cluster.workers)
                                                    if self.store.check([KEYS.finished(w)])), -1)
                    # Workers wait for this record before they pull the final model and shut down.
                    self.store.set(KEYS.drained(self.index), json.dumps(record))
                    published = True
                if done:
                    break
        finally:
            self._stop.set()
        if self.replicator is not None:
            self.replicator.finish(self.timeout)
        monitor.join(timeout=5 * self.interval + 5)
        # Let the threads of lost workers finish closing their links: a thread still inside a
        # gloo or store call while the interpreter tears down aborts the process ("terminate
        # called"). One stuck in a receive from a hung worker (until its idle limit) is left
        # behind: exiting while a thread waits in a gloo receive is safe (measured). A thread
        # still opening its link (a joiner lost before it reached this server) gives up at
        # once (Link's ``cancelled``).
        deadline = time.monotonic() + 5.0
        for peer in list(self.peers.values()):
            if _running(peer.thread):
                peer.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.readers.stop(deadline)
        if self._drain_thread is not None:
            # The workers may close their links (MOVED) before the drain has written its
            # migration record, which this record, and the shard's next server's, read.
            self._drain_thread.join(timeout=self.timeout)
        return self.record()

    def _done(self) -> bool:
        """Drained, and every link thread of a worker not lost has finished."""
        return self.drained and all(p.state == LOST or (p.state == CLOSED and not _running(p.thread))
                                    for p in self.peers.values())

    def record(self) -> dict[str, Any]:
        """The final record for the summary (JSON data)."""
        with self.cond:
            return {
                "version": self.version, "dense_elements": self.spec.count if self.spec else 0,
                "owned_rows": len(self.owned_keys),
                "children": list(self.names),
                "gradients": {str(w): n for w, n in sorted(self.gradients.items())},
                "fan_in_counts": {str(k): n for k, n in sorted(self.fan_in.items())},
                "applied": {str(w): p.applied for w, p in sorted(self.peers.items())},
                "acked": {str(w): p.acked for w, p in sorted(self.peers.items())},
                # Pushes dropped because their step was made without them (backup workers).
                "late": {str(w): n for w, n in sorted(self.gate.late.items())},
                "staleness_counts": list(self.histogram.counts),
                "reads": dict(self.readers.reads), "heartbeat": self.watch.record(),
                "lost": {str(w): why for w, why in sorted(self.lost.items())},
                "joined": {str(w): v for w, v in self.joined.items()}, "protocol_errors": self.protocol_errors,
                "bytes_sent": self.traffic.bytes_sent, "bytes_recv": self.traffic.bytes_recv,
                "traffic": self.traffic.snapshot(), "evaluator": self.evaluator,
                "host": self.host, "resent_pushes": self.resent,
                **self._replication_record(), **self._ledger_record(),
            }

    def _replication_record(self) -> dict[str, Any]:
        """Under the lock: the replicas, what replication sent, and the takeover's times."""
        out: dict[str, Any] = {}
        if self.replicator is not None:
            out["replication"] = {"replicas": sorted(self.replicator.live), "bytes_sent": self.replicator.bytes_sent,
                                  "messages": self.replicator.messages,
                                  "lost_replicas": {str(q): why for q, why in sorted(self.replicator.lost.items())}}
        moves = self.store.add(KEYS.migrations(self.index), 0)
        if moves:
            out["migrations"] = [json.loads(self.store.get(KEYS.migration(self.index, i)).decode())
                                 for i in range(moves)]
        if self.recovery is not None:
            out["recovery"] = dict(self.recovery)
            if self.store.check(["train/t0"]):  # seconds into training, as metrics.jsonl counts time
                out["recovery"]["detected_at"] = self.recovery["detected"] - float(self.store.get("train/t0").decode())
        return out

    def _ledger_record(self) -> dict[str, Any]:
        """``--ledger``: the sum applied, against what the workers sent and had acknowledged."""
        if not self.cfg.strategy.ledger:
            return {}
        # The workers (a tree root's peers are aggregators), and any that joined.
        workers = sorted(set(range(self.cfg.cluster.workers)) | (set() if self.tree else set(self.peers)))
        sent = sum(self.store.add(KEYS.ledger_sent(w), 0) for w in workers)
        acked = sum(self.store.add(KEYS.ledger_acked(self.index, w), 0) for w in workers)
        return {"ledger": {"final": self.ledger, "sent": sent, "acked": acked, "duplicates": self.duplicates}}

    # --- membership ---------------------------------------------------------------------

    def _start_link(self, worker: int) -> None:
        thread = threading.Thread(target=self._serve_worker, args=(worker,), name=f"{self.me} <- worker {worker}",
                                  daemon=True)
        self.peers[worker].thread = thread
        thread.start()

    def _monitor(self) -> None:
        """Heartbeats (ours and the workers'), losses declared by other servers, and joins.
        Uses its own store connection: a blocking store call in another thread must not
        hold up the heartbeats."""
        store = self.watch.attach(self.store.clone())
        beat_key = KEYS.heartbeat("server", self.host)
        known_joins = 0
        while not self._stop.is_set():
            store.add(beat_key, 1)
            now = time.monotonic()
            self.watch.tick(now)
            with self.cond:
                watched = [w for w, p in self.peers.items() if p.state in (EXPECTED, ACTIVE, FINISHED)]
            for w in watched:
                beats = store.add(KEYS.heartbeat_of(self.names[w]), 0)
                if store.check([KEYS.lost(self.names[w])]):
                    self._lose(w, "declared lost by another server", announce=False)
                    continue
                with self.cond:
                    why = self.watch.judge(self.names[w], beats, now, self.peers[w].since)
                if why is not None:
                    self._lose(w, why)
            if store.check([KEYS.draining(self.host)]):  # plexus drain, or another shard of ours drains
                with self.cond:
                    if self.optimizer is not None and self.moved_to is None:
                        self._start_drain()
            if self.tree and self.host == self.index:
                adopted = int(store.add(adopt_key(ROOT), 0))
                while self._adopted < adopted:  # a child of a dead aggregator re-attaches to the root
                    self._adopt(store.get(f"{adopt_key(ROOT)}/{self._adopted}").decode())
                    self._adopted += 1
                with self.cond:
                    awaited = set(self.awaiting)
                ended = {name for name in awaited if tree_node_ended(store, name)}
                if ended:  # finished or lost before it could re-attach: the root need not wait
                    with self.cond:
                        self.awaiting -= ended
                        self._check_drained()
                        self.cond.notify_all()
            if self.checkpoints is not None:
                self._checkpointed = server_checkpoints(store, self.checkpoints, self.index, self._checkpointed,
                                                        self._checkpoint_parts)
            joins = store.add(KEYS.joined, 0)
            while known_joins < joins:
                self._admit(self.workers + known_joins)
                known_joins += 1
            self._stop.wait(self.interval)

    def _adopt(self, name: str) -> None:
        """tree-ps: ``name`` re-attaches to the root after its aggregator died; its sender
        index follows the root's children in the order they re-attach."""
        with self.cond:
            index = len(self.names)
            self.names.append(name)
            self.peers[index] = _Worker(EXPECTED, time.monotonic())
            self.awaiting.discard(name)
        logger.warning("%s: %s re-attaches to the root", self.me, name)
        self._start_link(index)

    def _admit(self, worker: int) -> None:
        """A worker registered to join: expect its link (it becomes live at INIT)."""
        with self.cond:
            if worker in self.peers:
                return
            self.names.append(f"worker {worker}")
            if self.drained:  # too late: the job is over (it will be refused at INIT anyway)
                self.peers[worker] = _Worker(CLOSED, time.monotonic())
                return
            self.peers[worker] = _Worker(EXPECTED, time.monotonic())
        logger.info("%s: worker %d asks to join", self.me, worker)
        self._start_link(worker)

    def _lose(self, worker: int, reason: str, announce: bool = True) -> None:
        """Remove ``worker`` from the live set; its received pushes are still applied."""
        with self.cond:
            peer = self.peers.get(worker)
            if peer is None or peer.state in (CLOSED, LOST):
                return
            if self.moving:  # the shard moved: the worker follows it, nothing is lost here
                peer.state = CLOSED
                self.cond.notify_all()
                return
            if peer.state == FINISHED:
                # It had finished training; a broken link now loses nothing.
                peer.state = CLOSED
            else:
                peer.state = LOST
                self.lost[worker] = reason
                self._apply(self.gate.leave(worker))
                if self.tree and self.host == self.index:  # its children re-attach here: wait for them
                    self.awaiting |= set(orphans(self.tree_shape, self.names[worker]))
            self._check_drained()
            self.cond.notify_all()
            lost = peer.state == LOST
        if lost:
            logger.warning("%s: lost %s (%s); %d live", self.me, self.names[worker], reason, len(self.gate.live()))
            if announce:
                try:
                    self.store.clone().set(KEYS.lost(self.names[worker]), reason)
                except RuntimeError as exc:  # the store is the launcher's; if it is gone the job is over
                    logger.warning("%s: could not announce the loss of %s: %s", self.me, self.names[worker], exc)

    def _check_drained(self) -> None:
        """Under the lock, after a worker's state changed (which the replicas must learn):
        no worker live or expected and nothing pending means drained."""
        self.changes += 1
        if self.drained or self.gate.pending() or self.awaiting:
            return
        if any(p.state in (EXPECTED, ACTIVE) for p in self.peers.values()):
            return
        self.drained = True
        finished = [w for w, p in self.peers.items() if p.state == FINISHED]
        self.evaluator = min(finished, default=-1)
        logger.info("%s: drained at version %d; worker %d evaluates", self.me, self.version, self.evaluator)

    # --- one link ------------------------------------------------------------------------

    def _serve_worker(self, worker: int) -> None:
        peer_name = self.names[worker]
        try:
            link = Link(self.store.clone(), self.endpoint, peer_name, traffic=self.traffic, timeout=self.timeout,
                        net=self.cfg.cluster.net, transport=self.cfg.cluster.transport, tag=self.tag,
                        cancelled=lambda: self._stop.is_set() or self.peers[worker].state == LOST)
        except CommError as exc:
            self._lose(worker, f"its link could not be opened: {exc}")
            return
        buffer = header_buffer()
        try:
            while True:
                buffer.fill_(SENTINEL)
                link.recv_from_peer(buffer, timeout=self.idle_limit, counted=HEADER_BYTES)
                if not self._handle(link, worker, decode(buffer, peer_name)):
                    break
        except ProtocolError as exc:
            with self.cond:
                self.protocol_errors += 1
            logger.error("%s: protocol error from %s: %s; closing its link", self.me, peer_name, exc)
            self._reply_status(link, worker, Status.ERROR)
            self._lose(worker, f"protocol error: {exc}")
        except CommError as exc:
            self._lose(worker, str(exc))
        except _ShardMoved:
            pass
        finally:
            link.close()
            # Whatever ended the link, a live worker behind it is gone (a finished one is closed).
            self._lose(worker, "its link closed")
            with self.cond:
                if self.peers[worker].state != LOST:
                    self.peers[worker].state = CLOSED
                self._check_drained()
                self.cond.notify_all()

    def _reply_status(self, link: Link, worker: int, status: Status) -> None:
        """A payload-free reply (best effort: the link may be going away)."""
        try:
            link.send_to_peer(encode(Header(op=Op.REPLY, sender=self.index, shard=self.index, status=status,
                                            version=self.version)), timeout=min(5.0, self.timeout))
        except CommError:
            pass

    def _recv_payloads(self, link: Link, header: Header, peer: _Worker, borrow: bool = False
                       ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """The request's payloads; with ``borrow`` the dense one may be a view of a
        shared-memory ring (see ``_push``), and the returned release must be called once it
        is applied."""
        out, release = recv_payloads(link, header, peer.rx, borrow=borrow)
        if header.count and out and out[0].numel() == header.count and out[0].dtype.is_floating_point \
                and not borrow:
            peer.rx = out[0]  # reused for the next push, unless the gate keeps it (see _push)
        return out, release

    def _handle(self, link: Link, worker: int, h: Header) -> bool:
        """Serve one request; returns False when the link is to be closed."""
        with self.cond:
            peer = self.peers[worker]
            state, spec = peer.state, self.spec
        if state == LOST:
            self._reply_status(link, worker, Status.LOST)
            return False
        if h.op == Op.INIT:
            return self._init(link, worker, h)
        if spec is None or state == EXPECTED:
            raise ProtocolError(f"{link.peer} sent {h.describe()} before INIT", peer=link.peer)
        check_request(h, spec, worker, link.peer)
        if h.members > self.cfg.cluster.workers:
            raise ProtocolError(f"{link.peer} announced {h.members} gradients in one push, more than the job's "
                                f"{self.cfg.cluster.workers} workers", peer=link.peer)
        op = Op(h.op)
        # A push's gradient is applied straight from a shared-memory ring, without a copy.
        borrow = op in (Op.PUSH, Op.PUSH_PULL, Op.SPARSE_PUSH) and link.transport == "shm"
        payloads, release = self._recv_payloads(link, h, peer, borrow)
        if self.moving and op != Op.SHUTDOWN:
            release()
            self._send_reply(link, h, worker, dense=False, rows=None)  # MOVED: the worker follows the shard
        if op in (Op.PUSH, Op.PUSH_PULL, Op.SPARSE_PUSH):
            try:
                if state != ACTIVE:
                    raise ProtocolError(f"{link.peer} pushed after BYE", peer=link.peer)
                self._push(worker, h, payloads, borrowed=borrow)
            finally:
                release()
            if op == Op.PUSH_PULL:
                self._wait_read(worker, h.clock + 1)
                self._send_reply(link, h, worker, dense=True, rows=None)
            else:
                self._send_reply(link, h, worker, dense=False, rows=None)
            with self.cond:
                peer.acked += 1
            return True
        if op in (Op.PULL, Op.SPARSE_PULL):
            rows = self._local_rows(payloads[0], link.peer) if op == Op.SPARSE_PULL and h.keys else None
            self._wait_read(worker, h.clock)
            self._send_reply(link, h, worker, dense=True, rows=rows)
            return True
        if op == Op.CLOCK:
            self._send_reply(link, h, worker, dense=False, rows=None)
            return True
        if op == Op.BYE:
            with self.cond:
                if peer.state == ACTIVE:
                    peer.state = FINISHED
                    self._apply(self.gate.leave(worker))
                    self._check_drained()
                    self.cond.notify_all()
            self._send_reply(link, h, worker, dense=False, rows=None)
            # Receive nothing more until the job drains: the worker now waits on the store,
            # and a pending gloo receive would time out and break the link meanwhile.
            with self.cond:
                while not self.drained and peer.state == FINISHED:
                    self.cond.wait(1.0)
                return peer.state == FINISHED
        if op == Op.SHUTDOWN:
            self._send_reply(link, h, worker, dense=False, rows=None)
            with self.cond:
                if peer.state == ACTIVE:  # shut down without BYE: leaves like a BYE
                    self._apply(self.gate.leave(worker))
                peer.state = CLOSED
                self._check_drained()
                self.cond.notify_all()
            return False
        raise ProtocolError(f"{link.peer} sent {h.describe()}, which a server does not serve", peer=link.peer)

    def _init(self, link: Link, worker: int, h: Header) -> bool:
        """First message of every worker: fixes the shard's layout (the first one to arrive
        supplies the initial values; every worker's are the same, contract 2) and answers
        with the current values, so a worker that joins late starts from the current model."""
        if self.peers[worker].state != EXPECTED:
            raise ProtocolError(f"{link.peer} sent a second INIT", peer=link.peer)
        self._layout(h, link.peer)
        check_request(h, self.spec, worker, link.peer)
        payloads, _ = self._recv_payloads(link, h, self.peers[worker])
        dense = payloads[0] if h.count else torch.empty(0, dtype=self.spec.dtype)
        keys = payloads[1 if h.count else 0] if h.keys else torch.empty(0, dtype=torch.int64)
        if h.keys and (len(keys) != len(self.owned_keys) or not torch.equal(keys, self.owned_keys)):
            raise ProtocolError(f"{link.peer} sent INIT rows for keys other than the ones this shard owns",
                                peer=link.peer)
        with self.cond:
            peer = self.peers[worker]
            refused = self.drained or (worker >= self.workers and not self.gate.accepts_joins)
            if not refused:
                if self.optimizer is None:
                    self.params.copy_(dense)
                    if h.keys:
                        self.table.copy_(payloads[-1].view_as(self.table))
                    self.optimizer = make_server_optimizer(self.cfg.optim, self.spec.count, len(self.owned_keys),
                                                           self.spec.width, self.spec.dtype)
                if worker >= self.workers:
                    # A worker that joins starts at clock 0; a tree node that re-attached
                    # here after its parent died goes on from its own clock (h.clock).
                    peer.base = self.gate.join(worker) - h.clock
                    if not self.tree:
                        self.joined[worker] = self.version
                peer.state = ACTIVE
                self.changes += 1
                self.cond.notify_all()
        if refused:
            why = "the job has finished" if self.drained else f"--consistency {self.cfg.strategy.consistency} " \
                                                             f"admits no workers after the start"
            logger.warning("%s: refused worker %d: %s", self.me, worker, why)
            self._reply_status(link, worker, Status.REFUSED)
            with self.cond:
                peer.state = CLOSED
                self.cond.notify_all()
            return False
        rows = torch.arange(len(self.owned_keys)) if h.keys else None
        self._send_reply(link, h, worker, dense=True, rows=rows)
        return True

    def _layout(self, h: Header, peer: str) -> None:
        """Derive this shard's spec from the first INIT (every later one must agree)."""
        with self.cond:
            if self.spec is not None:
                return
            if h.total < 0 or h.rows < 0 or (h.rows and h.width < 1):
                raise ProtocolError(f"{peer} sent an impossible layout in {h.describe()}", peer=peer)
            if h.rows and self.replicator is not None:
                raise ProtocolError(f"{peer} sent a sparse table, which --replication does not replicate",
                                    peer=peer)
            self._set_layout(h.total, h.rows, h.width, code_dtype(h.dtype))

    def _set_layout(self, total: int, rows: int, width: int, dtype: torch.dtype) -> None:
        """Under the lock: this shard's range of a flat model of ``total`` elements."""
        start, stop = RangeSharding(total, self.servers).range(self.index)
        keys = HashRing(self.servers, VNODES).keys_of(self.index, rows) if rows else self.owned_keys
        self.spec = ShardSpec(index=self.index, start=start, stop=stop, dtype=dtype, total=total, rows=rows,
                              width=width if rows else 0, owned_rows=len(keys))
        self.owned_keys = keys
        self.params = torch.zeros(stop - start, dtype=dtype)
        self.table = torch.zeros(len(keys), self.spec.width, dtype=dtype)

    # --- drain: the shard moves to another server ------------------------------------------

    def drain(self) -> None:
        """Hand this shard over to another server, in two phases, with training going on:
        copy (the target becomes one more replica and catches up while this server still
        serves), then switch (fence: nothing more is applied here; the target gets the
        final state, takes the owner key, and every request here is answered MOVED)."""
        store = self.store.clone()  # its own client: the serving threads use the store meanwhile
        target = self._drain_target(store)
        if target is None:
            logger.error("%s: cannot drain: no other live server to take shard %d", self.me, self.index)
            return
        logger.warning("%s: drains shard %d to server %d", self.me, self.index, target)
        start = time.time()
        store.set(KEYS.draining(self.host), "1")  # every shard this server holds leaves with it
        store.set(handoff_key(self.index), str(target))  # the target's group starts a standby
        deadline = time.monotonic() + self.timeout
        with self.cond:
            if self.replicator is None:
                self.replicator = Replicator(self.store, self.host, self.index, [], self.cfg, self.traffic,
                                             self.cond, self._snapshot, lambda: self.changes)
                self.replicator.start()
            self.replicator.add(target)
            self.changes += 1
            self.cond.notify_all()
            while self.replicator.live.get(target, -1) < self.version and time.monotonic() < deadline:
                self.cond.wait(0.5)
            copied = time.time()
            # Fence. The state handed over is the one of this instant: workers sent on from
            # here (MOVED) close their links, which must not make them closed over there.
            self._handoff = self._snapshot()
            self.moving = True
            self.replicator.handoff = target
            self.changes += 1
            self.cond.notify_all()
        while owner_of(store, self.index) != target and time.monotonic() < deadline:
            time.sleep(0.002)
        with self.cond:
            self.moved_to = target
            self.migration = {"shard": self.index, "from": self.host, "to": target, "copy_seconds": copied - start,
                              "switch_seconds": time.time() - copied, "version": self.version}
        # The shard's last server reports every move it made (``record``); ``serve`` waits
        # for this thread before it reads them. The workers may close their links here
        # first (MOVED), which drains this server by itself.
        n = store.add(KEYS.migrations(self.index), 1)
        store.set(KEYS.migration(self.index, n - 1), json.dumps(self.migration))
        with self.cond:
            self.drained = True
            self.cond.notify_all()
        logger.warning("%s: shard %d moved to server %d at version %d", self.me, self.index, target, self.version)

    def _drain_target(self, store: dist.Store) -> int | None:
        """A server that joined the job as a spare and is still free, else the shard's
        first successor on the ring that is neither this server nor lost."""
        spares = int(store.add(KEYS.spares, 0))
        for j in range(spares):
            spare = self.servers + j
            if store.compare_set(KEYS.spare_claim(spare), "", str(self.index)).decode() == str(self.index):
                return spare
        for q in successors(self.index, self.servers, self.servers - 1):
            if q != self.host and not store.check([lost_key(f"server {q}")]) \
                    and not store.check([KEYS.draining(q)]):
                return q
        return None

    # --- replication ------------------------------------------------------------------------

    def _snapshot(self) -> tuple[ShardState, int] | None:
        """Under the lock: the shard's state for its replicas (None before the first INIT);
        once a drain fenced the shard, the state of that instant."""
        if self._handoff is not None:
            return self._handoff[0], self.changes
        if self.optimizer is None:
            return None
        # A push the gate still holds is not in this state: the worker sends it again to
        # whoever takes over, which must apply it, so its clock counts applied pushes only.
        rows = [WorkerRow(w, p.state, p.base, self.gate.applied_clock(w) if w in self.gate.clocks else -1,
                          p.applied, p.acked, p.pushed,
                          self.gradients.get(w, 0), p.staleness, self.ledger_seq.get(w, -1))
                for w, p in sorted(self.peers.items())]
        state = ShardState(self.index, self.version, self.spec.total, self.params.clone(),
                           [t.clone() for t in self.optimizer.state()], self.optimizer.steps, rows,
                           list(self.histogram.counts), self.ledger, self.duplicates)
        return state, self.changes

    def _checkpoint_parts(self) -> list[torch.Tensor]:
        """The shard's state for a checkpoint, taken under the lock (the workers stand at
        their step boundaries, so no push is in flight)."""
        with self.cond:
            snapshot = self._snapshot()
        if snapshot is None:
            raise ProtocolError(f"{self.me}: a checkpoint was asked for before any worker's INIT", peer=self.me)
        return snapshot[0].encode()

    def _restore(self, state: ShardState) -> None:
        """Start from a replicated ``state``: the weights, the optimizer, and every worker's
        clock, so that the gate expects from each worker the push it sends next."""
        with self.cond:
            self._set_layout(state.total, 0, 0, state.params.dtype)
            self.params.copy_(state.params)
            self.optimizer = make_server_optimizer(self.cfg.optim, self.spec.count, 0, 0, self.spec.dtype)
            for mine, theirs in zip(self.optimizer.state(), state.optimizer):
                mine.copy_(theirs)
            self.optimizer.steps = state.optimizer_steps
            self.version = state.version
            self.histogram = StalenessHistogram(state.histogram)
            self.ledger, self.duplicates = state.ledger, state.duplicates
            self.gate = make_consistency(self.cfg.strategy.consistency, self.workers, self.cfg.strategy.staleness,
                                         self.cfg.strategy.softsync)
            self.peers = {}
            now = time.monotonic()
            for row in state.workers:
                while len(self.names) <= row.rank:
                    self.names.append(f"worker {len(self.names)}")
                self.peers[row.rank] = _Worker(row.state, now, row.base, applied=row.applied, acked=row.acked,
                                               pushed=row.pushed, staleness=row.staleness)
                self.gradients[row.rank] = row.gradients
                if row.ledger_seq >= 0:
                    self.ledger_seq[row.rank] = row.ledger_seq
                if row.state == LOST:
                    self.lost[row.rank] = "lost before the takeover"
            self.gate.restore({row.rank: row.clock for row in state.workers if row.clock >= 0})
            self.changes = 1

    def _local_rows(self, keys: torch.Tensor, peer: str) -> torch.Tensor:
        """Local indices of ``keys`` (strictly increasing, all owned here), else ProtocolError."""
        if len(keys) > 1 and not bool((keys[1:] > keys[:-1]).all()):
            raise ProtocolError(f"{peer} sent keys that are not strictly increasing", peer=peer)
        local = torch.searchsorted(self.owned_keys, keys)
        inside = local < len(self.owned_keys)
        if not bool(inside.all()) or not torch.equal(self.owned_keys[local], keys):
            raise ProtocolError(f"{peer} sent keys that server {self.index} does not own", peer=peer)
        return local

    def _members(self, worker: int, h: Header, payload: torch.Tensor | None) -> list[tuple[int, int]]:
        """(worker rank, version) of each gradient a push holds; ProtocolError for
        versions ahead of the shard or workers the job does not have."""
        name = self.names[worker]
        role, rank = name.split()
        if payload is None:
            if role != "worker":
                raise ProtocolError(f"{name} pushed without listing whose gradients it sums", peer=name)
            members = [(int(rank), h.version)]
        else:
            table = payload.view(h.members, MEMBER_FIELDS)
            members = list(zip(table[:, 0].tolist(), table[:, 2].tolist()))
            if not all(0 <= r < self.cfg.cluster.workers for r, _ in members):
                raise ProtocolError(f"{name} pushed gradients of workers the job does not have", peer=name)
        if max(v for _, v in members) > self.version:
            raise ProtocolError(f"{name} claims a version ahead of the shard's {self.version}", peer=name)
        return members

    def _push(self, worker: int, h: Header, payloads: list[torch.Tensor], borrowed: bool = False) -> None:
        """Hand a push to the gate and apply what it releases. ``borrowed``: the dense
        gradient is a view of a shared-memory ring, released when this returns."""
        spec = self.spec
        name = self.names[worker]
        dense = payloads[0] if h.count else None
        rows = grads = None
        if h.op == Op.SPARSE_PUSH and h.keys:
            rows = self._local_rows(payloads[-2], name)
            grads = payloads[-1].view(h.keys, spec.width)
        with self.cond:
            if self.moving:  # fenced by a drain: not applied here; the reply sends it on (MOVED)
                return
            peer = self.peers[worker]
            members = self._members(worker, h, payloads[-1] if h.members else None)
            clocks = payloads[-1].view(h.members, MEMBER_FIELDS)[:, 1].tolist() if h.members else [h.clock]
            push = Push(worker, peer.base + h.clock, h.version, _Payload(dense, rows, grads, members, clocks),
                        weight=len(members))
            expected = self.gate.clocks.get(worker)
            if self.tree and all(c <= self.seen.get(w, -1) for (w, _), c in zip(members, clocks)):
                # Sent again by a tree node that re-attached after its parent died, which
                # had already forwarded it: every worker gradient in it was applied. The
                # gate never sees it, so the node's next push takes the clock it expects.
                self.resent += 1
                peer.base -= 1
                return
            for (w, _), c in zip(members, clocks):
                self.seen[w] = max(self.seen.get(w, -1), c)
            if (self.replicator is not None or self.recovery is not None) and expected is not None \
                    and push.clock < expected:
                # Sent again after a takeover: the old primary applied it and its replicas
                # hold it, but its acknowledgement was lost with the primary.
                self.resent += 1
                return
            late = self.gate.late.get(worker, 0)
            try:
                groups = self.gate.push(push)
            except ValueError as exc:
                raise ProtocolError(f"{name}: {exc}", peer=name) from None
            peer.pushed += 1
            self.last_push = time.monotonic()
            dropped = self.gate.late.get(worker, 0) > late  # too late for its step: nothing holds it
            if not dropped and not any(p is push for group in groups for p in group):
                # The gate holds this gradient until its group is complete: its buffer is
                # no longer ours to reuse, and a borrowed one must be copied out of the ring.
                peer.rx = None
                if borrowed and dense is not None:
                    push.payload.dense = dense.clone()
            self._apply(groups)
            self.cond.notify_all()

    def _apply(self, groups: list[list[Push]]) -> None:
        """Under the lock: average each group in rank order and apply it as one update."""
        if groups:
            self.changes += 1
        for group in groups:
            # Staleness per worker gradient (a tree push holds several).
            stale = [self.version - v for p in group for _, v in p.payload.members]
            scale = staleness_lr_scale(stale) if self.cfg.strategy.staleness_lr else 1.0
            divisor = self.gate.divisor(group)
            dense = [p.payload.dense for p in group if p.payload.dense is not None]
            if dense and self.optimizer is not None:
                if self.cfg.strategy.ledger:
                    dense = self._take_ledger(group)
                if len(dense) == 1 and divisor == 1:
                    grad = dense[0]
                else:  # the sum in rank order, divided: the mean of a flat PS's pushes
                    grad = dense[0].clone()
                    for more in dense[1:]:
                        grad.add_(more)
                    grad.div_(divisor)
                out = self._spare.pop() if self._spare else torch.empty_like(self.params)
                self.optimizer.step(self.params, grad, scale, out=out)
                self._retire(self.params)
                self.params = out
            sparse = [p.payload for p in group if p.payload.rows is not None and len(p.payload.rows)]
            if sparse and self.optimizer is not None:
                rows = torch.cat([p.rows for p in sparse])
                grads = torch.cat([p.grads for p in sparse])
                unique, inverse = torch.unique(rows, return_inverse=True)
                total = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
                self.optimizer.step_rows(self.table, unique, total.div_(divisor), scale)
            if self.optimizer is not None:
                self.optimizer.tick()
            senders = len({p.worker for p in group})
            self.fan_in[senders] = self.fan_in.get(senders, 0) + 1
            for p in group:
                for rank, version in p.payload.members:
                    self.histogram.record(self.version - version)
                    self.gradients[rank] = self.gradients.get(rank, 0) + 1
                peer = self.peers[p.worker]
                peer.applied += 1
                peer.staleness = self.version - max(v for _, v in p.payload.members)
            self.version += 1
            if self.recovery is not None and "first_update" not in self.recovery:
                self.recovery["first_update"] = time.time()
            if self.kill is not None:
                self.kill.at_step(self.version)
            if self.drain_at is not None and self.version >= self.drain_at:
                self._start_drain()

    def _start_drain(self) -> None:
        """Under the lock: drain in a thread of its own, once."""
        if self.drain_at == -1:
            return
        self.drain_at = -1
        self._drain_thread = threading.Thread(target=self.drain, name=f"{self.me} drain", daemon=True)
        self._drain_thread.start()

    def _take_ledger(self, group: list[Push]) -> list[torch.Tensor]:
        """``--ledger``: add the code each push carries in the shard's first element to the
        ledger (a tree push carries the sum of its members' codes), count a member whose
        (worker, clock) was applied before, and return the dense gradients with that element
        zeroed (copies: a payload may be a reused receive buffer or a shared-memory ring)."""
        out = []
        for p in group:
            dense = p.payload.dense.clone()
            for (worker, _), clock in zip(p.payload.members, p.payload.clocks):
                if clock <= self.ledger_seq.get(worker, -1):
                    self.duplicates += 1
                self.ledger_seq[worker] = max(clock, self.ledger_seq.get(worker, -1))
            self.ledger += int(dense[0])
            dense[0] = 0
            out.append(dense)
        return out

    def _retire(self, buffer: torch.Tensor) -> None:
        """Under the lock: ``buffer`` is no longer current; reuse it once no reply uses it."""
        if self._sending.get(id(buffer)):
            self._retired[id(buffer)] = buffer
        else:
            self._spare.append(buffer)

    def _wait_read(self, worker: int, clock: int) -> None:
        """Block until the gate lets ``worker`` read at (its own) ``clock``."""
        deadline = time.monotonic() + self.timeout
        with self.cond:
            peer = self.peers[worker]
            target = peer.base + clock
            while not self.gate.may_serve(worker, target) and peer.state != LOST and not self.moving:
                if isinstance(self.gate, SoftSync) and time.monotonic() - self.last_push > self.peer_timeout:
                    self._apply(self.gate.flush())  # see SoftSync.flush
                    self.cond.notify_all()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = ", ".join(f"worker {w}" for w in self.gate.blockers(worker, target)) or "nobody"
                    raise CommTimeout(f"{self.me}: worker {worker} waited {self.timeout:g} s to read at clock "
                                      f"{target}, held up by {waiting}", peer=waiting)
                self.cond.wait(min(left, 1.0))

    def _send_reply(self, link: Link, h: Header, worker: int, dense: bool, rows: torch.Tensor | None) -> None:
        """Answer ``h``: a header, then the dense range and the requested rows, copied
        under the lock so that each reply is one consistent version."""
        with self.cond:
            peer = self.peers[worker]
            payloads = []
            status = Status.LOST if peer.state == LOST else Status.MOVED if self.moving else Status.OK
            sending = None
            if status == Status.OK and dense and self.spec.count:
                sending = self.params
                self._sending[id(sending)] = self._sending.get(id(sending), 0) + 1
                payloads.append(sending)
            if status == Status.OK and rows is not None and len(rows):
                payloads.append(self.table.index_select(0, rows).reshape(-1))
            # The staleness of the push this answers, once it has been applied.
            known = peer.staleness >= 0 and peer.applied == peer.pushed and h.op in (Op.PUSH, Op.PUSH_PULL,
                                                                                       Op.SPARSE_PUSH)
            reply = Header(op=Op.REPLY, sender=self.index, shard=self.index, clock=max(peer.base, 0),
                           version=self.version, offset=h.offset, count=payloads[0].numel() if dense and payloads
                           and self.spec.count else 0, keys=len(rows) if rows is not None and status == Status.OK
                           else 0, width=h.width, dtype=h.dtype, staleness=peer.staleness + 1 if known else 0,
                           status=status)
            if self.replicator is not None and status == Status.OK:
                # Nothing is acknowledged, and no weights are shown, that a takeover could
                # lose (``sending`` is held, so its buffer stays this version's meanwhile).
                self.replicator.wait(reply.version, time.monotonic() + self.timeout)
                if self.moving:  # a drain fenced the shard meanwhile: send the worker on
                    reply = replace(reply, status=Status.MOVED, count=0, keys=0)
                    payloads = []
        try:
            works = [link.isend(encode(reply), link.peer_index)]
            works += [link.isend(p, link.peer_index) for p in payloads]
            for work in works:
                work.wait()
        finally:
            if sending is not None:
                with self.cond:
                    self._sending[id(sending)] -= 1
                    if not self._sending[id(sending)]:
                        del self._sending[id(sending)]
                        if id(sending) in self._retired:
                            self._spare.append(self._retired.pop(id(sending)))
        if status == Status.LOST:
            raise CommError(f"{self.me}: worker {worker} was declared lost", peer=link.peer)
        if reply.status == Status.MOVED:
            raise _ShardMoved()
