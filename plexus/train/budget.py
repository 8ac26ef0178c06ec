"""One budget of updates shared by the workers of an asynchronous job.

Why. An asynchronous run counts its progress in updates, summed over the workers (the
summary's ``steps``, as for asynchronous PS). AD-PSGD's analysis (Lian et al. 2018,
"Asynchronous decentralized parallel SGD", Theorem 1) is stated in K updates made by all
workers together, whoever makes them; nothing in it asks every worker to make K/P. With
a fixed ``--steps N`` per worker, a slow worker is still training long after the fast ones
have stopped; with nobody left to average with, its replica drifts away from the others
and the average of the final replicas is worse than any of them. With one budget of
N x P updates in the job's store, each worker claims its next update from the budget
(``store.add``, one atomic increment), so fast workers make more updates, a lost worker's
unspent share goes to the survivors, and every worker stops as soon as the budget is spent:
all at about the same time, within about one step of the slowest worker.

Invariants. A claim happens before the update it pays for, so the job never makes more
than ``total`` updates; a worker that dies mid-step takes its one claimed update with it.
The loop stays bounded with lost workers: the survivors spend their share. One claim is
one store round trip (about 20 us on loopback here), small beside a step that averages a
model with a neighbour.

Tickets. Claims are numbered from 0 in the order the store hands them out (``ticket``), so
the budget doubles as the job's queue of data units: under ``--assignment dynamic`` (ps)
the claim a worker makes before a step names the unit it trains on (``batches.UnitBatches``),
and an idle worker takes the job's next unit whoever made the last one (Dean et al. 2012,
section 4.2).
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["UpdateBudget", "BUDGET_KEY"]

BUDGET_KEY = "train/budget"
# c10d counters are int64; a run bounded only by --time-limit has no budget to share.
_UNBOUNDED = 2**62


class UpdateBudget:
    """``total`` updates claimed one at a time from a counter in the job's store."""

    def __init__(self, store: dist.Store, total: int, key: str = BUDGET_KEY) -> None:
        self.store = store
        self.total = total
        self.key = key
        self.spent = False
        self.ticket = -1  # the number of this worker's last claim (from 0, job-wide)

    @classmethod
    def open(cls, store: dist.Store, steps_per_worker: int, workers: int, numbered: bool = False
             ) -> UpdateBudget | None:
        """The job's budget of ``steps_per_worker x workers`` updates, or None when the run
        is bounded by time alone (nothing to share: every worker runs to the time limit).
        ``numbered``: the tickets name data units, so a run bounded by time alone still gets
        a budget, one that never runs out."""
        total = steps_per_worker * workers
        if total >= _UNBOUNDED:
            return cls(store, _UNBOUNDED) if numbered else None
        return cls(store, total)

    def take(self) -> bool:
        """Claim one update: True when it is this worker's to make (its number is then in
        ``ticket``), False once the budget is spent (and for ever after, without asking the
        store again)."""
        if self.spent:
            return False
        self.ticket = int(self.store.add(self.key, 1)) - 1
        if self.ticket >= self.total:
            self.spent = True
        return not self.spent

    def claimed(self) -> int:
        """Updates claimed so far by the whole job (at most ``total``)."""
        return min(self.total, int(self.store.add(self.key, 0)))
