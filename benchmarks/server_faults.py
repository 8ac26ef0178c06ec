"""Faults in the server group, on this machine: each fault under each consistency model,
with the ledger on (``--ledger``: worker w's push of clock t carries w * 10^6 + t).

Per row: the outcome (``completed``, or ``failed`` with the error), the processes lost,
the takeover's times from the death's detection (a replica sees its primary's link break),
a drain's two phases (copy while training goes on, then the switch during which the
shard applies nothing),
pushes sent again to the new primary that it already held, the ledger's verdict, and the
final accuracy beside that of the same job with no fault.

    python benchmarks/server_faults.py                 # the whole table (about 2 minutes)
    python benchmarks/server_faults.py --only bsp
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))
os.environ.setdefault("PLEXUS_NO_REPORT", "1")

import plexus  # noqa: E402
from plexus.errors import JobFailed  # noqa: E402

BASE = dict(strategy="ps", dataset="digits", model="mlp", hidden=32, lr=0.05, batch_size=48, workers=3,
            servers=2, steps=60, eval_every=0, log_every=100, quiet=True, timeout=30, peer_timeout=5, seed=1,
            ledger=True)
CONSISTENCY = {"asp": {"consistency": "asp"}, "bsp": {"consistency": "bsp"},
               "ssp": {"consistency": "ssp", "staleness": 2}, "softsync": {"consistency": "softsync", "softsync": 2}}
# fault: the flags that make it. Kills fire at shard version 40 (a shard makes one update
# per push under asp and ssp, one per step under bsp) or at a worker's step 20.
FAULTS = {
    "none, --replication 1": {"replication": 1},
    "server 1 killed, --replication 1": {"replication": 1, "kill": "server:1@step=40"},
    "servers 0 and 1 killed together, --replication 2 (3 servers)": {"replication": 2, "servers": 3,
                                                                      "kill": "server:0@step=40,server:1@step=40"},
    "worker 2 killed, --replication 1": {"replication": 1, "kill": "worker:2@step=20"},
    "server 1 drained (planned), --replication 1": {"replication": 1, "drain": "server:1@step=40"},
    "server 1 drained (planned), no replication": {"replication": 0, "drain": "server:1@step=40"},
    "server 1 killed, no replication": {"replication": 0, "kill": "server:1@step=40"},
}
# tree-ps (4 workers, fanout 2: aggregators 0 and 1 under the root, two workers each):
# aggregator 0 dies after forwarding 40 pushes.
TREE = {f"tree-ps {v}": {"strategy": "tree-ps", "variant": v, "workers": 4, "servers": 1, "batch_size": 64}
        for v in ("adv", "adv-star")}
TREE_FAULTS = {"none": {}, "aggregator 0 killed": {"kill": "aggregator:0@step=40"}}


def _row(out: Path, consistency: str, fault: str, calm: float | None) -> tuple[str, float | None]:
    flags = {**BASE, **{**CONSISTENCY, **TREE}[consistency], **{**FAULTS, **TREE_FAULTS}[fault], "out": str(out)}
    try:
        s = plexus.run(flags)
    except JobFailed as exc:
        return f"| {consistency} | {fault} | failed: {exc} | | | | | | |", None
    lost = [f"{role} {r}" for role in ("server", "aggregator", "worker") for r in s.get(f"lost_{role}s", [])]
    recoveries = s.get("recoveries", [])
    takeover = ", ".join(f"shard {r['shard']}: {1000 * r['takeover_seconds']:.1f} / "
                         f"{1000 * r['first_update_seconds']:.0f} ms" for r in recoveries)
    # tree-ps: a dead aggregator's children re-attach (node, new parent, seconds it took).
    takeover = takeover or ", ".join(f"{e['node']} re-attached to {e['to']} in {1000 * e['seconds']:.0f} ms"
                                     for e in s.get("reattached") or []) or "-"
    # A worker's mean step beside the switch: the pause it can see should stay under two.
    timed = [(t, n) for t, n in zip(s["step_seconds_per_worker"], s["steps_per_worker"]) if t is not None]
    step = sum(t for t, _ in timed) / max(sum(n for _, n in timed), 1)
    moves = ", ".join(f"shard {m['shard']} to server {m['to']}: {1000 * m['copy_seconds']:.0f} / "
                      f"{1000 * m['switch_seconds']:.0f} ms (a step: {1000 * step:.0f} ms)"
                      for m in s.get("migrations", [])) or "-"
    acc = s["final_test_accuracy"]
    same = f"{100 * acc:.2f} % ({100 * calm:.2f} %)" if calm is not None else f"{100 * acc:.2f} %"
    verdict = s["ledger_verdict"].split(":")[0]
    return (f"| {consistency} | {fault} | {s['status']} | {', '.join(lost) or '-'} | {takeover} | {moves} | "
            f"{s.get('resent_pushes', 0)} | {verdict} | {same} |", acc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted({**CONSISTENCY, **TREE}), help="one consistency model, or tree")
    args = parser.parse_args()
    print("| consistency | fault | outcome | lost | takeover / first update after detection | drain: copy / "
          "switch | pushes sent again | ledger | final accuracy (no fault) |")
    print("|---|---|---|---|---|---|---:|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for consistency in [args.only] if args.only else [*CONSISTENCY, *TREE]:
            calm = None
            for i, fault in enumerate(TREE_FAULTS if consistency in TREE else FAULTS):
                line, acc = _row(Path(scratch) / f"{consistency}-{i}", consistency, fault, calm)
                if i == 0:
                    calm = acc
                print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
