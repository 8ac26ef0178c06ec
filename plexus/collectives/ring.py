"""``ring``: ring reduce-scatter followed by ring all-gather (Patarasuk and Yuan 2009).

Each of the P ranks sends 2(P-1) messages of about N/P elements to its right neighbour
and receives as many from its left: 2(P-1)/P * N elements per rank in 2(P-1) steps,
bandwidth-optimal and independent of P for large N.

Every receive is posted before its message can arrive, so the sender never waits for the
receiver's "ready" notice: the all-gather receives go straight into place and are posted
at the start (on their own tag), the reduce-scatter ones alternate between two scratch
buffers, one step ahead. No copies besides the reduction itself.
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_GATHER, TAG_REDUCE, AllReduce, scratch, wait_all
from plexus.collectives.schedule import chunk_bounds

__all__ = ["Ring"]


class Ring(AllReduce):
    name = "ring"

    def peers(self, group: Endpoint) -> set[int]:
        return {(group.rank + 1) % group.size, (group.rank - 1) % group.size} - {group.rank}

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        p, r = group.size, group.rank
        right, left = (r + 1) % p, (r - 1) % p
        chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), p)]
        width = chunks[0].numel()  # the largest chunk
        buffers = [scratch(group, width, flat, (self.name, i)) for i in range(2)]

        def post(step: int):
            # Reduce-scatter step s receives chunk r - s - 1 (empty chunks: N < P, skipped alike).
            size = chunks[(r - step - 1) % p].numel()
            return group.irecv(buffers[step % 2][:size], left, TAG_REDUCE) if size else None

        # All-gather step s receives chunk r - s straight into place. Safe to post now:
        # it arrives only after the whole ring has reduced that chunk, long after this
        # rank last read or wrote it.
        gathers = [group.irecv(chunks[(r - s) % p], left, TAG_GATHER) if chunks[(r - s) % p].numel() else None
                   for s in range(p - 1)]
        pending = [post(0), post(1) if p > 2 else None]
        sends = []
        # Reduce-scatter: at step s pass on chunk r - s and fold in chunk r - s - 1 from the
        # left; after P - 1 steps rank r holds the full sum of chunk r + 1.
        for s in range(p - 1):
            out, into = chunks[(r - s) % p], chunks[(r - s - 1) % p]
            if out.numel():
                sends.append(group.isend(out, right, TAG_REDUCE))
            if pending[s % 2] is not None:
                pending[s % 2].wait()
                into.add_(buffers[s % 2][: into.numel()])
            if s + 2 < p - 1:
                pending[s % 2] = post(s + 2)
        # All-gather: circulate the reduced chunks.
        for s in range(p - 1):
            out = chunks[(r + 1 - s) % p]
            if out.numel():
                sends.append(group.isend(out, right, TAG_GATHER))
            if gathers[s] is not None:
                gathers[s].wait()
        wait_all(sends)
