"""The interface every strategy implements, and the context the runner hands it.

A strategy is the *synchroniser* of ARCHITECTURE.md section 9: how replicas agree. The
runners (``train/runner.py`` for a whole model in each worker, ``train/stage_runner.py``
for a replica cut into stages, the executors) drive every strategy with the same verbs
and never ask which one they drive:

- ``setup(model, loss_fn, ctx)``: take the model; ``loss_fn`` is the executor's;
- ``feed(ctx, samples)``: where each step's data comes from and when the worker stops
  (``train/feed.py``);
- ``step(x, y)``: train on this worker's share of one batch;
- ``snapshot(rank, final)``: make the global model current (it may be a collective) and
  hand it over on the worker that evaluates it;
- ``agree(flag)``: any worker's flag, known to all (stop together);
- ``finish(cfg, rank)``: the strategy's part of the final record, and whether the worker
  must wait for the others before it leaves;
- ``close()``: release links and threads.

The finer methods below them (``global_model``, ``evaluates``, ``final_model``,
``prepare_snapshot``, ``replica``, ``final_record``, ``tolerates_loss``) are what a
strategy overrides to change a verb's default. Roles other than workers, the summary and
checkpoints are class-level and optional. A strategy never reads data or writes metrics
itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from plexus.cluster.emulation import Emulator
from plexus.cluster.group import Group
from plexus.cluster.rendezvous import ProcessInfo
from plexus.cluster.traffic import Traffic
from plexus.collectives import get_algorithm
from plexus.collectives.base import AllReduce
from plexus.config import JobConfig, OptimConfig
from plexus.config.defaults import USER_SOURCES
from plexus.errors import ConfigError, PlexusError
from plexus.train.feed import Feed, GlobalFeed, PartitionFeed

__all__ = ["Strategy", "StepStats", "Snapshot", "Finish", "Regrouped", "ProcessContext", "Context", "RoleContext",
           "LossFn", "make_optimizer", "algorithm_for", "algorithm_ran", "ONE_MACHINE_ALGORITHM",
           "ONE_MACHINE_SOURCE"]

# loss_fn(model, x, y) -> scalar loss (mean over the batch)
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepStats:
    # Mean training loss of this worker's share of the batch.
    loss: float
    # Staleness of the update this step produced, where the strategy has one.
    staleness: float | None = None


@dataclass
class Snapshot:
    """What ``Strategy.snapshot`` hands the runner."""

    # The global model, on the worker that evaluates it now (None on the others).
    model: torch.nn.Module | None = None
    # That worker's own replica, where it differs from the global model (decentralized
    # strategies keep one per worker); evaluated too, labelled ``worker{rank}``.
    replica: torch.nn.Module | None = None
    # Values to log with the snapshot (a ``strategy`` event), e.g. the consensus distance.
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Finish:
    """What ``Strategy.finish`` hands the runner at the end of training."""

    # Extra JSON data for this worker's final record (read by ``summary_fields``).
    record: dict[str, Any]
    # The worker waits, once its record is written, until every worker is done: nobody may
    # tear down a group others still use. A strategy that outlives lost workers has no
    # such group, and its survivors cannot wait for all.
    wait: bool


class Regrouped(PlexusError):
    """Raised by ``step`` when the worker group re-formed during the step (an elastic
    group lost a worker). ``completed``: the step counts as done with ``loss``; otherwise the
    runner redoes it on the samples its feed gives again (``Feed.retry``)."""

    def __init__(self, completed: bool, loss: float) -> None:
        super().__init__("the worker group re-formed")
        self.completed = completed
        self.loss = loss


@dataclass
class ProcessContext:
    """Who this process is, the job's store and config, its counters and emulation."""

    info: ProcessInfo
    store: dist.Store
    cfg: JobConfig
    traffic: Traffic
    emulator: Emulator
    device: torch.device
    backend: str


@dataclass
class Context(ProcessContext):
    """What a worker's strategy may use."""

    _workers: Group | None = field(default=None, repr=False)
    # The metrics log (``MetricsLog``: ``log.log(event, **fields)``), for events the
    # strategy writes from its own threads (long heartbeat gaps); None writes nothing.
    log: Any = None

    def worker_group(self) -> Group:
        """The job's fixed group of workers (made on first use, by every worker)."""
        if self._workers is None:
            names = [f"worker {r}" for r in range(self.info.world_size)]
            self._workers = Group(self.store, "workers", self.info.rank, names, traffic=self.traffic,
                                  timeout=self.cfg.cluster.timeout, backend=self.backend,
                                  net=self.cfg.cluster.net)
        return self._workers


@dataclass
class RoleContext(ProcessContext):
    """What a non-worker process (server, aggregator) gets: the run directory (None when
    nothing is written) and the metrics log besides the process context."""

    run_dir: Path | None
    log: Any


# What the default --algorithm (native) runs among workers on one machine's CPUs, and the
# source the summary's settings give it.
ONE_MACHINE_ALGORITHM = "ring"
ONE_MACHINE_SOURCE = "default on one machine"


def algorithm_for(ctx: Context, group: Group) -> AllReduce:
    """The all-reduce ``--algorithm`` names; for the default, ``native``, ring where every
    member of ``group`` computes on this machine's CPUs over gloo and shared memory is
    allowed (``--transport`` not ``socket``). There ring's messages go over shared memory
    (``Group.connect``) where gloo's own all-reduce goes over its sockets, and allreduce
    trained 1.4-2.1x faster with it (docs/results/ddp-throughput.md); across machines, or
    on NCCL, the backend's own stays. A value the user set is never replaced. A collective
    call: every member of ``group`` makes it, and all choose the same."""
    s = ctx.cfg.strategy
    if (s.algorithm == "native" and ctx.cfg.source("algorithm") not in USER_SOURCES and ctx.backend == "gloo"
            and ctx.device.type == "cpu" and ctx.cfg.cluster.transport != "socket" and group.size > 1
            and group.on_one_machine()):
        return get_algorithm(ONE_MACHINE_ALGORITHM, s)
    return get_algorithm(s.algorithm, s)


def algorithm_ran(cfg: JobConfig, record: dict[str, Any]) -> dict[str, Any]:
    """The summary's ``algorithm`` where the default ran another (``algorithm_for``), from
    worker 0's final record (its ``algorithm``); nothing where it ran the one configured."""
    ran = record.get("algorithm", cfg.strategy.algorithm)
    return {} if ran == cfg.strategy.algorithm else {"algorithm": ran}


class SpikeCompensatedSGD(torch.optim.SGD):
    """Momentum SGD for gradients ``delay`` steps stale, with spike compensation (Kosson
    et al. 2020, "Pipelined backpropagation at scale"). A gradient g taken at step t and
    applied undelayed would have moved the weights by lr g beta^j at each step t + j; one
    that arrives D steps late has missed D of those, and its later terms are beta^-D too
    large. So the momentum buffer takes beta^D g instead of g, and the weights take the
    missed part, lr (1 + beta + ... + beta^D - beta^D) g, at once: the gradient's total
    contribution, and each of its terms from its arrival on, equal an undelayed one's.
    Without momentum it is plain SGD."""

    def __init__(self, params, *, lr: float, momentum: float, weight_decay: float, delay: int) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.delay = delay

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("SpikeCompensatedSGD takes no closure")
        raw = [[p.grad.clone() if p.grad is not None else None for p in group["params"]]
               for group in self.param_groups]
        for group in self.param_groups:
            beta = group["momentum"]
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(beta ** self.delay)
        super().step()
        for group, grads in zip(self.param_groups, raw):
            beta = group["momentum"]
            spike = sum(beta ** j for j in range(self.delay))  # 1 + ... + beta^(D-1)
            for p, g in zip(group["params"], grads):
                if g is not None:
                    p.add_(g, alpha=-group["lr"] * spike)
        return None


def make_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg`` over ``params`` (momentum SGD with spike
    compensation where ``cfg.delay_steps`` says its gradients are stale)."""
    if cfg.optimizer == "sgd" and cfg.delay_steps and cfg.momentum > 0:
        return SpikeCompensatedSGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                   delay=cfg.delay_steps)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ConfigError(f"unknown optimizer {cfg.optimizer!r}: choose sgd, adam or adagrad")


class Strategy(ABC):
    """One distributed architecture, as seen from one worker process."""

    name: ClassVar[str]
    # Synchronous strategies split each global batch over the workers (contract 1);
    # asynchronous ones give each worker its own partition of the training set.
    synchronous: ClassVar[bool] = True

    # --- the runner's verbs --------------------------------------------------------------

    @abstractmethod
    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        """Take ownership of ``model`` (already initialised identically on every worker).
        ``loss_fn(model, x, y)`` is the executor's: the whole model's loss, or one stage's
        part of a replica's (whose ``backward()`` exchanges gradients with the other stages)."""

    def feed(self, ctx: Context, samples: int, shared_budget: bool = True) -> Feed:
        """Where this worker's data comes from, out of the ``samples`` training samples, and
        when it stops (``train/feed.py``). The default: a synchronous strategy splits each
        global batch over the workers (contract 1); an asynchronous one gives each worker its
        own partition, and, where ``shares_budget``, one budget of updates for the job.
        ``shared_budget=False`` where a worker's steps must not depend on the other
        workers' (the stages of one replica must all make the same steps)."""
        cfg, rank, workers = ctx.cfg, ctx.info.rank, ctx.info.world_size
        if self.synchronous:
            return GlobalFeed(cfg, ctx.store, rank, workers, samples)
        return PartitionFeed(cfg, ctx.store, rank, workers, samples,
                             shares_budget=shared_budget and self.shares_budget(cfg))

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        """Train on this worker's share of one batch: forward, backward, communicate, update.
        May raise ``Regrouped``."""

    def snapshot(self, rank: int, final: bool = False) -> Snapshot:
        """Called on every worker at each snapshot step (``--eval-every``) and once after
        the last step with ``final=True``: make the global model current
        (``prepare_snapshot``, which may be a collective) and hand it over where this worker
        evaluates it now (``evaluates``; at the end ``final_model``, which may wait for the
        other workers)."""
        fields = self.prepare_snapshot(final=final)
        if final:
            model = self.final_model(rank)
        else:
            model = self.global_model() if self.evaluates(rank) else None
        return Snapshot(model=model, replica=self.replica() if model is not None else None, fields=fields)

    def agree(self, flag: bool) -> bool:
        """True when any worker's ``flag`` is true, known to all of them (used to stop
        together on a time limit or target accuracy)."""
        return flag

    def finish(self, cfg: JobConfig, rank: int) -> Finish:
        """The end of training on this worker: its part of the final record, and whether it
        waits for the others (synchronous strategies that do not outlive lost workers)."""
        wait = self.synchronous and not self.tolerates_loss(cfg, "worker", rank)
        return Finish(record=self.final_record(), wait=wait)

    def close(self) -> None:
        """Release links and threads (also after a failure)."""

    # --- what the verbs' defaults are made of ----------------------------------------------

    @abstractmethod
    def global_model(self) -> torch.nn.Module | None:
        """The model to evaluate, on the process that holds it (None elsewhere)."""

    def replica(self) -> torch.nn.Module | None:
        """This worker's own model where it differs from ``global_model()`` (decentralized
        strategies keep one replica per worker). Worker 0's is evaluated as well, and its
        eval events are labelled ``model: "worker0"``."""
        return None

    def prepare_snapshot(self, final: bool = False) -> dict[str, Any]:
        """Make ``global_model()`` current before it is read. Called on every worker at
        each snapshot step (``--eval-every``) and once more after the last step with
        ``final=True``, so strategies whose global model is an average of replicas may
        compute it here with a collective. Returns values to log with the snapshot (a
        ``strategy`` event), e.g. the consensus distance; {} logs nothing."""
        return {}

    def evaluates(self, rank: int) -> bool:
        """Whether this worker evaluates snapshots of ``global_model()`` now (asked at each
        snapshot step). Worker 0 does; strategies that outlive it hand
        the job to the lowest-ranked worker still training."""
        return rank == 0

    def final_model(self, rank: int) -> torch.nn.Module | None:
        """The finished global model on the one worker that evaluates it for the summary,
        None on the others; called once after the training loop. The default is worker 0's
        ``global_model()``. Strategies that outlive worker 0 pick a survivor instead (and may
        wait here for the other workers to finish)."""
        return self.global_model() if rank == 0 else None

    def final_record(self) -> dict[str, Any]:
        """Extra JSON data this worker adds to its final record (for ``summary_fields``)."""
        return {}

    # --- the job: checks, roles, summary ------------------------------------------------

    @classmethod
    def check_config(cls, cfg: JobConfig) -> None:
        """Raise ConfigError for combinations this strategy cannot run (called before any
        process starts)."""

    # --- roles other than workers (servers, aggregators), run in their own processes ---

    @classmethod
    def extra_roles(cls, cfg: JobConfig) -> list[tuple[str, int]]:
        """Processes besides the workers, as (role, count), e.g. [("server", 2)]."""
        return []

    @classmethod
    def run_role(cls, role: str, rank: int, ctx: "RoleContext") -> None:
        """The main loop of a non-worker process; returns when the job is over."""
        raise NotImplementedError(f"{cls.name} has no role {role!r}")

    @classmethod
    def joined_workers(cls, store: dist.Store) -> int:
        """Workers that joined the running job (ranks after the initial ones), whose final
        records the summary collects too."""
        return 0

    @classmethod
    def late_records(cls, cfg: JobConfig, store: dist.Store) -> list[tuple[str, int]]:
        """(role, rank) of final records that a process the launcher did not start writes
        (a server that joined the job), which the summary waits for after the launcher's
        processes have ended."""
        return []

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        """True when the job carries on without this process if it dies."""
        return False

    @classmethod
    def shares_budget(cls, cfg: JobConfig) -> bool:
        """True when the workers stop on one budget of ``steps x workers`` updates shared
        by all of them (``train/budget.py``), so that fast workers make more updates and
        every worker stops at about the same time, instead of ``steps`` updates each. Only
        asynchronous strategies can: a synchronous step needs every worker."""
        return False

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        """Strategy-specific summary values from the processes' final records
        (``records["worker"][r]``, ``records["server"][s]``, ...): e.g. updates_applied,
        staleness_mean, staleness_max. The default suits synchronous strategies."""
        return {}

    # --- checkpoints (train/checkpoint.py) ---------------------------------------------

    @classmethod
    def checkpoint_servers(cls, cfg: JobConfig) -> int:
        """Processes besides the workers whose state a checkpoint holds (ps's shards)."""
        return 0

    def checkpoint_state(self) -> dict[str, Any]:
        """What this worker adds to its part of a checkpoint (tensors, numbers, strings
        and their dicts and lists); its steps and random state are added by the runner."""
        return {}

    def restore_checkpoint(self, mine: dict[str, Any], read: Callable[[str], dict[str, Any]]) -> None:
        """Continue from ``mine``, this worker's part of a checkpoint (``read(name)``
        loads another part, e.g. ``worker-0``), before training starts."""
