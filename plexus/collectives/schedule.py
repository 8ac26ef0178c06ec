"""Who talks to whom, about which elements: the plans the all-reduce algorithms follow.

Pure arithmetic on ranks and element ranges, no tensors and no processes. The algorithms
(``ring.py``, ``rhd.py``, ...) execute these plans with real messages, and ``cost.py``
counts them without running anything, so the byte counts of the model and of the
counters cannot drift apart; the simulator reuses the same plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["chunk_bounds", "span", "Fold", "rhd_rounds", "Tree", "binary_tree", "double_tree",
           "dbtree_chunks", "hier_groups", "ceil_log2"]

Range = tuple[int, int]


def ceil_log2(n: int) -> int:
    """Smallest k with 2**k >= n (0 for n <= 1)."""
    return max(0, (n - 1).bit_length())


def chunk_bounds(length: int, parts: int) -> list[Range]:
    """Split ``length`` elements into ``parts`` contiguous ranges whose sizes differ by at
    most one (the first ``length % parts`` get the extra element); some may be empty."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def span(bounds: list[Range], lo: int, hi: int) -> Range:
    """The element range covered by blocks ``lo .. hi - 1`` of ``bounds`` (hi > lo)."""
    return bounds[lo][0], bounds[hi - 1][1]


@dataclass(frozen=True)
class Fold:
    """The standard handling of a P that is not a power of two (Thakur, Rabenseifner and
    Gropp 2005; MPICH): with p' the largest power of two <= P and r = P - p', each of the
    first r even ranks hands its whole vector to the next odd rank and sits out; the p'
    remaining ranks run the power-of-two algorithm as "core" ranks 0 .. p' - 1 and the odd
    ranks hand the result back at the end. Costs two extra steps and 2N extra bytes on the
    odd partners."""

    procs: int

    @property
    def pof2(self) -> int:
        return 1 << (self.procs.bit_length() - 1)

    @property
    def extra(self) -> int:
        return self.procs - self.pof2

    def core_rank(self, rank: int) -> int | None:
        """The rank among the p' core ranks, or None for a rank that sits out."""
        if rank < 2 * self.extra:
            return None if rank % 2 == 0 else rank // 2
        return rank - self.extra

    def rank_of(self, core: int) -> int:
        return 2 * core + 1 if core < self.extra else core + self.extra

    def partner(self, rank: int) -> int | None:
        """The rank this one folds into (or receives a fold from); None if it has none."""
        if rank >= 2 * self.extra:
            return None
        return rank + 1 if rank % 2 == 0 else rank - 1


@lru_cache(maxsize=4096)
def rhd_rounds(pof2: int, core: int) -> tuple[tuple[int, Range, Range], ...]:
    """Recursive halving among ``pof2`` core ranks: per round (partner, keep, give) in
    units of blocks (``pof2`` blocks in all). The distance halves each round (pof2/2 first),
    so after the last round core rank c keeps exactly block c. The all-gather replays the
    rounds backwards: send ``keep``, receive ``give``."""
    rounds = []
    lo, hi = 0, pof2
    mask = pof2 >> 1
    while mask:
        mid = (lo + hi) // 2
        if core & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        rounds.append((core ^ mask, keep, give))
        lo, hi = keep
        mask >>= 1
    return tuple(rounds)


@dataclass(frozen=True)
class Tree:
    """A rooted tree over ranks 0 .. P - 1: ``parent[r]`` (-1 at the root) and
    ``children[r]`` in increasing order."""

    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def root(self) -> int:
        return self.parent.index(-1)

    def depth(self, rank: int) -> int:
        d = 0
        while self.parent[rank] >= 0:
            rank = self.parent[rank]
            d += 1
        return d

    @property
    def height(self) -> int:
        """Edges on the longest root-to-leaf path."""
        return max(self.depth(r) for r in range(len(self.parent)))

    def below(self, rank: int) -> int:
        """Edges on the longest path from ``rank`` down to a leaf of its subtree."""
        return max((1 + self.below(c) for c in self.children[rank]), default=0)

    def relabel(self, mapping: list[int]) -> "Tree":
        """The same shape with rank ``r`` renamed ``mapping[r]``."""
        n = len(self.parent)
        parent = [-1] * n
        for r in range(n):
            if self.parent[r] >= 0:
                parent[mapping[r]] = mapping[self.parent[r]]
        return _tree_from_parents(parent)


def _tree_from_parents(parent: list[int]) -> Tree:
    children: list[list[int]] = [[] for _ in parent]
    for r, p in enumerate(parent):
        if p >= 0:
            children[p].append(r)
    return Tree(tuple(parent), tuple(tuple(sorted(c)) for c in children))


@lru_cache(maxsize=256)
def binary_tree(procs: int) -> Tree:
    """The in-order binary tree NCCL builds (Sanders, Speck and Traeff 2009): rank 0 is the
    root with a single child; for r > 0 with lowest set bit b, the parent is
    (r ^ b) | 2b, or r ^ b when that is out of range. Height about log2 P."""
    parent = [-1] * procs
    for r in range(1, procs):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        parent[r] = up if up < procs else r ^ bit
    return _tree_from_parents(parent)


@lru_cache(maxsize=256)
def double_tree(procs: int) -> tuple[Tree, Tree]:
    """Two complementary binary trees (NCCL 2.4): the second is the first mirrored
    (r -> P - 1 - r) for even P and shifted by one (r -> r + 1) for odd P, so that most
    ranks that are inner nodes in one tree are leaves in the other and the two halves of
    the data load every rank's links evenly."""
    first = binary_tree(procs)
    if procs % 2 == 0:
        mapping = [procs - 1 - r for r in range(procs)]
    else:
        mapping = [(r + 1) % procs for r in range(procs)]
    return first, first.relabel(mapping)


def hier_groups(procs: int, local_size: int) -> list[list[int]]:
    """Consecutive ranks in groups of ``local_size`` (the last may be smaller); the first
    rank of each group is its leader. Consecutive ranks share a machine under torchrun."""
    return [list(range(s, min(s + local_size, procs))) for s in range(0, procs, local_size)]


def dbtree_chunks(nbytes: int, chunk_bytes: int, limit: int = 256) -> int:
    """Pipeline chunks per tree for a vector of ``nbytes``: each tree carries half, cut in
    pieces of about ``chunk_bytes`` (at least 1, at most ``limit``)."""
    return max(1, min(limit, -(-nbytes // (2 * chunk_bytes))))
