"""Sandblaster's coordinator: L-BFGS (``lbfgs.py``) over the shards' vectors, and the
evaluations the replicas compute unit by unit (``scheduler.py``).

The coordinator holds no parameters. What reaches it from a shard is a reply header and,
for reductions, one float64 per result: the byte counters in its final record show it
(``bytes_recv`` is a few hundred bytes per iteration whatever the model's size).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Sequence

import torch

from plexus.cluster.group import Link, Work
from plexus.errors import ProtocolError
from plexus.sandblaster import wire
from plexus.sandblaster.lbfgs import Lbfgs, Settings, Slot
from plexus.sandblaster.scheduler import Opening, open_evaluation, stop, units_of, wait_complete
from plexus.sandblaster.wire import Kind, Op, Program

__all__ = ["ShardVectors", "Coordinator"]

logger = logging.getLogger(__name__)


class ShardVectors:
    """``lbfgs.Vectors`` over the shards: commands are queued and travel with the next
    reduction (or ``flush``), one message to every shard; results combine over shards."""

    def __init__(self, links: Sequence[Link], timeout: float) -> None:
        self.links, self.timeout = list(links), timeout
        self.program = Program()
        self.trips = 0
        # The largest reply a shard sent (bytes): a parameter vector never comes here.
        self.largest = 0

    # queued commands
    def copy(self, dst: int, src: int) -> None:
        self.program.add(Op.COPY, dst, src)

    def scale(self, dst: int, alpha: float) -> None:
        self.program.add(Op.SCALE, dst, alpha=alpha)

    def axpy(self, dst: int, alpha: float, src: int) -> None:
        self.program.add(Op.AXPY, dst, src, alpha=alpha)

    def lincomb(self, dst: int, terms: Sequence[tuple[float, int]]) -> None:
        self.program.add(Op.LINCOMB, dst, extra=[s for _, s in terms], coefs=[c for c, _ in terms])

    def open(self, evaluation: int) -> None:
        self.program.add(Op.OPEN, other=evaluation)

    # reductions: one round trip each call
    def dots(self, pairs: Sequence[tuple[int, int]]) -> list[float]:
        for a, b in pairs:
            self.program.add(Op.DOT, src=a, other=b)
        return self.flush()

    def absmax(self, slot: int) -> float:
        self.program.add(Op.ABSMAX, src=slot)
        return self.flush()[0]

    def abssum(self, slot: int) -> float:
        self.program.add(Op.ABSSUM, src=slot)
        return self.flush()[0]

    def gram(self, slots: Sequence[int]) -> torch.Tensor:
        self.program.add(Op.GRAM, extra=list(slots))
        n = len(slots)
        return torch.tensor(self.flush(), dtype=torch.float64).reshape(n, n)

    def loss_and_dots(self, pairs: Sequence[tuple[int, int]]) -> list[float]:
        """The open batch's loss sum and dot products, in one round trip."""
        self.program.add(Op.LOSS)
        for a, b in pairs:
            self.program.add(Op.DOT, src=a, other=b)
        return self.flush()

    def flush(self) -> list[float]:
        """Send the queued program to every shard and combine their results."""
        program, self.program = self.program, Program()
        ints = torch.tensor(program.ints, dtype=torch.int64)
        floats = torch.tensor(program.floats, dtype=torch.float64)
        head = wire.header(Kind.COMMANDS, program.count, len(program.ints), len(program.floats))
        sends: list[Work] = []
        for link in self.links:
            sends.append(link.isend(head, link.peer_index))
            sends.append(link.isend(ints, link.peer_index))
            if len(floats):
                sends.append(link.isend(floats, link.peer_index))
        expected = sum(n for _, n in program.results)
        per_shard = []
        for link in self.links:
            reply = torch.empty(wire.HEADER_LEN, dtype=torch.int64)
            link.recv_from_peer(reply, timeout=self.timeout)
            kind, count, *_ = wire.check(reply, link.me)
            if kind != Kind.REPLY or count != expected:
                raise ProtocolError(f"{link.me}: {link.peer} answered {count} results, {expected} expected")
            values = torch.empty(count, dtype=torch.float64)
            if count:
                link.recv_from_peer(values, timeout=self.timeout)
            self.largest = max(self.largest, reply.numel() * 8 + values.numel() * 8)
            per_shard.append(values)
        for work in sends:
            work.wait(self.timeout)
        self.trips += 1
        out: list[float] = []
        at = 0
        for op, n in program.results:
            parts = [values[at: at + n] for values in per_shard]
            how = wire.REDUCTIONS[op]
            if how == "sum":
                out += torch.stack(parts).sum(0).tolist()
            elif how == "max":
                out += torch.stack(parts).max(0).values.tolist()
            else:
                out += parts[0].tolist()
            at += n
        return out


class Coordinator:
    """Runs ``iterations`` L-BFGS iterations; each objective evaluation is one pass of the
    replicas over the iteration's batch. The objective is the batch's mean loss plus
    ``weight_decay`` / 2 |x|^2."""

    def __init__(self, store, vectors: ShardVectors, settings: Settings, *, batch_size: int, unit_size: int,
                 samples: int, timeout: float, weight_decay: float = 0.0, log=None, clock=time.monotonic
                 ) -> None:
        self.store, self.vectors, self.timeout = store, vectors, timeout
        self.weight_decay = weight_decay
        self.batch_size, self.samples = batch_size, samples
        self.units = units_of(batch_size, unit_size)
        self.full_batch = batch_size >= samples
        self.steps_per_epoch = max(1, samples // batch_size)
        self.evaluation = 0
        self.batch = 0
        self.log = log
        self.clock = clock
        self.lbfgs = Lbfgs(vectors, self._objective, settings, round_trips=lambda: vectors.trips)
        self.history: list[dict[str, Any]] = []
        self.evaluation_seconds = 0.0

    def _objective(self, t: float) -> tuple[float, float]:
        v = self.vectors
        v.copy(Slot.T, Slot.X)
        if t:
            v.axpy(Slot.T, t, Slot.D)
        v.open(self.evaluation)
        v.flush()  # the trial point is on every shard before any replica pulls it
        loss = self.lbfgs.loss
        opening = Opening(self.evaluation, self.batch, self.units, None if math.isnan(loss) else loss)
        start = time.perf_counter()
        open_evaluation(self.store, opening)
        wait_complete(self.store, opening, self.timeout)
        self.evaluation_seconds += time.perf_counter() - start
        self.evaluation += 1
        v.copy(Slot.GN, Slot.ACC)
        v.scale(Slot.GN, 1.0 / self.batch_size)
        if not self.weight_decay:
            loss_sum, gtd = v.loss_and_dots([(Slot.GN, Slot.D)])
            return loss_sum / self.batch_size, gtd
        # The objective's L2 term, wd / 2 |x|^2, on the shards: its gradient wd x joins GN.
        v.axpy(Slot.GN, self.weight_decay, Slot.T)
        loss_sum, gtd, squares = v.loss_and_dots([(Slot.GN, Slot.D), (Slot.T, Slot.T)])
        return loss_sum / self.batch_size + 0.5 * self.weight_decay * squares, gtd

    def run(self, iterations: int, time_limit: float | None = None, start: float = 0.0,
            stopped=lambda: False) -> dict[str, Any]:
        """Iterate until ``iterations``, the time limit, convergence (full batch only) or
        ``stopped()``; then tell the replicas to stop. Returns the coordinator's record."""
        converged = None
        for i in range(iterations):
            if (time_limit is not None and self.clock() - start >= time_limit) or stopped():
                break
            self.batch = 0 if self.full_batch else i
            trips, evals = self.vectors.trips, self.evaluation
            it = self.lbfgs.iterate(fresh_batch=not self.full_batch, last=i == iterations - 1)
            row = {"iteration": i + 1, "loss": it.loss, "step": it.step, "evaluations": self.evaluation - evals,
                   "round_trips": self.vectors.trips - trips, "direction_round_trips": it.direction_round_trips,
                   "pairs": len(self.lbfgs.pairs), "time": self.clock() - start}
            self.history.append(row)
            if self.log is not None:
                self.log("lbfgs", **row)
            if it.converged and self.full_batch:
                converged = it.converged
                break
        stop(self.store, self.evaluation)
        return {"iterations": len(self.history), "converged": converged, "evaluations": self.evaluation,
                "final_objective": self.history[-1]["loss"] if self.history else None,
                "round_trips": self.vectors.trips, "largest_message": self.vectors.largest,
                "evaluation_seconds": self.evaluation_seconds,
                "lbfgs_history": self.history}
