"""``native``: the backend's own all-reduce (gloo's ring on CPU, NCCL's on GPU), the reference.

It runs on the group's lane after the same argument check as every other algorithm:
gloo aborts the whole process when lengths differ across ranks, so the check is what
turns that into a ``ProtocolError``. Its traffic is counted as the ring's nominal
2(P-1)/P * N bytes per rank (the backend does not report what it sent).
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import AllReduce

__all__ = ["Native"]


class Native(AllReduce):
    name = "native"

    def peers(self, group: Endpoint) -> set[int]:
        return set()  # the backend moves the bytes over its own connections

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        group.all_reduce_backend(flat).wait()
