"""Who may start a pairwise averaging in AD-PSGD, and with whom (pure).

AD-PSGD (Lian et al. 2018) averages a worker's parameters with one random neighbour
after each gradient, atomically for the pair. If any worker could start an averaging
while holding its own model lock and waiting for a peer that does the same, two workers
could wait on each other for ever. Lian et al. (2018, Section 5) avoid that with a
bipartite graph: *active* workers start averagings, *passive* ones only answer. We do
that when the graph is bipartite (a ring of even size, a torus of even sides); on any
other graph (odd rings, exp, complete) edges point from the lower rank to the higher, so
that every chain of waits climbs in rank and cannot close into a cycle: deadlock is
impossible, and each worker still averages with every neighbour, now and then.
"""
from __future__ import annotations

import random
from collections.abc import Collection

from plexus.decentral.topology import Topology

__all__ = ["Pairing"]


class Pairing:
    """The orientation of a topology's edges for AD-PSGD and each worker's random picks.

    ``targets(rank)`` are the neighbours ``rank`` starts averagings with, ``sources(rank)``
    those that start averagings with it; ``pick(rank, live)`` draws the next target from a
    generator seeded by (seed, rank), so a run is reproducible up to timing.
    """

    def __init__(self, topology: Topology, seed: int = 0) -> None:
        self.topology = topology
        colour = topology.colouring()
        self.bipartite = colour is not None and topology.size > 1
        n = topology.size
        if colour is not None:
            self._targets = [topology.peers(r) if colour[r] == 0 else () for r in range(n)]
        else:
            self._targets = [tuple(j for j in topology.peers(r) if j > r) for r in range(n)]
        self._sources = [tuple(j for j in range(n) if r in self._targets[j]) for r in range(n)]
        self._rngs = [random.Random(seed * 1_000_003 + r) for r in range(n)]

    def active(self, rank: int) -> bool:
        """True when ``rank`` starts averagings."""
        return bool(self._targets[rank])

    def targets(self, rank: int) -> tuple[int, ...]:
        return self._targets[rank]

    def sources(self, rank: int) -> tuple[int, ...]:
        return self._sources[rank]

    def pick(self, rank: int, live: Collection[int] | None = None) -> int | None:
        """A uniformly random target of ``rank`` among ``live`` (all when None); None when
        no target is left."""
        choices = [j for j in self._targets[rank] if live is None or j in live]
        if not choices:
            return None
        return self._rngs[rank].choice(choices)
