"""How long a connection to the job's store takes, as every process and every link of a
job opens one: c10d's client names the address it connects to with ``getnameinfo``. For a
loopback job that address is ``::ffff:127.0.0.1`` (c10d tries IPv6 first, with v4-mapped
addresses), which /etc/hosts does not list, so each connection asks DNS for the name of
127.0.0.1. Where DNS drops a query (on the development machine: some of those that
several processes send at once), that connection waits the resolver's timeout (5 s by
default) before the second try.

    python benchmarks/store_connect.py                 # about a minute where DNS drops some

Hosts a store as a job does (``host_store``: IPv4, loopback, so the store's own lookup of
each client is answered by /etc/hosts) and, in ``--processes`` child processes at once,
opens ``--connections`` connections each, one after the other, under each resolver setting in
turn (the environment as it is, and ``RES_OPTIONS=timeout:1``, which glibc reads at a
process's first lookup), in ``--rounds`` alternating rounds. Prints one markdown table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"as it is": None, "RES_OPTIONS=timeout:1": "timeout:1"}
SLOW = 0.5  # seconds: a connection this slow waited for the resolver


def _child(port: int, connections: int) -> None:
    import torch.distributed as dist
    seconds = []
    for _ in range(connections):
        start = time.perf_counter()
        dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=dt.timedelta(seconds=30))
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=50, help="connections per round (default 50)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per setting, alternating (default 4)")
    parser.add_argument("--processes", type=int, default=4,
                        help="processes connecting at the same time, as a job's do (default 4)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.connections)
        return
    from plexus.cluster.rendezvous import host_store, new_token
    store = host_store("127.0.0.1", 0, new_token(), 30.0)
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, options in SETTINGS.items():
            env = {**os.environ, **({} if options is None else {"RES_OPTIONS": options})}
            children = [subprocess.Popen([sys.executable, __file__, "--child", str(store.port),
                                          "--connections", str(args.connections)],
                                         env=env, stdout=subprocess.PIPE, text=True)
                        for _ in range(args.processes)]
            for child in children:
                out, _ = child.communicate(timeout=600)
                if child.returncode != 0:
                    raise SystemExit(f"a child failed with status {child.returncode}")
                times[name] += json.loads(out.strip().splitlines()[-1])
    print(f"| resolver setting | connections | median ms | p99 ms | max s | waited >= {SLOW:g} s | "
          f"seconds waited in those |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, seconds in times.items():
        seconds.sort()
        slow = [s for s in seconds if s >= SLOW]
        print(f"| {name} | {len(seconds)} | {1e3 * statistics.median(seconds):.1f} | "
              f"{1e3 * seconds[int(0.99 * (len(seconds) - 1))]:.1f} | {seconds[-1]:.2f} | "
              f"{len(slow)} ({100 * len(slow) / len(seconds):.0f} %) | {sum(slow):.1f} |")


if __name__ == "__main__":
    main()
