"""``master``: every rank sends its whole vector to rank 0, which adds them and sends the
sum back (the single-master design the parameter-server papers start from).

Two steps, but rank 0 receives (P-1) * N elements with a fan-in of P - 1 and sends as
many: its links carry P - 1 times what a ring rank's do, so time grows linearly with P.
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_GATHER, TAG_REDUCE, AllReduce, sum_from, wait_all

__all__ = ["Master"]


class Master(AllReduce):
    name = "master"

    def peers(self, group: Endpoint) -> set[int]:
        return set(range(1, group.size)) if group.rank == 0 else {0}

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        if group.rank != 0:
            back = group.irecv(flat, 0, TAG_GATHER)  # arrives after rank 0 has read ours
            group.isend(flat, 0, TAG_REDUCE).wait()
            back.wait()
            return
        sum_from(group, flat, list(range(1, group.size)), self.name)
        wait_all([group.isend(flat, peer, TAG_GATHER) for peer in range(1, group.size)])
