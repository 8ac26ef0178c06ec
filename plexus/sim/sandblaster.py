"""Simulated Sandblaster L-BFGS (Dean et al. 2012, section 4.2).

The coordinator's algorithm is the real one (``sandblaster/lbfgs.py``'s ``Lbfgs``) over
``LocalVectors``, the same commands the shards run, whole; each reduction is one round
trip to the shards (2 alpha in simulated time). Each objective evaluation is a pass of the
replicas over the iteration's batch in work units (``sandblaster/scheduler.py``'s rules):
every replica pulls the trial point (the shards' links send it to one replica after
another), an idle replica claims the next unit, computes its gradient sum at the trial
point and pushes it to the shards (queued on their links); once at most ``--backup-after``
of the units are outstanding, idle replicas take backup copies of them, and a unit counts
once, when its first copy lands. The unit gradients are summed in the order they land,
as the shards add them.
"""
from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from plexus.sandblaster.lbfgs import Lbfgs, LocalVectors, Settings, Slot
from plexus.sandblaster.scheduler import units_of
from plexus.sim.engines import HEADER_BYTES, Outcome, Simulation
from plexus.train.batches import GlobalBatches
from plexus.train.evaluation import loss_fn

__all__ = ["SandblasterSim"]


class SandblasterSim(Simulation):

    def run(self, steps: int) -> Outcome:
        from plexus.strategies.sandblaster import unit_size
        cfg, p = self.cfg, self.workers
        s = cfg.strategy
        samples = len(self.data.x_train)
        self.batch = min(cfg.run.batch_size, samples)
        self.unit = unit_size(cfg, samples)
        self.units = units_of(self.batch, self.unit)
        self.full = self.batch >= samples
        self.servers = max(1, cfg.cluster.servers)
        self.shard_bytes = -(-self.numel // self.servers) * 4 + HEADER_BYTES
        self.batches = GlobalBatches(samples, self.batch, cfg.run.seed)
        self.now = 0.0
        self.units_done = [0] * p
        self.backups = self.duplicates = 0
        self.sent = np.zeros(p, dtype=np.int64)
        self.compute = np.zeros(p)
        self.maths = self.replica is not None
        self.vectors = LocalVectors(self.numel)
        if self.maths:
            self.vectors[Slot.X].copy_(self.replica.flat())
        self.current = 0
        lbfgs = Lbfgs(self.vectors, self._objective, Settings(lr=cfg.optim.lr, history=s.history,
                                                             line_search=s.line_search, recursion=s.lbfgs),
                      round_trips=lambda: self.vectors.trips)
        out = Outcome(bytes_sent=[0] * p)
        iterations, evaluations = 0, 0
        for i in range(steps):
            self.current = 0 if self.full else i
            trips = self.vectors.trips
            before = self.evaluations = getattr(self, "evaluations", 0)
            it = lbfgs.iterate(fresh_batch=not self.full, last=i == steps - 1)
            evaluations += self.evaluations - before
            self.now += (self.vectors.trips - trips) * 2 * self.net.alpha  # the reductions' round trips
            iterations = i + 1
            if (i + 1) % cfg.run.log_every == 0:
                self.log_train(self.now, i + 1, it.loss, sum(self.units_done) * self.unit, int(self.sent[0]),
                               worker_samples=self.units_done[0] * self.unit)
            if cfg.run.eval_every and (i + 1) % cfg.run.eval_every == 0 and i + 1 < steps and self.maths:
                if self.snapshot(self.now, i + 1, sum(self.units_done) * self.unit, self.vectors[Slot.X]):
                    break
            if it.converged and self.full:
                break
        if self.maths:
            self.replica.load(self.vectors[Slot.X])
        out.virtual_seconds = self.now
        out.steps = iterations
        out.steps_per_worker = list(self.units_done)
        out.samples = sum(self.units_done) * self.unit
        out.bytes_sent = [int(b) for b in self.sent]
        out.updates_applied = iterations
        out.compute_seconds = float(self.compute.mean())
        out.wait_seconds = max(0.0, self.now - out.compute_seconds)
        out.events = sum(self.units_done)
        out.extra = {"evaluations": evaluations, "round_trips": self.vectors.trips, "units_per_evaluation": self.units,
                     "unit_size": self.unit, "backups_taken": self.backups, "duplicates": self.duplicates}
        return out

    def _objective(self, t: float) -> tuple[float, float]:
        """The coordinator's objective at X + t D (``Coordinator._objective``)."""
        v = self.vectors
        v.copy(Slot.T, Slot.X)
        if t:
            v.axpy(Slot.T, t, Slot.D)
        v.trips += 1  # the trial point reaches every shard before any replica pulls it
        self.now += 2 * self.net.alpha
        loss_sum = self._evaluation()
        self.evaluations += 1
        v.copy(Slot.GN, Slot.ACC)
        v.scale(Slot.GN, 1.0 / self.batch)
        wd = self.cfg.optim.weight_decay
        if wd:
            v.axpy(Slot.GN, wd, Slot.T)
        v.trips += 1  # the loss sum and the dot products come back together
        gtd = float(v[Slot.GN].double().dot(v[Slot.D].double()))
        loss = loss_sum / self.batch
        if wd:
            loss += 0.5 * wd * float(v[Slot.T].double().dot(v[Slot.T].double()))
        return loss, gtd

    def _evaluation(self) -> float:
        """One pass of the replicas over the open batch; returns the loss sum and leaves the
        gradient sum in ACC. Advances ``self.now`` to the moment the last unit landed."""
        p, net, start = self.workers, self.net, self.now
        # Every replica pulls the trial point; the shards send it to one replica after another.
        free = [(start + net.alpha + (r + 1) * self.shard_bytes * net.beta, r) for r in range(p)]
        heapq.heapify(free)
        shard_in = start
        landed: dict[int, float] = {}
        running: dict[int, list[tuple[float, int]]] = {}  # unit -> [(lands, replica)]
        order: list[tuple[float, int, int]] = []  # (lands, unit, replica) of every copy
        claimed = 0
        while claimed < self.units or free:
            at, r = heapq.heappop(free) if free else (math.inf, -1)
            if r < 0:
                break
            if claimed < self.units:
                u = claimed
                claimed += 1
            else:
                # Backup copies of outstanding units, once few enough are left.
                outstanding = [u for u, copies in running.items() if min(c[0] for c in copies) > at]
                backup = self.cfg.strategy.backup_after
                if not outstanding or not backup or len(outstanding) > backup * self.units:
                    continue
                candidates = [u for u in outstanding if all(c[1] != r for c in running[u]) and len(running[u]) == 1]
                if not candidates:
                    continue
                u = min(candidates, key=lambda u: running[u][0][0] * -1)  # the one that will land last
                self.backups += 1
            c = self.spec.compute.step_time(self.unit) * float(self.slow[r] * self.jitter.draw(1)[0])
            self.compute[r] += c
            done = at + c
            lands = max(done + net.alpha + self.numel * 4 * net.beta, shard_in + self.shard_bytes * net.beta)
            shard_in = lands
            self.sent[r] += self.numel * 4 + HEADER_BYTES * self.servers
            self.units_done[r] += 1
            running.setdefault(u, []).append((lands, r))
            order.append((lands, u, r))
            heapq.heappush(free, (lands, r))
        loss_sum = 0.0
        acc = self.vectors[Slot.ACC]
        acc.zero_()
        indices = self.batches.indices(self.current)
        if self.maths:
            self.replica.load(self.vectors[Slot.T])
        for lands, u, r in sorted(order):
            if u in landed:
                self.duplicates += 1
                continue
            landed[u] = lands
            if self.maths:
                idx = indices[u * self.unit:(u + 1) * self.unit]
                x, y = self.data.x_train[idx], self.data.y_train[idx]
                for param in self.replica.params:
                    param.grad = None
                loss = loss_fn(self.replica.model, x, y)
                (loss * len(x)).backward()
                acc.add_(torch.cat([param.grad.reshape(-1) for param in self.replica.params]))
                loss_sum += float(loss.detach()) * len(x)
        self.now = max(landed.values()) + net.alpha
        return loss_sum
