"""``plexus bench simulate``: how large a cluster the simulator runs, and how fast.

Each row simulates one job in this process (``plexus.sim.simulate``, no run directory)
and reports the real seconds it took against the goal of issue 18: 1,000 workers x 1,000
steps with the real maths, and 10,000 workers x 1,000 steps with ``--timing-only``, each
within 60 s on this machine. The digits MLP, compute given (2e-5 s per sample) so that no
profiling enters the time, the default network (10 Gbit/s, 50 us per message).

    plexus bench simulate                 # the goal rows and the parameter server at scale
    plexus bench simulate --steps 100     # every row shortened (the goal needs 1000)
"""
from __future__ import annotations

import argparse
import time

__all__ = ["ROWS", "add_arguments", "main", "run_row"]

GOAL_SECONDS = 60.0

# (label, flags, simulated workers, servers, timing only, goal applies)
ROWS = [
    ("allreduce ring, real maths", {"strategy": "allreduce", "algorithm": "ring"}, 1000, 0, False, True),
    ("allreduce ring, timing only", {"strategy": "allreduce", "algorithm": "ring"}, 10000, 0, True, True),
    ("ps bsp, 8 servers, timing only", {"strategy": "ps", "consistency": "bsp"}, 1000, 8, True, False),
    ("ps asp, 8 servers, timing only", {"strategy": "ps", "consistency": "asp"}, 1000, 8, True, False),
    ("ps bsp, 8 servers, real maths", {"strategy": "ps", "consistency": "bsp"}, 100, 8, False, False),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=1000, help="steps of every row (default 1000, the goal's)")
    parser.add_argument("--rows", type=int, nargs="*", help="only these rows (0-based)")


def run_row(flags: dict, workers: int, servers: int, timing_only: bool, steps: int) -> tuple[float, dict]:
    """(real seconds, summary) of one simulated job."""
    from plexus.config import JobConfig
    from plexus.sim.cluster import ComputeModel, SimSpec, network_of
    from plexus.sim.run import simulate
    flat = {**flags, "workers": workers, "servers": servers, "batch_size": workers, "steps": steps,
            "dataset": "digits", "model": "mlp", "eval_every": 0, "quiet": True}
    cfg = JobConfig.from_flat(flat, {k: "flag" for k in flat})
    spec = SimSpec(workers=workers, servers=servers, compute=ComputeModel(per_sample=2e-5),
                   network=network_of(cfg.cluster.net), timing_only=timing_only)
    started = time.perf_counter()
    summary = simulate(cfg, spec, None)
    return time.perf_counter() - started, summary


def main(args: argparse.Namespace) -> int:
    from plexus.errors import ConfigError
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}: pass --steps 1000")
    chosen = getattr(args, "rows", None) or []
    if any(not 0 <= i < len(ROWS) for i in chosen):
        raise ConfigError(f"--rows: rows are numbered 0 to {len(ROWS) - 1}, got "
                          f"{next(i for i in chosen if not 0 <= i < len(ROWS))}")
    rows = [ROWS[i] for i in chosen] if chosen else ROWS
    print("| configuration | workers | steps | real s | goal s | real/goal | events/s | simulated s | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    met = True
    for label, flags, workers, servers, timing_only, goal in rows:
        real, summary = run_row(flags, workers, servers, timing_only, args.steps)
        acc = summary["final_test_accuracy"]
        print(f"| {label} | {workers:,} | {summary['steps']:,} | {real:.1f} | {GOAL_SECONDS if goal else '-'} | "
              f"{f'{real / GOAL_SECONDS:.2f}' if goal else '-'} | {summary['sim']['events'] / real:,.0f} | "
              f"{summary['wall_seconds']:.3f} | {'-' if acc is None else f'{acc:.1%}'} |")
        if goal and args.steps >= 1000:
            met = met and real <= GOAL_SECONDS
    print(f"\ngoal (issue 18): the two goal rows within {GOAL_SECONDS:.0f} s at 1000 steps: "
          f"{'met' if met else 'NOT met'}" + ("" if args.steps >= 1000 else " (not judged: --steps < 1000)"))
    return 0
