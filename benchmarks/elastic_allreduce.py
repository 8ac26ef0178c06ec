"""Elastic all-reduce on this machine: a worker killed at P = 4 under each algorithm that
can re-form, the time from its death to the survivors' first completed step, and the
final model against the same job with no fault; beside it, the anchor: what restarting
every process costs (a fresh job's start-up, which is the least a torchrun-style restart
of all P processes pays), and the same kill without ``--elastic``.

    python benchmarks/elastic_allreduce.py          # about a minute
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import torch  # noqa: E402

import plexus  # noqa: E402
from plexus.errors import JobFailed  # noqa: E402
from plexus.strategies.elastic import ELASTIC_ALGORITHMS  # noqa: E402

BASE = dict(strategy="allreduce", dataset="digits", model="mlp", batch_size=64, workers=4, steps=200, eval_every=0,
            log_every=100, quiet=True, timeout=30, seed=1, save_model=True)
KILL = "worker:2@step=100"


def _gap(a: Path, b: Path) -> float:
    x, y = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return max(float((x[k] - y[k]).abs().max() / x[k].abs().max()) for k in x)


def main() -> None:
    print("| algorithm | fault | outcome | detected after death | group re-formed in | first step after death | "
          "final accuracy (no fault) | model gap to no fault |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for algorithm in ELASTIC_ALGORITHMS:
            calm = plexus.run({**BASE, "algorithm": algorithm, "elastic": True, "out": str(root / f"{algorithm}-0")})
            s = plexus.run({**BASE, "algorithm": algorithm, "elastic": True, "kill": KILL,
                            "out": str(root / f"{algorithm}-1")})
            [r] = s["elastic"]["regroups"]
            print(f"| {algorithm} | worker 2 killed at step 100, --elastic | {s['status']}, workers "
                  f"{s['elastic']['final_members']} | {1000 * r['detect_seconds']:.0f} ms | "
                  f"{1000 * r['reform_seconds']:.0f} ms | {1000 * r['first_step_seconds']:.0f} ms | "
                  f"{100 * s['final_test_accuracy']:.2f} % ({100 * calm['final_test_accuracy']:.2f} %) | "
                  f"{_gap(root / f'{algorithm}-0', root / f'{algorithm}-1'):.1e} |", flush=True)
        try:
            plexus.run({**BASE, "algorithm": "ring", "kill": KILL, "out": str(root / "fixed")})
            outcome = "completed"
        except JobFailed as exc:
            outcome = f"failed: {exc}"
        print(f"| ring | worker 2 killed at step 100, no --elastic | {outcome} | | | | | |")
        started = time.perf_counter()
        plexus.run({**BASE, "algorithm": "ring", "steps": 1, "save_model": False, "out": str(root / "restart")})
        print(f"| ring | anchor: a fresh job of 4 processes, 1 step (what restarting them all costs at least) | "
              f"completed | | | {1000 * (time.perf_counter() - started):.0f} ms | | |")


if __name__ == "__main__":
    sys.exit(main())
