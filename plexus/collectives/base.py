"""The all-reduce interface every algorithm implements, and what they share.

An algorithm is a callable object: ``algo(tensor, group, op)`` reduces ``tensor`` in place
across the group's members, and ``algo.all_reduce_async(...)`` returns a handle whose
``wait()`` finishes it. Algorithms on point-to-point sends run asynchronously on the
group's single communication thread, so every member executes calls in the order it
issued them, which is what keeps the matching sends and receives of successive calls
paired.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar, Literal

import torch

from plexus.cluster.group import Endpoint

__all__ = ["AllReduce", "Handle", "Op", "chunk_bounds", "comm_executor"]

Op = Literal["sum", "mean"]

_EXECUTORS: dict[int, ThreadPoolExecutor] = {}
_EXECUTORS_LOCK = threading.Lock()


def comm_executor(group: Endpoint) -> ThreadPoolExecutor:
    """The group's communication thread (one per group, calls run in issue order)."""
    with _EXECUTORS_LOCK:
        executor = _EXECUTORS.get(id(group))
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"comm-{group.me}")
            _EXECUTORS[id(group)] = executor
        return executor


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Split ``length`` elements into ``parts`` contiguous ranges whose sizes differ by at
    most one (the first ``length % parts`` get the extra element); some may be empty."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class Handle:
    """The pending result of an ``all_reduce_async`` call."""

    def __init__(self, future: Future | None = None, work=None, finish=None) -> None:
        self._future = future
        self._work = work
        self._finish = finish

    def wait(self, timeout: float | None = None) -> None:
        if self._future is not None:
            self._future.result(timeout)
        if self._work is not None:
            self._work.wait(timeout)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._work is None or self._work.is_completed()


class AllReduce(ABC):
    """Reduces a tensor in place across a group. Subclasses implement ``_reduce`` on the
    contiguous, float32-or-wider work tensor; this class handles dtype widening, ``mean``
    and the asynchronous call."""

    name: ClassVar[str]

    def __call__(self, tensor: torch.Tensor, group: Endpoint, op: Op = "sum") -> None:
        self.all_reduce_async(tensor, group, op).wait()

    def all_reduce_async(self, tensor: torch.Tensor, group: Endpoint, op: Op = "sum") -> Handle:
        work, finish = self._prepare(tensor, group, op)
        if group.size == 1:
            finish()
            return Handle()
        future = comm_executor(group).submit(self._reduce, work, group)
        return Handle(future=future, finish=finish)

    @staticmethod
    def _prepare(tensor: torch.Tensor, group: Endpoint, op: Op):
        """A flat work buffer (float32 for narrower floats, so sums accumulate exactly
        enough) and the function that writes the result back into ``tensor``."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        narrow = tensor.dtype in (torch.float16, torch.bfloat16)
        flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
        work = flat.float() if narrow else flat

        def finish() -> None:
            if op == "mean" and group.size > 1:
                work.div_(group.size)
            if work.data_ptr() != tensor.data_ptr():
                tensor.copy_(work.view(tensor.shape))

        return work, finish

    @abstractmethod
    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        """Sum ``flat`` (1-D, contiguous) in place across ``group``."""
