"""A discrete-event queue with virtual time.

Our own small queue rather than ``simpy``: the simulator's actors are callbacks, not
generator processes, so that 10,000 workers cost 10,000 pending events and nothing more;
ties at the same virtual time run in the order they were scheduled (a sequence number
breaks them), so a run is a pure function of its seed; and it adds no dependency.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable

__all__ = ["EventQueue"]


class EventQueue:
    """``at(t, fn, *args)`` schedules ``fn(*args)`` at virtual time ``t``; ``run()`` pops
    events in (time, scheduling order) until none is left or ``stop()`` is called."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # events run so far
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self._stopped = False

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < now {self.now}")
        heapq.heappush(self._heap, (time, self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def stop(self) -> None:
        self._stopped = True

    def run(self) -> None:
        heap = self._heap
        while heap and not self._stopped:
            self.now, _, fn, args = heapq.heappop(heap)
            self.events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)
