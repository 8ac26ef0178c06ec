"""Sandblaster L-BFGS: load balancing under a straggler, and Dean et al. 2012's comparison.

Part 1, load balancing. The same full-batch job (mnist1d, an MLP of width 256, so that a
pass over the 8000 samples is mostly compute; 4 replicas, 8 iterations) runs three ways:
no straggler; replica 0 four times slow (``--slow worker:0=4``) with the default small
units; and the same straggler with a static split (one unit of batch / N per replica, no
backup tasks), the way a fixed partition of the batch would wait for the slowest. The table gives the mean time of one evaluation (a pass over the batch), its
ratio to the no-straggler run, and the units each replica computed.

Part 2, Dean 2012's comparison (their figure 4): Sandblaster L-BFGS, Downpour SGD,
Downpour with server Adagrad and single-process SGD on the same model, data and seed,
each for about the same wall time. Accuracy against time and against machine-seconds
(processes x seconds, the cost the paper plots), as a table and a figure.

    python benchmarks/sandblaster.py                 # both parts; writes docs/results/
    python benchmarks/sandblaster.py --part balance
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))

import plexus  # noqa: E402
from plexus.train.metrics import read_events  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"

REPLICAS = 4
BALANCE = {
    "no straggler": {},
    "worker 0 4x slow, units": {"slow": "worker:0=4"},
    "worker 0 4x slow, static split": {"slow": "worker:0=4", "unit_size": 8000 // REPLICAS, "backup_after": 0.0},
}

COMPARE = {
    "Sandblaster L-BFGS (2 replicas)": {"strategy": "sandblaster", "workers": 2, "steps": 200},
    "Downpour SGD (ps asp, 2 workers)": {"strategy": "ps", "consistency": "asp", "workers": 2, "optimizer": "sgd",
                                         "steps": 600},
    "Downpour Adagrad (ps asp, 2 workers)": {"strategy": "ps", "consistency": "asp", "workers": 2,
                                             "optimizer": "adagrad", "steps": 600},
    "single-process SGD": {"strategy": "allreduce", "workers": 1, "steps": 1200},
}


def _processes(summary: dict) -> int:
    extra = {"sandblaster": 2, "ps": 1}.get(summary["strategy"], 0)  # shard + coordinator; one server
    return summary["workers"] + extra


def balance(folder: Path) -> list[str]:
    rows, base = [], None
    for label, flags in BALANCE.items():
        summary = plexus.run({"strategy": "sandblaster", "dataset": "mnist1d", "hidden": 256, "workers": REPLICAS,
                              "steps": 8, "eval_every": 0, "quiet": True,
                              "out": str(folder / label.replace(" ", "_")), **flags})
        seconds = summary["batch_seconds_mean"]
        base = base or seconds
        units = summary["units_by_worker"]
        fast = sum(units[str(r)] for r in range(1, REPLICAS)) / (REPLICAS - 1)
        rows.append(f"| {label} | {summary['unit_size']} | {seconds * 1000:.0f} | {seconds / base:.2f}x | "
                    f"{' / '.join(str(units[str(r)]) for r in range(REPLICAS))} | {units['0'] / fast:.2f} | "
                    f"{summary['duplicates_dropped']} |")
        print(rows[-1], flush=True)
    head = ["| run | unit size | evaluation (ms) | vs no straggler | units by replica 0 / 1 / 2 / 3 | "
            "replica 0 / fast mean | duplicates dropped |", "|---|---|---|---|---|---|---|"]
    return head + rows


def compare(folder: Path) -> tuple[list[str], dict]:
    curves, rows = {}, []
    for label, flags in COMPARE.items():
        out = folder / label.split(" (")[0].replace(" ", "_")
        summary = plexus.run({"dataset": "digits", "eval_every": 20 if flags["strategy"] == "sandblaster" else 50,
                              "quiet": True, "out": str(out), **flags})
        procs = _processes(summary)
        points = [(e["time"], e["test_accuracy"]) for e in read_events(out, "eval") if e.get("model", "global")
                  == "global"]
        curves[label] = {"points": points, "processes": procs}
        best = max(acc for _, acc in points)
        to_95 = next((t for t, acc in points if acc >= 0.95), None)
        rows.append(f"| {label} | {procs} | {summary['wall_seconds']:.1f} | {summary['final_test_accuracy']:.4f} | "
                    f"{best:.4f} | {'-' if to_95 is None else f'{to_95:.1f}'} | "
                    f"{'-' if to_95 is None else f'{to_95 * procs:.1f}'} |")
        print(rows[-1], flush=True)
    head = ["| run | processes | wall (s) | final accuracy | best | time to 95 % (s) | machine-seconds to 95 % |",
            "|---|---|---|---|---|---|---|"]
    return head + rows, curves


def plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, curve in curves.items():
        t = [p[0] for p in curve["points"]]
        acc = [p[1] for p in curve["points"]]
        left.plot(t, acc, label=label)
        right.plot([x * curve["processes"] for x in t], acc, label=label)
    for ax, xlabel in ((left, "seconds"), (right, "machine-seconds (processes x seconds)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, loc="lower right")
    fig.suptitle("digits, mlp: Sandblaster L-BFGS against Downpour (Dean et al. 2012, figure 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["balance", "compare", "both"], default="both")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    args = parser.parse_args()
    lines = ["# Sandblaster L-BFGS", "",
             f"Measured {time.strftime('%Y-%m-%d')} on this machine (2 cores), with "
             f"`python benchmarks/sandblaster.py --part {args.part}`.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("balance", "both"):
            lines += ["## Load balancing under a straggler", "",
                      "mnist1d, mlp of width 256, full batch (8000 samples), 4 replicas, 1 shard, 8 iterations; "
                      "an evaluation is one pass of the replicas over the batch.", ""]
            lines += balance(Path(tmp) / "balance") + [""]
        if args.part in ("compare", "both"):
            table, curves = compare(Path(tmp) / "compare")
            lines += ["## Dean et al. 2012's comparison", "",
                      "digits, mlp, each with its defaults; machine-seconds count every process (replicas, "
                      "servers, the coordinator).", ""] + table + ["", "![accuracy against time and "
                                                                       "machine-seconds](sandblaster.png)", ""]
            if not args.no_write:
                plot(curves, RESULTS / "sandblaster.png")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        (RESULTS / f"sandblaster{'' if args.part == 'both' else '-' + args.part}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
