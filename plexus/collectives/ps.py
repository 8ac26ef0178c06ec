"""``ps``: the parameter-server all-reduce. The vector is split into P shards, rank j owns
shard j: every rank sends each shard to its owner (reduce-scatter with fan-in P - 1), each
owner adds the P contributions to its shard, and sends the sum to every rank (all-gather).

Two steps and 2(P-1)/P * N elements per rank, like the ring's bytes with the master's
latency; the price is fan-in P - 1 (incast) in both steps, which real switches punish.
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_GATHER, TAG_REDUCE, AllReduce, scratch, wait_all
from plexus.collectives.schedule import chunk_bounds

__all__ = ["ParameterServer"]


class ParameterServer(AllReduce):
    name = "ps"

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        p, r = group.size, group.rank
        shards = [flat[a:b] for a, b in chunk_bounds(flat.numel(), p)]
        mine = shards[r]
        # Peers in the order r+1, r+2, ...: staggered, so rank 0 is not everyone's first.
        peers = [(r + k) % p for k in range(1, p)]
        buf = scratch(group, (p - 1) * mine.numel(), flat, self.name)
        parts = {peer: buf[i * mine.numel(): (i + 1) * mine.numel()] for i, peer in enumerate(peers)}
        # Receives before sends, as in rhd.py: every pair exchanges both ways at once, the
        # sending thread writing while gloo's I/O thread reads.
        incoming = {peer: group.irecv(parts[peer], peer, TAG_REDUCE) for peer in peers if mine.numel()}
        sends = [group.isend(shards[peer], peer, TAG_REDUCE) for peer in peers if shards[peer].numel()]
        for peer in range(p):  # add in rank order: the same order in every run
            if peer in incoming:
                incoming[peer].wait()
                mine.add_(parts[peer])
        wait_all(sends)  # the shards sent are where the gathered sums land
        gathers = [group.irecv(shards[peer], peer, TAG_GATHER) for peer in peers if shards[peer].numel()]
        sends = [group.isend(mine, peer, TAG_GATHER) for peer in peers] if mine.numel() else []
        wait_all(gathers)
        wait_all(sends)
