"""Staleness accounting and the staleness-aware learning rate, as pure objects.

The staleness of an applied push is the server's version when it is applied minus the
version of the weights its gradient was computed on (both counted in updates of that
shard). Synchronous training has staleness 0; asynchronous training with P equally fast
workers has about P - 1 (Dean et al. 2012), n-softsync about n (Gupta et al. 2016).
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["StalenessHistogram", "staleness_lr_scale"]


class StalenessHistogram:
    """``counts[k]``: pushes applied with staleness k."""

    def __init__(self, counts: Iterable[int] = ()) -> None:
        self.counts: list[int] = list(counts)

    def record(self, staleness: int, times: int = 1) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be non-negative, got {staleness}")
        if staleness >= len(self.counts):
            self.counts.extend([0] * (staleness + 1 - len(self.counts)))
        self.counts[staleness] += times

    def merge(self, other: "StalenessHistogram") -> "StalenessHistogram":
        """A new histogram holding both (e.g. every shard's)."""
        out = StalenessHistogram(self.counts)
        for k, n in enumerate(other.counts):
            if n:
                out.record(k, n)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        total = self.total
        return sum(k * n for k, n in enumerate(self.counts)) / total if total else 0.0

    @property
    def max(self) -> int:
        return max((k for k, n in enumerate(self.counts) if n), default=0)


def staleness_lr_scale(stalenesses: Sequence[int]) -> float:
    """The factor ``--staleness-lr`` applies to the learning rate of one update.

    Zhang et al. 2016 ("Staleness-aware async-SGD") divide the learning rate of a gradient
    by its staleness tau: alpha = alpha0 / tau. Our variant: an update that averages several
    pushes (bsp, softsync) divides by their mean staleness, as Zhang et al. do for
    n-softsync (alpha0 / <tau>), and a staleness below 1 leaves the rate as is
    (alpha0 / max(1, tau)), so that fresh gradients are not sped up.
    """
    if not stalenesses:
        return 1.0
    mean = sum(stalenesses) / len(stalenesses)
    return 1.0 / max(1.0, mean)
