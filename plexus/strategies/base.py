"""The interface every strategy implements, and the context the runner hands it.

The runner drives a strategy with ``setup`` once, ``step`` per batch and ``close`` at the
end; a strategy never reads data or writes metrics itself.
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
from plexus.config import JobConfig, OptimConfig
from plexus.errors import ConfigError

__all__ = ["Strategy", "StepStats", "Context", "RoleContext", "LossFn", "make_optimizer"]

# loss_fn(model, x, y) -> scalar loss (mean over the batch)
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepStats:
    # Mean training loss of this worker's share of the batch.
    loss: float
    # Staleness of the update this step produced, where the strategy has one.
    staleness: float | None = None


@dataclass
class Context:
    """What a strategy may use: who it is, the job's store, config, counters, emulation."""

    info: ProcessInfo
    store: dist.Store
    cfg: JobConfig
    traffic: Traffic
    emulator: Emulator
    device: torch.device
    backend: str
    _workers: Group | None = field(default=None, repr=False)

    def worker_group(self) -> Group:
        """The job's fixed group of workers (made on first use, by every worker)."""
        if self._workers is None:
            names = [f"worker {r}" for r in range(self.info.world_size)]
            self._workers = Group(self.store, "workers", self.info.rank, names, traffic=self.traffic,
                                  timeout=self.cfg.cluster.timeout, backend=self.backend,
                                  net=self.cfg.cluster.net)
        return self._workers


@dataclass
class RoleContext:
    """What a non-worker process (server, aggregator) gets: the same as a worker's
    context, plus the run directory (None when nothing is written) and the metrics log."""

    info: ProcessInfo
    store: dist.Store
    cfg: JobConfig
    traffic: Traffic
    emulator: Emulator
    device: torch.device
    backend: str
    run_dir: Path | None
    log: Any


def make_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg`` over ``params``."""
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

    @abstractmethod
    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        """Take ownership of ``model`` (already initialised identically on every worker)."""

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        """Train on this worker's share of one batch: forward, backward, communicate, update."""

    @abstractmethod
    def global_model(self) -> torch.nn.Module | None:
        """The model to evaluate, on the process that holds it (None elsewhere)."""

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
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        """True when the job carries on without this process if it dies."""
        return False

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        """Strategy-specific summary values from the processes' final records
        (``records["worker"][r]``, ``records["server"][s]``, ...): e.g. updates_applied,
        staleness_mean, staleness_max. The default suits synchronous strategies."""
        return {}

    def agree(self, flag: bool) -> bool:
        """True when any worker's ``flag`` is true, known to all of them (used to stop
        together on a time limit or target accuracy)."""
        return flag

    def final_record(self) -> dict[str, Any]:
        """Extra JSON data this worker adds to its final record (for ``summary_fields``)."""
        return {}

    def close(self) -> None:
        """Release links and threads."""
