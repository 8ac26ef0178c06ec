"""Simulated strategies whose workers keep their own replica: ``local-sgd`` and ``gossip``
(D-PSGD, in lockstep).

Every worker has a copy of the model laid out by ``FlatParameters`` and its own optimizer,
as in the real strategies; averaging uses the real code's arithmetic (``mix`` in rank
order for gossip, the all-reduce's order for local SGD's mean, ``AveragingSchedule`` for
the period and AdaComm), so a simulated run of a few workers equals the real one.

Time: each worker has its own clock. Local SGD: a worker's local steps add its compute
times; an averaging waits for the slowest worker, then takes the modelled all-reduce of
the parameters (``collectives/cost.py``). Gossip: a worker sends its replica to its
neighbours one after another through its card, and takes theirs in one at a time
(``cluster.take_in``); with combine-first the exchange overlaps the gradient (forward and
backward), and a worker's step ends when its own gradient and its neighbours' replicas
are in, plus the step's work outside forward and backward (``ComputeModel.outside``: the
mixing, the optimizer), which follows the exchange: there is no global barrier, only
neighbours wait for each other.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from plexus.collectives.cost import cost
from plexus.decentral.adacomm import AveragingSchedule
from plexus.decentral.averaging import FlatParameters, consensus_distance, mix, optimizer_buffers
from plexus.decentral.topology import make_topology
from plexus.sim.cluster import take_in_each
from plexus.sim.engines import Outcome, Simulation
from plexus.sim.maths import rank_sum, ring_sum
from plexus.strategies.base import make_optimizer
from plexus.train.batches import GlobalBatches
from plexus.train.evaluation import loss_fn

__all__ = ["LocalSgdSim", "GossipSim", "EasgdSim", "AdPsgdSim"]


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
        self.log("strategy", time=now, worker=0, step=step,
                 consensus_distance=consensus_distance([f.flat for f in self.flats]))
        return self.snapshot(now, step, samples, self._average_model())

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

    def _event_outcome(self, failed: str | None, updates: int, extra: dict) -> Outcome:
        """The outcome of an event-driven run (``self.done``, ``sent``, ``lost``, ``end``,
        ``compute`` and ``queue`` kept by the engine)."""
        steps = sum(self.done)
        compute = float(self.compute.mean())
        return Outcome(virtual_seconds=self.end, steps=steps, steps_per_worker=list(self.done),
                       samples=steps * self.share, bytes_sent=[int(b) for b in self.sent],
                       lost_workers=self.lost, failed=failed, updates_applied=updates,
                       compute_seconds=compute, wait_seconds=max(0.0, self.end - compute),
                       events=self.queue.events, extra=extra)

    def _after_step(self, done: int, steps: int, loss: float | None, clocks: np.ndarray, sent: int) -> bool:
        """Log step ``done`` and take its snapshot when one is due; True when the snapshot
        reached --target-accuracy (the run stops there)."""
        cfg, now = self.cfg, float(clocks.max())
        if done % cfg.run.log_every == 0:
            self.log_train(now, done, loss, done * cfg.run.batch_size, sent)
        if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done != steps:
            return self._snapshot(now, done, done * cfg.run.batch_size)
        return False


class LocalSgdSim(_Replicas):
    """Local SGD: H local steps, then the replicas' parameters are averaged."""

    communicates_every_step = False  # each all-reduce pays ``per_round``

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
        return np.full_like(clocks, clocks.max() + c.time + self.per_round)

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
        edges_of = None  # the peers the message arrays below were made for
        for step in range(steps):
            peers = [topology.peers(r, step) for r in range(p)]
            times = self.compute_times()
            compute += times
            sent += np.array([len(n) for n in peers]) * self.nbytes
            # The part of a step after the exchange, and the gradient before it.
            after = times * (self.outside / self.base_compute if self.base_compute else 0.0)
            gradient = times - after
            # When each worker's sends start: at the step's start (combine-first,
            # overlapping the gradient) or after the local step (adapt-first). Its k-th
            # neighbour's copy leaves k wires later and its first byte arrives alpha after.
            leaves = clocks if combine else clocks + gradient
            if peers != edges_of:
                edges_of = peers
                edges = [(j, r, k) for j in range(p) for k, r in enumerate(peers[j])]  # j's k-th send is to r
                src, dst, place = np.array(edges, dtype=np.int64).reshape(-1, 3).T
            wire = self.nbytes * self.net.beta
            arrived = take_in_each(dst, leaves[src] + place * wire + self.net.alpha, wire, p)
            clocks = np.maximum(clocks + gradient, arrived) + after
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


class EasgdSim(_Replicas):
    """Asynchronous EASGD: workers on their own partitions and pace, an elastic exchange
    with the centre every ``--period`` steps. The centre is a server with one card, full
    duplex as ``--net`` emulates it: it takes the workers' replicas in one at a time and
    sends its replies out one at a time, the two sides apart. It answers each with the
    centre before the update and adds the elastic difference, and the worker subtracts
    the same difference on the reply."""

    communicates_every_step = False  # each exchange pays ``per_round``

    def run(self, steps: int) -> Outcome:
        from plexus.decentral.averaging import elastic_difference
        from plexus.sim.events import EventQueue
        from plexus.train.batches import PartitionBatches
        cfg, p = self.cfg, self.workers
        self.alpha, self.period, self.steps = cfg.strategy.elastic_alpha, cfg.strategy.period, steps
        self.diff = elastic_difference
        self.maths = self.replica is not None
        if self.maths:
            self._replicas()
            self.centre = self.flats[0].flat.clone()
            n = len(self.data.x_train)
            self.batches = [PartitionBatches(n, self.share, cfg.run.seed, r, p) for r in range(p)]
        self.queue = EventQueue()
        self.done = [0] * p
        self.alive = [True] * p
        self.in_free = self.out_free = 0.0  # when the centre's card takes in, and sends, its next message
        self.compute = np.zeros(p)
        self.sent = np.zeros(p, dtype=np.int64)
        self.exchanges = 0
        self.failed: str | None = None
        self.lost: list[int] = []
        self.end = 0.0
        for (role, rank), t in sorted(self.fail_at.items(), key=lambda kv: kv[1]):
            self.queue.at(t, self._die, role, rank)
        for r in range(p):
            self._start(r)
        self.queue.run()
        out = self._event_outcome(self.failed, self.exchanges, {"exchanges": self.exchanges})
        if self.maths:
            self.replica.load(self.centre)
        return out

    def _start(self, r: int) -> None:
        if not self.alive[r] or self.failed or self.done[r] >= self.steps:
            return
        t = float(self.compute_times(np.array([r]))[0])
        self.compute[r] += t
        loss = None
        if self.maths:
            idx = self.batches[r].indices(self.done[r])
            loss = self._backward(r, self.data.x_train[idx], self.data.y_train[idx])
            self.optimizers[r].step()
        self.queue.after(t, self._stepped, r, loss)

    def _stepped(self, r: int, loss: float | None) -> None:
        if not self.alive[r] or self.failed:
            return
        self.end = self.queue.now
        self.done[r] += 1
        if r == 0 and self.done[0] % self.cfg.run.log_every == 0:
            self.log_train(self.queue.now, self.done[0], loss, sum(self.done) * self.share, int(self.sent[0]))
        if self.done[r] % self.period:
            self._start(r)
            return
        self.sent[r] += self.nbytes
        sent = self.flats[r].flat.clone() if self.maths else None
        # Its first byte reaches the centre alpha after it leaves.
        self.queue.after(self.per_round + self.net.alpha, self._reach_centre, r, sent)

    def _reach_centre(self, r: int, sent) -> None:
        """The centre's card takes the replica in once it has taken in the ones before."""
        self.in_free = max(self.queue.now, self.in_free) + self.nbytes * self.net.beta
        self.queue.at(self.in_free, self._at_centre, r, sent)

    def _at_centre(self, r: int, sent) -> None:
        if self.failed:
            return
        reply = None
        if self.maths:
            reply = self.centre.clone()
            self.centre.add_(self.diff(sent, reply, self.alpha))
        self.exchanges += 1
        # The reply leaves once the card has sent the replies before it.
        self.out_free = max(self.queue.now, self.out_free) + self.nbytes * self.net.beta
        self.queue.at(self.out_free + self.net.alpha, self._reply, r, reply)

    def _reply(self, r: int, reply) -> None:
        if not self.alive[r] or self.failed:
            return
        self.end = self.queue.now
        if self.maths:
            flat = self.flats[r].flat
            flat.sub_(self.diff(flat, reply, self.alpha))
        if r == 0:
            self._eval_if_due()
        self._start(r)

    def _eval_if_due(self) -> None:
        step = self.done[0]
        if self.snapshot_due(step, self.steps) and \
                self.snapshot(self.queue.now, step, sum(self.done) * self.share, self.centre):
            self.queue.stop()

    def _die(self, role: str, rank: int) -> None:
        if self.failed or all(d >= self.steps or not a for d, a in zip(self.done, self.alive)):
            return
        if role == "server" or rank == 0:
            # The centre, or worker 0 that holds the evaluated model: the job cannot go on.
            self.failed = f"{role} {rank} died at {self.queue.now:.3f} s (simulated)"
            self.end = self.queue.now
            self.queue.stop()
            return
        self.alive[rank] = False
        self.lost.append(rank)


class AdPsgdSim(_Replicas):
    """AD-PSGD (``gossip --async``): each worker computes a gradient on a copy of its
    replica; an active worker then averages its replica with one random neighbour
    (``decentral/pairing.py``), atomically for the pair, and applies the gradient.

    A worker's replica is locked while its own averaging is in flight, as the real
    worker's lock is: an averaging that reaches a locked worker waits until it is
    released. Each averaging costs two messages of the whole model on the pair's link.
    The workers share one budget of steps x P updates (``train/budget.py``)."""

    communicates_every_step = False  # an active worker's averaging pays ``per_round``

    def run(self, steps: int) -> Outcome:
        from plexus.decentral.pairing import Pairing
        from plexus.sim.events import EventQueue
        from plexus.train.batches import PartitionBatches
        cfg, p, s = self.cfg, self.workers, self.cfg.strategy
        self.pairing = Pairing(make_topology(s.topology, p, s.mixing), cfg.run.seed)
        self.maths = self.replica is not None
        if self.maths:
            self._replicas()
            n = len(self.data.x_train)
            self.batches = [PartitionBatches(n, self.share, cfg.run.seed, r, p) for r in range(p)]
            self.compute_model = copy.deepcopy(self.replica.model)
            self.compute_flat = FlatParameters(self.compute_model)
        self.queue = EventQueue()
        self.budget, self.claimed = steps * p, 0
        self.done = [0] * p
        self.alive = [True] * p
        self.live = set(range(p))
        self.locked = [False] * p
        self.waiting: list[list] = [[] for _ in range(p)]  # averagings held by a locked worker
        self.grads: list = [None] * p
        self.compute = np.zeros(p)
        self.sent = np.zeros(p, dtype=np.int64)
        self.averagings = 0
        self.lost: list[int] = []
        self.end = 0.0
        for (role, rank), t in sorted(self.fail_at.items(), key=lambda kv: kv[1]):
            if role == "worker":
                self.queue.at(t, self._die, rank)
        for r in range(p):
            self._start(r)
        self.queue.run()
        failed = None if any(self.alive) else f"every worker was lost ({p} of {p})"
        out = self._event_outcome(failed, sum(self.done), {"averagings": self.averagings})
        if self.maths:
            self.replica.load(self._average_model([r for r in range(p) if self.alive[r]]))
        return out

    def _average_model(self, ranks: list[int] | None = None) -> torch.Tensor:
        ranks = list(range(self.workers)) if ranks is None else ranks
        total = rank_sum([self.flats[r].flat.double() for r in ranks])
        return total.div_(len(ranks)).float()

    def _start(self, r: int) -> None:
        if not self.alive[r] or self.claimed >= self.budget:
            return
        self.claimed += 1
        t = float(self.compute_times(np.array([r]))[0])
        self.compute[r] += t
        if self.maths:
            # The gradient at a copy of the replica as it is now (the real worker's compute model).
            self.compute_flat.flat.copy_(self.flats[r].flat)
            self.compute_model.zero_grad(set_to_none=True)
            idx = self.batches[r].indices(self.done[r])
            loss_fn(self.compute_model, self.data.x_train[idx], self.data.y_train[idx]).backward()
            self.grads[r] = [g.clone() for g in self.compute_flat.grads()]
        self.queue.after(t, self._computed, r)

    def _computed(self, r: int) -> None:
        if not self.alive[r]:
            return
        peer = self.pairing.pick(r, self.live) if self.pairing.active(r) else None
        if peer is None:
            self._apply(r)
            return
        self.locked[r] = True
        self.sent[r] += self.nbytes
        self.queue.after(self.per_round + self.net.alpha + self.nbytes * self.net.beta, self._arrive, peer, r)

    def _arrive(self, j: int, i: int) -> None:
        """Worker i's replica reaches j, which averages with it and answers."""
        if not self.alive[j]:
            # The link breaks: i drops j (the real worker logs it) and applies its gradient.
            self.live.discard(j)
            self.locked[i] = False
            self._release(i)
            self._apply(i)
            return
        if self.locked[j]:
            self.waiting[j].append(i)
            return
        if self.maths:
            self.flats[j].flat.add_(self.flats[i].flat).mul_(0.5)
        self.averagings += 1
        self.sent[j] += self.nbytes
        self.queue.after(self.net.alpha + self.nbytes * self.net.beta, self._answered, i, j)

    def _answered(self, i: int, j: int) -> None:
        if self.maths:
            self.flats[i].flat.copy_(self.flats[j].flat)
        self.locked[i] = False
        self._release(i)
        if self.alive[i]:
            self._apply(i)

    def _release(self, r: int) -> None:
        """Serve the averagings that waited for ``r``'s lock."""
        held, self.waiting[r] = self.waiting[r], []
        for i in held:
            self._arrive(r, i)

    def _apply(self, r: int) -> None:
        if self.maths:
            for param, g in zip(self.flats[r].params, self.grads[r]):
                param.grad = g
            self.optimizers[r].step()
        self.done[r] += 1
        self.end = self.queue.now
        if r == 0 and self.done[0] % self.cfg.run.log_every == 0:
            self.log_train(self.queue.now, self.done[0], None, sum(self.done) * self.share, int(self.sent[0]))
        # Worker 0's replica is the global model during the run, as the real run evaluates it.
        if r == 0 and self.snapshot_due(self.done[0]) and \
                self.snapshot(self.queue.now, self.done[0], sum(self.done) * self.share, self.flats[0].flat):
            self.queue.stop()
            return
        self._start(r)

    def _die(self, rank: int) -> None:
        if not self.alive[rank] or self.claimed >= self.budget and not any(self.locked):
            return
        self.alive[rank] = False
        self.lost.append(rank)
        self.live.discard(rank)
        for i in self.waiting[rank]:
            self._arrive(rank, i)  # their links break
        self.waiting[rank] = []
