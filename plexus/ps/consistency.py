"""Consistency models of a parameter server, as pure gates: when pushes are applied, and
when a worker may read.

A gate knows nothing of processes, links or tensors. The server calls it under its lock
(and the simulator with virtual clocks): ``join``/``leave`` when membership changes,
``push`` for every push that arrives, which returns the groups of pushes to apply now
(each group is averaged into one update, in rank order), and ``may_serve`` before it
answers a read. Clocks count pushes: a worker at clock c has pushed c times, and its next
push carries clock c.

- ``bsp``: the pushes of all live workers for clock c are averaged and applied once, then
  clock c + 1 may be read (Valiant's bulk-synchronous model; with the global batch split
  evenly it equals one process training with the whole batch, contract 1).
- ``bsp`` with b backup workers (Chen et al. 2016, "Revisiting distributed synchronous
  SGD"): of the P live workers, the first N = P - b gradients computed on the weights of
  step c to arrive make step c; the gradients of step c that arrive later are dropped
  (counted in ``late``), and their senders read the new weights and go on with the job's
  current step, so a straggler costs no one any waiting.
- ``asp``: every push is applied on arrival and reads never wait (Downpour SGD, Dean et
  al. 2012).
- ``ssp``: pushes are applied on arrival, but a worker at clock c may read only once the
  slowest live worker has reached clock c - T (stale synchronous parallel, Ho et al.
  2013). Ho et al. define T = 0 as BSP, and we do the same: at T = 0 every worker waits for
  all the others at every clock, so the pushes of a clock are all on hand together and are
  applied as BSP applies them (averaged once). Applying them one by one instead would equal
  BSP only for plain SGD; with a stateful server optimizer (momentum, Adagrad, Adam) it
  would not.
- ``softsync``: every N pushes, from whichever workers, are averaged into one update
  (Gupta et al. 2016's n-softsync, with N their c = lambda / n gradients per update). A
  push is answered once its group has been applied, so a worker never computes on weights
  that lack its own last gradient; hence N = number of workers is BSP and N = 1 is ASP.
  When every live worker is waiting on a group that is not full (workers finished or
  died), the partial group is applied rather than waited for forever.

Workers that leave (finished, or lost) stop counting towards any barrier; what they
pushed before is still applied, so nothing a server acknowledged is dropped.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

__all__ = ["Push", "Consistency", "BSP", "BackupBSP", "ASP", "SSP", "SoftSync", "make_consistency",
           "is_synchronous", "ConsistencyName"]

P = TypeVar("P")
ConsistencyName = str  # "bsp" | "asp" | "ssp" | "softsync"


@dataclass(frozen=True)
class Push(Generic[P]):
    """One worker's push as a gate sees it; ``payload`` is opaque to the gate."""

    worker: int
    clock: int      # the worker's clock before this push (its pushes so far)
    version: int    # server version the gradient was computed on
    payload: P
    # Worker gradients the payload sums: 1 for a worker's push, more for an aggregator's
    # (tree.py). softsync counts gradients, not pushes; the other gates apply per push.
    weight: int = 1


class Consistency(ABC):
    """A gate over the live workers' clocks (``clocks[w]`` = pushes received from w)."""

    name: ClassVar[str]
    # Whether a worker may join once training has started.
    accepts_joins: ClassVar[bool] = True

    def __init__(self) -> None:
        self.clocks: dict[int, int] = {}
        # Per worker: pushes dropped unapplied because their step was made without them
        # (BackupBSP); stays empty under the other gates, which apply every push.
        self.late: dict[int, int] = {}

    def join(self, worker: int, clock: int | None = None) -> int:
        """Add ``worker`` to the live set; returns the clock it starts at. A worker that
        joins a running job starts at the slowest live worker's clock, so that it holds
        nobody back and is not ahead of anyone (initial workers start at 0)."""
        if worker in self.clocks:
            raise ValueError(f"worker {worker} is already live")
        start = clock if clock is not None else min(self.clocks.values(), default=0)
        self.clocks[worker] = start
        return start

    def live(self) -> list[int]:
        return sorted(self.clocks)

    def restore(self, clocks: dict[int, int]) -> None:
        """Start from the live workers' ``clocks`` (a replica taking a shard over, with
        every update before them applied and nothing pending)."""
        if self.clocks:
            raise ValueError("restore needs a gate with no live worker")
        for worker, clock in sorted(clocks.items()):
            self.join(worker, clock)

    def push(self, push: Push[P]) -> list[list[Push[P]]]:
        """Record a push; returns the groups to apply now, in order."""
        expected = self.clocks.get(push.worker)
        if expected is None:
            raise ValueError(f"worker {push.worker} is not live")
        if push.clock != expected:
            raise ValueError(f"worker {push.worker} pushed clock {push.clock}, expected clock {expected}")
        self.clocks[push.worker] = expected + 1
        return self._on_push(push)

    def leave(self, worker: int) -> list[list[Push[P]]]:
        """Remove ``worker`` from the live set (finished or lost); returns groups that can
        now be applied because nobody waits for it any more."""
        self.clocks.pop(worker, None)
        return self._ready()

    @abstractmethod
    def may_serve(self, worker: int, clock: int) -> bool:
        """Whether ``worker``, at ``clock``, may read now."""

    def blockers(self, worker: int, clock: int) -> list[int]:
        """The live workers a read by ``worker`` at ``clock`` waits for (for error messages)."""
        return []

    def pending(self) -> int:
        """Pushes received but not yet applied."""
        return 0

    def applied_clock(self, worker: int) -> int:
        """``worker``'s clock counting only its pushes applied so far (its live clock less
        those the gate still holds): where a replica's gate must start it."""
        return self.clocks[worker] - sum(1 for p in self._held() if p.worker == worker)

    def _held(self) -> list[Push[P]]:
        """The pushes received and not yet applied."""
        return []

    def divisor(self, group: list[Push[P]]) -> int:
        """What the sum of a group's payloads is divided by to make its update: the
        gradients it holds (their mean)."""
        return sum(p.weight for p in group)

    @abstractmethod
    def _on_push(self, push: Push[P]) -> list[list[Push[P]]]:
        ...

    def _ready(self) -> list[list[Push[P]]]:
        return []


class ASP(Consistency):
    name = "asp"

    def _on_push(self, push: Push[P]) -> list[list[Push[P]]]:
        return [[push]]

    def may_serve(self, worker: int, clock: int) -> bool:
        return True


class SSP(Consistency):
    """Apply on arrival; a read at clock c waits until min live clock >= c - T (T >= 1)."""

    name = "ssp"

    def __init__(self, staleness: int) -> None:
        super().__init__()
        if staleness < 1:
            raise ValueError("SSP with T = 0 is BSP: use make_consistency, which returns BSP for it")
        self.staleness = staleness

    def _on_push(self, push: Push[P]) -> list[list[Push[P]]]:
        return [[push]]

    def may_serve(self, worker: int, clock: int) -> bool:
        return min(self.clocks.values(), default=clock) >= clock - self.staleness

    def blockers(self, worker: int, clock: int) -> list[int]:
        return [w for w, c in sorted(self.clocks.items()) if c < clock - self.staleness]


class BSP(Consistency):
    """Average the pushes of clock r once every live worker has pushed it; reads at clock c
    wait for clocks < c to be applied."""

    name = "bsp"
    accepts_joins = False

    def __init__(self) -> None:
        super().__init__()
        self.rounds: dict[int, list[Push[P]]] = {}
        self.applied = 0  # clocks applied so far
        # Live workers per clock: a round's check looks at the few distinct clocks, not at
        # every worker (the simulator runs this gate with thousands of them).
        self._at: dict[int, int] = {}

    def _count(self, clock: int, delta: int) -> None:
        n = self._at.get(clock, 0) + delta
        if n:
            self._at[clock] = n
        else:
            self._at.pop(clock, None)

    def join(self, worker: int, clock: int | None = None) -> int:
        start = super().join(worker, clock)
        self._count(start, 1)
        return start

    def leave(self, worker: int) -> list[list[Push[P]]]:
        if worker in self.clocks:
            self._count(self.clocks[worker], -1)
        return super().leave(worker)

    def restore(self, clocks: dict[int, int]) -> None:
        super().restore(clocks)
        self.applied = min(clocks.values(), default=0)  # every round below every clock was applied

    def _on_push(self, push: Push[P]) -> list[list[Push[P]]]:
        self._count(push.clock, -1)
        self._count(push.clock + 1, 1)
        self.rounds.setdefault(push.clock, []).append(push)
        return self._ready()

    def _ready(self) -> list[list[Push[P]]]:
        groups = []
        while self.rounds:
            r = self.applied
            if any(c <= r for c in self._at):
                break  # a live worker has not pushed clock r yet
            group = sorted(self.rounds.pop(r, []), key=lambda p: p.worker)
            self.applied += 1
            if group:
                groups.append(group)
        return groups

    def may_serve(self, worker: int, clock: int) -> bool:
        return self.applied >= clock

    def blockers(self, worker: int, clock: int) -> list[int]:
        return [w for w, c in sorted(self.clocks.items()) if c <= self.applied]

    def pending(self) -> int:
        return sum(len(r) for r in self.rounds.values())

    def _held(self) -> list[Push[P]]:
        return [p for r in self.rounds.values() for p in r]


class BackupBSP(Consistency):
    """BSP with backup workers (Chen et al. 2016): step r is the average of the first
    ``quorum`` pushes computed on the weights of step r (``Push.version == r``) to arrive;
    later pushes of step r are dropped and counted in ``late``.

    Rounds are named by the version a gradient was computed on, not by the worker's own
    clock: a worker that fell behind reads the current weights and its next push belongs
    to the current step. This needs the server's version to count this gate's steps (one
    update per step, as the server applies each group once), and a worker to push once per
    fetch (``--fetch-every 1 --push-every 1``). Workers tag a push, on every shard, with the
    oldest shard version they hold, so shards stay at most one step apart. With fewer live
    workers than ``quorum`` (lost or finished) a step is made from every live worker's push,
    as BSP does."""

    name = "bsp"
    accepts_joins = False

    def __init__(self, quorum: int) -> None:
        super().__init__()
        if quorum < 1:
            raise ValueError(f"BSP with backup workers needs a quorum of at least 1 push, got {quorum}")
        self.quorum = quorum
        self.applied = 0                      # steps made so far
        self.round: list[Push[P]] = []        # pushes of step ``applied`` held so far
        self.last: dict[int, int] = {}        # worker -> step of its last push

    def _on_push(self, push: Push[P]) -> list[list[Push[P]]]:
        if push.version > self.applied:
            raise ValueError(f"worker {push.worker} pushed a gradient of step {push.version}, ahead of step "
                             f"{self.applied}")
        self.last[push.worker] = push.version
        if push.version < self.applied or any(p.worker == push.worker for p in self.round):
            self.late[push.worker] = self.late.get(push.worker, 0) + 1
            return []
        self.round.append(push)
        return self._ready()

    def _ready(self) -> list[list[Push[P]]]:
        pushed = {p.worker for p in self.round}
        if self.round and (len(self.round) >= self.quorum or all(w in pushed for w in self.clocks)):
            group, self.round = sorted(self.round, key=lambda p: p.worker), []
            self.applied += 1
            return [group]
        return []

    def may_serve(self, worker: int, clock: int) -> bool:
        """A worker reads once the step of its last push is made (at once after a late push)."""
        return self.applied > self.last.get(worker, -1)

    def blockers(self, worker: int, clock: int) -> list[int]:
        pushed = {p.worker for p in self.round}
        return [w for w in sorted(self.clocks) if w not in pushed]

    def pending(self) -> int:
        return len(self.round)

    def _held(self) -> list[Push[P]]:
        return list(self.round)


class SoftSync(Consistency):
    """Average every ``n`` gradients into one update (n-softsync); a worker's read waits
    until its own pushes have been applied.

    Pushes from aggregators carry several gradients (``Push.weight``): a group closes once
    it holds at least ``n`` gradients, and its update is the sum divided by ``n``, so every
    gradient moves the weights by lr / n however the tree batched it (a push of 2n
    gradients makes one update as large as two). A partial group (see the module
    docstring) is averaged over what it holds."""

    name = "softsync"

    def __init__(self, n: int) -> None:
        super().__init__()
        if n < 1:
            raise ValueError(f"softsync needs n >= 1, got {n}")
        self.n = n
        self.queue: list[Push[P]] = []

    def _on_push(self, push: Push[P]) -> list[list[Push[P]]]:
        self.queue.append(push)
        return self._ready()

    def _ready(self) -> list[list[Push[P]]]:
        groups = []
        while sum(p.weight for p in self.queue) >= self.n:
            size, held = 0, 0
            while held < self.n:
                held += self.queue[size].weight
                size += 1
            groups.append(sorted(self.queue[:size], key=lambda p: (p.worker, p.clock)))
            del self.queue[:size]
        waiting = {p.worker for p in self.queue}
        if self.queue and all(w in waiting for w in self.clocks):
            # Every live worker waits on this group: nobody can complete it.
            groups.append(sorted(self.queue, key=lambda p: (p.worker, p.clock)))
            self.queue = []
        return groups

    def divisor(self, group: list[Push[P]]) -> int:
        return min(self.n, sum(p.weight for p in group))

    def flush(self) -> list[list[Push[P]]]:
        """The waiting pushes as one partial group (the server calls it when no push has
        joined them for --peer-timeout). Each shard groups pushes in its own arrival order;
        after a worker is lost with a push that reached only some shards, the shards can
        group differently, and two workers can each wait on a group of a different shard
        that only the other would complete. Applying a group that has waited that long
        ends such a wait."""
        groups = [sorted(self.queue, key=lambda p: (p.worker, p.clock))] if self.queue else []
        self.queue = []
        return groups

    def may_serve(self, worker: int, clock: int) -> bool:
        return all(p.worker != worker for p in self.queue)

    def blockers(self, worker: int, clock: int) -> list[int]:
        waiting = {p.worker for p in self.queue}
        return [w for w in sorted(self.clocks) if w not in waiting]

    def pending(self) -> int:
        return len(self.queue)

    def _held(self) -> list[Push[P]]:
        return list(self.queue)


def make_consistency(name: str, workers: int, staleness: int = 0, softsync: int = 0, backups: int = 0
                     ) -> Consistency:
    """The gate for ``--consistency name`` with ``workers`` initial workers, ``backups`` of
    them backup workers (BSP only: each step waits for ``workers - backups`` pushes).

    ``ssp`` with T = 0 is BSP (Ho et al. 2013); ``softsync`` with N = 0 means N = workers."""
    if name == "bsp" or (name == "ssp" and staleness == 0):
        return BackupBSP(workers - backups) if backups else BSP()
    if backups:
        raise ValueError(f"backup workers need bsp, got {name!r}")
    if name == "asp":
        return ASP()
    if name == "ssp":
        return SSP(staleness)
    if name == "softsync":
        return SoftSync(softsync or workers)
    raise ValueError(f"unknown consistency {name!r}: choose bsp, asp, ssp or softsync")


def is_synchronous(name: str, workers: int, staleness: int = 0, softsync: int = 0) -> bool:
    """Whether every update averages exactly one push per worker, computed on the same
    weights: then the job is synchronous training and takes global batches (contract 1).
    True for bsp, ssp with T = 0, softsync with N = workers, and anything with one worker."""
    return (workers == 1 or name == "bsp" or (name == "ssp" and staleness == 0)
            or (name == "softsync" and (softsync or workers) >= workers))
