"""``plexus bench defaults``: does every strategy learn with its own defaults?

Each configuration trains with only the flags that select it, plus ``--workers 4``, on
the same data, model, steps and seed as allreduce, which is the reference measured in the
same run; the table gives each final test accuracy and its ratio to the reference. The
goal is a ratio of at least 0.9 on every row (the test suite holds it there).

    plexus bench defaults                          # digits 300 steps, mnist1d 800 steps
    plexus bench defaults --datasets digits --steps 200 --only ps
"""
from __future__ import annotations

import argparse
import io
import time
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["MATRIX", "REFERENCE", "Row", "train_one", "run_matrix", "add_arguments", "main"]

_ALGORITHMS = ("ring", "rhd", "dbtree", "master", "ps", "hier", "native")


def _matrix() -> dict[str, dict[str, Any]]:
    """label -> the flags that select the configuration (nothing else)."""
    rows: dict[str, dict[str, Any]] = {}
    for algorithm in _ALGORITHMS:
        rows[f"allreduce --algorithm {algorithm}"] = {"strategy": "allreduce", "algorithm": algorithm}
    for consistency in ("bsp", "asp", "ssp", "softsync"):
        for optimizer in ("sgd", "adagrad", "adam"):
            rows[f"ps --consistency {consistency} --optimizer {optimizer}"] = {
                "strategy": "ps", "consistency": consistency, "optimizer": optimizer}
    for variant in ("base", "adv", "adv-star"):
        for consistency in ("bsp", "asp", "softsync"):  # tree-ps speaks n-softsync, not ssp
            rows[f"tree-ps --variant {variant} --consistency {consistency}"] = {
                "strategy": "tree-ps", "variant": variant, "consistency": consistency}
    for topology in ("ring", "torus", "exp", "complete"):
        rows[f"gossip --topology {topology}"] = {"strategy": "gossip", "topology": topology}
        rows[f"gossip --topology {topology} --async"] = {"strategy": "gossip", "topology": topology,
                                                         "async_gossip": True}
    rows["local-sgd --period 8"] = {"strategy": "local-sgd", "period": 8}
    rows["local-sgd --adaptive"] = {"strategy": "local-sgd", "adaptive": True}
    rows["easgd"] = {"strategy": "easgd"}
    return rows


MATRIX = _matrix()
REFERENCE = "allreduce --algorithm ring"
# Steps per dataset: mnist1d's runs at 300 steps are still on the steep part of their curves.
DEFAULT_STEPS = {"digits": 300, "mnist1d": 800}


@dataclass(frozen=True)
class Row:
    dataset: str
    label: str
    accuracy: float | None  # None: the run failed
    ratio: float | None
    health: str
    seconds: float
    error: str | None = None


def train_one(dataset: str, label: str, out: str, *, workers: int = 4, steps: int = 300, seed: int = 0
              ) -> dict[str, Any]:
    """The summary of configuration ``label`` trained with only its own flags (and the
    common ones: dataset, model, workers, steps, seed)."""
    from plexus.config import JobConfig
    from plexus.train.job import run_local
    flags = {**MATRIX[label], "dataset": dataset, "model": "mlp", "workers": workers, "steps": steps, "seed": seed}
    cfg = JobConfig.from_flat({**flags, "out": out, "quiet": True, "eval_every": 0}, {k: "flag" for k in flags})
    return run_local(cfg, sink=io.StringIO())[1]


def run_matrix(datasets: list[str], labels: list[str], *, workers: int = 4, steps: int = 300, seed: int = 0,
               root: str | None = None) -> Iterator[Row]:
    """Train the reference, then each configuration in ``labels``, on each dataset; the run
    directories go under ``root``, by default a temporary folder removed at the end."""
    if root is None:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="plexus-defaults-") as tmp:
            yield from run_matrix(datasets, labels, workers=workers, steps=steps, seed=seed, root=tmp)
        return
    for dataset in datasets:
        reference = None
        for n, label in enumerate([REFERENCE] + [x for x in labels if x != REFERENCE]):
            started = time.monotonic()
            try:
                summary = train_one(dataset, label, f"{root}/{dataset}-{n:02d}", workers=workers, steps=steps,
                                    seed=seed)
            except Exception as exc:  # a failed configuration is a row, not the end of the table
                yield Row(dataset, label, None, None, "failed", time.monotonic() - started, str(exc))
                continue
            acc = summary["final_test_accuracy"]
            if label == REFERENCE:
                reference = acc
            ratio = acc / reference if reference else None
            yield Row(dataset, label, acc, ratio, summary["health"], time.monotonic() - started)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist1d"])
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per worker (default: 300 on digits, 800 on mnist1d, whose "
                             "runs at 300 steps are still on the steep part of their curves)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="keep the rows whose label contains this text")


def main(args: argparse.Namespace) -> int:
    from plexus.errors import ConfigError
    from plexus.train.data import check_dataset
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}: pass --workers 4")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}: leave it out for each dataset's default")
    for dataset in args.datasets:
        check_dataset(dataset, "--datasets")
    labels = [label for label in MATRIX if args.only in label]
    if not labels:
        raise ConfigError(f"--only {args.only!r} matches no configuration: pass part of a label, e.g. --only ps")
    steps = {d: args.steps or DEFAULT_STEPS.get(d, 300) for d in args.datasets}
    print(f"plexus bench defaults, {time.strftime('%Y-%m-%d')}: --workers {args.workers}, steps "
          f"{', '.join(f'{d} {n}' for d, n in steps.items())}, --seed {args.seed}, model mlp; "
          f"reference {REFERENCE}\n")
    print("| dataset | configuration (only these flags) | test accuracy | / allreduce | health |")
    print("|---|---|---:|---:|---|")
    worst = None
    rows = (row for d in args.datasets
            for row in run_matrix([d], labels, workers=args.workers, steps=steps[d], seed=args.seed))
    for row in rows:
        acc = "failed" if row.accuracy is None else f"{100 * row.accuracy:.1f} %"
        ratio = "–" if row.ratio is None else f"{row.ratio:.2f}"
        print(f"| {row.dataset} | `{row.label}` | {acc} | {ratio} | {row.health} |", flush=True)
        if row.label != REFERENCE:
            worst = min(worst if worst is not None else 9.0, row.ratio or 0.0)
    if worst is not None:
        print(f"\nlowest ratio {worst:.2f} (goal: at least 0.90)")
    return 0
