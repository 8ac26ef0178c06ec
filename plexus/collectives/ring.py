"""``ring``: ring reduce-scatter followed by ring all-gather (Patarasuk and Yuan 2009).

Each of the P ranks sends 2(P-1) messages of about N/P elements to its right neighbour
and receives as many from its left: 2(P-1)/P * N elements per rank in 2(P-1) steps,
bandwidth-optimal and independent of P for large N.
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import AllReduce, chunk_bounds

__all__ = ["Ring"]


class Ring(AllReduce):
    name = "ring"

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        p, r = group.size, group.rank
        right, left = (r + 1) % p, (r - 1) % p
        bounds = chunk_bounds(flat.numel(), p)
        chunks = [flat[a:b] for a, b in bounds]
        scratch = torch.empty(max(b - a for a, b in bounds), dtype=flat.dtype, device=flat.device)
        # Reduce-scatter: at step s, pass on chunk r - s and fold in chunk r - s - 1 from the
        # left; after P - 1 steps rank r holds the full sum of chunk r + 1.
        for s in range(p - 1):
            out, into = chunks[(r - s) % p], chunks[(r - s - 1) % p]
            incoming = scratch[: into.numel()]
            self._exchange(group, out, right, incoming, left)
            into.add_(incoming)
        # All-gather: circulate the reduced chunks; each arrives straight into place.
        for s in range(p - 1):
            self._exchange(group, chunks[(r + 1 - s) % p], right, chunks[(r - s) % p], left)

    @staticmethod
    def _exchange(group: Endpoint, out: torch.Tensor, dst: int, into: torch.Tensor, src: int) -> None:
        # Empty chunks (N < P) are skipped on both sides alike.
        recv = group.irecv(into, src) if into.numel() else None
        send = group.isend(out, dst) if out.numel() else None
        if send is not None:
            send.wait()
        if recv is not None:
            recv.wait()
