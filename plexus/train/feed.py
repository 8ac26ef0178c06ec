"""Where a worker's data comes from, step by step, and when it stops: what a strategy's
``feed`` verb returns (``strategies/base.py``).

The runners (``runner.worker_main``, ``stage_runner.stage_main``) ask a feed for the
first step, the indices of each step's samples, whether the step just made was the last,
and how many samples the job has seen; they never ask which strategy they drive. Each
rule of a strategy is one feed:

- ``GlobalFeed``: synchronous strategies; worker r trains on slice r of global batch t
  (contract 1). An elastic group names the slice at each step (``share``).
- ``PartitionFeed``: asynchronous ones; each worker walks its own partition of the
  training set, optionally stopping on one budget of updates shared by the workers
  (``train/budget.py``), so that fast workers make more of them.
- ``UnitFeed``: ``ps --assignment dynamic``; each step trains on the job's next unit,
  numbered by the shared budget's tickets.
- ``CatchUpFeed``: ``ps --backup-workers``; a worker that fell behind skips to the job's
  current step, and the job ends when it has made its steps.
- ``ClaimFeed``: a strategy with its own scheduler (Sandblaster's) hands out units of
  data and says when the run ends, whatever ``--steps``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from plexus.config import JobConfig
from plexus.train.batches import GlobalBatches, PartitionBatches, UnitBatches
from plexus.train.budget import BUDGET_KEY, UpdateBudget

__all__ = ["Feed", "GlobalFeed", "PartitionFeed", "UnitFeed", "CatchUpFeed", "ClaimFeed", "total_steps",
           "DEFAULT_MIN_STEPS", "SAMPLES_KEY", "UNBOUNDED"]

# Asynchronous workers count the samples of the whole job together under this key (at
# every log step), so that the evaluating worker says how much the job has seen.
SAMPLES_KEY = "train/samples"
# Steps of a run that its strategy ends, or its time limit alone.
UNBOUNDED = 2**62
# Steps of a run given no length: one epoch of a small dataset (digits: 22 steps of 64) is
# too short to learn anything, or for a --kill at step 30 to fire.
DEFAULT_MIN_STEPS = 300


def total_steps(cfg: JobConfig, steps_per_epoch: int) -> int:
    """Steps the run may take: --steps, else --epochs; when neither (nor --time-limit) is
    given, one epoch or DEFAULT_MIN_STEPS, whichever is longer."""
    if cfg.run.steps is not None:
        return cfg.run.steps
    if cfg.run.epochs is not None:
        return max(1, math.ceil(cfg.run.epochs * steps_per_epoch))
    if cfg.run.time_limit is not None:
        return UNBOUNDED  # bounded by --time-limit alone
    return max(steps_per_epoch, DEFAULT_MIN_STEPS)


class Feed:
    """One worker's steps ``start() .. limit``, each on the samples ``indices(step)``.

    The runner's loop is::

        step = feed.start(resumed)
        while step < feed.limit and (idx := feed.indices(step)) is not None:
            ... train on idx ...
            step += 1
            if not feed.stepped(step): break
    """

    # Every worker trains on a slice of the same global batch at each step, so the job's
    # workers reach each step together (a checkpoint is then taken at one common step).
    lockstep = False
    # The job's update budget, where the workers share one (None elsewhere).
    budget: UpdateBudget | None = None

    def __init__(self, cfg: JobConfig, store, rank: int, workers: int, per_step: int, limit: int,
                 shared_count: bool = False) -> None:
        self.cfg, self.store, self.rank, self.workers = cfg, store, rank, workers
        self.per_step = per_step  # samples the job consumes per step, as this worker counts them
        self.limit = limit
        # Workers on their own clocks add their samples up in the store; the others know
        # the job's count from their own steps.
        self.shared_count = shared_count and workers > 1
        self._reported = 0

    def restore(self, job_updates: Callable[[], int]) -> None:
        """Before training, when resuming (on worker 0): ``job_updates()`` counts every
        worker's steps in the checkpoint, for a feed whose workers share a budget."""

    def start(self, resumed: int) -> int:
        """The first step: ``resumed`` (0 unless the run resumes from a checkpoint) or later."""
        return resumed

    def indices(self, step: int) -> torch.Tensor | None:
        """This worker's samples for ``step``; None when the job has no more work for it."""
        raise NotImplementedError

    def retry(self, step: int) -> torch.Tensor:
        """The samples for ``step`` again, after the strategy re-formed its group during the
        step (``Regrouped``): the slice may have changed."""
        return self.indices(step)

    def stepped(self, steps_done: int) -> bool:
        """Called after each step; False when that step was this worker's last."""
        return True

    def samples(self, steps_done: int) -> int:
        """The samples the job has trained on, as this worker knows it after ``steps_done``."""
        return steps_done * self.per_step

    def publish(self, steps_done: int) -> int:
        """At a log step: the job's samples so far, this worker's adding to the job's count
        where the workers keep it together."""
        mine = self.samples(steps_done)
        if not self.shared_count:
            return mine
        total = int(self.store.add(SAMPLES_KEY, mine - self._reported))
        self._reported = mine
        return total

    def seen(self, steps_done: int) -> int:
        """The job's samples for an evaluation record (the job's count, where kept)."""
        return int(self.store.add(SAMPLES_KEY, 0)) if self.shared_count else self.samples(steps_done)


class GlobalFeed(Feed):
    """Slice ``share(step)`` of global batch ``step`` (contract 1)."""

    lockstep = True

    def __init__(self, cfg: JobConfig, store, rank: int, workers: int, n: int,
                 share: Callable[[int, int, int], tuple[int, int]] | None = None, first: int = 0) -> None:
        self.batches = GlobalBatches(n, cfg.run.batch_size, cfg.run.seed)
        super().__init__(cfg, store, rank, workers, cfg.run.batch_size, total_steps(cfg, self.batches.steps_per_epoch))
        self._share = share if share is not None else (lambda step, rank, workers: (rank, workers))
        self._first = first  # a worker that joined an elastic group starts at the job's step

    def start(self, resumed: int) -> int:
        return max(self._first, resumed)

    def indices(self, step: int) -> torch.Tensor:
        return self.batches.worker_indices(step, *self._share(step, self.rank, self.workers))


class _Budgeted(Feed):
    """A feed whose workers may stop on one budget of ``limit x workers`` updates shared by
    all of them (Lian et al. 2018): each update is claimed before it is made, and a worker's
    last step is the one after which no claim is left."""

    numbered = False  # the budget's tickets name data units (UnitFeed)

    def __init__(self, *args, shares_budget: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shares_budget = shares_budget

    def restore(self, job_updates: Callable[[], int]) -> None:
        if self.shares_budget:
            self.store.add(BUDGET_KEY, job_updates())  # the updates the job had made

    def start(self, resumed: int) -> int:
        if self.shares_budget:
            self.budget = UpdateBudget.open(self.store, self.limit, self.workers, numbered=self.numbered)
            if self.budget is not None:
                self.limit = self.budget.total if self.budget.take() else 0
        return resumed

    def stepped(self, steps_done: int) -> bool:
        if self.budget is None:
            return True
        if not self.budget.take():
            self.limit = steps_done  # the shared budget is spent: this step was this worker's last
        return not self.budget.spent


class PartitionFeed(_Budgeted):
    """Batches of B/P samples from the worker's own partition of the training set."""

    def __init__(self, cfg: JobConfig, store, rank: int, workers: int, n: int, shares_budget: bool = False) -> None:
        share = cfg.run.batch_size // workers
        self.batches = PartitionBatches(n, share, cfg.run.seed, rank, workers)
        super().__init__(cfg, store, rank, workers, share, total_steps(cfg, self.batches.steps_per_epoch),
                         shared_count=True, shares_budget=shares_budget)

    def indices(self, step: int) -> torch.Tensor:
        return self.batches.indices(step)


class UnitFeed(_Budgeted):
    """The job's next unit at each step: the budget's ticket names it (``UnitBatches``)."""

    numbered = True

    def __init__(self, cfg: JobConfig, store, rank: int, workers: int, n: int) -> None:
        self.batches = UnitBatches(n, cfg.run.batch_size, cfg.run.seed, workers)
        super().__init__(cfg, store, rank, workers, cfg.run.batch_size // workers,
                         total_steps(cfg, self.batches.steps_per_epoch), shared_count=True, shares_budget=True)

    def indices(self, step: int) -> torch.Tensor:
        return self.batches.indices(self.budget.ticket)


class CatchUpFeed(Feed):
    """Slice r of the job's current step, ``job_step()``, which a worker that fell behind
    skips to; a job's step uses the first P - backup slices' samples."""

    lockstep = True

    def __init__(self, cfg: JobConfig, store, rank: int, workers: int, n: int, job_step: Callable[[], int]) -> None:
        self.batches = GlobalBatches(n, cfg.run.batch_size, cfg.run.seed)
        share = cfg.run.batch_size // workers
        super().__init__(cfg, store, rank, workers, (workers - cfg.strategy.backup_workers) * share,
                         total_steps(cfg, self.batches.steps_per_epoch))
        self.job_step = job_step

    def indices(self, step: int) -> torch.Tensor | None:
        at = self.job_step()
        if at >= self.limit:
            return None  # the job has made its steps, with or without this worker
        return self.batches.worker_indices(at, self.rank, self.workers)

    def samples(self, steps_done: int) -> int:
        return self.job_step() * self.per_step


class ClaimFeed(Feed):
    """Units from the strategy's own scheduler (``units.next()``: indices, or None once the
    job has no more work for this worker); the run lasts as long as the scheduler says."""

    def __init__(self, cfg: JobConfig, store, rank: int, workers: int, units) -> None:
        super().__init__(cfg, store, rank, workers, units.unit_samples, UNBOUNDED, shared_count=True)
        self.units = units

    def indices(self, step: int) -> torch.Tensor | None:
        return self.units.next()
