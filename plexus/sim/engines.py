"""The simulated jobs: the real rules under virtual time.

``AllReduceSim`` (``allreduce``, every algorithm) and ``ParameterServerSim`` (``ps`` under
bsp, asp, ssp and softsync) drive the classes the real runtime drives: the all-reduce
cost model and bucket layout (``collectives/cost.py``, ``bucketing.py``), the consistency
gates (``ps/consistency.py``), the server optimizers (``ps/optimizers.py``), the
staleness accounting (``ps/staleness.py``) and the batch plans (``train/batches.py``).
Time comes from the cluster description (``cluster.py``), never from the wall clock, so
the same seed gives the same run, event for event.

Time model (documented in the README):

- allreduce: a step takes the slowest worker's compute plus the modelled time of the
  all-reduce of every bucket one after the other (no overlap of communication with
  backward: exact for a model of one bucket, which the built-in models are). ``master``
  is timed message by message instead (``master_round``), because its workers do not
  finish together: rank 0 sends the sum to one worker after another, so worker 1 computes
  its next gradient while the sum is still on its way to the last, and their gradients
  reach rank 0 staggered. In steady state a step then takes about P N beta + 2 alpha plus
  a worker's compute, where the closed form's 2(P - 1)(alpha + N beta) assumes every
  worker starts together and pays each latency in turn.
- ps: a push occupies the worker's link for alpha + N beta (N the gradient's bytes); each
  server's link takes its shard's bytes one message at a time (a FIFO, so P workers
  pushing at once queue there: the parameter server's bottleneck); the server applies an
  update in (shard bytes) x server_gamma seconds, one at a time; the reply (the fresh
  weights) leaves when the gate lets the worker read and queues on the server's link
  again. Shards are equal to within an element and see the same messages in the same
  order, so one server's timeline stands for all of them and the update is applied to
  the whole vector at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from plexus.collectives.cost import Network, cost
from plexus.config import JobConfig
from plexus.ps.consistency import Push, make_consistency, is_synchronous
from plexus.ps.optimizers import make_server_optimizer
from plexus.ps.staleness import StalenessHistogram, staleness_lr_scale
from plexus.sim.cluster import Jitter, SimSpec, take_in
from plexus.sim.events import EventQueue
from plexus.sim.maths import BucketedGradients, Replica
from plexus.train.batches import GlobalBatches, PartitionBatches

__all__ = ["Outcome", "Simulation", "AllReduceSim", "ParameterServerSim", "server_update", "master_round"]

# Bytes of a message header on the wire (ps/protocol.py's int64 header, rounded).
HEADER_BYTES = 128


@dataclass
class Outcome:
    """What a simulated run did, for the run directory and the summary."""

    virtual_seconds: float = 0.0
    steps: int = 0                 # the job's steps (synchronous) or worker steps (asynchronous)
    steps_per_worker: list[int] = field(default_factory=list)
    samples: int = 0
    bytes_sent: list[int] = field(default_factory=list)   # per worker
    bytes_sent_servers: int = 0
    lost_workers: list[int] = field(default_factory=list)
    failed: str | None = None      # why the job failed, naming the process
    updates_applied: int | None = None
    staleness: StalenessHistogram | None = None
    order: list[tuple[int, int]] = field(default_factory=list)  # (worker, clock) per applied gradient
    compute_seconds: float = 0.0   # mean per worker
    wait_seconds: float = 0.0      # mean per worker: communication and waiting
    events: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Simulation:
    """What every simulated strategy shares: the config, the cluster, the data, the model,
    the compute times and the metrics callbacks."""

    # False where rounds of communication are fewer than steps (local SGD, EASGD,
    # AD-PSGD), which then charge ``ComputeModel.per_round`` at each round themselves.
    communicates_every_step = True

    def __init__(self, cfg: JobConfig, spec: SimSpec, data, replica: Replica | None,
                 log: Callable[..., None], evaluate: Callable[[float, int, int], None]) -> None:
        self.cfg, self.spec, self.data, self.replica = cfg, spec, data, replica
        self.log, self.evaluate = log, evaluate
        self.workers = spec.workers
        self.share = cfg.run.batch_size // self.workers
        self.jitter = Jitter(spec.compute.jitter, cfg.run.seed)
        slow = {s.rank: s.factor for s in cfg.cluster.slow if s.role == "worker"}
        self.slow = np.array([slow.get(r, 1.0) for r in range(self.workers)])
        # A round's work besides the wire: in every step of a strategy that communicates at
        # every step, else where its rounds are (``per_round``).
        every = spec.compute.per_round if self.communicates_every_step else 0.0
        self.per_round = spec.compute.per_round
        self.base_compute = spec.compute.step_time(self.share) + every
        self.outside = spec.compute.outside + every  # of base_compute: a step's work besides forward and backward
        self.numel = replica.numel if replica is not None else spec.extra["numel"]
        self.nbytes = self.numel * 4
        self.net = spec.network
        self.fail_at = self._failure_times()
        self._snapshots = 0  # snapshots taken by snapshot_due

    def _failure_times(self) -> dict[tuple[str, int], float]:
        times = {(f.role, f.rank): f.time for f in self.spec.failures}
        if self.spec.fail_rate > 0:
            rng = np.random.default_rng(self.cfg.run.seed + 104729)
            lifetimes = rng.exponential(3600.0 / self.spec.fail_rate, self.workers)
            for r, t in enumerate(lifetimes):
                key = ("worker", r)
                times[key] = min(times.get(key, math.inf), float(t))
        return times

    def log_train(self, now: float, step: int, loss: float | None, samples: int, sent: int,
                  staleness: float | None = None, worker_samples: int | None = None) -> None:
        """Worker 0's ``train`` event at its step ``step`` (the report's curves)."""
        self.log("train", time=now, worker=0, step=step, loss=loss, samples=samples,
                 worker_samples=step * self.share if worker_samples is None else worker_samples,
                 bytes_sent=sent, bytes_recv=None, staleness=staleness)

    def snapshot_due(self, step: int, last: int | None = None) -> bool:
        """Whether worker 0's ``step`` reaches a new multiple of --eval-every in a run driven
        by events (steps arrive one worker at a time); never at ``last``, the step the
        run's end evaluates anyway, nor without the maths."""
        every = self.cfg.run.eval_every
        if not every or self.replica is None or step // every <= self._snapshots \
                or (last is not None and step >= last):
            return False
        self._snapshots = step // every
        return True

    def snapshot(self, now: float, step: int, samples: int, weights: torch.Tensor) -> bool:
        """Evaluate ``weights`` as the global model; True when --target-accuracy is reached."""
        self.replica.load(weights)
        return self.evaluate(now, step, samples)

    def compute_times(self, ranks: np.ndarray | None = None) -> np.ndarray:
        n = self.workers if ranks is None else len(ranks)
        slow = self.slow if ranks is None else self.slow[ranks]
        return self.base_compute * slow * self.jitter.draw(n)

    def run(self, steps: int) -> Outcome:
        raise NotImplementedError


class AllReduceSim(Simulation):
    """Synchronous all-reduce: every step waits for the slowest worker, then reduces."""

    def run(self, steps: int) -> Outcome:
        cfg, spec, p = self.cfg, self.spec, self.workers
        s = cfg.strategy
        out = Outcome(steps_per_worker=[0] * p, bytes_sent=[0] * p)
        grads = None
        if self.replica is not None:
            grads = BucketedGradients(self.replica, int(s.bucket_mb * 2**20), s.algorithm)
            bucket_bytes = [b.buffer.numel() * b.buffer.element_size() for b in grads.buckets.buckets]
            from plexus.strategies.base import make_optimizer
            optimizer = make_optimizer(self.replica.model.parameters(), cfg.optim)
        else:
            bucket_bytes = _buckets_of(spec.extra["param_sizes"], int(s.bucket_mb * 2**20))
        algorithm = "ring" if s.algorithm == "native" else s.algorithm  # gloo's all-reduce is a ring
        costs = [cost(algorithm, p, n, network=self.net, local_size=s.local_size or 2) for n in bucket_bytes]
        comm = sum(c.time for c in costs)
        staggered = algorithm == "master" and p > 1
        ready = np.zeros(p)  # staggered: when each worker holds the last step's sum
        comm_total = 0.0
        sent = np.zeros(p, dtype=np.int64)
        for c in costs:
            sent += np.asarray(c.sent, dtype=np.int64)
        batches = GlobalBatches(len(self.data.x_train), cfg.run.batch_size, cfg.run.seed) if grads else None
        deaths = sorted((t, r) for (role, r), t in self.fail_at.items() if role == "worker")
        now, compute_total = 0.0, 0.0
        exact = p <= spec.exact_up_to
        for step in range(steps):
            times = self.compute_times()
            if staggered:
                held = ready + times
                for n in bucket_bytes:
                    held = master_round(held, n, self.net)
                end = float(held.max())
                comm_total += end - float((ready + times).max())
            else:
                end = now + float(times.max()) + comm
                held = np.full(p, end)
                comm_total += comm
            if deaths and deaths[0][0] < end:
                t, r = deaths[0]
                # A synchronous group cannot go on without a member: the collective times
                # out, and the job fails naming the worker (as the real runtime does).
                out.failed = f"worker {r} died at {t:.3f} s (simulated); the all-reduce timed out " \
                             f"{cfg.cluster.timeout:g} s later"
                out.lost_workers = [r]
                now = max(now, t) + cfg.cluster.timeout
                break
            loss = None
            if grads is not None:
                idx = batches.indices(step)
                x, y = self.data.x_train[idx], self.data.y_train[idx]
                if exact:
                    per_worker, losses = [], []
                    for r in range(p):
                        buffers, value = grads.worker(x[r * self.share:(r + 1) * self.share],
                                                      y[r * self.share:(r + 1) * self.share])
                        per_worker.append(buffers)
                        losses.append(value)
                    grads.reduce(per_worker)
                    loss = losses[0]
                else:
                    loss = grads.whole_batch(x[:p * self.share], y[:p * self.share])
                optimizer.step()
            compute_total += float(times.mean())
            now, ready = end, held
            out.steps = step + 1
            done = out.steps
            if done % cfg.run.log_every == 0 or done == steps:
                self.log_train(now, done, loss, done * cfg.run.batch_size, int(sent[0]) * done)
            if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done != steps:
                if self.evaluate(now, done, done * cfg.run.batch_size):
                    break  # --target-accuracy reached
        if grads is not None:
            grads.close()
        out.virtual_seconds = now
        out.steps_per_worker = [out.steps] * p
        out.samples = out.steps * self.share * p
        out.bytes_sent = [int(b) * out.steps for b in sent]
        out.compute_seconds = compute_total
        out.wait_seconds = now - compute_total
        out.events = out.steps  # one virtual-time advance per step: nothing else happens between
        out.extra = {"algorithm_seconds_per_step": comm_total / out.steps if out.steps else comm,
                     "algorithm_modelled": algorithm + (", staggered" if staggered else ""),
                     "gradients": "per worker, summed in the algorithm's order" if exact else
                     "the whole global batch in one backward (the same mean, other rounding)"}
        return out


def master_round(ready: np.ndarray, nbytes: int, net: Network) -> np.ndarray:
    """When each rank holds the sum of a ``master`` all-reduce of ``nbytes`` bytes whose
    rank r has its vector ready at ``ready[r]``, under one card per rank as ``--net``
    emulates it (``cluster/emulation.py``): a message occupies the sender's card for
    nbytes x beta, arrives alpha after it left, and the receiver's card takes in one
    message at a time. Rank 0 takes the others' vectors in the order they arrive, adds
    them ((P - 1) nbytes gamma), and sends the sum to ranks 1, 2, ..., P - 1 one after
    another; rank 0 itself goes on once the last send has left its card."""
    p, wire = len(ready), nbytes * net.beta
    gathered = take_in(ready[1:] + net.alpha, wire)
    start = max(gathered, float(ready[0])) + (p - 1) * nbytes * net.gamma
    held = start + np.arange(p) * wire + net.alpha
    held[0] = start + (p - 2) * wire
    return held


def _buckets_of(sizes: list[int], bucket_bytes: int) -> list[int]:
    """Bucket sizes in bytes, as ``GradientBuckets`` packs float32 parameters (reverse order)."""
    buckets, current = [], 0
    for n in reversed(sizes):
        nbytes = n * 4
        if current and current + nbytes > bucket_bytes:
            buckets.append(current)
            current = 0
        current += nbytes
    if current:
        buckets.append(current)
    return buckets


def server_update(params: torch.Tensor, optimizer, dense: list[torch.Tensor], divisor: int, stale: list[int],
                  staleness_lr: bool) -> torch.Tensor:
    """The new weights after one update of a group, as ``ps/server.py`` applies it: the
    sum of the group's gradients in its order, divided, through the server optimizer."""
    if len(dense) == 1 and divisor == 1:
        grad = dense[0]
    else:
        grad = dense[0].clone()
        for more in dense[1:]:
            grad.add_(more)
        grad.div_(divisor)
    out = torch.empty_like(params)
    optimizer.step(params, grad, staleness_lr_scale(stale) if staleness_lr else 1.0, out=out)
    optimizer.tick()
    return out


@dataclass
class _Worker:
    rank: int
    batches: Any
    clock: int = 0            # pushes made
    steps: int = 0
    version: int = 0          # server version of the weights it holds
    alive: bool = True
    grad: torch.Tensor | None = None
    loss: float | None = None
    sent: int = 0
    compute: float = 0.0
    busy: bool = False        # computing, or waiting for the reply to its push
    staleness: int | None = None


class ParameterServerSim(Simulation):
    """Downpour SGD against S server shards, under a consistency gate."""

    def run(self, steps: int) -> Outcome:
        cfg, spec, p = self.cfg, self.spec, self.workers
        s = cfg.strategy
        servers = max(1, spec.servers)
        # Backup workers (Chen et al. 2016): a step is the first P - b pushes computed on its
        # weights; a worker that fell behind skips to the job's step (DownpourStrategy.job_step).
        self.backups = s.backup_workers if s.consistency == "bsp" else 0
        self.gate = make_consistency(s.consistency, p, s.staleness, s.softsync, self.backups)
        self.synchronous = is_synchronous(s.consistency, p, s.staleness, s.softsync)
        for r in range(p):
            self.gate.join(r)
        self.queue = EventQueue()
        self.out = Outcome(steps_per_worker=[0] * p, bytes_sent=[0] * p)
        self.hist = StalenessHistogram()
        self.version = 0
        self.shard_bytes = math.ceil(self.numel / servers) * 4 + HEADER_BYTES
        self.push_bytes = self.nbytes + servers * HEADER_BYTES
        self.link_in = self.link_out = self.cpu = 0.0
        n = len(self.data.x_train)
        self.budget = steps * p if not self.synchronous else None  # shared by asynchronous workers
        self.claimed = 0
        self.steps = steps
        self.params = None
        self._held: dict[int, torch.Tensor] = {}  # per worker: the weights of its last reply
        if self.replica is not None:
            self.params = self.replica.flat()
            self.optimizer = make_server_optimizer(cfg.optim, self.numel)
            self._held = {r: self.params for r in range(p)}
        self.end = 0.0
        self.waiting: list[_Worker] = []  # pushes arrived, replies not yet sent (arrival order)
        if self.replica is None:  # timing alone reads no sample
            self.ws = [_Worker(r, None) for r in range(p)]
        elif self.synchronous:
            plan = GlobalBatches(n, cfg.run.batch_size, cfg.run.seed)
            self.ws = [_Worker(r, plan) for r in range(p)]
        else:
            self.ws = [_Worker(r, PartitionBatches(n, self.share, cfg.run.seed, r, p)) for r in range(p)]
        for (role, rank), t in sorted(self.fail_at.items(), key=lambda kv: kv[1]):
            self.queue.at(t, self._die, role, rank)
        for w in self.ws:
            self._start_step(w)
        self.queue.run()
        out = self.out
        out.virtual_seconds = self.end
        out.steps_per_worker = [w.steps for w in self.ws]
        out.steps = sum(out.steps_per_worker) if not self.synchronous else max(out.steps_per_worker)
        # As a real synchronous run counts them (summary.py): the job's steps of a whole batch,
        # though a run stopped at its target has workers one push apart.
        out.samples = (sum(out.steps_per_worker) if not self.synchronous else out.steps * p) * self.share
        if self.backups:  # the job's steps, each of P - b gradients; late pushes are dropped
            out.steps = self.version
            out.samples = self.version * (p - self.backups) * self.share
            out.extra = {"late_pushes": sum(self.gate.late.values()), "backup_workers": self.backups}
        out.bytes_sent = [w.sent for w in self.ws]
        out.updates_applied = self.version
        out.staleness = self.hist
        out.compute_seconds = float(np.mean([w.compute for w in self.ws]))
        out.wait_seconds = max(0.0, self.end - out.compute_seconds)
        out.events = self.queue.events
        if self.replica is not None:
            self.replica.load(self.params)
        return out

    # --- workers ---------------------------------------------------------------------

    def _may_step(self, w: _Worker) -> bool:
        if not w.alive or self.out.failed:
            return False
        if self.backups:
            return w.version < self.steps  # the job has made its steps, with or without this worker
        if self.budget is None:
            return w.steps < self.steps
        if self.claimed >= self.budget:
            return False
        self.claimed += 1
        return True

    def _start_step(self, w: _Worker) -> None:
        """The worker holds fresh weights: compute a gradient on its next batch."""
        if not self._may_step(w):
            self._maybe_finish()
            return
        w.busy = True
        t = float(self.compute_times(np.array([w.rank]))[0])
        if self.params is not None:
            step = w.version if self.backups else w.steps
            idx = (w.batches.worker_indices(step, w.rank, self.workers) if self.synchronous
                   else w.batches.indices(w.steps))
            self.replica.load(self._held[w.rank])
            w.grad, w.loss = self.replica.flat_grad(self.data.x_train[idx], self.data.y_train[idx])
        w.compute += t
        self.queue.after(t, self._push, w)

    def _push(self, w: _Worker) -> None:
        if not w.alive:
            return
        now = self.queue.now
        w.sent += self.push_bytes
        w.steps += 1
        self.out.steps_per_worker[w.rank] = w.steps
        reach = now + self.net.alpha + self.nbytes * self.net.beta
        arrive = max(reach, self.link_in + self.shard_bytes * self.net.beta)
        self.link_in = arrive
        self.queue.at(arrive, self._arrive, w, w.clock, w.version, w.grad)
        w.clock += 1
        if w.rank == 0 and (w.steps % self.cfg.run.log_every == 0):
            self._log_worker0(w)

    # --- the server ------------------------------------------------------------------

    def _arrive(self, w: _Worker, clock: int, version: int, grad: torch.Tensor | None) -> None:
        if self.out.failed:
            return
        if not w.alive and self.gate.clocks.get(w.rank) is None:
            return  # declared lost before its push arrived: the gate no longer knows it
        self.end = self.queue.now
        start = max(self.queue.now, self.cpu)
        groups = self.gate.push(Push(w.rank, clock, version, grad))
        self.cpu = start + len(groups) * self.shard_bytes * self.spec.server_gamma
        self._apply(groups)
        self.waiting.append(w)
        # Only an update can let a worker that already waits read; without one, only this
        # worker may be served (its own gate check).
        self.queue.at(self.cpu, self._serve, None if groups else w)

    def _apply(self, groups) -> None:
        for group in groups:
            stale = [self.version - push.version for push in group]
            for push in group:
                self.hist.record(self.version - push.version)
                self.out.order.append((push.worker, push.clock))
            if self.params is not None:
                self.params = server_update(self.params, self.optimizer, [push.payload for push in group],
                                            self.gate.divisor(group), stale, self.cfg.strategy.staleness_lr)
            self.version += 1

    def _serve(self, only: _Worker | None = None) -> None:
        """Send the fresh weights to the waiting workers the gate lets read (``only``: to
        that worker, if it may and still waits: a push that arrives while the server applies
        an update is served by that update's replies, at the same moment, and a second
        reply would start a second chain of steps)."""
        waiting = self.waiting if only is None else [w for w in self.waiting if w is only]
        ready = [w for w in waiting if w.alive and self.gate.may_serve(w.rank, w.clock)]
        if ready:
            served = {id(w) for w in ready}
            self.waiting = [w for w in self.waiting if id(w) not in served and w.alive]
        for w in ready:
            depart = max(self.queue.now, self.link_out) + self.shard_bytes * self.net.beta
            self.link_out = depart
            self.out.bytes_sent_servers += self.push_bytes
            w.staleness = self.version - w.version
            w.version = self.version
            if self.params is not None:
                self._held[w.rank] = self.params  # the weights as they leave (applies make new tensors)
            self.queue.at(depart + self.net.alpha, self._receive, w)
        self._eval_if_due()

    def _receive(self, w: _Worker) -> None:
        w.busy = False
        if w.alive and not self.out.failed:
            self.end = self.queue.now
            self._start_step(w)

    # --- faults, metrics, the end ------------------------------------------------------

    def _die(self, role: str, rank: int) -> None:
        if self.out.failed or self._finished():
            return
        t = self.queue.now
        if role == "server":
            self.out.failed = f"server {rank} died at {t:.3f} s (simulated); a dead server ends the job"
            self.queue.stop()
            return
        w = self.ws[rank]
        if not w.alive:
            return
        w.alive = False
        self.out.lost_workers.append(w.rank)
        self._maybe_finish()
        # The servers notice after --peer-timeout; the gate forgets the worker then.
        self.queue.after(self.cfg.cluster.peer_timeout, self._declare_lost, w)

    def _declare_lost(self, w: _Worker) -> None:
        if self.out.failed:
            return
        if all(not x.alive for x in self.ws):
            self.out.failed = f"every worker was lost ({self.workers} of {self.workers})"
            self.queue.stop()
            return
        groups = self.gate.leave(w.rank)
        self._apply(groups)
        self._serve()
        self._maybe_finish()

    def _finished(self) -> bool:
        return all(not w.alive or (not w.busy and not self._may_continue(w)) for w in self.ws)

    def _may_continue(self, w: _Worker) -> bool:
        if self.budget is None:
            return w.steps < self.steps
        return self.claimed < self.budget

    def _maybe_finish(self) -> None:
        if self._finished():
            self.queue.stop()

    def _log_worker0(self, w: _Worker) -> None:
        self.log_train(self.queue.now, w.steps, w.loss, sum(x.steps for x in self.ws) * self.share, w.sent,
                       staleness=w.staleness)

    def _eval_if_due(self) -> None:
        w0 = self.ws[0]
        if self.snapshot_due(w0.steps, None if self.budget is not None else self.steps) and \
                self.snapshot(self.queue.now, w0.steps, sum(x.steps for x in self.ws) * self.share, self.params):
            self.end = self.queue.now  # --target-accuracy reached: every worker stops
            self.queue.stop()
