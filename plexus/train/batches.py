"""Which samples each worker trains on at each step (contracts 1 and 2).

Synchronous strategies: step t of the job consumes global batch t, the same B samples
whatever the number of workers P; worker r takes the r-th contiguous slice of B/P. The
order is a seeded permutation per epoch, so the same seed gives the same order.

Asynchronous strategies: the training set is split into P disjoint contiguous partitions
of a seeded permutation (as DistBelief shards its data), and each worker walks its own
partition in batches of B/P, reshuffled per epoch.

Dynamic assignment (ps ``--assignment dynamic``): the job is one queue of units of B/P
samples, and a worker takes the next unit whenever it is idle, so a slow worker trains on
fewer samples (Dean et al. 2012, section 4.2). Unit u is worker u mod P's slice of global
batch u div P, so the job's units walk the same seeded per-epoch order as a synchronous
job's global batches.
"""
from __future__ import annotations

import torch

from plexus.errors import ConfigError

__all__ = ["GlobalBatches", "PartitionBatches", "UnitBatches"]


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


class GlobalBatches:
    """Global batch ``step`` of ``batch_size`` samples out of ``n``, and worker slices of it."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        if batch_size > n:
            raise ConfigError(f"batch_size must not exceed the training set ({n} samples), got {batch_size}: "
                              f"pass a smaller --batch-size")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        # The last partial batch of an epoch is dropped so every step has exactly B samples.
        self.steps_per_epoch = n // batch_size
        self._epoch, self._perm = -1, None

    def indices(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, _permutation(self.n, self.seed, epoch)
        return self._perm[within * self.batch_size: (within + 1) * self.batch_size]

    def worker_indices(self, step: int, rank: int, workers: int) -> torch.Tensor:
        """Slice ``rank`` of ``workers`` contiguous slices of global batch ``step``: B/P
        samples each, or, where P does not divide B (an elastic group that lost a worker),
        floor or ceil of B/P, the whole batch covered."""
        lo, hi = rank * self.batch_size // workers, (rank + 1) * self.batch_size // workers
        return self.indices(step)[lo:hi]


class PartitionBatches:
    """Batches of ``share`` samples from worker ``rank``'s own partition of ``n`` samples."""

    def __init__(self, n: int, share: int, seed: int, rank: int, workers: int) -> None:
        owned = _permutation(n, seed, -1)
        size = n // workers
        # A worker that joins a running job (rank >= workers) shares partition rank mod
        # workers, walked in its own order.
        part = rank % workers
        self.partition = owned[part * size: (part + 1) * size]
        if share > len(self.partition):
            raise ConfigError(f"batch_size / workers ({share}) exceeds a worker's partition "
                              f"({len(self.partition)} samples): pass a smaller --batch-size")
        self.share, self.seed, self.rank = share, seed, rank
        self.steps_per_epoch = len(self.partition) // share
        self._epoch, self._order = -1, None

    def indices(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            perm = _permutation(len(self.partition), self.seed * 31 + self.rank, epoch)
            self._epoch, self._order = epoch, self.partition[perm]
        return self._order[within * self.share: (within + 1) * self.share]


class UnitBatches:
    """Unit ``u`` of a job of ``workers`` workers: ``batch_size // workers`` samples, the
    slice ``u mod workers`` of global batch ``u div workers``, whoever trains on it."""

    def __init__(self, n: int, batch_size: int, seed: int, workers: int) -> None:
        self.batches = GlobalBatches(n, batch_size, seed)
        self.workers = workers
        # Per worker, as for the other batch plans: the job's units of one epoch over P.
        self.steps_per_epoch = self.batches.steps_per_epoch

    def indices(self, unit: int) -> torch.Tensor:
        step, slot = divmod(unit, self.workers)
        return self.batches.worker_indices(step, slot, self.workers)
