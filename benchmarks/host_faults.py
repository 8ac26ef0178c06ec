"""Host faults across two real hosts: every strategy, a host killed or cut off mid-run.

Two network namespaces on a bridge (``tests/netns.py``: own address, host name and
/dev/shm each). Each job runs with the environment torchrun gives its processes (RANK,
WORLD_SIZE, MASTER_ADDR, ...), without torchrun's agent, so that each process's own exit
status and time of exit are seen; the agent's own waits are in the README. Once worker 0
has logged training, host 2 is either killed (every process in its namespace gets
SIGKILL) or cut off (its link goes down; its processes still run). The table gives, per
strategy and fault:

- outcome: ``failed`` (host 1's processes exit non-zero) or ``completed`` (the job goes on
  and worker 0 writes its summary), with the lost workers the summary names;
- detect: seconds from the fault to host 1's first line about it (a ``lost``
  warning, or the error line);
- the error line of host 1, as a user reads it;
- left: processes still alive on either host 30 s after the fault, for a job that failed
  (one that goes on is stopped by the benchmark once it has said what it lost).

    sudo python benchmarks/host_faults.py                    # root: it makes namespaces
    python benchmarks/host_faults.py --timeout 8 --only "ps asp"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "plexus-mpl"))

import netns  # noqa: E402

# name: (processes on host 1, on host 2; flags). workers-first: host 2 holds the last
# workers and the other roles (servers, aggregators, the coordinator) beside them.
B48 = ["--batch-size", "48"]  # 3 workers: the global batch splits evenly
PEER = ["--peer-timeout", "4"]  # servers drop a silent worker before --timeout (8 s) runs out
CONFIGS = {
    "allreduce ring": ([1, 2], ["--strategy", "allreduce", "--algorithm", "ring", *B48]),
    "allreduce native": ([1, 2], ["--strategy", "allreduce", "--algorithm", "native", *B48]),
    "ps bsp, server on host 1": ([2, 2], ["--strategy", "ps", "--consistency", "bsp", "--place", "roles-first", *B48, *PEER]),
    "ps asp, server on host 1": ([2, 2], ["--strategy", "ps", "--consistency", "asp", "--place", "roles-first", *B48, *PEER]),
    "ps asp, server on host 2": ([2, 2], ["--strategy", "ps", "--consistency", "asp", *B48, *PEER]),
    "tree-ps adv": ([3, 4], ["--strategy", "tree-ps", "--variant", "adv", *PEER]),
    "gossip": ([2, 2], ["--strategy", "gossip"]),
    "gossip --async (AD-PSGD)": ([2, 2], ["--strategy", "gossip", "--async"]),
    "local-sgd": ([1, 2], ["--strategy", "local-sgd", *B48]),
    "easgd, server on host 1": ([2, 1], ["--strategy", "easgd", "--place", "roles-first"]),
    "sandblaster, 2 replicas on host 2": ([3, 2], ["--strategy", "sandblaster", "--place", "roles-first"]),
}
FAULTS = ("killed", "link down")


def _reader(stream, lines: list[tuple[float, str]]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            lines.append((time.monotonic(), line.rstrip()))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def one(name: str, fault: str, timeout: float, port: int) -> dict:
    per_node, flags = CONFIGS[name]
    out = Path(tempfile.mkdtemp(prefix="host-fault-")) / "run"
    flags = [*flags, "--steps", "100000", "--log-every", "5", "--timeout", f"{timeout:g}"]
    row = {"strategy": name, "fault": fault}
    with netns.hosts(2) as (first, second):
        procs = netns.start_train([first, second], per_node, flags, out, port, agent=False)
        mine = procs[:per_node[0]]
        lines: list[list[tuple[float, str]]] = [[] for _ in procs]
        readers = [_reader(p.stderr, got) for p, got in zip(procs, lines)]
        try:
            deadline = time.monotonic() + 120
            metrics = out / "metrics.jsonl"
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    netns.kill_all(procs)
                    said = [text for got in lines for _, text in got if text.startswith("plexus:")]
                    return {**row, "outcome": "did not start", "line": (said or [""])[0][:220]}
                time.sleep(0.1)
            began = time.monotonic()
            (netns.kill_host if fault == "killed" else netns.link_down)(second)
            # A job that goes on runs 100000 steps: stop it once it has said what it lost and
            # worker 0 has logged 4 more lines of metrics since.
            end, logged = began + 4 * timeout + 30, None
            while any(p.poll() is None for p in mine) and time.monotonic() < end:
                heard = any(t >= began and "lost" in text for got in lines[:len(mine)] for t, text in got)
                if heard and logged is None:
                    logged = len(metrics.read_text().splitlines())
                if logged is not None and len(metrics.read_text().splitlines()) >= logged + 4:
                    break
                time.sleep(0.1)
            ended = [p.poll() for p in mine]
            for reader in readers[:len(mine)]:
                reader.join(timeout=2)
            said = [(t, text) for got in lines[:len(mine)] for t, text in got
                    if t >= began and ("lost" in text or text.startswith("plexus:"))]
            said.sort()
            errors = [text for _, text in said if text.startswith("plexus:")]
            row["detect_s"] = round(said[0][0] - began, 1) if said else None
            if all(code is not None and code != 0 for code in ended):
                row["outcome"] = "failed"
            elif all(code is None for code in ended):
                row["outcome"] = "goes on"
            else:
                row["outcome"] = f"exit {ended}"
            row["line"] = (errors or [text for _, text in said] or [""])[0][:220]
            if row["outcome"] == "failed":  # every process, on both hosts, must end by itself
                settle = time.monotonic() + 30
                while netns.pids(first) + netns.pids(second) and time.monotonic() < settle:
                    time.sleep(0.2)
                row["left"] = len(netns.pids(first)) + len(netns.pids(second))
        finally:
            netns.kill_all(procs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=8.0, help="the jobs' --timeout (peer timeout), seconds")
    parser.add_argument("--only", action="append", help="a configuration name (repeatable)")
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    why = netns.skip_reason()
    if why:
        raise SystemExit(f"host_faults: {why}")
    rows = []
    print("| strategy (hosts: processes) | fault | outcome | detect s | left | what host 1 says |")
    print("|---|---|---|---:|---:|---|")
    for name in args.only or list(CONFIGS):
        for fault in FAULTS:
            row = one(name, fault, args.timeout, args.port)
            rows.append(row)
            left = "" if row.get("left") is None else row["left"]
            detect = "" if row.get("detect_s") is None else row["detect_s"]
            print(f"| {name} {CONFIGS[name][0]} | {fault} | {row['outcome']} | {detect} | {left} | "
                  f"`{row['line']}` |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
