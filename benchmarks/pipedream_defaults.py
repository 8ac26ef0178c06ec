"""What an asynchronous pipeline (pipedream, pipedream-2bw) learns with its defaults: each
built-in model over 2-4 stages on digits (seeds 0 and 1) and mlp over 3 stages on mnist1d
(seeds 0 to 4, where runs differ more), at the default 300 steps and each model's default
rate (0.1; deep-mlp 0.05), beside the 1f1b pipeline with its defaults. Each schedule runs
with delay compensation (the default: momentum 0.9, a stage D steps behind at lr / (1 + 2D)
with its weights predicted D steps ahead) and without (--no-delay-compensation) under
momentum 0.5 (the default there) and 0.9.

    python benchmarks/pipedream_defaults.py        # about 5 minutes on 2 cores

Prints the markdown table of docs/results/pipedream-defaults.md: final test accuracy,
"x" where the run diverged (a stage's loss became non-finite), then each column's mean
on mnist1d and its ratio to 1f1b's.
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
SEEDS = {"digits": (0, 1), "mnist1d": (0, 1, 2, 3, 4)}
# (column, flags on top of the case's): each asynchronous schedule with its defaults, then
# without delay compensation at its default momentum there (0.5) and at the synchronous 0.9.
RUNS = [("1f1b (defaults)", {"microbatches": 4})]
for schedule, flags in (("pipedream", {"schedule": "pipedream"}),
                        ("2bw", {"schedule": "pipedream-2bw", "microbatches": 4})):
    RUNS += [(f"{schedule} (defaults)", flags),
             (f"{schedule} uncompensated m 0.5", {**flags, "delay_compensation": False}),
             (f"{schedule} uncompensated m 0.9", {**flags, "delay_compensation": False, "momentum": 0.9})]


def accuracy(flat: dict) -> float | None:
    with tempfile.TemporaryDirectory() as out:
        try:
            return plexus.run({**flat, "quiet": True, "eval_every": 0, "out": out,
                               "overwrite": True})["final_test_accuracy"]
        except JobFailed:
            return None


def main() -> None:
    head = ["dataset", "model", "stages", "seed", *(label for label, _ in RUNS)]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|" + "---:|" * len(RUNS)]
    mnist1d: list[list[float | None]] = []
    for dataset, model, stages in CASES:
        for seed in SEEDS[dataset]:
            base = dict(dataset=dataset, model=model, stages=stages, seed=seed)
            got = [accuracy({**base, **flags}) for _, flags in RUNS]
            if dataset == "mnist1d":
                mnist1d.append(got)
            cells = ["x" if a is None else f"{a:.3f}" for a in got]
            lines.append("| " + " | ".join([dataset, model, str(stages), str(seed), *cells]) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    # A diverged run counts as chance (0.1) in the mean.
    means = [sum(0.1 if a is None else a for a in column) / len(column) for column in zip(*mnist1d)]
    lines.append("| mnist1d | mlp | 3 | mean | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    lines.append("| mnist1d | mlp | 3 | x 1f1b | " + " | ".join(f"{m / means[0]:.2f}" for m in means) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
