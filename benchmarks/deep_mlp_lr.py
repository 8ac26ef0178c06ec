"""deep-mlp's default learning rate: momentum SGD (0.9) at --lr 0.1 against 0.05 (and
0.03 for one process) on digits (one process at hidden 128 and 1024; the default four
allreduce workers; 3-stage pipelines: 1f1b, pipedream, pipedream-2bw) and mnist1d (one
process), seeds 0-2 (0-1 for the longer ones), 300 steps or one epoch.

    python benchmarks/deep_mlp_lr.py        # about 5 minutes on 2 cores

Prints one line per run: its flags and its final test accuracy, or "diverging" where the
run stopped on a diverging loss (docs/results/deep-mlp-lr.md has the table).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

RUNS = (
    [["--hidden", str(h), "--workers", "1", "--lr", lr, "--seed", str(s)]
     for h in (128, 1024) for lr in ("0.1", "0.05", "0.03") for s in range(3)]
    + [["--lr", lr, "--seed", str(s)] for lr in ("0.1", "0.05") for s in range(3)]
    + [["--dataset", "mnist1d", "--workers", "1", "--lr", lr, "--seed", str(s)] for lr in ("0.1", "0.05")
       for s in range(2)]
    + [["--stages", "3", *pipeline, "--lr", lr, "--seed", str(s), "--eval-every", "0"]
       for lr in ("0.1", "0.05") for s in range(2)
       for pipeline in (["--microbatches", "4"], ["--schedule", "pipedream"],
                        ["--schedule", "pipedream-2bw", "--microbatches", "4"])]
)


def main() -> None:
    env = {**os.environ, "PLEXUS_NO_REPORT": "1"}
    env.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
    with tempfile.TemporaryDirectory() as tmp:
        for flags in RUNS:
            done = subprocess.run([sys.executable, "-m", "plexus.cli", "train", "--model", "deep-mlp", *flags,
                                   "--out", os.path.join(tmp, "run"), "--overwrite", "--quiet"],
                                  capture_output=True, text=True, env=env, timeout=600)
            text = done.stdout + done.stderr
            found = re.search(r"final test accuracy [0-9.]+%", text)
            got = found.group(0) if found else "diverging" if "diverging" in text else f"failed ({done.returncode})"
            print(" ".join(flags), "->", got, flush=True)


if __name__ == "__main__":
    main()
