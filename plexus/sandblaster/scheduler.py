"""Work units handed to idle replicas, with backup tasks (Dean et al. 2012, section 4.2;
Dean and Ghemawat 2004, section 3.6).

Each evaluation of the objective is one pass over a batch, split into units of
``unit_size`` samples. The coordinator opens evaluation ``e`` in the job's store
(``sb/open/e``: which batch, how many units); an idle replica claims the next unit with
one atomic ``store.add``, so a replica that finishes sooner claims again sooner and fast
replicas do more of the batch than slow ones.

Tail. Once every unit is claimed, an idle replica may take a copy of a unit still
outstanding:

- a backup copy, once at most ``backup_after`` of the units is outstanding (at most one
  backup per unit);
- a re-run, when the unit's owner was declared lost (``lost/worker r``, set by the shards when
  its link breaks), whatever ``backup_after``.

Exactly once. Shards add a unit's gradient only the first time they see its id
(``shard.py``), and the first replica to finish a unit marks it done here (``store.add``
returns 1 to exactly one caller); the replica that completes the last unit marks the
evaluation complete, which is what the coordinator waits for. A copy that finishes second
is counted as a duplicate, never added.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from plexus.cluster.rendezvous import lost_key, wait_keys
from plexus.errors import CommTimeout

__all__ = ["units_of", "Opening", "open_evaluation", "stop", "wait_complete", "Claims", "mark_lost", "PREFIX"]

PREFIX = "sb"
_STOP = "stop"
# An idle replica looks at the store again after this long (seconds).
_POLL = 0.002


def units_of(batch_size: int, unit_size: int) -> int:
    return math.ceil(batch_size / unit_size)


@dataclass(frozen=True)
class Opening:
    """Evaluation ``evaluation`` over batch ``batch`` of the data, in ``units`` units;
    ``objective``: the last objective value L-BFGS accepted (None before the first)."""

    evaluation: int
    batch: int
    units: int
    objective: float | None = None


def open_evaluation(store: dist.Store, opening: Opening) -> None:
    store.set(f"{PREFIX}/open/{opening.evaluation}", json.dumps({"batch": opening.batch, "units": opening.units,
                                                                 "objective": opening.objective}))
    store.set(f"{PREFIX}/latest", str(opening.evaluation))


def stop(store: dist.Store, evaluation: int) -> None:
    """No evaluation after ``evaluation - 1``: replicas waiting for ``evaluation`` stop."""
    store.set(f"{PREFIX}/open/{evaluation}", _STOP)
    store.set(f"{PREFIX}/latest", str(evaluation))


def mark_lost(store: dist.Store, rank: int) -> None:
    store.set(lost_key(f"worker {rank}"), "its link to a shard broke")


def wait_complete(store: dist.Store, opening: Opening, timeout: float) -> None:
    """Block until every unit of the evaluation is done; on timeout name the missing units
    and who held them."""
    key = f"{PREFIX}/{opening.evaluation}/complete"
    try:
        wait_keys(store, [key], timeout, "")
    except CommTimeout:
        missing = [u for u in range(opening.units) if not store.check([f"{PREFIX}/{opening.evaluation}/done/{u}"])]
        owners = sorted({store.get(f"{PREFIX}/{opening.evaluation}/owner/{u}").decode() for u in missing
                         if store.check([f"{PREFIX}/{opening.evaluation}/owner/{u}"])})
        raise CommTimeout(f"coordinator: evaluation {opening.evaluation}: units {missing[:8]} were not done within "
                          f"{timeout:g} s (held by worker {', '.join(owners) or 'nobody'}; every replica lost?)",
                          peer=", ".join(f"worker {o}" for o in owners)) from None


@dataclass
class Claims:
    """A replica's side: ``next()`` waits for an open evaluation and claims a unit of it.

    ``on_open(opening)`` runs once per evaluation this replica works on, before its first
    unit (the replica pulls the trial point there). Counts go to the final record."""

    store: dist.Store
    rank: int
    batch_size: int
    unit_size: int
    backup_after: float
    indices_of_batch: Callable[[int], torch.Tensor]
    on_open: Callable[[Opening], None]
    timeout: float
    opening: Opening | None = None
    current: tuple[int, int] | None = None  # (evaluation, unit) being computed
    units_done: int = 0
    backups: int = 0
    reruns: int = 0
    duplicates: int = 0
    seconds: float = 0.0
    _started: float = 0.0
    _batch: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def unit_samples(self) -> int:
        return self.unit_size

    def _key(self, *parts: object) -> str:
        return "/".join([PREFIX, str(self.opening.evaluation), *map(str, parts)])

    def _complete(self) -> bool:
        return self.store.check([self._key("complete")])

    def _advance(self) -> bool:
        """Move to the newest open evaluation; False when the coordinator has stopped."""
        after = self.opening.evaluation + 1 if self.opening is not None else 0
        key = f"{PREFIX}/open/{after}"
        deadline = time.monotonic() + self.timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise CommTimeout(f"worker {self.rank}: the coordinator opened no evaluation after {after - 1} "
                                  f"within {self.timeout:g} s", peer="coordinator 0")
            time.sleep(_POLL)
        latest = int(self.store.get(f"{PREFIX}/latest").decode())
        raw = self.store.get(f"{PREFIX}/open/{max(after, latest)}").decode()
        if raw == _STOP:
            return False
        spec = json.loads(raw)
        self.opening = Opening(max(after, latest), spec["batch"], spec["units"], spec["objective"])
        self.on_open(self.opening)
        return True

    def next(self) -> torch.Tensor | None:
        """The sample indices of the next unit this replica computes; None at the end."""
        while True:
            if self.opening is None or self._complete():
                if not self._advance():
                    return None
                continue
            unit = self._claim()
            if unit is not None:
                self.current = (self.opening.evaluation, unit)
                self._started = time.perf_counter()
                return self._unit_indices(unit)
            time.sleep(_POLL)

    def _unit_indices(self, unit: int) -> torch.Tensor:
        batch = self.opening.batch
        if self._batch is None or self._batch[0] != batch:
            self._batch = (batch, self.indices_of_batch(batch))
        return self._batch[1][unit * self.unit_size: (unit + 1) * self.unit_size]

    def _claim(self) -> int | None:
        units = self.opening.units
        ticket = self.store.add(self._key("claim"), 1) - 1
        if ticket < units:
            self.store.set(self._key("owner", ticket), str(self.rank))
            return ticket
        outstanding = [u for u in range(units) if not self.store.check([self._key("done", u)])]
        if not outstanding:
            return None
        backup = self.backup_after > 0 and len(outstanding) <= self.backup_after * units
        for unit in outstanding:
            owner_key = self._key("owner", unit)
            owner = self.store.get(owner_key).decode() if self.store.check([owner_key]) else None
            if owner == str(self.rank):
                continue
            if owner is not None and self.store.check([lost_key(f"worker {owner}")]) \
                    and self.store.add(self._key("rerun", unit, owner), 1) == 1:
                self.reruns += 1
                return unit
            if backup and self.store.add(self._key("copies", unit), 1) == 1:
                self.backups += 1
                return unit
        return None

    def finished(self) -> bool:
        """Mark the current unit done (its gradient is on every shard); False when another
        copy finished first."""
        evaluation, unit = self.current
        self.seconds += time.perf_counter() - self._started
        self.current = None
        self.units_done += 1
        prefix = f"{PREFIX}/{evaluation}"
        if self.store.add(f"{prefix}/u/{unit}", 1) != 1:
            self.duplicates += 1
            return False
        self.store.set(f"{prefix}/done/{unit}", "1")
        if self.store.add(f"{prefix}/ndone", 1) == self.opening.units:
            self.store.set(f"{prefix}/complete", "1")
        return True

    def record(self) -> dict:
        return {"units_done": self.units_done, "unit_seconds": self.seconds, "backups_taken": self.backups,
                "reruns_taken": self.reruns, "duplicates": self.duplicates}
