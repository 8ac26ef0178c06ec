"""Which faults each strategy survives, on this machine: every strategy with each process
it has killed once (a worker, a server, a primary with its replica, an aggregator, the
coordinator), and the outcome, continues or fails naming the process, as measured.

    python benchmarks/fault_matrix.py            # about three minutes
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import plexus  # noqa: E402
from plexus.errors import JobFailed  # noqa: E402

BASE = dict(dataset="digits", model="mlp", workers=4, batch_size=64, steps=200, eval_every=0, log_every=100,
            quiet=True, timeout=30, seed=1)
# (strategy as the table names it, its flags, fault, the fault's flags). Kills at a step
# where the process counts steps (workers; a ps server at its shard's version; an
# aggregator after N forwarded pushes), else 1 s after training starts, in a run long
# enough to be under way by then.
LONG = {"steps": 1500}
ROWS = [
    ("allreduce", {"strategy": "allreduce"}, "worker 1", {"kill": "worker:1@step=100"}),
    ("allreduce --elastic", {"strategy": "allreduce", "elastic": True}, "worker 1", {"kill": "worker:1@step=100"}),
    ("ps asp", {"strategy": "ps", "servers": 2}, "worker 1", {"kill": "worker:1@step=100"}),
    ("ps asp", {"strategy": "ps", "servers": 2}, "server 1", {"kill": "server:1@step=100"}),
    ("ps asp --replication 1", {"strategy": "ps", "servers": 2, "replication": 1}, "server 1",
     {"kill": "server:1@step=100"}),
    ("ps asp --replication 1", {"strategy": "ps", "servers": 3, "replication": 1},
     "primary and replica (servers 0, 1)", {"kill": "server:0@step=100,server:1@step=100"}),
    ("ps asp --replication 2", {"strategy": "ps", "servers": 3, "replication": 2},
     "primary and replica (servers 0, 1)", {"kill": "server:0@step=100,server:1@step=100"}),
    ("ps bsp", {"strategy": "ps", "servers": 2, "consistency": "bsp"}, "worker 1", {"kill": "worker:1@step=100"}),
    ("ps bsp --replication 1", {"strategy": "ps", "servers": 2, "consistency": "bsp", "replication": 1}, "server 1",
     {"kill": "server:1@step=100"}),
    ("tree-ps adv", {"strategy": "tree-ps"}, "worker 1", {"kill": "worker:1@step=100"}),
    ("tree-ps adv", {"strategy": "tree-ps"}, "aggregator 0", {"kill": "aggregator:0@step=100"}),
    ("tree-ps adv", {"strategy": "tree-ps", **LONG}, "server 0 (the root)", {"kill": "server:0@time=1"}),
    ("tree-ps adv-star", {"strategy": "tree-ps", "variant": "adv-star"}, "aggregator 0",
     {"kill": "aggregator:0@step=100"}),
    ("gossip", {"strategy": "gossip"}, "worker 1", {"kill": "worker:1@step=100"}),
    ("gossip --async", {"strategy": "gossip", "async_gossip": True}, "worker 1", {"kill": "worker:1@step=100"}),
    ("local-sgd", {"strategy": "local-sgd"}, "worker 1", {"kill": "worker:1@step=100"}),
    ("easgd", {"strategy": "easgd"}, "worker 1", {"kill": "worker:1@step=100"}),
    ("easgd", {"strategy": "easgd", **LONG}, "server 0 (the centre)", {"kill": "server:0@time=1"}),
    ("sandblaster", {"strategy": "sandblaster", "steps": 40}, "worker 1", {"kill": "worker:1@step=5"}),
    ("sandblaster", {"strategy": "sandblaster", "steps": 400}, "server 0", {"kill": "server:0@time=1"}),
    ("sandblaster", {"strategy": "sandblaster", "steps": 400}, "coordinator", {"kill": "coordinator:0@time=1"}),
]


def _lost(s: dict) -> str:
    names = [f"{role} {r}" for role in ("worker", "server", "aggregator") for r in s.get(f"lost_{role}s") or []]
    return ", ".join(names) or "none"


def _moved(s: dict) -> str:
    """tree-ps: the children of a dead aggregator, re-attached (node to its new parent)."""
    return ", ".join(f"{e['node']} to {e['to']}" for e in s.get("reattached") or []) or "-"


def main() -> None:
    print("| strategy | process killed | outcome | lost | re-attached | final accuracy |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for i, (strategy, flags, fault, kill) in enumerate(ROWS):
            try:
                s = plexus.run({**BASE, **flags, **kill, "out": str(Path(scratch) / str(i))})
            except JobFailed as exc:
                print(f"| {strategy} | {fault} | fails: {str(exc).split(';')[0]} | | | |", flush=True)
                continue
            print(f"| {strategy} | {fault} | continues | {_lost(s)} | {_moved(s)} | {100 * s['final_test_accuracy']:.2f} % |",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
