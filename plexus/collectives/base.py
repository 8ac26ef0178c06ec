"""The all-reduce interface every algorithm implements, and what they share.

An algorithm is a callable object: ``algo(tensor, group, op)`` reduces ``tensor`` in place
across the group's members, and ``algo.all_reduce_async(...)`` returns a handle whose
``wait()`` finishes it. Every call first checks that all members passed the same length,
dtype, algorithm and op (``check.py``), then runs the algorithm's ``_reduce`` on the
group's communication lane: one thread per group, calls in the order they were issued, so
the matching sends and receives of successive calls stay paired. A synchronous call that
finds the lane idle runs in the caller's thread instead, which saves two thread hand-offs
(about 0.5 ms per call on an oversubscribed 2-core machine).

Message tags: the check uses ``TAG_CHECK``; algorithms send their reduce-phase messages
with ``TAG_REDUCE + k`` and their gather/broadcast-phase messages with ``TAG_GATHER + k``
(k < 16 picks a stream, e.g. one per tree in dbtree), so that receives of a later phase
can be posted early without being matched by messages of an earlier one.

The lane also issues ``native``'s backend all-reduce. Backend collectives called directly
on the group (``group.barrier()``, ``group.all_reduce_backend``) must not overlap calls
still pending on the lane, or ranks could issue them in different orders.
"""
from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, ClassVar, Literal

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.check import TAG_CHECK, signature, verify
from plexus.collectives.schedule import chunk_bounds

__all__ = ["Persistent", "AllReduce", "Handle", "Op", "chunk_bounds", "comm_executor", "CommLane", "scratch", "root_group",
           "wait_all", "sum_from", "TAG_CHECK", "TAG_REDUCE", "TAG_GATHER", "TAG_CALIBRATE"]

Op = Literal["sum", "mean"]

TAG_REDUCE = 0x7C10
TAG_GATHER = 0x7C20
TAG_CALIBRATE = 0x7C30


def root_group(group: Any) -> Any:
    """The real group behind views (``SubGroup``, ``TracedEndpoint``), which share its lane
    and scratch buffers."""
    while getattr(group, "parent", None) is not None:
        group = group.parent
    return group


class CommLane:
    """A group's communication lane: one thread that runs calls in issue order, and a fast
    path that runs a synchronous call in the caller's thread when nothing is queued."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"comm-{name}")
        self._busy = threading.Lock()    # held by whichever thread runs a call
        self._state = threading.Lock()   # guards _queued
        self._queued = 0
        self.scratch: dict[Any, torch.Tensor] = {}

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Run ``fn(*args)`` on the lane's thread after everything submitted before."""
        with self._state:
            self._queued += 1
        return self._executor.submit(self._run, fn, args)

    def _run(self, fn: Callable, args: tuple) -> Any:
        try:
            with self._busy:
                return fn(*args)
        finally:
            with self._state:
                self._queued -= 1

    def call(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn(*args)`` after everything submitted before and return its result."""
        with self._state:
            idle = self._queued == 0 and self._busy.acquire(blocking=False)
        if not idle:
            return self.submit(fn, *args).result()
        try:
            return fn(*args)
        finally:
            self._busy.release()


_LANES: "weakref.WeakKeyDictionary[Any, CommLane]" = weakref.WeakKeyDictionary()
_LANES_LOCK = threading.Lock()


def comm_executor(group: Endpoint) -> CommLane:
    """The group's communication lane (one per group; calls run in issue order)."""
    group = root_group(group)
    with _LANES_LOCK:
        lane = _LANES.get(group)
        if lane is None:
            lane = _LANES[group] = CommLane(group.me)
        return lane


def scratch(group: Endpoint, numel: int, like: torch.Tensor, key: Any) -> torch.Tensor:
    """A reusable buffer of ``numel`` elements of ``like``'s dtype and device for the
    algorithm running on ``group``'s lane. Kept between calls (a fresh 4 MB buffer costs a
    thousand page faults per call), so it grows to the largest call's needs. Only code
    running on the lane may use it; ``key`` separates buffers in use at once."""
    store = comm_executor(group).scratch
    slot = (key, like.dtype, like.device)
    buf = store.get(slot)
    if buf is None or buf.numel() < numel:
        buf = store[slot] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


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
    contiguous, float32-or-wider work tensor; this class handles dtype widening, ``mean``,
    the argument check and the asynchronous call."""

    name: ClassVar[str]

    @classmethod
    def from_options(cls, options: Any = None) -> "AllReduce":
        """An instance configured from a ``StrategyConfig`` (only hier reads it)."""
        return cls()

    def __call__(self, tensor: torch.Tensor, group: Endpoint, op: Op = "sum") -> None:
        work, finish = self._prepare(tensor, group, op)
        if group.size > 1:
            comm_executor(group).call(self._run, tensor, work, group, op)
        finish()

    def all_reduce_async(self, tensor: torch.Tensor, group: Endpoint, op: Op = "sum") -> Handle:
        work, finish = self._prepare(tensor, group, op)
        if group.size == 1:
            finish()
            return Handle()
        future = comm_executor(group).submit(self._run, tensor, work, group, op)
        return Handle(future=future, finish=finish)

    def persistent(self, tensor: torch.Tensor, group: Endpoint, op: Op = "sum") -> "Persistent":
        """Check the arguments across the group once, now, and return a reusable reduction
        of this very tensor (same storage, length and dtype) that skips the check on every
        later call. For callers that reduce the same buffers every step, such as gradient
        buckets, as DDP verifies parameter shapes once at construction: a check that
        passed holds as long as every rank reduces the same buffers in the same order."""
        return Persistent(self, tensor, group, op)

    def _run(self, tensor: torch.Tensor, work: torch.Tensor, group: Endpoint, op: Op) -> None:
        verify(group, signature(tensor, self.name, op, self.options(group, work)), work.device)
        if work.numel():
            self._reduce(work, group)

    def peers(self, group: Endpoint) -> set[int]:
        """The members this rank sends to or receives from, by index in ``group``: all of
        them unless an algorithm says fewer. Symmetric: if i names j, j names i."""
        return set(range(group.size)) - {group.rank}

    def connect(self, group: Endpoint, transport: str = "auto") -> None:
        """Let the messages between this rank and its ``peers`` go over shared memory where
        they run on one machine (``Group.connect``; views and links keep their transport).
        A collective call: every member makes it after forming ``group`` and before its
        first reduction there."""
        connect = getattr(group, "connect", None)
        if connect is not None and group.size > 1:
            connect(self.peers(group), transport)

    def options(self, group: Endpoint, flat: torch.Tensor) -> tuple[int, int]:
        """Parameters of this call that every rank must share (checked with the
        arguments); runs on the lane just before the check."""
        return (0, 0)

    @staticmethod
    def _prepare(tensor: torch.Tensor, group: Endpoint, op: Op):
        """A flat work buffer (float32 for narrower floats, so sums accumulate exactly
        enough) and the function that writes the result back into ``tensor``."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"op 'mean' needs a floating-point tensor, got {tensor.dtype}")
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
        """Sum ``flat`` (1-D, contiguous, non-empty) in place across ``group``; every
        member calls it with the same length. Wait for every send before returning."""


class Persistent:
    """A checked, reusable all-reduce of one tensor; see ``AllReduce.persistent``."""

    def __init__(self, algorithm: AllReduce, tensor: torch.Tensor, group: Endpoint, op: Op) -> None:
        self._algorithm, self._tensor, self._group = algorithm, tensor, group
        self._work, self._finish = algorithm._prepare(tensor, group, op)
        # A narrower tensor is reduced through a float32 copy that must be refreshed per call.
        self._copy = self._work.data_ptr() != tensor.data_ptr()
        self._lane = comm_executor(group)
        if group.size > 1:
            self._lane.call(lambda: verify(group, signature(tensor, algorithm.name, op,
                                                            algorithm.options(group, self._work)),
                                           self._work.device))

    def _reduce(self) -> None:
        if self._copy:
            self._work.copy_(self._tensor.reshape(-1))
        self._algorithm._reduce(self._work, self._group)

    def __call__(self) -> None:
        """Reduce now; runs in the caller's thread when the group's lane is idle."""
        if self._group.size > 1 and self._work.numel():
            self._lane.call(self._reduce)
        self._finish()

    def start(self) -> Handle:
        """Reduce on the group's communication thread; ``wait()`` on the handle."""
        if self._group.size == 1 or not self._work.numel():
            self._finish()
            return Handle()
        return Handle(future=self._lane.submit(self._reduce), finish=self._finish)


# sum_from receives into at most this many bytes of scratch at once (then reuses regions).
_WINDOW_BYTES = 256 << 20


def sum_from(group: Endpoint, flat: torch.Tensor, peers: list[int], key: Any) -> None:
    """Receive a whole vector from each of ``peers`` (all sending at once, on
    ``TAG_REDUCE``) and add them into ``flat`` in the order given, so that every run sums
    in the same order. Scratch holds at most 256 MiB of them at a time."""
    n = flat.numel()
    window = max(1, min(len(peers), _WINDOW_BYTES // max(1, n * flat.element_size())))
    buf = scratch(group, window * n, flat, key)
    slots = [buf[i * n: (i + 1) * n] for i in range(window)]
    recvs = [group.irecv(slots[i], peer, TAG_REDUCE) for i, peer in enumerate(peers[:window])]
    for i, peer in enumerate(peers):
        recvs[i].wait()
        flat.add_(slots[i % window])
        if i + window < len(peers):
            recvs.append(group.irecv(slots[i % window], peers[i + window], TAG_REDUCE))


def wait_all(works: list) -> None:
    """Wait for every send or receive in ``works`` (skipping None)."""
    for work in works:
        if work is not None:
            work.wait()
