"""The momentum an asynchronous pipeline (pipedream, pipedream-2bw) gets by default: each
built-in model over 2-4 stages on digits (and mlp on mnist1d), at the default 300 steps
and each model's default rate (0.1; deep-mlp's has been 0.05 since the table in
docs/results/pipedream-defaults.md was measured), under momentum 0.9 (the synchronous
default), 0.7 and 0.5, beside the 1f1b pipeline with its defaults, seeds 0 and 1.

    python benchmarks/pipedream_defaults.py        # about 5 minutes on 2 cores

Prints the markdown table of docs/results/pipedream-defaults.md: final test accuracy,
"x" where the run diverged (a stage's loss became non-finite).
"""
from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import plexus  # noqa: E402
from plexus.errors import JobFailed  # noqa: E402

CASES = [("digits", "deep-mlp", 2), ("digits", "deep-mlp", 3), ("digits", "deep-mlp", 4), ("digits", "cnn", 3),
         ("digits", "cnn", 4), ("digits", "mlp", 2), ("digits", "mlp", 4), ("mnist1d", "mlp", 3)]
MOMENTA = (0.9, 0.7, 0.5)
SEEDS = (0, 1)


def accuracy(flat: dict) -> str:
    with tempfile.TemporaryDirectory() as out:
        try:
            return f"{plexus.run({**flat, 'quiet': True, 'eval_every': 0, 'out': out, 'overwrite': True})['final_test_accuracy']:.3f}"
        except JobFailed:
            return "x"


def main() -> None:
    head = ["dataset", "model", "stages", "seed", "1f1b (defaults)"]
    head += [f"{schedule} m {m}" for schedule in ("pipedream", "2bw") for m in MOMENTA]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|" + "---:|" * (len(head) - 4)]
    for dataset, model, stages in CASES:
        for seed in SEEDS:
            base = dict(dataset=dataset, model=model, stages=stages, seed=seed)
            row = [dataset, model, str(stages), str(seed), accuracy({**base, "microbatches": 4})]
            row += [accuracy({**base, "schedule": "pipedream", "momentum": m}) for m in MOMENTA]
            row += [accuracy({**base, "schedule": "pipedream-2bw", "microbatches": 4, "momentum": m})
                    for m in MOMENTA]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
