"""``plexus bench ddp``: samples/s of the allreduce strategy against PyTorch's
``DistributedDataParallel`` on gloo, measured in one run.

For each worker count one job of P processes is spawned, and inside it every process
alternates the contenders on the same model, data, batch size, optimizer and steps: our
strategy through the real training loop (``worker_main``, one run per ``--algorithms``
entry) and a plain DDP loop that does the same per-step work (index the batch, forward,
backward, optimizer step, ``loss.item()``). Both use one torch thread per process, the same
bucket size, and the same clock: rank 0's time between the end of the warm-up steps and
the end of the last step (setup, warm-up and the final evaluation excluded). The order of
the contenders is reversed on every repeat and the median of ``--repeats`` runs is kept,
so the drift of a shared machine (other load, frequency changes) falls on both sides.

DDP runs with its defaults (``gradient_as_bucket_view=False``, 25 MiB buckets unless
``--bucket-mb`` says otherwise), i.e. what a user gets when they wrap a model in DDP.
Ours runs with the training default ``--transport auto``: the algorithms' messages
between workers on one machine over shared memory (``native`` uses gloo's connections,
as DDP does); ``--transport socket`` puts them on gloo's sockets too.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from plexus.bench import csv_list

__all__ = ["add_arguments", "main", "measure"]

# The reference's name among the contenders (ours are named by their algorithm).
DDP = "ddp"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from plexus.config import TRANSPORTS

    parser.add_argument("--models", default="mlp,cnn", help="comma-separated models (default mlp,cnn)")
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    parser.add_argument("--algorithms", default="native,ring",
                        help="comma-separated all-reduce algorithms of ours (default native,ring)")
    parser.add_argument("--dataset", default="mnist1d", help="dataset (default mnist1d)")
    parser.add_argument("--num-samples", type=int, default=None, help="samples to generate (dataset default)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the models (default 128)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run (default 300)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps before the clock starts (default 20)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each contender, alternated; the median is kept (default 3)")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket size in MiB, ours and DDP's (default 25)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data order (default 0)")
    parser.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                        help="what carries our algorithms' messages: auto (shared memory on one machine, the "
                             "training default), socket (gloo's, as DDP's) or shm")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")


def _check(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    from plexus.collectives import get_algorithm
    from plexus.errors import ConfigError
    from plexus.train.models import KNOWN_MODELS

    models, algorithms = csv_list(args.models), csv_list(args.algorithms)
    try:
        workers = [int(w) for w in csv_list(args.workers)]
    except ValueError:
        raise ConfigError(f"--workers must be comma-separated integers, got {args.workers!r}: "
                          f"pass --workers 2,4") from None
    for name, values in (("--models", models), ("--workers", workers), ("--algorithms", algorithms)):
        if not values:
            raise ConfigError(f"{name} must name at least one value, got nothing: see --help")
    for model in models:
        if model not in KNOWN_MODELS:
            raise ConfigError(f"--models: unknown model {model!r}: choose from {', '.join(KNOWN_MODELS)}")
    for algorithm in algorithms:
        get_algorithm(algorithm)
    for p in workers:
        if p < 1 or args.batch_size % p:
            raise ConfigError(f"--workers {p}: each worker count must be at least 1 and divide --batch-size "
                              f"({args.batch_size}), so every worker takes an equal share of the batch")
    for name in ("steps", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} must be {'non-negative' if name == 'warmup' else 'at least 1'}, "
                              f"got {getattr(args, name)}")
    return models, workers, algorithms


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from plexus.cluster.spawn import spawn
    from plexus.config import JobConfig
    from plexus.train.job import validate
    from plexus.train.models import build_model
    from plexus.train.runner import save_dataset

    models, workers, algorithms = _check(args)
    base = {"strategy": "allreduce", "dataset": args.dataset, "hidden": args.hidden,
            "batch_size": args.batch_size, "steps": args.warmup + args.steps, "eval_every": 0,
            "log_every": max(1, args.warmup or args.steps), "bucket_mb": args.bucket_mb, "seed": args.seed,
            "threads": 1, "device": "cpu", "backend": "gloo", "transport": args.transport}
    if args.num_samples is not None:
        base["num_samples"] = args.num_samples
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="plexus-bench-ddp-"))
    try:
        # Check every model against the data before anything starts; the children read one copy.
        data = validate(JobConfig.from_flat({**base, "model": models[0]}))
        for model in models[1:]:
            build_model(JobConfig.from_flat({**base, "model": model}).model, data)
        save_dataset(data, root / "data")
        for p in workers:
            console.print(f"[dim]bench ddp: {p} workers, {len(models)} models x {len(algorithms) + 1} "
                          f"contenders x {args.repeats} repeats[/dim]")
            # Generous: the children's own timeouts end a hung run first.
            budget = 300.0 + 2.0 * len(models) * (len(algorithms) + 1) * args.repeats * (args.warmup + args.steps)
            results = spawn("plexus.bench.ddp:measure", p,
                            {"base": base, "models": models, "algorithms": algorithms, "repeats": args.repeats,
                             "warmup": args.warmup, "steps": args.steps, "root": str(root / f"w{p}")},
                            timeout=budget, comm_timeout=120.0)
            rows += _rows(results[0], models, p, algorithms, args.batch_size * args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    table = Table(title=f"allreduce vs DistributedDataParallel (gloo): {args.dataset}, batch {args.batch_size}, "
                        f"{args.steps} steps, median of {args.repeats}")
    for col in ("model", "workers", "algorithm", "ours samples/s", "DDP samples/s", "ours / DDP"):
        table.add_column(col, justify="left" if col in ("model", "algorithm") else "right")
    for row in rows:
        table.add_row(row["model"], str(row["workers"]), row["algorithm"], f"{row['ours_samples_per_s']:,.0f}",
                      f"{row['ddp_samples_per_s']:,.0f}", f"{row['ratio']:.3f}")
    Console().print(table)
    if args.json:
        print(json.dumps(rows))
    return 0


def _rows(seconds: dict[str, dict[str, list[float]]], models: list[str], workers: int, algorithms: list[str],
          samples: int) -> list[dict[str, Any]]:
    """One row per (model, algorithm): median samples/s of ours, of DDP, and their ratio."""
    rows = []
    for model in models:
        ddp = samples / statistics.median(seconds[model][DDP])
        for algorithm in algorithms:
            ours = samples / statistics.median(seconds[model][algorithm])
            rows.append({"model": model, "workers": workers, "algorithm": algorithm,
                         "ours_samples_per_s": ours, "ddp_samples_per_s": ddp, "ratio": ours / ddp})
    return rows


# ---------------------------------------------------------------------------------------
# Inside each spawned process.

def measure(group, base: dict[str, Any], models: list[str], algorithms: list[str], repeats: int, warmup: int,
            steps: int, root: str) -> dict[str, dict[str, list[float]]]:
    """Run every contender ``repeats`` times per model; returns this rank's timed seconds
    as {model: {contender: [seconds per repeat]}}."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from plexus.cluster.rendezvous import ProcessInfo
    from plexus.config import JobConfig
    from plexus.train.runner import load_saved_dataset

    torch.set_num_threads(1)
    info = ProcessInfo.from_env()
    data = load_saved_dataset(Path(root).parent / "data")
    # DDP needs the default process group; it lives in its own namespace of the job's store.
    dist.init_process_group("gloo", store=dist.PrefixStore("bench/ddp/", group.store), rank=group.rank,
                            world_size=group.size, timeout=dt.timedelta(seconds=group.timeout))
    out: dict[str, dict[str, list[float]]] = {m: {c: [] for c in (DDP, *algorithms)} for m in models}
    run = 0
    try:
        for model in models:
            for repeat in range(repeats):
                order = [DDP, *algorithms]
                if repeat % 2:
                    order.reverse()
                for contender in order:
                    run += 1
                    cfg = JobConfig.from_flat({**base, "model": model, "workers": group.size,
                                               "algorithm": contender if contender != DDP else "native"})
                    if contender == DDP:
                        seconds = _time_ddp(cfg, data, info.rank, group.size, warmup)
                    else:
                        seconds = _time_ours(cfg, data, info, dist.PrefixStore(f"bench/run{run}/", group.store),
                                             Path(root) / f"run{run}", warmup)
                    out[model][contender].append(seconds)
    finally:
        dist.destroy_process_group()
    return out


def _time_ours(cfg, data, info, store, run_dir: Path, warmup: int) -> float | None:
    """Seconds of the timed steps of the real training loop, read from rank 0's events
    (the runner logs every ``warmup`` steps, so the end of the warm-up is one of them)."""
    from plexus.train.metrics import read_events
    from plexus.train.runner import worker_main

    run_dir.mkdir(parents=True, exist_ok=True)
    worker_main(cfg, info, store, run_dir if info.rank == 0 else None, data=data)
    if info.rank != 0:
        return None  # rank 0's clock is the one compared
    times = {e["step"]: e["time"] for e in read_events(run_dir, "train") if e["worker"] == 0}
    # With no warm-up the clock starts at the barrier: time 0 on the training clock.
    return times[cfg.run.steps] - times.get(warmup, 0.0)


def _time_ddp(cfg, data, rank: int, workers: int, warmup: int) -> float:
    """Seconds of the timed steps of a DDP loop doing what the runner's loop does per step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from plexus.strategies.base import make_optimizer
    from plexus.train.batches import GlobalBatches
    from plexus.train.evaluation import loss_fn
    from plexus.train.models import build_model

    device = torch.device("cpu")
    torch.manual_seed(cfg.run.seed)
    model = DistributedDataParallel(build_model(cfg.model, data).to(device), bucket_cap_mb=cfg.strategy.bucket_mb)
    optimizer = make_optimizer(model.parameters(), cfg.optim)
    batches = GlobalBatches(len(data.x_train), cfg.run.batch_size, cfg.run.seed)
    dist.barrier()
    start = time.time()
    for step in range(cfg.run.steps):
        idx = batches.worker_indices(step, rank, workers)
        x, y = data.x_train[idx].to(device, non_blocking=True), data.y_train[idx].to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"worker {rank}: DDP's training loss became {value} at step {step}")
        if step + 1 == warmup:
            start = time.time()
    seconds = time.time() - start
    del model
    return seconds
