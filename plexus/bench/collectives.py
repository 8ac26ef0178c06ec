"""``plexus bench collectives``: time, bandwidth, bytes and steps of every all-reduce
algorithm against ``native``, measured in one run.

For each ``--procs`` P one job of P processes is spawned. Inside it, for each size, every
algorithm first runs ``--warmup`` untimed calls (auto measures alpha and beta then), then
one traced call whose bytes sent per rank come from the ``Traffic`` counters and whose
steps come from its message log (``collectives/trace.py``), then ``--reps`` rounds in
which every algorithm runs once, in an order rotated every round, each call after a
barrier. A call's time is the slowest rank's; the table shows the median over rounds, so
the drift of a shared machine falls on every algorithm alike.

Columns follow nccl-tests: algbw = bytes / time, busbw = algbw * 2(P-1)/P (what each
rank's link carries in a bandwidth-optimal algorithm), and ``time / native`` is the time
ratio to plexus's ``native`` in the same run (busbw ratio = its inverse). Every algorithm,
native included, pays plexus's per-call argument check (``collectives/check.py``); the
extra row ``backend`` is gloo's all-reduce called directly, without the check and the
lane, to show what the check costs. The model columns are ``cost.py``'s with this
cluster's alpha, beta and gamma (measured by ``auto.calibrate``). Every process uses one
torch thread: P processes share this machine's cores. The algorithms' messages between
processes on one machine go over shared memory, as in training (``--transport``,
``Group.connect``); ``native`` and ``backend`` use gloo's own connections either way.

Sizes take K, M, G suffixes in powers of 1024 (``4KB`` is 4096 bytes) and are rounded
down to whole float32 elements.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any

from plexus.bench import csv_list

__all__ = ["add_arguments", "main", "measure", "parse_size", "DEFAULT_SIZES"]

DEFAULT_SIZES = "4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"
BACKEND = "backend"  # gloo's all-reduce without plexus's lane and check
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes in ``text`` such as 4096, 4KB, 1.5MB or 64MiB (powers of 1024)."""
    from plexus.errors import ConfigError

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"--sizes: cannot read {text!r} as a size: write e.g. 4096, 4KB, 1MB or 64MB")
    return int(float(match.group(1)) * _UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from plexus.config import TRANSPORTS

    parser.add_argument("--algorithms", default="all",
                        help="comma-separated all-reduce algorithms, or all (default all; native always runs; "
                             f"{BACKEND} is gloo's all-reduce without plexus's check, included in all)")
    parser.add_argument("--procs", default="4", help="comma-separated process counts (default 4)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"comma-separated message sizes, K/M/G in powers of 1024 (default {DEFAULT_SIZES})")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds; the median is kept (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per algorithm and size (default 2)")
    parser.add_argument("--local-size", type=int, default=0,
                        help="ranks per group for hier (default 0: ranks per machine, 2 on one machine)")
    parser.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                        help="what carries the algorithms' messages: auto (shared memory on one machine, as "
                             "in training), socket (gloo's) or shm")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")


def _check(args: argparse.Namespace) -> tuple[list[str], list[int], list[int]]:
    from plexus.collectives import ALGORITHMS
    from plexus.errors import ConfigError

    names = list(ALGORITHMS) if args.algorithms.strip() == "all" else csv_list(args.algorithms)
    for name in names:
        if name not in ALGORITHMS and name != BACKEND:
            raise ConfigError(f"--algorithms: unknown algorithm {name!r}: choose from {', '.join(ALGORITHMS)}, "
                              f"{BACKEND} or all")
    if "native" not in names:
        names.append("native")  # the reference of every ratio
    if args.algorithms.strip() == "all":
        names.append(BACKEND)
    try:
        procs = [int(p) for p in csv_list(args.procs)]
    except ValueError:
        raise ConfigError(f"--procs must be comma-separated integers, got {args.procs!r}: pass --procs 2,4") from None
    sizes = [parse_size(s) // 4 * 4 for s in csv_list(args.sizes)]
    for flag, values in (("--procs", procs), ("--sizes", sizes), ("--algorithms", names)):
        if not values:
            raise ConfigError(f"{flag} must name at least one value, got nothing: see --help")
    if min(procs) < 1:
        raise ConfigError(f"--procs: every process count must be at least 1, got {min(procs)}")
    if min(sizes) < 4:
        raise ConfigError(f"--sizes: every size must be at least 4 bytes (one float32), got {min(sizes)} after "
                          f"rounding down to whole floats: pass e.g. --sizes 4KB,1MB")
    if args.reps < 1 or args.warmup < 0:
        raise ConfigError(f"--reps must be at least 1 and --warmup at least 0, got {args.reps} and {args.warmup}")
    if args.local_size < 0:
        raise ConfigError(f"--local-size must be 0 (ranks per machine) or positive, got {args.local_size}")
    return names, procs, sizes


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from plexus.cluster.spawn import spawn

    names, procs, sizes = _check(args)
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    for p in procs:
        console.print(f"[dim]bench collectives: {p} processes, {len(names)} algorithms x {len(sizes)} sizes x "
                      f"{args.reps} rounds[/dim]")
        calls = len(names) * (args.reps + args.warmup + 1)
        # Generous (about 1 GB/s per process and 20 ms per call); the children's own
        # communication timeouts end a hung run first.
        budget = 120.0 + sum(calls * (0.02 + p * size / 1e9) for size in sizes) * 5
        results = spawn("plexus.bench.collectives:measure", p,
                        {"algorithms": names, "sizes": sizes, "reps": args.reps, "warmup": args.warmup,
                         "local_size": args.local_size, "transport": args.transport},
                        timeout=budget, comm_timeout=120.0)
        rows += _rows(results, names, sizes, p)
    Console().print(_table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


def _rows(results: list[dict], names: list[str], sizes: list[int], procs: int) -> list[dict[str, Any]]:
    """One row per (algorithm, size), judged from every rank's measurements."""
    from plexus.collectives.check import TAG_CHECK
    from plexus.collectives.cost import Network, cost
    from plexus.collectives.trace import steps

    network = Network(**results[0]["network"])
    rows = []
    for size in sizes:
        per = {name: [r["sizes"][str(size)][name] for r in results] for name in names}
        # A round's time is the slowest rank's.
        seconds = {name: statistics.median(max(rounds) for rounds in zip(*(m["seconds"] for m in per[name])))
                   for name in names}
        for name in names:
            mine = per[name][0]
            row: dict[str, Any] = {"algorithm": name, "procs": procs, "bytes": size, "seconds": seconds[name],
                                   "seconds_min": min(max(rounds) for rounds in zip(*(m["seconds"] for m in per[name])))}
            factor = 2 * (procs - 1) / procs
            row["algbw_gbps"] = size / seconds[name] / 1e9 if seconds[name] > 0 else 0.0
            row["busbw_gbps"] = row["algbw_gbps"] * factor
            row["vs_native"] = seconds[name] / seconds["native"]
            row["vs_backend"] = seconds[name] / seconds[BACKEND] if BACKEND in seconds else None
            if name == BACKEND:
                row.update(sent_bytes_max=None, model_sent_bytes_max=None, steps=None, model_steps=None)
                rows.append(row)
                continue
            logs = [m["log"] for m in per[name]]
            row["sent_bytes_max"] = max(m["bytes"] for m in per[name])
            row["steps"] = steps(logs, ignore_tags=[TAG_CHECK])
            kwargs = {"local_size": mine["local_size"]} if "local_size" in mine else {}
            model = cost(mine.get("choice", name), procs, size, network=network, **kwargs)
            row["model_sent_bytes_max"] = model.wire_bytes_max
            row["model_steps"] = model.steps
            row["check_bytes"] = model.check_bytes
            row["check_steps"] = model.check_steps
            row["fan_in"] = model.fan_in
            row["model_seconds"] = model.time
            if "choice" in mine:
                row["choice"] = mine["choice"]
            rows.append(row)
    return rows


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:g}B"


def _table(rows: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(title="all-reduce: median time of the slowest rank; busbw = algbw x 2(P-1)/P; "
                        "sent = bytes per rank (max), counted and modelled (check included)")
    for col in ("algorithm", "P", "size", "time ms", "algbw GB/s", "busbw GB/s", "time/native", "sent",
                "= model", "steps", "model steps"):
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    for row in rows:
        name = row["algorithm"] + (f" ({row['choice']})" if "choice" in row else "")
        if row["sent_bytes_max"] is None:
            sent = same = steps = model_steps = "-"
        else:
            sent = _fmt_bytes(row["sent_bytes_max"])
            same = "yes" if row["sent_bytes_max"] == row["model_sent_bytes_max"] else _fmt_bytes(
                row["model_sent_bytes_max"])
            steps = "-" if row["steps"] is None else str(row["steps"])
            model_steps = str(row["model_steps"])
        table.add_row(name, str(row["procs"]), _fmt_bytes(row["bytes"]), f"{row['seconds'] * 1e3:.3f}",
                      f"{row['algbw_gbps']:.3f}", f"{row['busbw_gbps']:.3f}", f"{row['vs_native']:.2f}", sent, same,
                      steps, model_steps)
    return table


# ---------------------------------------------------------------------------------------
# Inside each spawned process.

def measure(group, algorithms: list[str], sizes: list[int], reps: int, warmup: int, local_size: int,
            transport: str = "auto") -> dict:
    """This rank's measurements: {"network": alpha/beta/gamma, "sizes": {size: {algorithm:
    {"seconds": [per round], "bytes": sent in the traced call, "log": its messages}}}}."""
    import torch

    from plexus.collectives import ALGORITHMS
    from plexus.collectives.auto import Auto
    from plexus.collectives.hier import Hierarchical
    from plexus.collectives.trace import TracedEndpoint

    torch.set_num_threads(1)
    contenders: dict[str, Any] = {}
    for name in algorithms:
        if name == BACKEND:
            contenders[name] = lambda t, g: g.all_reduce_backend(t).wait()
        elif name == "hier":
            contenders[name] = Hierarchical(local_size=local_size)
        else:
            contenders[name] = ALGORITHMS[name]()
    group.connect(range(group.size), transport)
    network = Auto().network(group)  # measured once per group; auto's choices use the same numbers
    out: dict[str, Any] = {"network": {"alpha": network.alpha, "beta": network.beta, "gamma": network.gamma},
                           "sizes": {}}
    for size in sizes:
        t = torch.zeros(size // 4)  # zeros stay zeros: every round sums the same numbers
        row: dict[str, dict[str, Any]] = {name: {"seconds": []} for name in algorithms}
        for name, fn in contenders.items():
            for _ in range(warmup):
                fn(t, group)
            if name == BACKEND:
                continue
            traced = TracedEndpoint(group)
            group.traffic.reset()
            fn(t, traced)
            row[name].update(bytes=group.traffic.bytes_sent, log=traced.log())
            if isinstance(fn, Auto):
                row[name]["choice"] = fn.choice(group, size // 4 * 4)
            if isinstance(fn, Hierarchical):
                row[name]["local_size"] = fn.group_size(group.size)
        for rnd in range(reps):
            order = algorithms[rnd % len(algorithms):] + algorithms[:rnd % len(algorithms)]
            for name in order:
                group.barrier()
                start = time.perf_counter()
                contenders[name](t, group)
                row[name]["seconds"].append(time.perf_counter() - start)
        out["sizes"][str(size)] = row
    return out
