"""Benchmarks that print tables with ratios against a reference measured in the same run.

Each module offers ``add_arguments(parser)`` and ``main(args) -> int``; ``plexus bench NAME``
runs one.
"""
from __future__ import annotations

import statistics
import time
from importlib.util import find_spec

__all__ = ["BENCHMARKS", "csv_list", "machine_line", "reference_op_ms"]

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


def reference_op_ms(repeats: int = 200, copies: int = 1) -> float:
    """The median milliseconds of one reference op on one thread: a 32-row, 1024-wide
    ``x @ W.T``, the size of a micro-batch through one of the benchmarks' Linear layers.
    A shared machine's speed drifts (the development machine's took 0.75 to 2.8 ms in one
    day), so every benchmark prints it beside its table: rows measured at different speeds
    are not comparable, and ratios within one run are.

    ``copies``: that many threads run the op at once, each on one torch thread (the
    product releases the GIL), and the median is over all of them. On independent cores
    the time stays; the development machine's two cores took 1.5 to 2 times as long each
    when both ran it, so its processes slow each other whenever they compute at once."""
    import threading

    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples: list[float] = []
    lock = threading.Lock()

    def run() -> None:
        x, weight = torch.randn(32, 1024), torch.randn(1024, 1024)
        mine = []
        for i in range(repeats + 20):
            start = time.perf_counter()
            x @ weight.T
            if i >= 20:  # the first ones warm the caches and the allocator
                mine.append(time.perf_counter() - start)
        with lock:
            samples.extend(mine)

    try:
        workers = [threading.Thread(target=run) for _ in range(max(1, copies))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(threads)
    return 1e3 * statistics.median(samples)


def machine_line(before_ms: float) -> str:
    """One line saying how fast this machine was: ``reference_op_ms`` measured before a
    benchmark (``before_ms``) and now, after it, alone and with a copy on every core."""
    import torch

    from plexus.train.progress import usable_cores
    # The cores this process may run on (taskset pins benchmarks to some), not the machine's.
    cores = usable_cores()
    return (f"machine: {cores} core{'s' if cores != 1 else ''}, torch {torch.__version__}; reference op "
            f"(32 x 1024 by 1024 x 1024, one thread) {before_ms:.2f} ms before the benchmark, "
            f"{reference_op_ms():.2f} ms after, {reference_op_ms(copies=cores):.2f} ms with one on each core at once")


def csv_list(text: str) -> list[str]:
    """A comma-separated flag's values (``--algorithms native,ring``), blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


# name -> (one-line summary, module)
BENCHMARKS = {name: entry for name, entry in _ALL.items() if find_spec(entry[1]) is not None}
