"""The sweep behind the per-strategy defaults (``plexus/config/defaults.py``).

Every asynchronous configuration (ps under asp, ssp and softsync; tree-ps under each
variant and consistency it accepts) trains with each candidate optimizer setting, four
workers, the same steps and seed, on digits and on mnist1d; allreduce with the
synchronous defaults is the reference measured in the same run. The table gives the
final test accuracy and its ratio to the reference. easgd's targets sweep its elastic
moving rate alpha; ``--repeats`` runs every seed again, since asynchronous runs of one
seed differ from each other, and the table then shows the range as well as the mean.

    python benchmarks/defaults_sweep.py                      # every ps and tree-ps target
    python benchmarks/defaults_sweep.py --datasets digits --seeds 0 1
    python benchmarks/defaults_sweep.py --datasets mnist1d --steps 800 --seeds 0 1 --repeats 3 \
        --targets "easgd alpha .1" "easgd alpha .05" --candidates "sgd lr .1 m .9 (sync)"
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))

from plexus.config import JobConfig  # noqa: E402
from plexus.train.job import run_local  # noqa: E402

# The configurations whose defaults are in question: the flags that select each one.
TARGETS: dict[str, dict] = {
    "allreduce": {"strategy": "allreduce", "algorithm": "ring"},
    "ps asp": {"strategy": "ps", "consistency": "asp"},
    "ps ssp 2": {"strategy": "ps", "consistency": "ssp", "staleness": 2},
    "ps softsync 2": {"strategy": "ps", "consistency": "softsync", "softsync": 2},
    "tree-ps adv": {"strategy": "tree-ps", "variant": "adv"},
    "tree-ps adv-star": {"strategy": "tree-ps", "variant": "adv-star"},
    "tree-ps adv-star bsp": {"strategy": "tree-ps", "variant": "adv-star", "consistency": "bsp"},
    "tree-ps adv-star softsync": {"strategy": "tree-ps", "variant": "adv-star", "consistency": "softsync"},
    "tree-ps base": {"strategy": "tree-ps", "variant": "base"},
    **{f"easgd alpha {alpha:g}".replace("0.", "."): {"strategy": "easgd", "elastic_alpha": alpha}
       for alpha in (0.2, 0.1, 0.075, 0.05, 0.03)},
}

# Candidate optimizer settings: (label, flat keys).
CANDIDATES: dict[str, dict] = {
    "sgd lr .1 m .9 (sync)": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
    "sgd lr .1 m 0": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0},
    "sgd lr .2 m 0": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.0},
    "sgd lr .4 m 0 /stale": {"optimizer": "sgd", "lr": 0.4, "momentum": 0.0, "staleness_lr": True},
    "sgd lr .1 m .5": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.5},
    "sgd lr .05 m .9": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
    "sgd lr .15 m .9": {"optimizer": "sgd", "lr": 0.15, "momentum": 0.9},
    "sgd lr .2 m .5": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.5},
    "sgd lr .1 m .8": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.8},
    "sgd lr .2 m .8": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.8},
    "sgd lr .3 m .7": {"optimizer": "sgd", "lr": 0.3, "momentum": 0.7},
    "adagrad lr .05": {"optimizer": "adagrad", "lr": 0.05, "momentum": 0.0},
    "adagrad lr .1": {"optimizer": "adagrad", "lr": 0.1, "momentum": 0.0},
    "adagrad lr .02": {"optimizer": "adagrad", "lr": 0.02, "momentum": 0.0},
    "adagrad lr .03": {"optimizer": "adagrad", "lr": 0.03, "momentum": 0.0},
    "adagrad lr .07": {"optimizer": "adagrad", "lr": 0.07, "momentum": 0.0},
    "adam lr .001": {"optimizer": "adam", "lr": 0.001},
    "adam lr .003": {"optimizer": "adam", "lr": 0.003},
    "adam lr .0042": {"optimizer": "adam", "lr": 0.0042},
    "adam lr .005": {"optimizer": "adam", "lr": 0.005},
    "adam lr .006": {"optimizer": "adam", "lr": 0.006},
    "adam lr .01": {"optimizer": "adam", "lr": 0.01},
    "adam lr .02": {"optimizer": "adam", "lr": 0.02},
}

EASGD = [t for t in TARGETS if t.startswith("easgd")]
REFERENCE = {"strategy": "allreduce", "algorithm": "ring", "optimizer": "sgd", "lr": 0.1, "momentum": 0.9}


def train(flat: dict, out: str) -> tuple[float, float]:
    """(final test accuracy, wall seconds) of one run."""
    cfg = JobConfig.from_flat({**flat, "out": out, "quiet": True})
    started = time.monotonic()
    _, summary = run_local(cfg, sink=io.StringIO())
    return summary["final_test_accuracy"] or 0.0, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist1d"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every seed")
    parser.add_argument("--targets", nargs="+", default=[t for t in TARGETS if t not in ("allreduce", *EASGD)],
                        choices=list(TARGETS))
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    args = parser.parse_args(argv)
    workdir = tempfile.TemporaryDirectory(prefix="plexus-sweep-")  # the runs' directories, removed at the end
    root = workdir.name
    print(f"# defaults sweep, {time.strftime('%Y-%m-%d')}, workers {args.workers}, steps {args.steps}, "
          f"seeds {args.seeds}, repeats {args.repeats}\n")
    spread = args.repeats > 1 or len(args.seeds) > 1
    print("| dataset | configuration | optimizer setting | accuracy (mean over seeds) | / allreduce |"
          + (" lowest - highest run |" if spread else ""))
    print("|---|---|---|---:|---:|" + ("---:|" if spread else ""))
    runs = [s for _ in range(args.repeats) for s in args.seeds]
    n = 0

    def row(dataset: str, target: str, label: str, accs: list[float], ref_acc: float) -> str:
        acc = sum(accs) / len(accs)
        cells = f"| {dataset} | {target} | {label} | {100 * acc:.1f} % | {acc / ref_acc:.2f} |"
        return cells + (f" {100 * min(accs):.1f} - {100 * max(accs):.1f} % |" if spread else "")

    try:
        for dataset in args.datasets:
            common = {"dataset": dataset, "model": "mlp", "workers": args.workers, "steps": args.steps}
            # allreduce is deterministic: one run per seed.
            ref = [train({**common, **REFERENCE, "seed": s}, f"{root}/{n}-{s}")[0] for s in args.seeds]
            n += 1
            ref_acc = sum(ref) / len(ref)
            print(row(dataset, "allreduce ring", "sgd lr .1 m .9 (sync)", ref, ref_acc), flush=True)
            for target in args.targets:
                for label in args.candidates:
                    accs = []
                    for i, s in enumerate(runs):
                        flat = {**common, **TARGETS[target], **CANDIDATES[label], "seed": s}
                        try:
                            accs.append(train(flat, f"{root}/{n}-{i}")[0])
                        except Exception as exc:  # a failed run is a row, not the end of the sweep
                            print(f"<!-- {target} / {label}: {exc} -->", file=sys.stderr)
                            accs.append(0.0)
                    n += 1
                    print(row(dataset, target, label, accs, ref_acc), flush=True)
    finally:
        workdir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
