"""Analytic costs of the all-reduce algorithms: steps, bytes per rank, fan-in and time.

Time follows Hockney's alpha-beta model with a reduction term, for ranks with one
full-duplex port (Thakur, Rabenseifner and Gropp 2005): a message of m bytes costs
alpha + m * beta, a rank sends one message and receives one at a time (so k messages in
one step cost the busiest rank k * (alpha + m * beta)), and adding m bytes costs
m * gamma. With N the vector's bytes and P ranks (p' the largest power of two <= P,
lg = log2):

=========  =================================  ==========================================
algorithm  steps                              time
=========  =================================  ==========================================
ring       2(P-1)                             2(P-1) a + 2(P-1)/P N b + (P-1)/P N g
rhd        2 lg p' (+2 if P != p')            2 lg p' a + 2(p'-1)/p' N b + (p'-1)/p' N g
                                              (+ 2a + 2N b + N g for the fold)
ps         2                                  2(P-1) a + 2(P-1)/P N b + (P-1)/P N g
master     2                                  2(P-1)(a + N b) + (P-1) N g
dbtree     2H + C - 1                         (2H + C - 1)(k (a + m b) + c m g)
hier       2 + inner(G)                       2(L-1)(a + N b) + (L-1) N g + inner(G)
native     2(P-1) (gloo's ring)               as ring
=========  =================================  ==========================================

dbtree: H the taller tree's height, C chunks of m = N / 2C bytes per tree, k the most
messages a rank sends per pipeline step and c the most children it adds per step. hier:
L ranks per group, G = ceil(P / L) leaders running the inner algorithm.

Bytes per rank are exact, for every length: they are counted from the same plans the
algorithms execute (``schedule.py``), in whole elements, with empty messages skipped as
the algorithms skip them. Steps are the sequential communication steps (the longest
chain of messages, see ``trace.py``), exact when every message is non-empty (N at least
P elements; for dbtree every chunk non-empty). Every call also pays the argument check
of ``check.py``: ceil(lg P) steps of 96 bytes, reported apart (``check_steps``,
``check_bytes``) because it is plexus's protocol, not the algorithm.

Pure code: no tensors, no processes; the simulator reuses it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from plexus.collectives.check import check_bytes
from plexus.collectives.schedule import (Fold, ceil_log2, chunk_bounds, dbtree_chunks, double_tree, hier_groups,
                                         rhd_rounds, span)
from plexus.errors import ConfigError

__all__ = ["Network", "Cost", "cost", "best", "ALGORITHM_NAMES", "AUTO_CANDIDATES", "DBTREE_CHUNK_BYTES"]

ALGORITHM_NAMES = ("master", "ps", "rhd", "ring", "dbtree", "hier", "native", "auto")
# What auto chooses among, in order of preference when the model ties.
AUTO_CANDIDATES = ("rhd", "ring", "ps", "dbtree", "master")
DBTREE_CHUNK_BYTES = 1 << 20


@dataclass(kw_only=True, frozen=True)
class Network:
    """Parameters of the alpha-beta-gamma model."""

    # Seconds per message, whatever its size (latency plus per-message overhead).
    alpha: float = 100e-6
    # Seconds per byte sent (the inverse of a link's bandwidth).
    beta: float = 1e-9
    # Seconds per byte added by a reduction (the inverse of the add's memory bandwidth).
    gamma: float = 0.25e-9

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"network {name} must be a finite number >= 0 seconds, got {value!r}")


@dataclass(frozen=True)
class Cost:
    """The model's account of one all-reduce of ``nbytes`` bytes over ``procs`` ranks."""

    algorithm: str
    procs: int
    nbytes: int
    # Sequential communication steps of the algorithm (check excluded).
    steps: int
    # Bytes each rank sends, by rank (check excluded).
    sent: tuple[int, ...]
    # Most messages one rank receives in one step.
    fan_in: int
    # Seconds under the alpha-beta-gamma model (check excluded).
    time: float
    # The argument check of every call: steps and bytes sent per rank.
    check_steps: int = 0
    check_bytes: int = 0
    # For auto: the algorithm it picks; otherwise the algorithm itself.
    choice: str = ""

    @property
    def sent_max(self) -> int:
        return max(self.sent, default=0)

    @property
    def wire_bytes_max(self) -> int:
        """Most bytes a rank sends per call, check included (what the counters show)."""
        return self.sent_max + self.check_bytes


def _ring(p: int, n: int, w: int, net: Network) -> tuple[int, list[int], int, float]:
    sizes = [b - a for a, b in chunk_bounds(n, p)]
    # Rank r sends every chunk but r + 1 in the reduce-scatter and every chunk but r + 2
    # in the all-gather.
    sent = [(2 * n - sizes[(r + 1) % p] - sizes[(r + 2) % p]) * w for r in range(p)]
    nb = n * w
    time = 2 * (p - 1) * net.alpha + 2 * (p - 1) / p * nb * net.beta + (p - 1) / p * nb * net.gamma
    return 2 * (p - 1), sent, 1, time


def _rhd(p: int, n: int, w: int, net: Network) -> tuple[int, list[int], int, float]:
    fold = Fold(p)
    q = fold.pof2
    blocks = chunk_bounds(n, q)
    sent = []
    for r in range(p):
        core = fold.core_rank(r)
        if core is None:
            sent.append(n * w)
            continue
        total = n if fold.partner(r) is not None else 0
        for _, keep, give in rhd_rounds(q, core):
            ga, gb = span(blocks, *give)
            ka, kb = span(blocks, *keep)
            total += (gb - ga) + (kb - ka)
        sent.append(total * w)
    nb = n * w
    steps = 2 * ceil_log2(q) + (2 if fold.extra else 0)
    time = (2 * ceil_log2(q) * net.alpha + 2 * (q - 1) / q * nb * net.beta + (q - 1) / q * nb * net.gamma)
    if fold.extra:
        time += 2 * net.alpha + 2 * nb * net.beta + nb * net.gamma
    return steps, sent, 1, time


def _ps(p: int, n: int, w: int, net: Network) -> tuple[int, list[int], int, float]:
    shards = [b - a for a, b in chunk_bounds(n, p)]
    sent = [((n - s) + (p - 1) * s) * w for s in shards]
    nb = n * w
    time = 2 * (p - 1) * net.alpha + 2 * (p - 1) / p * nb * net.beta + (p - 1) / p * nb * net.gamma
    return 2, sent, p - 1, time


def _master(p: int, n: int, w: int, net: Network) -> tuple[int, list[int], int, float]:
    nb = n * w
    sent = [(p - 1) * nb] + [nb] * (p - 1)
    time = 2 * (p - 1) * (net.alpha + nb * net.beta) + (p - 1) * nb * net.gamma
    return 2, sent, p - 1, time


def _dbtree(p: int, n: int, w: int, net: Network, chunk_bytes: int) -> tuple[int, list[int], int, float]:
    trees = double_tree(p)
    halves = [b - a for a, b in chunk_bounds(n, 2)]
    count = dbtree_chunks(n * w, chunk_bytes)
    sent, fan_in, per_step, adds = [], 0, 0, 0
    for r in range(p):
        total = messages = incoming = children = 0
        for tree, half in zip(trees, halves):
            up = 1 if tree.parent[r] >= 0 else 0
            kids = len(tree.children[r])
            total += (up + kids) * half
            messages += up + kids
            incoming += kids + up  # children's sums up, the parent's result down
            children += kids
        sent.append(total * w)
        fan_in, per_step, adds = max(fan_in, incoming), max(per_step, messages), max(adds, children)
    height = max(tree.height for tree in trees)
    steps = 2 * height + count - 1
    chunk = max(halves) / count * w
    time = steps * (per_step * (net.alpha + chunk * net.beta) + adds * chunk * net.gamma)
    return steps, sent, fan_in, time


def _hier(p: int, n: int, w: int, net: Network, local_size: int, inner: str, chunk_bytes: int
          ) -> tuple[int, list[int], int, float]:
    if local_size < 1:
        raise ConfigError(f"hier's local_size must be at least 1 in the cost model, got {local_size}")
    if inner not in ("rhd", "ring", "ps", "dbtree", "master"):
        raise ConfigError(f"hier's inner algorithm must be rhd, ring, ps, dbtree or master, got {inner!r}")
    groups = hier_groups(p, local_size)
    leaders = [g[0] for g in groups]
    widest = max(len(g) for g in groups)
    if len(leaders) > 1:
        in_steps, in_sent, in_fan, in_time = _plan(inner, len(leaders), n, w, net, local_size, inner, chunk_bytes)
    else:
        in_steps, in_sent, in_fan, in_time = 0, [0], 0, 0.0
    nb = n * w
    sent = [0] * p
    for index, g in enumerate(groups):
        sent[g[0]] = (len(g) - 1) * nb + in_sent[index]
        for member in g[1:]:
            sent[member] = nb
    local = widest > 1
    steps = (2 if local else 0) + in_steps
    time = in_time + (2 * (widest - 1) * (net.alpha + nb * net.beta) + (widest - 1) * nb * net.gamma)
    return steps, sent, max(widest - 1, in_fan), time


def _native(p: int, n: int, w: int, net: Network) -> tuple[int, list[int], int, float]:
    steps, _, fan_in, time = _ring(p, n, w, net)
    # Counted as group.all_reduce_backend counts it: 2(P-1)/P N, split evenly over peers.
    per_peer = (2 * (p - 1) * n * w // p) // (p - 1)
    return steps, [per_peer * (p - 1)] * p, fan_in, time


def _plan(algorithm: str, p: int, n: int, w: int, net: Network, local_size: int, inner: str,
          chunk_bytes: int) -> tuple[int, list[int], int, float]:
    if algorithm == "ring":
        return _ring(p, n, w, net)
    if algorithm == "rhd":
        return _rhd(p, n, w, net)
    if algorithm == "ps":
        return _ps(p, n, w, net)
    if algorithm == "master":
        return _master(p, n, w, net)
    if algorithm == "dbtree":
        return _dbtree(p, n, w, net, chunk_bytes)
    if algorithm == "hier":
        return _hier(p, n, w, net, local_size, inner, chunk_bytes)
    if algorithm == "native":
        return _native(p, n, w, net)
    raise ConfigError(f"no cost model for algorithm {algorithm!r}: choose one of {', '.join(ALGORITHM_NAMES)}")


def cost(algorithm: str, procs: int, nbytes: int, *, itemsize: int = 4, network: Network | None = None,
         local_size: int = 2, inner: str = "rhd", chunk_bytes: int = DBTREE_CHUNK_BYTES,
         candidates: tuple[str, ...] = AUTO_CANDIDATES) -> Cost:
    """The model's cost of ``algorithm`` all-reducing ``nbytes`` bytes (a whole number of
    ``itemsize``-byte elements, as sent on the wire: float32 for float16/bfloat16 input)
    over ``procs`` ranks. ``local_size`` and ``inner`` configure hier, ``chunk_bytes``
    dbtree, ``candidates`` auto."""
    if procs < 1:
        raise ConfigError(f"procs must be at least 1, got {procs}")
    if itemsize < 1 or nbytes < 0 or nbytes % itemsize:
        raise ConfigError(f"nbytes must be a non-negative multiple of itemsize {itemsize}, got {nbytes}")
    if algorithm not in ALGORITHM_NAMES:
        raise ConfigError(f"no cost model for algorithm {algorithm!r}: choose one of {', '.join(ALGORITHM_NAMES)}")
    net = network or Network()
    choice = algorithm
    if algorithm == "auto":
        choice = best(procs, nbytes, net, itemsize=itemsize, candidates=candidates, chunk_bytes=chunk_bytes)
    n = nbytes // itemsize
    if procs == 1 or n == 0:
        steps, sent, fan_in, time = 0, [0] * procs, 0, 0.0
    else:
        steps, sent, fan_in, time = _plan(choice, procs, n, itemsize, net, local_size, inner, chunk_bytes)
    return Cost(algorithm=algorithm, procs=procs, nbytes=nbytes, steps=steps, sent=tuple(sent), fan_in=fan_in,
                time=time, check_steps=ceil_log2(procs), check_bytes=check_bytes(procs), choice=choice)


def best(procs: int, nbytes: int, network: Network, *, itemsize: int = 4,
         candidates: tuple[str, ...] = AUTO_CANDIDATES, chunk_bytes: int = DBTREE_CHUNK_BYTES) -> str:
    """The candidate with the least modelled time (the first of equals)."""
    unknown = [name for name in candidates if name not in AUTO_CANDIDATES]
    if not candidates or unknown:
        raise ConfigError(f"auto chooses among {', '.join(AUTO_CANDIDATES)}, got {list(candidates)!r}")
    times = [cost(name, procs, nbytes, itemsize=itemsize, network=network, chunk_bytes=chunk_bytes).time
             for name in candidates]
    return candidates[times.index(min(times))]
