"""Simulated strategies whose workers keep their own replica: ``local-sgd`` and ``gossip``
(D-PSGD, in lockstep).

Every worker has a copy of the model laid out by ``FlatParameters`` and its own optimizer,
as in the real strategies; averaging uses the real code's arithmetic (``mix`` in rank
order for gossip, the all-reduce's order for local SGD's mean, ``AveragingSchedule`` for
the period and AdaComm), so a simulated run of a few workers equals the real one.

Time: each worker has its own clock. Local SGD: a worker's local steps add its compute
times; an averaging waits for the slowest worker, then takes the modelled all-reduce of
the parameters (``collectives/cost.py``). Gossip: a worker sends its replica to each
neighbour through its one link (degree x (alpha + N beta)); with combine-first the
exchange overlaps the gradient, and a worker's step ends when its own gradient and its
neighbours' replicas are in: there is no global barrier, only neighbours wait for each
other.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from plexus.collectives.cost import cost
from plexus.decentral.adacomm import AveragingSchedule
from plexus.decentral.averaging import FlatParameters, consensus_distance, mix, optimizer_buffers
from plexus.decentral.topology import make_topology
from plexus.sim.engines import Outcome, Simulation
from plexus.sim.maths import rank_sum, ring_sum
from plexus.strategies.base import make_optimizer
from plexus.train.batches import GlobalBatches
from plexus.train.evaluation import loss_fn

__all__ = ["LocalSgdSim", "GossipSim"]


class _Replicas(Simulation):
    """P replicas of the job's model, each with its optimizer."""

    def _replicas(self) -> None:
        self.models = [copy.deepcopy(self.replica.model) for _ in range(self.workers)]
        self.flats = [FlatParameters(m) for m in self.models]
        self.optimizers = [make_optimizer(m.parameters(), self.cfg.optim) for m in self.models]

    def _backward(self, r: int, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizers[r].zero_grad()
        loss = loss_fn(self.models[r], x, y)
        loss.backward()
        return loss.item()

    def _average_model(self) -> torch.Tensor:
        """The global model evaluated: the mean of the replicas, summed in float64 as the
        real strategies' probe sums it (``strategies/replicas.py``)."""
        total = rank_sum([f.flat.double() for f in self.flats])
        return total.div_(self.workers).float()

    def _snapshot(self, now: float, step: int, samples: int) -> bool:
        if self.replica is None:
            return False
        self.replica.load(self._average_model())
        self.log("strategy", time=now, worker=0, step=step,
                 consensus_distance=consensus_distance([f.flat for f in self.flats]))
        return self.evaluate(now, step, samples)

    def _finish(self, out: Outcome, clocks: np.ndarray, steps: int, compute: np.ndarray) -> Outcome:
        out.virtual_seconds = float(clocks.max())
        out.steps = steps
        out.steps_per_worker = [steps] * self.workers
        out.samples = steps * self.share * self.workers
        out.compute_seconds = float(compute.mean())
        out.wait_seconds = out.virtual_seconds - out.compute_seconds
        if self.replica is not None:
            self.replica.load(self._average_model())
        return out

    def _after_step(self, done: int, steps: int, loss: float | None, clocks: np.ndarray, sent: int) -> bool:
        """Log step ``done`` and take its snapshot when one is due; True when the snapshot
        reached --target-accuracy (the run stops there)."""
        cfg, now = self.cfg, float(clocks.max())
        if done % cfg.run.log_every == 0:
            self.log("train", time=now, worker=0, step=done, loss=loss, samples=done * cfg.run.batch_size,
                     worker_samples=done * self.share, bytes_sent=sent, bytes_recv=None, staleness=None)
        if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done != steps:
            return self._snapshot(now, done, done * cfg.run.batch_size)
        return False


class LocalSgdSim(_Replicas):
    """Local SGD: H local steps, then the replicas' parameters are averaged."""

    def run(self, steps: int) -> Outcome:
        cfg, p, s = self.cfg, self.workers, self.cfg.strategy
        maths = self.replica is not None
        if maths:
            self._replicas()
            batches = GlobalBatches(len(self.data.x_train), cfg.run.batch_size, cfg.run.seed)
        schedule = AveragingSchedule(s.period, s.warmup_steps, s.adaptive)
        reduce = ring_sum if s.algorithm == "ring" else rank_sum
        algorithm = "ring" if s.algorithm in ("native", "auto") else s.algorithm
        clocks, compute = np.zeros(p), np.zeros(p)
        out = Outcome(bytes_sent=[0] * p)
        sent = np.zeros(p, dtype=np.int64)
        round_loss, round_steps, averagings = np.zeros(p), 0, 0
        # What an averaging moves: the parameters, the optimizer's buffers with
        # --average-optimizer-state, and AdaComm's one loss element.
        state_copies = 0
        if s.average_optimizer_state and cfg.optim.optimizer != "sgd":
            state_copies = 2 if cfg.optim.optimizer == "adam" else 1
        elif s.average_optimizer_state and cfg.optim.momentum > 0:
            state_copies = 1
        for step in range(steps):
            times = self.compute_times()
            clocks += times
            compute += times
            loss = None
            warm = schedule.warmup(step)
            if maths:
                idx = batches.indices(step)
                x, y = self.data.x_train[idx], self.data.y_train[idx]
                losses = [self._backward(r, x[r * self.share:(r + 1) * self.share],
                                         y[r * self.share:(r + 1) * self.share]) for r in range(p)]
                loss = losses[0]
            if warm:
                if maths:
                    self._average_gradients(reduce)
                    for opt in self.optimizers:
                        opt.step()
                clocks[:] = self._all_reduce(clocks, self.numel, algorithm, sent)
            else:
                if maths:
                    for opt in self.optimizers:
                        opt.step()
                    round_loss += np.array(losses)
                round_steps += 1
                if schedule.local_step_done():
                    extra = 1 if schedule.rule is not None else 0
                    mean_loss = None
                    if maths:
                        mean_loss = self._average_parameters(reduce, s.average_optimizer_state,
                                                             round_loss / max(round_steps, 1), extra)
                    clocks[:] = self._all_reduce(clocks, self.numel * (1 + state_copies) + extra, algorithm, sent)
                    averagings += 1
                    round_loss, round_steps = np.zeros(p), 0
                    schedule.averaged(mean_loss if mean_loss is not None else 1.0)
            if self._after_step(step + 1, steps, loss, clocks, int(sent[0])):
                break
        out.bytes_sent = [int(b) for b in sent]
        out.extra = {"averagings": averagings, "period_final": schedule.period,
                     "rounds_per_period": {str(h): n for h, n in sorted(schedule.rounds.items())}}
        return self._finish(out, clocks, step + 1, compute)

    def _all_reduce(self, clocks: np.ndarray, numel: int, algorithm: str, sent: np.ndarray) -> np.ndarray:
        """Everyone waits for the slowest, then the all-reduce of ``numel`` float32s."""
        c = cost(algorithm, self.workers, numel * 4, network=self.net, local_size=self.cfg.strategy.local_size or 2)
        sent += np.asarray(c.sent, dtype=np.int64)
        return np.full_like(clocks, clocks.max() + c.time)

    @torch.no_grad()
    def _average_gradients(self, reduce) -> None:
        flats = [torch.cat([g.reshape(-1) for g in f.grads()]) for f in self.flats]
        mean = reduce(flats).div_(self.workers) if self.workers > 1 else flats[0]
        for f in self.flats:
            offset = 0
            for param in f.params:
                n = param.numel()
                param.grad = mean[offset:offset + n].view_as(param).clone()
                offset += n

    @torch.no_grad()
    def _average_parameters(self, reduce, with_state: bool, round_loss: np.ndarray, extra: int) -> float:
        """The real strategy's buffer: parameters, then optimizer buffers, then (AdaComm)
        each worker's mean loss of the round."""
        bufs = []
        for r, (f, opt) in enumerate(zip(self.flats, self.optimizers)):
            extras = optimizer_buffers(opt, f.params) if with_state else []
            parts = [f.flat] + [b.reshape(-1) for b in extras]
            if extra:
                parts.append(torch.tensor([float(round_loss[r])], dtype=f.flat.dtype))
            bufs.append((parts, torch.cat(parts) if len(parts) > 1 else f.flat.clone()))
        total = reduce([b for _, b in bufs])
        if self.workers > 1:
            total.div_(self.workers)
        for parts, _ in bufs:
            offset = 0
            for part in parts[:len(parts) - extra]:
                n = part.numel()
                part.copy_(total[offset:offset + n].view_as(part))
                offset += n
        return float(total[-1]) if extra else float(round_loss[0])


class GossipSim(_Replicas):
    """D-PSGD in lockstep over a topology, combine-first or adapt-first."""

    def run(self, steps: int) -> Outcome:
        cfg, p, s = self.cfg, self.workers, self.cfg.strategy
        maths = self.replica is not None
        topology = make_topology(s.topology, p, s.mixing)
        combine = s.gossip_order == "combine-first"
        if maths:
            self._replicas()
            batches = GlobalBatches(len(self.data.x_train), cfg.run.batch_size, cfg.run.seed)
        clocks, compute = np.zeros(p), np.zeros(p)
        sent = np.zeros(p, dtype=np.int64)
        out = Outcome()
        for step in range(steps):
            peers = [topology.peers(r, step) for r in range(p)]
            times = self.compute_times()
            compute += times
            degree = np.array([len(n) for n in peers])
            send = degree * (self.net.alpha + self.nbytes * self.net.beta)
            sent += degree * self.nbytes
            # When each replica leaves: at the step's start (combine-first, overlapping the
            # gradient) or after the local step (adapt-first); it arrives after the link.
            leaves = clocks if combine else clocks + times
            arrive = leaves + send
            ready = clocks + times
            for r in range(p):
                if peers[r]:
                    ready[r] = max(ready[r], max(arrive[j] for j in peers[r]))
            clocks = ready
            loss = None
            if maths:
                idx = batches.indices(step)
                x, y = self.data.x_train[idx], self.data.y_train[idx]
                losses = []
                for r in range(p):
                    losses.append(self._backward(r, x[r * self.share:(r + 1) * self.share],
                                                 y[r * self.share:(r + 1) * self.share]))
                if not combine:
                    for opt in self.optimizers:
                        opt.step()
                held = [f.flat.clone() for f in self.flats]  # what each worker sends
                for r in range(p):
                    if peers[r]:
                        weights = topology.weights(r)
                        mix(weights, {j: held[j] for j in weights}, out=self.flats[r].flat)
                if combine:
                    for opt in self.optimizers:
                        opt.step()
                loss = losses[0]
            if self._after_step(step + 1, steps, loss, clocks, int(sent[0])):
                break
        out.bytes_sent = [int(b) for b in sent]
        out.extra = {"topology": s.topology, "degree_max": int(max(len(topology.peers(r)) for r in range(p)))}
        return self._finish(out, clocks, step + 1, compute)
