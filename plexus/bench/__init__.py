"""Benchmarks that print tables with ratios against a reference measured in the same run.

Each module offers ``add_arguments(parser)`` and ``main(args) -> int``; ``plexus bench NAME``
runs one.
"""
from __future__ import annotations

from importlib.util import find_spec

__all__ = ["BENCHMARKS", "csv_list"]

_ALL = {
    "ddp": ("samples/s of the allreduce strategy against DistributedDataParallel", "plexus.bench.ddp"),
    "collectives": ("time and bandwidth of every all-reduce algorithm against native", "plexus.bench.collectives"),
    "ps": ("push-pull rate of the parameter server against torch.distributed.rpc", "plexus.bench.ps"),
    "defaults": ("accuracy of every strategy with its own defaults against allreduce", "plexus.bench.defaults"),
    "startup": ("time to the first training step at 1, 2 and 4 workers against import torch",
                "plexus.bench.startup"),
    "pipeline": ("step rate, bubble and memory of each schedule against torch pipelining", "plexus.bench.pipeline"),
    "simulate": ("real seconds of 1,000- and 10,000-worker simulations against the 60 s goal",
                 "plexus.bench.simulate"),
}

def csv_list(text: str) -> list[str]:
    """A comma-separated flag's values (``--algorithms native,ring``), blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


# name -> (one-line summary, module)
BENCHMARKS = {name: entry for name, entry in _ALL.items() if find_spec(entry[1]) is not None}
