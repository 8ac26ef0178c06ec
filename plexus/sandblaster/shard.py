"""A Sandblaster server shard: one range of every vector, and the commands that act on it.

The shard keeps its range of the parameters, the gradient accumulator, the direction and
the L-BFGS history (``lbfgs.Slot``) and serves three kinds of peers, each link in its own
thread under one lock:

- the coordinator's command programs (``wire.Program``): copies, scalings, axpys and
  linear combinations run in place; reductions (dot products, max and sum of |x|, Gram
  matrices, the batch's loss) return one float64 scalar each;
- replicas' pulls of the trial point (or of the parameters, for evaluation);
- replicas' pushes of a unit's gradient: added to the accumulator the first time the
  shard sees the unit's id in the open evaluation, dropped as a duplicate after that
  (backup copies and re-runs), dropped as stale when the evaluation is closed.

A replica whose link breaks is marked lost in the store (``scheduler.mark_lost``), so
idle replicas re-run its outstanding unit.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from plexus.cluster.group import Link
from plexus.errors import CommError, ProtocolError
from plexus.sandblaster import wire
from plexus.sandblaster.lbfgs import LocalVectors, Slot
from plexus.sandblaster.scheduler import mark_lost
from plexus.sandblaster.wire import Accepted, Kind, Op

__all__ = ["Shard", "shard_range", "run_program"]

logger = logging.getLogger(__name__)


def shard_range(numel: int, shards: int, shard: int) -> tuple[int, int]:
    """[start, end) of shard ``shard``'s range of a flat vector of ``numel`` elements."""
    return numel * shard // shards, numel * (shard + 1) // shards


def run_program(vectors: LocalVectors, ints: list[int], floats: list[float], state: "Shard | None" = None
                ) -> list[float]:
    """Execute a command program on ``vectors``; returns the reductions' results in order."""
    out: list[float] = []
    i = f = 0
    while i < len(ints):
        op, dst, src, other, n = ints[i: i + 5]
        extra = ints[i + 5: i + 5 + n]
        i += 5 + n
        op = Op(op)
        for slot in (dst, src, other, *extra):
            if not 0 <= slot < 4096:
                raise ProtocolError(f"slot {slot} out of range")
        if op == Op.COPY:
            vectors.copy(dst, src)
        elif op == Op.SCALE:
            vectors.scale(dst, floats[f])
            f += 1
        elif op == Op.AXPY:
            vectors.axpy(dst, floats[f], src)
            f += 1
        elif op == Op.MUL:
            vectors[dst].mul_(vectors[src])
        elif op == Op.LINCOMB:
            vectors.lincomb(dst, list(zip(floats[f: f + n], extra)))
            f += n
        elif op == Op.DOT:
            out += vectors.dots([(src, other)])
        elif op == Op.ABSMAX:
            out.append(vectors.absmax(src))
        elif op == Op.ABSSUM:
            out.append(vectors.abssum(src))
        elif op == Op.GRAM:
            out += vectors.gram(extra).reshape(-1).tolist()
        elif op == Op.OPEN:
            vectors[Slot.ACC].zero_()
            if state is not None:
                state.open(other)
        elif op == Op.LOSS:
            out.append(state.loss if state is not None else 0.0)
    return out


class Shard:
    """Shard ``index`` of ``shards`` over a flat vector of ``numel`` elements."""

    def __init__(self, store, index: int, shards: int, numel: int, dtype: torch.dtype, workers: int, *,
                 traffic, timeout: float, backend: str, net, transport: str,
                 joined: Callable[[], int] = lambda: 0) -> None:
        self.store, self.index, self.workers, self.joined = store, index, workers, joined
        self.name = f"server {index}"
        self.start, self.end = shard_range(numel, shards, index)
        self.vectors = LocalVectors(self.end - self.start, dtype)
        self.dtype = dtype
        self.link_args = dict(traffic=traffic, timeout=timeout, backend=backend, net=net, transport=transport)
        self.timeout = timeout
        self.lock = threading.Lock()
        self.initialised = threading.Event()
        self.evaluation = -1
        self.seen: set[int] = set()
        self.loss = 0.0
        self.accepted = self.duplicates = self.stale = self.programs = 0
        self.accepted_by: dict[str, int] = {}
        self.duplicates_by: dict[str, int] = {}
        self.lost: list[int] = []
        self.left: list[int] = []
        self.errors: list[str] = []

    def open(self, evaluation: int) -> None:
        self.evaluation, self.seen, self.loss = evaluation, set(), 0.0

    # --- serving -------------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Serve the coordinator and every replica until the coordinator says STOP and each
        replica has said BYE or is lost; returns the final record."""
        threads: list[threading.Thread] = []

        def start(rank: int) -> None:
            thread = threading.Thread(target=self._serve_worker, args=(rank,), name=f"shard-worker-{rank}",
                                      daemon=True)
            thread.start()
            threads.append(thread)

        for rank in range(self.workers):
            start(rank)
        stopped = threading.Event()

        def watch_joins() -> None:
            """Replicas that join (``plexus worker --join``) get a link of their own."""
            while not stopped.wait(0.1):
                while len(threads) < self.workers + self.joined():
                    start(len(threads))

        watcher = threading.Thread(target=watch_joins, name="shard-joins", daemon=True)
        watcher.start()
        try:
            self._serve_coordinator()
        finally:
            stopped.set()
            watcher.join()
        deadline = time.monotonic() + self.timeout
        for thread in list(threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.errors:
            raise CommError(f"{self.name}: {self.errors[0]}")
        return {"accepted": self.accepted, "duplicates": self.duplicates, "stale": self.stale,
                "programs": self.programs, "accepted_by": self.accepted_by, "duplicates_by": self.duplicates_by,
                "lost": sorted(self.lost), "range": [self.start, self.end]}

    def _link(self, peer: str) -> Link:
        return Link(self.store, self.name, peer, tag="sandblaster", **self.link_args)

    def _recv_header(self, link: Link) -> tuple[Kind, int, int, int, int]:
        head = torch.empty(wire.HEADER_LEN, dtype=torch.int64)
        link.recv_from_peer(head)
        return wire.check(head, self.name)

    def _serve_coordinator(self) -> None:
        link = self._link("coordinator 0")
        try:
            if not self.initialised.wait(self.timeout):
                raise CommError(f"{self.name}: worker 0 sent no initial parameters within {self.timeout:g} s")
            while True:
                kind, count, n_ints, n_floats, _ = self._recv_header(link)
                if kind == Kind.STOP:
                    link.send_to_peer(wire.header(Kind.REPLY))
                    return
                if kind != Kind.COMMANDS:
                    raise ProtocolError(f"{self.name}: the coordinator sent {kind.name}")
                ints = torch.empty(n_ints, dtype=torch.int64)
                floats = torch.empty(n_floats, dtype=torch.float64)
                link.recv_from_peer(ints)
                if n_floats:
                    link.recv_from_peer(floats)
                with self.lock:
                    results = run_program(self.vectors, ints.tolist(), floats.tolist(), self)
                    self.programs += 1
                link.send_to_peer(wire.header(Kind.REPLY, len(results)))
                if results:
                    link.send_to_peer(torch.tensor(results, dtype=torch.float64))
        finally:
            link.close()

    def _serve_worker(self, rank: int) -> None:
        peer = f"worker {rank}"
        try:
            link = self._link(peer)
        except CommError as exc:
            self._lose(rank, exc)
            return
        try:
            while True:
                kind, a, b, c, _ = self._recv_header(link)
                if kind == Kind.BYE:
                    self.left.append(rank)
                    return
                if kind == Kind.INIT:
                    if a != self.end - self.start:
                        raise ProtocolError(f"{self.name}: INIT of {a} elements, the shard holds "
                                            f"{self.end - self.start}")
                    values = torch.empty(a, dtype=self.dtype)
                    link.recv_from_peer(values)
                    with self.lock:
                        self.vectors[Slot.X].copy_(values)
                    self.initialised.set()
                    link.send_to_peer(wire.header(Kind.REPLY))
                elif kind == Kind.PULL:
                    with self.lock:
                        values = self.vectors[a].clone()
                    link.send_to_peer(wire.header(Kind.REPLY, values.numel()))
                    link.send_to_peer(values)
                elif kind == Kind.PUSH:
                    if c != self.end - self.start:
                        raise ProtocolError(f"{self.name}: a push of {c} elements, the shard holds "
                                            f"{self.end - self.start}")
                    grad = torch.empty(c, dtype=self.dtype)
                    loss = torch.empty(1, dtype=torch.float64)
                    link.recv_from_peer(grad)
                    link.recv_from_peer(loss)
                    link.send_to_peer(wire.header(Kind.REPLY, int(self._add(peer, a, b, grad, float(loss)))))
                else:
                    raise ProtocolError(f"{self.name}: {peer} sent {kind.name}")
        except CommError as exc:
            self._lose(rank, exc)
        finally:
            link.close()

    def _add(self, peer: str, evaluation: int, unit: int, grad: torch.Tensor, loss: float) -> Accepted:
        with self.lock:
            if evaluation != self.evaluation:
                self.stale += 1
                return Accepted.STALE
            if unit in self.seen:
                self.duplicates += 1
                self.duplicates_by[peer] = self.duplicates_by.get(peer, 0) + 1
                return Accepted.DUPLICATE
            self.seen.add(unit)
            self.vectors[Slot.ACC].add_(grad)
            self.loss += loss
            self.accepted += 1
            self.accepted_by[peer] = self.accepted_by.get(peer, 0) + 1
            return Accepted.YES

    def _lose(self, rank: int, exc: BaseException) -> None:
        if isinstance(exc, ProtocolError):
            self.errors.append(str(exc))
        logger.warning("%s: lost worker %d (%s); its outstanding units go to the others", self.name, rank, exc)
        self.lost.append(rank)
        mark_lost(self.store, rank)
