"""Gossip graphs and their mixing weights, as pure objects (no processes, no sockets).

D-PSGD (Lian et al. 2017) replaces the all-reduce by one step of averaging with
neighbours, x_i <- sum_j W_ij x_j, with W symmetric and doubly stochastic (rows and
columns sum to 1), so the average of the replicas moves exactly as centralized SGD's
iterate would, and the replicas contract towards it at a rate set by the spectral gap
1 - max(|lambda_2|, |lambda_n|) of W: the larger the gap, the fewer steps the graph needs
to forget a disagreement (Lian et al. 2017, Theorem 1 and Corollary 2; Boyd et al. 2006).

Built-in graphs (``make_topology``), all regular and undirected:

========  =========================================  =======================
name      neighbours of rank r among P                degree
========  =========================================  =======================
ring      r - 1, r + 1 (mod P)                        2 (1 at P = 2)
torus     up, down, left, right on an R x C grid      <= 4; R the largest
          with wrap-around (R x C = P)                divisor of P <= sqrt(P)
exp       r +- 1, r +- 2, r +- 4, ... (mod P)         <= 2 ceil(log2 P)
complete  everyone                                    P - 1
========  =========================================  =======================

Mixing weights: ``uniform`` gives every neighbour and self 1 / (degree + 1), which is
doubly stochastic on regular graphs only; ``metropolis`` (Metropolis-Hastings, Xiao and
Boyd 2004) gives W_ij = 1 / (1 + max(d_i, d_j)) and W_ii the rest, doubly stochastic on
any undirected graph. On a regular graph the two coincide.

The simulator *(later)* drives these very objects with virtual clocks.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Literal, Sequence

import torch

from plexus.errors import ConfigError

__all__ = ["Topology", "make_topology", "TOPOLOGIES", "Mixing", "torus_shape"]

Mixing = Literal["uniform", "metropolis"]
TOPOLOGIES = ("ring", "torus", "exp", "complete")


def torus_shape(size: int) -> tuple[int, int]:
    """(rows, cols) of the squarest grid with rows * cols = size, rows <= cols; a prime
    size gives a 1 x P grid, which is a ring."""
    rows = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return rows, size // rows


def _neighbour_sets(name: str, size: int) -> list[set[int]]:
    if name == "ring":
        return [{(r - 1) % size, (r + 1) % size} - {r} for r in range(size)]
    if name == "torus":
        rows, cols = torus_shape(size)
        out = []
        for r in range(size):
            i, j = divmod(r, cols)
            near = {((i - 1) % rows) * cols + j, ((i + 1) % rows) * cols + j,
                    i * cols + (j - 1) % cols, i * cols + (j + 1) % cols}
            out.append(near - {r})
        return out
    if name == "exp":
        hops = [1 << k for k in range(max(1, math.ceil(math.log2(size))) + 1) if (1 << k) < size]
        return [{(r + h) % size for h in hops} | {(r - h) % size for h in hops} - {r} for r in range(size)]
    if name == "complete":
        return [set(range(size)) - {r} for r in range(size)]
    raise ConfigError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {name!r}: pass --topology ring")


class Topology:
    """An undirected graph over ``size`` ranks with symmetric doubly-stochastic weights.

    ``peers(rank, step)`` are the ranks ``rank`` exchanges with at ``step`` (the graphs
    here are static, so every step has the same peers); ``weights(rank)`` maps each of
    them and ``rank`` itself to its mixing weight.
    """

    def __init__(self, name: str, neighbours: Sequence[Sequence[int]], mixing: Mixing = "uniform") -> None:
        size = len(neighbours)
        if size < 1:
            raise ConfigError("a topology needs at least one rank")
        sets = [set(n) for n in neighbours]
        for r, near in enumerate(sets):
            bad = [j for j in near if not 0 <= j < size or j == r]
            if bad:
                raise ValueError(f"topology {name}: rank {r} lists invalid neighbours {bad}")
            for j in near:
                if r not in sets[j]:
                    raise ValueError(f"topology {name}: edge {r}-{j} is not symmetric; mixing weights "
                                     f"must be symmetric, so every edge must be listed both ways")
        if mixing not in ("uniform", "metropolis"):
            raise ConfigError(f"mixing must be uniform or metropolis, got {mixing!r}: pass --mixing uniform")
        degrees = [len(n) for n in sets]
        if mixing == "uniform" and len(set(degrees)) > 1:
            raise ConfigError(f"uniform mixing weights on topology {name} are not doubly stochastic: its "
                              f"degrees differ ({min(degrees)} to {max(degrees)}), so the average model "
                              f"would drift; pass --mixing metropolis")
        self.name = name
        self.size = size
        self.mixing = mixing
        self._peers = [tuple(sorted(n)) for n in sets]
        self._weights: list[dict[int, float]] = []
        for r in range(size):
            if mixing == "uniform":
                w = {j: 1.0 / (degrees[r] + 1) for j in self._peers[r]}
            else:
                w = {j: 1.0 / (1 + max(degrees[r], degrees[j])) for j in self._peers[r]}
            w[r] = 1.0 - sum(w.values())
            self._weights.append(dict(sorted(w.items())))

    def peers(self, rank: int, step: int = 0) -> tuple[int, ...]:
        """The ranks ``rank`` sends its parameters to (and receives from) at ``step``."""
        return self._peers[rank]

    def degree(self, rank: int) -> int:
        return len(self._peers[rank])

    def weights(self, rank: int) -> dict[int, float]:
        """Row ``rank`` of W: {rank or neighbour: weight}, in rank order, summing to 1."""
        return dict(self._weights[rank])

    def matrix(self) -> torch.Tensor:
        """W as a dense float64 matrix."""
        w = torch.zeros(self.size, self.size, dtype=torch.float64)
        for r, row in enumerate(self._weights):
            for j, v in row.items():
                w[r, j] = v
        return w

    def spectral_gap(self) -> float:
        """1 - max(|lambda_2|, |lambda_n|) of W: 1 for a complete graph with uniform
        weights (one step reaches consensus), near 0 for a long ring."""
        if self.size == 1:
            return 1.0
        eig = torch.linalg.eigvalsh(self.matrix()).abs().sort(descending=True).values
        return float(1.0 - eig[1])

    def colouring(self) -> list[int] | None:
        """A 2-colouring (0/1 per rank) if the graph is bipartite, else None (BFS)."""
        colour: list[int | None] = [None] * self.size
        for start in range(self.size):
            if colour[start] is not None:
                continue
            colour[start] = 0
            queue = deque([start])
            while queue:
                r = queue.popleft()
                for j in self._peers[r]:
                    if colour[j] is None:
                        colour[j] = 1 - colour[r]
                        queue.append(j)
                    elif colour[j] == colour[r]:
                        return None
        return [int(c) for c in colour]  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Topology({self.name}, size={self.size}, mixing={self.mixing})"


def make_topology(name: str, size: int, mixing: Mixing = "uniform") -> Topology:
    """The built-in graph ``name`` over ``size`` ranks."""
    if size < 1:
        raise ConfigError(f"a topology needs at least one rank, got {size}")
    return Topology(name, [sorted(n) for n in _neighbour_sets(name, size)], mixing)
