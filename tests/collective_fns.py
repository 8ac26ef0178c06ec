"""Functions run inside spawned worker processes by tests/test_collectives.py.

One spawn per P runs ``suite``, which loops over every algorithm, dtype and length and
returns a JSON summary; the test process judges it.
"""
from __future__ import annotations

import hashlib
import time

import torch

from plexus.collectives import ALGORITHMS, AllReduce, get_algorithm
from plexus.collectives.auto import Auto
from plexus.collectives.dbtree import DoubleTree
from plexus.collectives.hier import Hierarchical
from plexus.collectives.rhd import Rhd
from plexus.collectives.trace import TracedEndpoint
from plexus.errors import ProtocolError

DTYPES = ("float32", "float64", "float16", "bfloat16")
# |got - exact| <= ATOL + RTOL * |exact|: 16-bit results are rounded once to their dtype,
# the sums themselves accumulate in float32 or wider.
TOLERANCE = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12), "float16": (2e-3, 2e-3),
             "bfloat16": (1e-2, 1e-2)}


def algorithms(procs: int) -> dict[str, AllReduce]:
    """Every registered algorithm, plus variants that exercise other code paths."""
    out = {name: get_algorithm(name) for name in sorted(ALGORITHMS)}
    out["hier:3"] = Hierarchical(local_size=3)
    out["hier:2/ring"] = Hierarchical(local_size=2, inner="ring")
    out["dbtree:small-chunks"] = DoubleTree(chunk_bytes=64)
    out["rhd:send-first"] = Rhd(early_bytes=0)  # the large-vector path at every size
    return out


def _inputs(procs: int, n: int, dtype: str) -> list[torch.Tensor]:
    """Every rank's input (each rank can compute everyone's: the exact sum is the oracle)."""
    dt = getattr(torch, dtype)
    return [torch.randn(n, generator=torch.Generator().manual_seed(7919 * r + n), dtype=torch.float64).to(dt)
            for r in range(procs)]


def _digest(t: torch.Tensor) -> str:
    raw = t.contiguous().view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:12]


def _excess(got: torch.Tensor, exact: torch.Tensor, dtype: str) -> float:
    """How far outside the tolerance the result is (<= 0: inside)."""
    if not got.numel():
        return 0.0
    atol, rtol = TOLERANCE[dtype]
    return ((got.double() - exact).abs() - (atol + rtol * exact.abs())).max().item()


def sums(group, lengths: list[int], big: int, big_dtypes: list[str]) -> list[dict]:
    """Every algorithm x dtype x length (and op mean) against the exact sum."""
    rows = []
    cases = [(n, dtype) for n in lengths for dtype in DTYPES] + [(big, dtype) for dtype in big_dtypes]
    for n, dtype in cases:
        xs = _inputs(group.size, n, dtype)
        exact = sum(x.double() for x in xs)
        for name, algo in algorithms(group.size).items():
            for op in ("sum", "mean") if n == lengths[-1] else ("sum",):
                t = xs[group.rank].clone()
                algo(t, group, op)
                want = exact / group.size if op == "mean" else exact
                # auto: the algorithm it ran (its choice rests on timings measured on this group)
                chose = algo.decisions()[-1]["chose"] if isinstance(algo, Auto) and algo.decisions() else name
                rows.append({"algorithm": name, "n": n, "dtype": dtype, "op": op, "excess": _excess(t, want, dtype),
                             "digest": _digest(t), "same_dtype": t.dtype == xs[0].dtype, "chose": chose})
    return rows


def handles(group) -> dict[str, bool]:
    """Several async calls in flight at once, a sync call among them, waited out of order."""
    out = {}
    for name, algo in algorithms(group.size).items():
        lengths = (group.size + 1, 1000, 7)
        xs = {n: _inputs(group.size, n, "float32") for n in lengths}
        mine = [xs[n][group.rank].clone() for n in lengths]
        pending = [algo.all_reduce_async(t, group) for t in mine[:2]]
        algo(mine[2], group)  # sync call issued after the async ones: must run after them
        last = algo.all_reduce_async(mine[2], group, "mean")  # P copies of the sum, over P: the sum
        for h in reversed(pending + [last]):
            h.wait()
        ok = all(h.done() for h in pending + [last])
        for n, t in zip(lengths[:2], mine[:2]):
            ok &= _excess(t, sum(x.double() for x in xs[n]), "float32") <= 0
        ok &= _excess(mine[2], sum(x.double() for x in xs[lengths[2]]), "float32") <= 0
        out[name] = bool(ok)
    return out


def mismatches(group) -> dict[str, dict]:
    """Lengths or dtypes that differ across ranks: ProtocolError everywhere, no hang, and
    the group still works afterwards."""
    out = {}
    last = group.size - 1
    for name, algo in algorithms(group.size).items():
        row = {}
        for kind in ("length", "dtype"):
            n = 10 + (1 if kind == "length" and group.rank == last else 0)
            dtype = torch.float64 if kind == "dtype" and group.rank == 0 else torch.float32
            start = time.perf_counter()
            try:
                algo(torch.ones(n, dtype=dtype), group)
                row[kind] = "no error"
            except ProtocolError as exc:
                row[kind] = str(exc)
                row[kind + "_peer"] = exc.peer
            row[kind + "_seconds"] = time.perf_counter() - start
        t = torch.ones(5)
        algo(t, group)
        row["after"] = t.tolist()
        out[name] = row
    return out


def counters(group, n: int) -> dict[str, dict]:
    """One traced call per algorithm: this rank's bytes sent (Traffic) and message log."""
    out = {}
    for name, algo in algorithms(group.size).items():
        t = torch.ones(n)
        algo(t, group)  # warm-up (auto calibrates on its first call)
        traced = TracedEndpoint(group)
        group.traffic.reset()
        algo(t, traced)
        row = {"bytes": group.traffic.bytes_sent, "log": traced.log()}
        if isinstance(algo, Auto):
            row["choice"] = algo.choice(group, n * 4)
        if isinstance(algo, Hierarchical):
            row["local_size"] = algo.group_size(group.size)
            row["inner"] = algo.inner
        if isinstance(algo, DoubleTree):
            row["chunk_bytes"] = algo.chunk_bytes
        out[name] = row
    return out


def suite(group, lengths: list[int], big: int, big_dtypes: list[str], counter_length: int) -> dict:
    """Everything one spawn of P processes checks."""
    torch.set_num_threads(1)  # P processes share 2 cores
    result = {"sums": sums(group, lengths, big, big_dtypes), "handles": handles(group),
              "counters": counters(group, counter_length)}
    if group.size > 1:
        result["mismatches"] = mismatches(group)
    return result


def linked(group, lengths: list[int], big: int, counter_length: int) -> dict:
    """``suite``'s sums (float32), counters and mismatches with every member connected over
    shared memory (``Group.connect``), as the training strategies connect them."""
    torch.set_num_threads(1)
    result = {"linked": group.connect(range(group.size), "shm"),
              "sums": sums(group, lengths, big, ["float32"]), "counters": counters(group, counter_length)}
    if group.size > 1:
        result["mismatches"] = mismatches(group)
    result["links_open"] = all(link.shm is not None for link in group.links.values())
    return result

