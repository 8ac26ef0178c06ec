"""``native``: the backend's own all-reduce (gloo's ring on CPU, NCCL's on GPU), the reference."""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import AllReduce, Handle, Op

__all__ = ["Native"]


class Native(AllReduce):
    name = "native"

    def all_reduce_async(self, tensor: torch.Tensor, group: Endpoint, op: Op = "sum") -> Handle:
        # The backend runs it on its own threads; no need for our communication thread.
        work, finish = self._prepare(tensor, group, op)
        return Handle(work=group.all_reduce_backend(work), finish=finish)

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        group.all_reduce_backend(flat).wait()
