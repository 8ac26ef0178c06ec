"""``plexus bench pipeline``: step rate, bubble and peak memory of each pipeline schedule
against ``torch.distributed.pipelining`` on gloo, measured in one run.

For every (schedule, K, M) row both contenders train the same model (built from the same
config and seed), cut at the same layers, on the same batches, with the same optimizer,
batch size, steps and one torch thread per process:

- ours: ``plexus.run`` with ``--stages K --microbatches M --schedule S`` (the real
  launcher, K stage processes);
- the reference: K processes started by ``plexus.cluster.spawn`` (its timeout ends a hung
  run), each joining a gloo default group, holding its slice of the model's
  ``nn.Sequential`` in a ``PipelineStage`` and running ``ScheduleGPipe`` or
  ``Schedule1F1B`` with ``n_microbatches=M`` and cross-entropy, then an optimizer step.
  The cut is the one our run reports (``summary.stages[i].nodes``), so the stages hold
  the same layers on both sides.

Both clocks run from the end of the warm-up steps to the end of the last step (setup and
warm-up excluded; torch's first step also infers the stages' shapes). The order of the
contenders is reversed on every repeat and the median of ``--repeats`` runs is kept.

Bubble: ours is the executor's own (the share of the pipelined part of a step each stage
spends waiting for a receive or a send, averaged over the stages). torch has no hook for
it, so the reference wraps the one function every torch schedule waits on,
``torch.distributed.pipelining.schedules._wait_batch_p2p`` (private; if it is gone the
column says "not measured"), and divides its seconds by those of ``schedule.step``: the
same definition. plexus's stage processes keep the memory they free for their next
allocations (``cluster.child.keep_freed_memory``); the reference's run with glibc's
defaults, as a torch user's would, unless ``--same-malloc``. Peak memory is ``ru_maxrss``
of each stage process on both sides
(``executor.peak_bytes``), which includes the interpreter, torch and the data set.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from plexus.bench import csv_list

__all__ = ["add_arguments", "main", "measure_torch"]

SCHEDULES = ("gpipe", "1f1b")
# Models whose layers sit in one top-level nn.Sequential (``net``), which the reference
# slices into stages; the others are not cut by this benchmark.
SEQUENTIAL_MODELS = ("deep-mlp", "mlp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="deep-mlp", help=f"model: {' or '.join(SEQUENTIAL_MODELS)} "
                                                            f"(default deep-mlp)")
    parser.add_argument("--dataset", default="digits", help="dataset (default digits)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of the model (default 1024)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch size per step (default 256)")
    parser.add_argument("--stages", default="2", help="comma-separated stage counts K (default 2)")
    parser.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts M (default 4,8)")
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated schedules (default gpipe,1f1b)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps before the clock starts, at least 1 (default 5)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each contender, alternated; the median is kept (default 3)")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="sgd learning rate, both sides (default 0.01: deep-mlp diverges at 0.1)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a torch run may take before it is stopped as hung (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data order (default 0)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")
    parser.add_argument("--same-malloc", action="store_true",
                        help="give the reference's processes plexus's malloc setting too (keep freed memory, "
                             "cluster/child.py); by default they run with glibc's, as a torch user's do")


def _ints(name: str, text: str, least: int) -> list[int]:
    from plexus.errors import ConfigError
    try:
        values = [int(v) for v in csv_list(text)]
    except ValueError:
        raise ConfigError(f"--{name} must be comma-separated integers, got {text!r}: pass --{name} 2,4") from None
    if not values or min(values) < least:
        raise ConfigError(f"--{name} must name integers of at least {least}, got {text!r}")
    return values


def _check(args: argparse.Namespace) -> tuple[list[int], list[int], list[str]]:
    from plexus.errors import ConfigError

    stages, microbatches = _ints("stages", args.stages, 2), _ints("microbatches", args.microbatches, 1)
    schedules = csv_list(args.schedules)
    if not schedules or any(s not in SCHEDULES for s in schedules):
        raise ConfigError(f"--schedules must name schedules among {', '.join(SCHEDULES)} (those both plexus and "
                          f"torch.distributed.pipelining run), got {args.schedules!r}")
    if args.model not in SEQUENTIAL_MODELS:
        raise ConfigError(f"--model {args.model}: the torch reference slices a model's nn.Sequential into stages, "
                          f"so the benchmark runs {' or '.join(SEQUENTIAL_MODELS)}")
    for m in microbatches:
        if args.batch_size % m:
            raise ConfigError(f"--microbatches {m} must divide --batch-size ({args.batch_size}), so every "
                              f"micro-batch holds the same samples on both sides")
    for name, least in (("steps", 1), ("warmup", 1), ("repeats", 1)):
        if getattr(args, name) < least:
            raise ConfigError(f"--{name} must be at least {least}, got {getattr(args, name)}"
                              + (" (torch's first step infers the stages' shapes; it is not timed)"
                                 if name == "warmup" else ""))
    return stages, microbatches, schedules


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from plexus.config import JobConfig
    from plexus.train.job import validate
    from plexus.train.runner import save_dataset

    stages, microbatches, schedules = _check(args)
    base = {"model": args.model, "dataset": args.dataset, "hidden": args.hidden, "batch_size": args.batch_size,
            "steps": args.warmup + args.steps, "eval_every": 0, "log_every": args.warmup, "lr": args.lr,
            "seed": args.seed, "threads": 1, "device": "cpu", "backend": "gloo"}
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="plexus-bench-pipeline-"))
    try:
        save_dataset(validate(JobConfig.from_flat(base)), root / "data")
        for k in stages:
            for m in microbatches:
                for schedule in schedules:
                    console.print(f"[dim]bench pipeline: {schedule}, K={k}, M={m}, {args.repeats} repeats[/dim]")
                    rows.append(_row(args, {**base, "stages": k, "microbatches": m, "schedule": schedule},
                                     root, console))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Console().print(_table(args, rows))
    if args.json:
        print(json.dumps(rows))
    return 0


def _row(args: argparse.Namespace, flat: dict[str, Any], root: Path, console) -> dict[str, Any]:
    """One (schedule, K, M) row: the median run of each side, or the line that says why
    a side has none."""
    from rich.markup import escape

    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    ours_error = torch_error = None
    name = f"{flat['schedule']}-k{flat['stages']}-m{flat['microbatches']}"
    for repeat in range(args.repeats):
        order = ["plexus", "torch"] if repeat % 2 == 0 else ["torch", "plexus"]
        for side in order:
            if side == "plexus" and ours_error is None:
                result = _run_ours(flat, root / f"{name}-r{repeat}", args.warmup)
                ours_error = result.get("error")
                if ours_error is None:
                    ours.append(result)
            elif side == "torch" and torch_error is None and ours:  # the cut comes from our run
                result = _run_torch(flat, ours[0]["nodes"], root, args.warmup, args.steps, args.timeout,
                                    args.same_malloc)
                torch_error = result.get("error")
                if torch_error is None:
                    theirs.append(result)
        if ours_error is not None and not ours:
            torch_error = torch_error or "not run: plexus gave no cut to copy"
            break
    samples = flat["batch_size"] * args.steps
    row: dict[str, Any] = {"schedule": flat["schedule"], "stages": flat["stages"],
                           "microbatches": flat["microbatches"], "plexus_error": ours_error,
                           "torch_error": torch_error if not theirs else None}
    for side, runs in (("plexus", ours), ("torch", theirs)):
        if runs:
            best = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]  # the median run
            row[f"{side}_samples_per_s"] = samples / statistics.median(r["seconds"] for r in runs)
            row[f"{side}_bubble"] = best["bubble"]
            row[f"{side}_peak_mib"] = [b / 2**20 for b in best["peak_bytes"]]
        else:
            row[f"{side}_samples_per_s"] = row[f"{side}_bubble"] = row[f"{side}_peak_mib"] = None
        row[f"{side}_runs_samples_per_s"] = [samples / r["seconds"] for r in runs]  # the spread behind the median
    row["plexus_bubble_predicted"] = ours[0]["bubble_predicted"] if ours else None
    both = row["plexus_samples_per_s"] and row["torch_samples_per_s"]
    row["ratio"] = row["plexus_samples_per_s"] / row["torch_samples_per_s"] if both else None
    if torch_error is not None and not theirs:
        console.print(f"[yellow]bench pipeline: torch {name}: {escape(torch_error)}[/yellow]")
    return row


def _one_line(text: str) -> str:
    """The last line of a failure's output that names an error, else its last line, its
    launcher prefix ``[worker 0] `` written ``worker 0: ``."""
    lines = [re.sub(r"^\[([^\]]+)\]\s*", r"\1: ", line.strip()) for line in text.splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    line = (named or lines or ["no output"])[-1]
    return line if len(line) <= 160 else line[:157] + "..."


def _run_ours(flat: dict[str, Any], out: Path, warmup: int) -> dict[str, Any]:
    """Our pipeline through ``plexus.run``: timed seconds from the output stage's events."""
    import plexus
    from plexus.errors import ConfigError, JobFailed
    from plexus.train.metrics import read_events

    try:
        summary = plexus.run({**flat, "out": str(out)})
    except ConfigError as e:  # a combination plexus refuses is this row's result, not the benchmark's end
        return {"error": f"refused: {_one_line(str(e))}"}
    except JobFailed as e:
        return {"error": f"failed: {_one_line(str(e))}"}
    if summary.get("status") not in (None, "ok", "completed") or "pipeline" not in summary:
        return {"error": f"failed: run ended {summary.get('status')!r} without a pipeline record"}
    times = {e["step"]: e["time"] for e in read_events(out, "train") if e["worker"] == 0}
    stages = summary["stages"]
    return {"seconds": times[flat["steps"]] - times[warmup], "bubble": summary["pipeline"]["bubble_measured"],
            "bubble_predicted": summary["pipeline"]["bubble_predicted"],
            "peak_bytes": [s["peak_memory_bytes"] for s in stages], "nodes": [s["nodes"] for s in stages]}


def _run_torch(flat: dict[str, Any], nodes: list[list[str]], root: Path, warmup: int, steps: int,
               timeout: float, same_malloc: bool = False) -> dict[str, Any]:
    """The reference in K spawned processes; a hang or a failure becomes the row's line.
    They run with glibc's malloc defaults, as a torch user's processes do, unless
    ``same_malloc``: every child of plexus's launcher keeps the memory it frees
    (``child.keep_freed_memory``), the spawned ones too."""
    from plexus.cluster.spawn import spawn
    from plexus.errors import JobFailed

    started = time.monotonic()
    try:
        results = spawn("plexus.bench.pipeline:measure_torch", flat["stages"],
                        {"flat": flat, "nodes": nodes, "data": str(root / "data"), "warmup": warmup,
                         "steps": steps}, timeout=timeout, comm_timeout=min(120.0, timeout),
                        env={} if same_malloc else {"PLEXUS_KEEP_FREED_MEMORY": "0"})
    except JobFailed as e:
        if e.exit_code == 124:
            return {"error": f"hung after {time.monotonic() - started:.0f} s"}
        return {"error": f"failed: {_one_line(str(e))}"}
    waits = [r["bubble"] for r in results]
    return {"seconds": max(r["seconds"] for r in results),
            "bubble": None if None in waits else sum(waits) / len(waits),
            "peak_bytes": [r["peak_bytes"] for r in results]}


def _table(args: argparse.Namespace, rows: list[dict[str, Any]]):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"plexus pipelines vs torch.distributed.pipelining (gloo): {args.model} {args.hidden} wide on "
                        f"{args.dataset}, batch {args.batch_size}, {args.steps} steps, median of {args.repeats}")
    for col in ("schedule", "K", "M", "plexus samples/s", "torch samples/s", "plexus / torch",
                "plexus bubble (predicted)", "torch bubble", "plexus peak MiB per stage", "torch peak MiB per stage"):
        table.add_column(col, justify="left" if col == "schedule" else "right")

    def rate(v):
        return "–" if v is None else f"{v:,.0f}"

    def mib(v):
        return "–" if v is None else " / ".join(f"{b:,.0f}" for b in v)

    for r in rows:
        ours = rate(r["plexus_samples_per_s"]) if r["plexus_error"] is None else escape(r["plexus_error"])
        theirs = rate(r["torch_samples_per_s"]) if r["torch_error"] is None else escape(r["torch_error"])
        bubble = "–" if r["plexus_bubble"] is None else \
            f"{r['plexus_bubble']:.3f} ({r['plexus_bubble_predicted']:.3f})"
        torch_bubble = "–" if r["torch_error"] else \
            ("not measured" if r["torch_bubble"] is None else f"{r['torch_bubble']:.3f}")
        table.add_row(r["schedule"], str(r["stages"]), str(r["microbatches"]), ours, theirs,
                      "–" if r["ratio"] is None else f"{r['ratio']:.3f}", bubble, torch_bubble,
                      mib(r["plexus_peak_mib"]), mib(r["torch_peak_mib"]))
    return table


# ---------------------------------------------------------------------------------------
# Inside each spawned process of the reference.

def measure_torch(group, flat: dict[str, Any], nodes: list[list[str]], data: str, warmup: int,
                  steps: int) -> dict[str, Any]:
    """Stage ``group.rank`` of the torch pipeline: its timed seconds, its bubble (or None
    where the schedule's wait function cannot be wrapped) and its peak memory."""
    import datetime as dt

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining import schedules as torch_schedules

    from plexus.config import JobConfig
    from plexus.parallel.executor import peak_bytes
    from plexus.strategies.base import make_optimizer
    from plexus.train.batches import GlobalBatches
    from plexus.train.models import build_model
    from plexus.train.runner import load_saved_dataset

    torch.set_num_threads(1)
    k, count = group.rank, group.size
    cfg = JobConfig.from_flat(flat)
    dataset = load_saved_dataset(Path(data))
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, dataset)  # the same initial model as our stages build
    stage_module = torch.nn.Sequential(*_stage_layers(model, nodes[k]))
    dist.init_process_group("gloo", store=dist.PrefixStore("bench/pipeline/", group.store), rank=k,
                            world_size=count, timeout=dt.timedelta(seconds=group.timeout))
    try:
        stage = PipelineStage(stage_module, k, count, torch.device("cpu"))

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[flat["schedule"]]
        schedule = kind(stage, n_microbatches=flat["microbatches"], loss_fn=loss)
        optimizer = make_optimizer(stage_module.parameters(), cfg.optim)
        waited = _wrap_waits(torch_schedules)
        batches = GlobalBatches(len(dataset.x_train), cfg.run.batch_size, cfg.run.seed)
        piped = 0.0
        dist.barrier()
        start = time.time()
        for step in range(warmup + steps):
            if step == warmup:
                dist.barrier()
                start, piped = time.time(), 0.0
                if waited is not None:
                    waited[0] = 0.0
            idx = batches.worker_indices(step, 0, 1)
            optimizer.zero_grad()
            began = time.time()
            if k == 0:
                schedule.step(dataset.x_train[idx])
            elif k == count - 1:
                losses: list[torch.Tensor] = []
                schedule.step(target=dataset.y_train[idx], losses=losses)
                value = float(sum(v.item() for v in losses) / len(losses))  # as ours reads its loss
                if value != value:
                    raise FloatingPointError(f"stage {k}: torch's training loss became {value} at step {step}")
            else:
                schedule.step()
            piped += time.time() - began
            optimizer.step()
        seconds = time.time() - start
    finally:
        dist.destroy_process_group()
    return {"seconds": seconds, "bubble": None if waited is None else waited[0] / piped,
            "peak_bytes": peak_bytes(torch.device("cpu"))}


def _stage_layers(model, names: list[str]) -> list[Any]:
    """The modules of one stage, by our plan's fx node names (``net_3`` is ``net.3``);
    a stage must be whole layers of the model, in order."""
    import torch.fx

    from plexus.errors import ConfigError

    targets = {n.name: n for n in torch.fx.symbolic_trace(model).graph.nodes}
    layers = []
    for name in names:
        node = targets.get(name)
        if node is None or node.op != "call_module":
            raise ConfigError(f"stage node {name!r} is not a layer of the model ({node.op if node else 'missing'}): "
                              f"the torch reference cuts only between the layers of an nn.Sequential")
        layers.append(model.get_submodule(node.target))
    return layers


def _wrap_waits(module) -> list[float] | None:
    """Count the seconds torch's schedules block in ``_wait_batch_p2p`` (its receives and
    send completions) in a one-element list; None if that private function is gone."""
    original = getattr(module, "_wait_batch_p2p", None)
    if original is None:
        return None
    waited = [0.0]

    def timed(*a, **kw):
        began = time.time()
        try:
            return original(*a, **kw)
        finally:
            waited[0] += time.time() - began

    module._wait_batch_p2p = timed
    return waited
