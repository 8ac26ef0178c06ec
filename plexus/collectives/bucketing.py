"""Gradient buckets: all-reduce gradients while backward is still running (as DDP does).

Parameters are laid out in reverse registration order, the order in which backward
usually produces their gradients, in flat buffers of at most ``bucket_bytes`` each. Every
parameter's ``.grad`` is a view into its bucket, so autograd accumulates straight into the
buffer and nothing is copied before or after communication. When the last gradient of a
bucket is accumulated, the bucket's all-reduce starts; buckets start strictly in index
order on every rank, which keeps the point-to-point algorithms' messages paired.

The last bucket is the exception: it starts in ``finish()``, right after backward. It
can only start once every other bucket has, i.e. once every gradient has been computed,
so there is nothing left to overlap it with, and the launcher may run it in the caller's
thread instead of handing it to a communication thread and waiting for it: two thread
hand-offs saved per step, a large share of a small model's step on a busy machine (with
one bucket, the whole all-reduce). Starting it after backward rather than inside the
last hook also keeps communication out of the backward pass that ``--slow`` stretches.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from plexus.collectives.base import Handle

__all__ = ["GradientBuckets"]


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        total = sum(p.numel() for p in params)
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.pending = len(params)


class GradientBuckets:
    """Owns the gradient buffers of ``params`` and reduces them with ``launch``.

    ``launch(buffer, last) -> Handle`` starts an in-place all-reduce (mean) of one bucket;
    ``last`` is true for the last bucket, started by ``finish()`` once backward is over
    (it may complete before returning). Use: ``zero()`` before the backward pass,
    ``finish()`` after it.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_bytes: int,
                 launch: Callable[[torch.Tensor, bool], Handle]) -> None:
        self._launch = launch
        self.buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles: list[Handle] = []
        # The last bucket starts in finish(), so its parameters need no hook (one bucket: none).
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets[:-1] for p in b.params]
        self._ready = [False] * len(self.buckets)
        self._next = 0

    def zero(self) -> None:
        """Clear the gradients and re-arm every bucket for the next backward pass."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.pending = len(bucket.params)
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._handles = []

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        index = self._bucket_of[id(param)]
        bucket = self.buckets[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._ready[index] = True
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        last = len(self.buckets) - 1
        while self._next < last and (force or self._ready[self._next]):
            self._handles.append(self._launch(self.buckets[self._next].buffer, False))
            self._next += 1

    def finish(self) -> None:
        """Start the buckets whose parameters got no gradient and the last one, then wait for all."""
        self._launch_ready(force=True)
        if self.buckets:
            self._handles.append(self._launch(self.buckets[-1].buffer, True))
        for handle in self._handles:
            handle.wait()
        self._handles = []

    def abandon(self) -> None:
        """After ``finish`` raised: wait for the other buckets' calls to end (each
        completes or fails as its peers drop the broken group), ignoring their errors."""
        for handle in self._handles:
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        self._handles = []

    @property
    def numel(self) -> int:
        return sum(b.buffer.numel() for b in self.buckets)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
