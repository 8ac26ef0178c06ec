"""Samples/s of plexus's allreduce strategy against torch's DistributedDataParallel (gloo).

The same as ``plexus bench ddp`` (the code is ``plexus/bench/ddp.py``): for each worker
count, one spawned job trains the same model on the same data, batches, optimizer and
steps with our strategy (each ``--algorithms`` entry) and with DDP, alternately, and
prints median samples/s and the ratio ours / DDP. Example:

    python benchmarks/ddp_throughput.py --models mlp,cnn --workers 2,4 --repeats 5
"""
from __future__ import annotations

import sys

from plexus.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ddp", *sys.argv[1:]]))
