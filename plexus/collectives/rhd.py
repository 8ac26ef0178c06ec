"""``rhd``: recursive halving reduce-scatter, then recursive doubling all-gather
(Rabenseifner 2004; Thakur, Rabenseifner and Gropp 2005).

With P a power of two, rank r exchanges half of its current range with r ^ P/2, then a
quarter with r ^ P/4, and so on: after log2 P steps it holds the sum of block r; the
all-gather retraces the steps backwards. 2 log2 P steps and 2(P-1)/P * N elements per
rank: the ring's bandwidth with logarithmic latency, which is why MPICH uses it for
long messages. For other P the standard fold applies (``schedule.Fold``): the first
P - p' even ranks hand their vector to their odd neighbour first and get the result back
at the end, two more steps and N more elements for those pairs.

Partners send to each other at the same time over one connection, and every receive is
posted at the start, before any send: the sending thread then writes while gloo's I/O
thread reads, both directions at once. Posting the send first let the I/O thread do both,
which was about 10 % cheaper at 16 MB between processes of one 2-core machine but
serialised the two directions on a real link: across two hosts on a 100 Mbit/s tbf link,
rhd took 1.97x the ring's time (docs/results/two-hosts.md). ``early_bytes`` keeps the
old order above a size, for measurements; the messages are the same either way.
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_GATHER, TAG_REDUCE, AllReduce, scratch, wait_all
from plexus.collectives.schedule import Fold, chunk_bounds, rhd_rounds, span

__all__ = ["Rhd", "EARLY_BYTES"]

# Up to this many bytes, receives are posted at the start (all of them: see above).
EARLY_BYTES = 1 << 62


class Rhd(AllReduce):
    name = "rhd"

    def __init__(self, early_bytes: int = EARLY_BYTES) -> None:
        # Only when receives are posted changes, never the messages: ranks may differ.
        self.early_bytes = early_bytes

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        fold = Fold(group.size)
        r, n = group.rank, flat.numel()
        core, partner = fold.core_rank(r), fold.partner(r)
        if core is None:
            # Sit out: hand the vector over and receive the result.
            sent = group.isend(flat, partner, TAG_REDUCE)
            group.irecv(flat, partner, TAG_GATHER).wait()  # comes after the partner read ours
            sent.wait()
            return
        rounds = rhd_rounds(fold.pof2, core)
        blocks = chunk_bounds(n, fold.pof2)
        keeps = [span(blocks, *keep) for _, keep, _ in rounds]
        gives = [span(blocks, *give) for _, _, give in rounds]
        peers = [fold.rank_of(pc) for pc, _, _ in rounds]
        # One scratch region per round (the fold's first): all can be posted at once.
        sizes = [n if partner is not None else 0] + [b - a for a, b in keeps]
        buf = scratch(group, sum(sizes), flat, self.name)
        regions, offset = [], 0
        for size in sizes:
            regions.append(buf[offset: offset + size])
            offset += size
        folded, halving = regions[0], regions[1:]

        def halve(k: int):
            return group.irecv(halving[k], peers[k], TAG_REDUCE) if halving[k].numel() else None

        def double(k: int):
            a, b = gives[k]
            return group.irecv(flat[a:b], peers[k], TAG_GATHER) if b > a else None

        early = n * flat.element_size() <= self.early_bytes
        rounds_in = [halve(k) for k in range(len(rounds))] if early else []
        gathers_in = [double(k) for k in range(len(rounds))] if early else []
        sends = []
        if partner is not None:
            group.irecv(folded, partner, TAG_REDUCE).wait()
            flat.add_(folded)
        for k in range(len(rounds)):  # reduce-scatter
            (ga, gb), (ka, kb) = gives[k], keeps[k]
            if gb > ga:
                sends.append(group.isend(flat[ga:gb], peers[k], TAG_REDUCE))
            work = rounds_in[k] if early else halve(k)
            if work is not None:
                work.wait()
                flat[ka:kb].add_(halving[k])
        for k in reversed(range(len(rounds))):  # all-gather, straight into place
            ka, kb = keeps[k]
            if kb > ka:
                sends.append(group.isend(flat[ka:kb], peers[k], TAG_GATHER))
            work = gathers_in[k] if early else double(k)
            if work is not None:
                work.wait()
        if partner is not None:
            sends.append(group.isend(flat, partner, TAG_GATHER))
        wait_all(sends)
