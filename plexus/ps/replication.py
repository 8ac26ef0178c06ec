"""Replicated shards: each shard's state on its k successors, and a successor that takes
over when the primary dies (Li et al. 2014, section 4.3; ARCHITECTURE.md, section 9).

Ring. With ``--replication k`` and S servers, shard s lives on server s (its primary) and
on servers s+1, ..., s+k modulo S (its replicas, ``successors``). Who serves a shard now is
the store key ``ps/owner/<s>`` (absent: server s); it changes only by compare-and-set, so
two replicas can never both take a shard over. The job's store (the launcher's) plays Li
et al.'s server manager: it holds the ownership and the losses, and every process already
reaches it.

Replication. After each update, the primary sends its replicas the shard's whole state
(``ShardState``: the weights, the optimizer's state, every worker's clock and counters,
the ledger), never one message per push: under bsp, ssp and softsync one update averages
several pushes, so replication costs one message per update. A replica keeps only the
newest state; when updates come faster than a replica acknowledges, the primary skips to
the newest, so a slow replica slows the acknowledgements and never grows a queue. A reply
to a worker (an acknowledgement or weights) waits until every live replica holds the
version it answers with (``Replicator.wait``): a worker never sees, and never counts as
acknowledged, a state that a takeover could lose. A replica that dies is dropped from the
set the primary waits for; the shard then has fewer copies until the job ends.

State, not gradients. Sending the state rather than the aggregated gradient costs one
(sgd) to three (adam) times the shard's size per update, and buys a replica that is a byte
copy of the primary with no assumption that two processes compute bit for bit alike, and
one message for the first copy, a resynchronisation after a takeover and a replica that
fell behind. A shard's state is numbers only: int64 headers and tables and the float
tensors, as on every other link (no pickle, ARCHITECTURE.md contract 5).

Takeover. A replica sees its primary die when the replication link breaks (a killed
process's sockets and pipes close at once). It declares the primary lost, and the first
successor of the shard not declared lost takes it over with compare-and-set on the owner
key; the others wait for the key to move and connect to the new primary, which sends them
its state at once. The new primary rebuilds the consistency gate from the replicated
clocks, so every worker's next push is the one it expects; a push that was applied but not
acknowledged before the death comes again and is recognised by its (worker, clock) and
acknowledged without being applied twice, and one that was never applied is applied now.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from plexus.cluster.group import Link
from plexus.cluster.rendezvous import lost_key
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.errors import CommError, ProtocolError
from plexus.ps.protocol import code_dtype, dtype_code

__all__ = ["successors", "owner_key", "owner_of", "handoff_key", "ShardState", "WorkerRow", "decode_state", "Replicator", "Standby",
           "replicated_shards"]

logger = logging.getLogger(__name__)

_MAGIC = 0x504C5852_0001  # "PLXR", replication protocol 1
# Header: magic, shard, version, count, dtype, total, optimizer tensors, optimizer steps,
# workers, histogram length, ledger, duplicates, final flag, handoff target (-1: none).
_HEADER = 14
# Per worker: rank, state, base, gate clock (-1: not live in the gate), applied, acked,
# pushed, gradients, staleness, highest ledger sequence applied.
_ROW = 10
# Worker states, as int codes on the wire (``server.py`` uses the names).
STATES = ("expected", "active", "finished", "closed", "lost")


def successors(shard: int, servers: int, k: int) -> list[int]:
    """The servers holding replicas of ``shard``, in takeover order."""
    return [(shard + i) % servers for i in range(1, k + 1)]


def replicated_shards(server: int, servers: int, k: int) -> list[int]:
    """The shards ``server`` holds a replica of."""
    return [s for s in range(servers) if server in successors(s, servers, k)]


def owner_key(shard: int) -> str:
    return f"ps/owner/{shard}"


def handoff_key(shard: int) -> str:
    """Names the server a drain hands ``shard`` to (which then follows it as a replica)."""
    return f"ps/handoff/{shard}"


def owner_of(store: dist.Store, shard: int) -> int:
    """The server that serves ``shard`` now."""
    key = owner_key(shard)
    return int(store.get(key).decode()) if store.check([key]) else shard


@dataclass
class WorkerRow:
    rank: int
    state: str
    base: int
    clock: int          # the gate's clock of this worker (-1: not in the gate)
    applied: int
    acked: int
    pushed: int
    gradients: int
    staleness: int
    ledger_seq: int     # highest ledger sequence applied (-1: none)


@dataclass
class ShardState:
    """Everything a replica needs to serve a shard from the version it holds."""

    shard: int
    version: int
    total: int                        # elements of the whole flat model
    params: torch.Tensor
    optimizer: list[torch.Tensor]     # the server optimizer's dense state tensors
    optimizer_steps: int
    workers: list[WorkerRow]
    histogram: list[int]
    ledger: int = 0
    duplicates: int = 0
    final: bool = False
    handoff: int = -1                 # a drain: the server that is to take the shard over
    received: float = field(default=0.0, compare=False)   # monotonic time it arrived

    def encode(self) -> list[torch.Tensor]:
        """The header tensor, then the payloads it announces."""
        header = torch.tensor([_MAGIC, self.shard, self.version, self.params.numel(), dtype_code(self.params.dtype),
                               self.total, len(self.optimizer), self.optimizer_steps, len(self.workers),
                               len(self.histogram), self.ledger, self.duplicates, int(self.final), self.handoff],
                              dtype=torch.int64)
        rows = torch.tensor([[w.rank, STATES.index(w.state), w.base, w.clock, w.applied, w.acked, w.pushed,
                              w.gradients, w.staleness, w.ledger_seq] for w in self.workers],
                            dtype=torch.int64).reshape(-1)
        out = [header, self.params, *self.optimizer, rows]
        if self.histogram:
            out.append(torch.tensor(self.histogram, dtype=torch.int64))
        return out


def _recv_state(link: Link, timeout: float, expect_shard: int) -> ShardState:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    link.recv_from_peer(header, timeout=timeout)
    (magic, shard, version, count, dtype, total, n_opt, steps, n_workers, n_hist, ledger, duplicates,
     final, handoff) = header.tolist()
    if magic != _MAGIC or shard != expect_shard or count < 0 or n_opt < 0 or n_workers < 0 or n_hist < 0:
        raise ProtocolError(f"{link.peer} sent a malformed replica of shard {expect_shard}", peer=link.peer)
    dtype = code_dtype(dtype)
    params = torch.empty(count, dtype=dtype)
    link.recv_from_peer(params, timeout=timeout)
    optimizer = []
    for _ in range(n_opt):
        optimizer.append(torch.empty(count, dtype=dtype))
        link.recv_from_peer(optimizer[-1], timeout=timeout)
    rows = torch.empty(n_workers * _ROW, dtype=torch.int64)
    link.recv_from_peer(rows, timeout=timeout)
    histogram = torch.empty(n_hist, dtype=torch.int64)
    if n_hist:
        link.recv_from_peer(histogram, timeout=timeout)
    return _state(header.tolist(), params, optimizer, rows, histogram)


def _state(header: list[int], params: torch.Tensor, optimizer: list[torch.Tensor], rows: torch.Tensor,
           histogram: torch.Tensor) -> ShardState:
    (_, shard, version, _, _, total, _, steps, n_workers, _, ledger, duplicates, final, handoff) = header
    workers = [WorkerRow(r[0], STATES[r[1]], *r[2:]) for r in rows.view(n_workers, _ROW).tolist()]
    return ShardState(shard, version, total, params, optimizer, steps, workers, histogram.tolist(), ledger,
                      duplicates, bool(final), handoff, received=time.monotonic())


def decode_state(parts: list[torch.Tensor]) -> ShardState:
    """The inverse of ``ShardState.encode`` (a checkpoint's copy, train/checkpoint.py)."""
    header = parts[0].tolist()
    n_opt, n_hist = header[6], header[9]
    if header[0] != _MAGIC or len(header) != _HEADER or len(parts) != 3 + n_opt + (1 if n_hist else 0):
        raise ValueError("not the encoding of a shard's state")
    histogram = parts[3 + n_opt] if n_hist else torch.empty(0, dtype=torch.int64)
    return _state(header, parts[1], list(parts[2:2 + n_opt]), parts[2 + n_opt], histogram)


def _link_tag(shard: int) -> str:
    return f"replica {shard}"


def draining_key(server: int) -> str:
    """Set to ask ``server`` to drain (``plexus drain``), and by the server as it drains:
    every shard and replica it holds leaves with it."""
    return f"ps/drain/{server}"


class Replicator:
    """The primary's side: one thread per replica sends the newest state and waits for
    its acknowledgement. ``snapshot`` (called under ``cond``) returns the current state
    and the count of changes it holds; ``changes`` (under ``cond``) counts changes so far."""

    def __init__(self, store: dist.Store, host: int, shard: int, replicas: list[int], cfg: JobConfig,
                 traffic: Traffic, cond: threading.Condition, snapshot: Callable[[], tuple[ShardState, int] | None],
                 changes: Callable[[], int]) -> None:
        self.store, self.host, self.shard, self.cfg, self.traffic = store, host, shard, cfg, traffic
        self.cond, self.snapshot, self.changes = cond, snapshot, changes
        self.live = {q: -1 for q in replicas}        # replica -> version it acknowledged
        self.lost: dict[int, str] = {}
        self.bytes_sent = 0
        self.messages = 0
        self._final = False
        self._started = False
        self.handoff = -1       # a drain: the replica that is to take the shard over
        self._threads = [self._thread(q) for q in replicas]

    def _thread(self, replica: int) -> threading.Thread:
        return threading.Thread(target=self._run, args=(replica,), name=f"server {self.host} -> replica {replica}",
                                daemon=True)

    def start(self) -> None:
        self._started = True
        for thread in self._threads:
            thread.start()

    def add(self, replica: int) -> None:
        """Under ``cond``: one more replica (a drain's target), sent the state at once."""
        if replica in self.live:
            return
        self.live[replica] = -1
        self._threads.append(self._thread(replica))
        if self._started:
            self._threads[-1].start()

    def wait(self, version: int, deadline: float) -> None:
        """Under ``cond``: block until every live replica holds ``version``."""
        while any(v < version for v in self.live.values()) and time.monotonic() < deadline:
            self.cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def finish(self, timeout: float) -> None:
        """Send the final state (the job drained) and close the links."""
        with self.cond:
            self._final = True
            self.cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self, replica: int) -> None:
        timeout = self.cfg.cluster.timeout
        link = None
        sent = 0
        store = self.store.clone()
        try:
            # A replica that died before its link was made is declared lost by a standby of
            # its own shard (it is that shard's primary): stop waiting for it then.
            link = Link(store, f"server {self.host}", f"server {replica}", traffic=self.traffic,
                        timeout=timeout, net=self.cfg.cluster.net, tag=_link_tag(self.shard),
                        transport=self.cfg.cluster.transport,
                        cancelled=lambda: store.check([lost_key(f"server {replica}")]))
            while True:
                with self.cond:
                    while True:
                        taken = self.snapshot() if self.changes() > sent or self._final else None
                        if taken is not None or self._final:
                            break
                        self.cond.wait(1.0)
                    final = self._final
                if taken is None:
                    return  # the job ended before any worker arrived: nothing to replicate
                state, changes = taken
                state.final = final
                state.handoff = self.handoff if self.handoff == replica else -1
                for tensor in state.encode():
                    link.send_to_peer(tensor, timeout=timeout)
                    self.bytes_sent += tensor.numel() * tensor.element_size()
                self.messages += 1
                ack = torch.zeros(1, dtype=torch.int64)
                link.recv_from_peer(ack, timeout=timeout)
                sent = changes
                with self.cond:
                    self.live[replica] = max(self.live[replica], int(ack[0]))
                    self.cond.notify_all()
                if final or state.handoff == replica:  # the job ended, or the replica took the shard
                    return
        except CommError as exc:
            if self.store.check([draining_key(replica)]):  # a planned drain, not a fault
                logger.warning("server %d: replica server %d of shard %d drained away; %d live replicas left",
                               self.host, replica, self.shard, len(self.live) - 1)
            else:
                logger.warning("server %d: lost replica server %d of shard %d: %s", self.host, replica, self.shard,
                               exc)
            with self.cond:
                self.live.pop(replica, None)
                self.lost[replica] = str(exc)
                self.cond.notify_all()
        finally:
            if link is not None:
                link.close()


class Standby:
    """A replica's side, for one shard: receives the primary's states; when the primary
    dies, either takes the shard over (``promote`` is called with the newest state) or
    follows the new primary."""

    def __init__(self, store: dist.Store, host: int, shard: int, cfg: JobConfig, traffic: Traffic,
                 promote: Callable[[ShardState, dict[str, float]], None], drained: Callable[[], bool]) -> None:
        self.store, self.host, self.shard, self.cfg, self.traffic = store, host, shard, cfg, traffic
        self.promote, self.drained = promote, drained
        self.state: ShardState | None = None
        self.leaving = False    # this server drains: a broken link is its own doing
        self.link: Link | None = None
        self.bytes_received = 0
        self.thread = threading.Thread(target=self._run, name=f"server {host}: replica of shard {shard}", daemon=True)

    def _run(self) -> None:
        store = self.store.clone()
        timeout = self.cfg.cluster.timeout
        owner = owner_of(store, self.shard)
        while True:
            link = None
            try:
                link = self.link = Link(store, f"server {self.host}", f"server {owner}", traffic=self.traffic,
                                        timeout=timeout, net=self.cfg.cluster.net, tag=_link_tag(self.shard),
                                        transport=self.cfg.cluster.transport,
                                        cancelled=lambda: self.leaving or store.check([lost_key(f"server {owner}")]))
                while True:
                    state = _recv_state(link, 2 * timeout + self.cfg.cluster.peer_timeout, self.shard)
                    self.state = state
                    self.bytes_received += sum(t.numel() * t.element_size() for t in state.encode())
                    if state.handoff == self.host:
                        # A drain hands the shard over: the primary applies nothing more, and
                        # waits for the owner key to name us before it sends workers here.
                        store.compare_set(owner_key(self.shard), str(owner) if store.check([owner_key(self.shard)])
                                          else "", str(self.host))
                        now = time.time()
                        self.promote(state, {"detected": now, "takeover": now, "from": owner, "drained": 1})
                        link.send_to_peer(torch.tensor([state.version], dtype=torch.int64), timeout=timeout)
                        return
                    link.send_to_peer(torch.tensor([state.version], dtype=torch.int64), timeout=timeout)
                    if state.final:
                        return
            except CommError as exc:
                if self.drained() or self.leaving or (self.state is not None and self.state.final):
                    return
                detected, dead = time.time(), owner
                logger.warning("server %d: primary server %d of shard %d is gone: %s", self.host, owner, self.shard,
                               exc)
                store.set(lost_key(f"server {owner}"), f"its replication link broke: {exc}")
                owner = self._next_owner(store, owner)
                if owner is None:
                    return
                if owner == self.host:
                    if self.state is None:
                        logger.error("server %d: cannot take shard %d over: no state replicated yet", self.host,
                                     self.shard)
                        return
                    self.promote(self.state, {"detected": detected, "takeover": time.time(), "from": dead})
                    return
            finally:
                if link is not None and not self.leaving:  # stop() closed it already
                    link.close()

    def stop(self) -> None:
        """This server leaves (it drained): stop following the primary."""
        self.leaving = True
        if self.link is not None:
            self.link.close()

    def _next_owner(self, store: dist.Store, dead: int) -> int | None:
        """The shard's next primary: this server, if it is the first successor not
        declared lost and wins the compare-and-set; else whoever the owner key names once
        it moves (None if it does not move within ``--timeout``)."""
        servers, k = max(1, self.cfg.cluster.servers), self.cfg.strategy.replication
        deadline = time.monotonic() + self.cfg.cluster.timeout
        while time.monotonic() < deadline:
            current = owner_of(store, self.shard)
            if current != dead:
                return current
            candidates = [q for q in successors(self.shard, servers, k)
                          if q != dead and not store.check([lost_key(f"server {q}")])]
            if candidates and candidates[0] == self.host:
                expected = store.get(owner_key(self.shard)).decode() if store.check([owner_key(self.shard)]) else ""
                won = store.compare_set(owner_key(self.shard), expected, str(self.host)).decode()
                return int(won)
            time.sleep(0.02)
        return None
