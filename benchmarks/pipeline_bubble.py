"""The pipeline bubble, measured against each schedule's closed form: deep-mlp (hidden
1024, batch 256, one thread per process) cut into K stages, M micro-batches, 40 steps.

    python benchmarks/pipeline_bubble.py        # about a minute

Prints the markdown table of docs/results/pipeline.md.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import plexus  # noqa: E402

BASE = dict(dataset="digits", model="deep-mlp", hidden=1024, batch_size=256, threads=1, steps=40, eval_every=0,
            quiet=True, seed=1)
CASES = [(k, m, schedule) for k in (2, 3) for m in (4, 8) for schedule in ("gpipe", "1f1b")]


def main() -> None:
    lines = ["| stages | micro-batches | schedule | bubble predicted | simulated with measured op costs "
             "| bubble measured | per stage | gap to predicted | most micro-batches held | step ms |",
             "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for k, m, schedule in CASES:
            s = plexus.run({**BASE, "stages": k, "microbatches": m, "schedule": schedule,
                            "out": str(Path(tmp) / f"{k}-{m}-{schedule}")})
            p = s["pipeline"]
            per_stage = " / ".join(f"{x['bubble']:.3f}" for x in s["stages"])
            lines.append(f"| {k} | {m} | {schedule} | {p['bubble_predicted']:.3f} | {p['bubble_simulated']:.3f} "
                         f"| {p['bubble_measured']:.3f} "
                         f"| {per_stage} | {p['bubble_measured'] - p['bubble_predicted']:+.3f} "
                         f"| {' / '.join(str(x['max_in_flight']) for x in s['stages'])} "
                         f"| {1000 * s['wall_seconds'] / s['steps']:.1f} |")
            print(lines[-1], file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
