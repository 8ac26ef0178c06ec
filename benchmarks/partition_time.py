"""Partition methods on the deep model under a memory cap: each stage's predicted compute
per step against what its process measured.

deep-mlp (8 Linear layers, --hidden 1024) on digits at batch 64 under a --stage-memory
cap that no fewer than --stages K stages meet; for each --partition method (uniform,
params, time) one real run of ``plexus train --stages K`` (one process per stage, one
thread each, --steps S), and per stage:

- predicted: the plan's compute seconds per step (``Partition.compute_s``) and its
  transfers' seconds. Under --partition time stage 0 cuts by a node profile and then
  prices that cut by running its stage programs in one process as a step runs them
  (``executor.price_plan``); those prices are the prediction;
- measured: the stage's ``compute_seconds`` / steps from the run's summary, which counts
  the same work (zero_grad, forward, loss, backward, optimizer step; not the waits for
  values and gradients, nor the start of sends).

For ``time`` the prediction is the run's own (the summary carries it). uniform and
params runs price nothing, so this script prices the run's cut as stage 0 would (same
seed, sample, one thread, optimizer: ``make_plan`` of the cut, then ``price_plan``),
and for ``time`` also shows the node profile's sum for the same cut (what the plan
predicted before pricing). The goal (issue 13): the time cut's slowest stage measured
within 15 % of its prediction.

    python benchmarks/partition_time.py                      # about 40 s on 2 cores
    python benchmarks/partition_time.py --stages 4 --stage-memory 26.2MB --hidden 1024
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import torch  # noqa: E402

import plexus  # noqa: E402
from plexus.config import JobConfig  # noqa: E402
from plexus.parallel.executor import make_plan, price_plan  # noqa: E402
from plexus.parallel.partition import plan_partitions, trace_model  # noqa: E402
from plexus.strategies.base import make_optimizer  # noqa: E402
from plexus.train.data import load_dataset  # noqa: E402
from plexus.train.models import build_model  # noqa: E402

METHODS = ("uniform", "params", "time")


def _base(args: argparse.Namespace) -> dict:
    return dict(dataset=args.dataset, model="deep-mlp", hidden=args.hidden, batch_size=args.batch_size,
                stages=args.stages, stage_memory=args.stage_memory, steps=args.steps, lr=args.lr,
                threads=args.threads, eval_every=0, log_every=args.steps, quiet=True, seed=1, timeout=120)


def _predicted(flat: dict, split_points: list[str], priced: bool) -> list[tuple[float, float]]:
    """(compute, transfers) seconds per step of each stage of the cut at ``split_points``,
    measured here as stage 0 measures them in a --partition time run: priced on the
    cut's stage programs, or (``priced`` false) summed from the calibrated node profile."""
    cfg = JobConfig.from_flat({**flat, "partition": "manual", "split_points": ",".join(split_points)})
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.threads or threads)
    optimizer = lambda params: make_optimizer(params, cfg.optim)  # noqa: E731
    try:
        data = load_dataset(cfg.data, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model, data)
        sample = data.x_train[:cfg.run.batch_size]
        if priced:
            graph, plan = make_plan(cfg, model, sample)
            plan = price_plan(graph, plan, sample, optimizer)
        else:
            graph = trace_model(model, sample, profile=True, optimizer=optimizer)
            slots = 1 if cfg.optim.momentum > 0 else 0  # sgd, as the run
            plan = plan_partitions(graph, cfg.parallel.stages, "manual", split_points=split_points,
                                   memory_cap=cfg.parallel.stage_memory_bytes, optimizer_slots=slots)
    finally:
        torch.set_num_threads(threads)
    return [(p.compute_s, p.time_s - p.compute_s) for p in plan.partitions]


def _ms(values: list[float]) -> str:
    return " / ".join(f"{1e3 * v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--stage-memory", default="39MB", help="a cap that no fewer than --stages stages meet")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    base = _base(args)
    print("| partition | nodes per stage | predicted compute ms/step | predicted transfers ms/step | "
          "measured compute ms/step | slowest stage predicted ms | slowest stage measured ms | "
          "measured / predicted | step ms (wall) |")
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    ratios: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for method in METHODS:
            s = plexus.run({**base, "partition": method, "out": str(Path(scratch) / method)})
            steps = s["steps"]
            stages = s["stages"]
            measured = [st["compute_seconds"] / steps for st in stages]
            points = [st["nodes"][0] for st in stages[1:]]
            rows = []
            if method == "time":
                rows.append(("time (the run's prediction)",
                             [(st["predicted_compute_seconds"] / steps,
                               (st["predicted_seconds"] - st["predicted_compute_seconds"]) / steps) for st in stages]))
                rows.append(("time (this script's node profile of the same cut)", _predicted(base, points, False)))
            else:
                rows.append((f"{method} (priced here)", _predicted(base, points, True)))
            for label, predicted in rows:
                compute = [c for c, _ in predicted]
                slow = max(range(len(stages)), key=lambda k: compute[k])
                print(f"| {label} | {' / '.join(str(len(st['nodes'])) for st in stages)} | {_ms(compute)} | "
                      f"{_ms([t for _, t in predicted])} | {_ms(measured)} | {1e3 * compute[slow]:.2f} "
                      f"(stage {slow}) | {1e3 * max(measured):.2f} (stage {measured.index(max(measured))}) | "
                      f"{max(measured) / compute[slow]:.3f} | {1e3 * s['wall_seconds'] / steps:.1f} |", flush=True)
                ratios[label] = (f"{1e3 * max(measured):.2f} / {1e3 * compute[slow]:.2f} = "
                                 f"{max(measured) / compute[slow]:.3f}")
    print("\nslowest stage, measured / predicted ms: " + "; ".join(f"{k}: {v}" for k, v in ratios.items()))


if __name__ == "__main__":
    sys.exit(main())
