"""``auto``: for each call, the algorithm the cost model (``cost.py``) says is fastest for
this message size and number of ranks, with this cluster's alpha, beta and gamma.

The parameters are given (``Auto(network=Network(...))``) or measured on the first
non-empty call on a group, right after its argument check (``calibrate``): ranks 0 and 1 time a ping-pong of 4-byte messages (alpha,
half the median round trip) and of 1 MiB messages (beta, the rest per byte), rank 0 times
an add of 4 MiB (gamma), and rank 0 sends the three numbers to every rank, so that all
ranks make the same choices. Under the model this picks rhd for powers of two (its
log-latency with the ring's bandwidth), and for other P rhd for small messages and ring
for large ones (rhd's fold costs 2N more bytes), much as MPICH decides.
"""
from __future__ import annotations

import hashlib
import statistics
import time
import weakref
from typing import Any

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_CALIBRATE, AllReduce, root_group
from plexus.collectives.cost import AUTO_CANDIDATES, Network, best, cost
from plexus.collectives.dbtree import CHUNK_BYTES
from plexus.collectives.hier import INNER

__all__ = ["Auto", "calibrate"]

_MEASURED: "weakref.WeakKeyDictionary[Any, Network]" = weakref.WeakKeyDictionary()
_BIG = 1 << 20


def _pingpong(group: Endpoint, buf: torch.Tensor, peer: int, reps: int) -> list[float]:
    """One-way times (half round trips) of ``reps`` round trips between ranks 0 and 1."""
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        if group.rank == 0:
            group.send(buf, peer, TAG_CALIBRATE)
            group.recv(buf, peer, TAG_CALIBRATE)
        else:
            group.recv(buf, peer, TAG_CALIBRATE)
            group.send(buf, peer, TAG_CALIBRATE)
        out.append((time.perf_counter() - start) / 2)
    return out


def calibrate(group: Endpoint) -> Network:
    """Measure alpha, beta and gamma on ``group`` (collective: every member calls it);
    every member returns rank 0's numbers."""
    if group.size == 1:
        return Network()  # nothing to measure, nothing to choose between
    numbers = torch.zeros(3, dtype=torch.float64)
    if group.rank in (0, 1):
        peer = 1 - group.rank
        small, big = torch.zeros(1), torch.zeros(_BIG // 4)
        _pingpong(group, small, peer, 3)  # warm up the connection
        alpha = statistics.median(_pingpong(group, small, peer, 15))
        one_way = statistics.median(_pingpong(group, big, peer, 5))
        if group.rank == 0:
            a, b = torch.zeros(_BIG), torch.ones(_BIG)
            adds = []
            for _ in range(5):
                start = time.perf_counter()
                a.add_(b)
                adds.append(time.perf_counter() - start)
            beta = max(one_way - alpha, 0.0) / _BIG
            numbers = torch.tensor([alpha, beta, statistics.median(adds) / (4 * _BIG)], dtype=torch.float64)
    if group.rank == 0:
        for peer in range(1, group.size):
            group.send(numbers, peer, TAG_CALIBRATE)
    else:
        group.recv(numbers, 0, TAG_CALIBRATE)
    alpha, beta, gamma = numbers.tolist()
    return Network(alpha=alpha, beta=beta, gamma=gamma)


class Auto(AllReduce):
    name = "auto"

    def __init__(self, network: Network | None = None, candidates: tuple[str, ...] = AUTO_CANDIDATES) -> None:
        best(2, 4, Network(), candidates=candidates)  # raises ConfigError for unknown candidates
        self.given = network
        self.candidates = tuple(candidates)
        self._algorithms = {name: INNER[name]() for name in self.candidates}
        self._decided: dict[int, dict[str, Any]] = {}

    def network(self, group: Endpoint) -> Network:
        """The given parameters, or those measured on ``group`` (measured on the first
        non-empty call, after its argument check: collective, every member measures at the
        same point)."""
        if self.given is not None:
            return self.given
        key = root_group(group)
        if key not in _MEASURED:
            _MEASURED[key] = calibrate(group)
        return _MEASURED[key]

    def choice(self, group: Endpoint, nbytes: int) -> str:
        """The algorithm this call of ``nbytes`` bytes (as sent: float32 for 16-bit input)
        runs on ``group``."""
        return best(group.size, nbytes, self.network(group), candidates=self.candidates, chunk_bytes=CHUNK_BYTES)

    def options(self, group: Endpoint, flat: torch.Tensor) -> tuple[int, int]:
        # Given parameters and candidates are part of the check: ranks configured
        # differently would choose differently and hang; they fail the check instead.
        # Measured parameters come from rank 0, so they agree.
        digest = hashlib.blake2b(repr((self.given, self.candidates)).encode(), digest_size=6).digest()
        return (int(self.given is not None), int.from_bytes(digest, "big"))

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        nbytes = flat.numel() * flat.element_size()
        name = self.choice(group, nbytes)
        self._remember(group, nbytes, name)
        self._algorithms[name]._reduce(flat, group)

    def _remember(self, group: Endpoint, nbytes: int, name: str) -> None:
        """Keep the first choice per message size, with the network it was made on and each
        candidate's modelled time: the reason, for the summary (``decisions``)."""
        if nbytes in self._decided:
            self._decided[nbytes]["calls"] += 1
            return
        net = self.network(group)
        times = {c: cost(c, group.size, nbytes, network=net, chunk_bytes=CHUNK_BYTES).time for c in self.candidates}
        self._decided[nbytes] = {"bytes": nbytes, "ranks": group.size, "chose": name, "calls": 1,
                                 "network": {"alpha": net.alpha, "beta": net.beta, "gamma": net.gamma},
                                 "modelled_seconds": times}

    def decisions(self) -> list[dict[str, Any]]:
        """What this rank chose for each message size, and why (the modelled times)."""
        return list(self._decided.values())
