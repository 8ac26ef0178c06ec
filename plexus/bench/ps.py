"""``plexus bench ps``: push-pull round trips per second and GB/s of our parameter server
against a reference parameter server built on ``torch.distributed.rpc``, measured in one run.

The reference follows PyTorch's parameter-server tutorials ("Implementing a Parameter
Server Using Distributed RPC Framework" and the batch-updating server of "Implementing
Batch RPC Processing Using Asynchronous Executions"): the server process holds the
parameters, and each worker calls a function on it with ``rpc`` that applies the
gradient under a lock and returns the updated parameters (TensorPipe backend, default
options). With S servers the reference holds one contiguous shard per server process and
a worker calls all S at once (``rpc_async``, then waits), as ours does.

Ours: ``plexus.ps`` servers (asp, plain SGD, the real protocol with its checks) and the
worker's ``PSClient.push_pull``: one fused push-and-pull per round trip, one header
and one payload each way per shard over Links, whose ``--transport`` is shared memory on
one machine by default (``cluster/shm.py``; ``--transport socket`` gives gloo's sockets).

A third column, ``link``, is what the same links carry when the servers do nothing but
echo the bytes back (same messages: a header and a payload each way): the ceiling of any
parameter server over them on this machine, against which ours can be judged.

For each (workers P, servers S), each contender and each repeat, one job of P + S fresh
processes is spawned (see ``measure``); inside it, for each size, the workers run
``--rounds`` timed round trips after ``--warmup`` untimed ones. The contenders' order
alternates from repeat to repeat. A round trip moves the gradient to the servers and the
parameters back: 2 x 4 N bytes for N float32 parameters. Rates are aggregates over the
workers: total round trips divided by the slowest worker's time, the median over
``--repeats`` runs (a shared machine drifts; alternating spreads the drift).
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from typing import Any

__all__ = ["add_arguments", "main", "measure"]

_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9}


def _size(text: str) -> int:
    from plexus.errors import ConfigError
    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * _UNITS[t[-1]]) if t and t[-1] in _UNITS else int(t)
    except ValueError:
        raise ConfigError(f"--sizes: {text!r} is not a parameter count like 1M or 250k") from None


def _ints(text: str, flag: str) -> list[int]:
    from plexus.errors import ConfigError
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} must list integers of at least 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1M,10M", help="parameter counts (default 1M,10M)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    parser.add_argument("--servers", default="1,2", help="server counts (default 1,2)")
    parser.add_argument("--rounds", type=int, default=20, help="timed round trips per worker (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed round trips first (default 3)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each contender, alternated; the median is kept (default 3)")
    from plexus.config import TRANSPORTS

    parser.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                        help="what carries our links (default auto: shared memory on one machine)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from plexus.cluster.spawn import spawn
    from plexus.errors import ConfigError

    sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    workers, servers = _ints(args.workers, "--workers"), _ints(args.servers, "--servers")
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes must list positive parameter counts, got {args.sizes!r}")
    if args.rounds < 1 or args.warmup < 0 or args.repeats < 1:
        raise ConfigError(f"--rounds and --repeats must be at least 1 and --warmup non-negative, got "
                          f"{args.rounds}, {args.repeats} and {args.warmup}")
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    for p in workers:
        for s in servers:
            console.print(f"[dim]bench ps: {p} workers, {s} servers[/dim]")
            budget = 300.0 + 2e-8 * sum(sizes) * (args.rounds + args.warmup) * p * 40
            # seconds[name][size]: per repeat, the slowest worker's time.
            seconds: dict[str, dict[int, list[float]]] = {name: {size: [] for size in sizes} for name in CONTENDERS}
            for k in range(args.repeats):
                for name in CONTENDERS if k % 2 == 0 else CONTENDERS[::-1]:
                    results = spawn("plexus.bench.ps:measure", p + s,
                                    {"contender": name, "workers": p, "servers": s, "sizes": sizes,
                                     "rounds": args.rounds, "warmup": args.warmup, "transport": args.transport},
                                    timeout=budget, comm_timeout=120.0)
                    for size in sizes:
                        seconds[name][size].append(max(r[str(size)] for r in results[:p]))
            for size in sizes:
                row = {"size": size, "workers": p, "servers": s, "transport": args.transport}
                for name in CONTENDERS:
                    rate = p * args.rounds / statistics.median(seconds[name][size])
                    row[f"{name}_rt_per_s"] = rate
                    row[f"{name}_gb_per_s"] = rate * 2 * 4 * size / 1e9
                row["ratio"] = row["ours_rt_per_s"] / row["rpc_rt_per_s"]
                rows.append(row)
    table = Table(title=f"parameter server push-pull vs torch.distributed.rpc: {args.rounds} round trips per "
                        f"worker after {args.warmup} warm-up, --transport {args.transport}")
    for col in ("params", "workers", "servers", "ours RT/s", "ours GB/s", "rpc RT/s", "rpc GB/s", "ours / rpc",
                "link GB/s", "ours / link"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['size'] / 1e6:g}M", str(r["workers"]), str(r["servers"]), f"{r['ours_rt_per_s']:,.1f}",
                      f"{r['ours_gb_per_s']:.2f}", f"{r['rpc_rt_per_s']:,.1f}", f"{r['rpc_gb_per_s']:.2f}",
                      f"{r['ratio']:.2f}", f"{r['link_gb_per_s']:.2f}",
                      f"{r['ours_rt_per_s'] / r['link_rt_per_s']:.2f}")
    Console().print(table)
    if args.json:
        print(json.dumps(rows))
    return 0


# ---------------------------------------------------------------------------------------
# Inside each spawned process: ranks < workers are workers, the rest servers.

CONTENDERS = ("ours", "rpc", "link")


def measure(group, contender: str, workers: int, servers: int, sizes: list[int], rounds: int, warmup: int,
            transport: str = "auto") -> dict[str, float]:
    """Per size, this worker's timed seconds for ``contender`` ({} on servers). Each run of
    each contender has fresh processes: the rpc reference slowed down from one
    ``init_rpc`` to the next in one process (12.6, 8.9, 7.0 round trips per second at 10M,
    2 workers, 2 servers), and more so after our runs in the same processes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if contender == "rpc":
        return _rpc(group, workers, servers, sizes, rounds, warmup)
    run = _ours if contender == "ours" else _link
    out = {}
    for size in sizes:
        store = dist.PrefixStore(f"bench/{size}/", group.store)
        seconds = run(store, group.rank, workers, servers, size, rounds, warmup, group.timeout, transport)
        if seconds is not None:
            out[str(size)] = seconds
    return out


def _ours(store, rank: int, workers: int, servers: int, size: int, rounds: int, warmup: int,
          timeout: float, transport: str = "auto") -> float | None:
    import torch

    from plexus.cluster.rendezvous import store_barrier
    from plexus.cluster.traffic import Traffic
    from plexus.config import JobConfig
    from plexus.ps.client import Heartbeat, PSClient
    from plexus.ps.protocol import Op
    from plexus.ps.server import ParameterServer

    cfg = JobConfig.from_flat({"strategy": "ps", "consistency": "asp", "workers": workers, "servers": servers,
                               "optimizer": "sgd", "momentum": 0.0, "lr": 1e-6, "batch_size": workers,
                               "timeout": timeout, "peer_timeout": min(30.0, timeout / 2), "transport": transport})
    if rank >= workers:
        ParameterServer(store, rank - workers, cfg, Traffic()).serve()
        return None
    beat = Heartbeat(store, rank, cfg.cluster.peer_timeout / 5)
    client = PSClient(store, rank, servers, numel=size, dtype=torch.float32, traffic=Traffic(), timeout=timeout,
                      transport=transport)
    try:
        client.connect()
        flat = torch.zeros(size)
        client.init(flat)
        grad = torch.full((size,), 1e-3)
        for clock in range(warmup):
            client.push_pull(grad, flat, clock, client.versions)
        store_barrier(store, "start", workers, timeout)
        start = time.perf_counter()
        for clock in range(warmup, warmup + rounds):
            client.push_pull(grad, flat, clock, client.versions)
        seconds = time.perf_counter() - start
        client.signal(Op.BYE, warmup + rounds)
        client.wait_drained(cfg.cluster.peer_timeout)
        client.signal(Op.SHUTDOWN)
    finally:
        client.close()
        beat.stop(timeout)
    return seconds


# --- the ceiling: the same links, servers that only echo --------------------------------

def _link(store, rank: int, workers: int, servers: int, size: int, rounds: int, warmup: int,
          timeout: float, transport: str = "auto") -> float | None:
    import threading

    import torch

    from plexus.cluster.group import Link
    from plexus.cluster.rendezvous import store_barrier
    from plexus.cluster.traffic import Traffic
    from plexus.ps.protocol import HEADER_LEN
    from plexus.ps.sharding import RangeSharding

    sharding = RangeSharding(size, servers)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if rank >= workers:
        server = rank - workers
        numel = sharding.size(server)

        def echo(worker: int) -> None:
            link = Link(store.clone(), f"server {server}", f"worker {worker}", traffic=Traffic(), timeout=timeout,
                        transport=transport)
            head, body = header.clone(), torch.empty(numel)
            for _ in range(warmup + rounds):
                link.recv_from_peer(head)
                link.recv_from_peer(body)
                link.send_to_peer(head)
                link.send_to_peer(body)
            link.close()

        threads = [threading.Thread(target=echo, args=(w,)) for w in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return None
    links = [Link(store, f"worker {rank}", f"server {s}", traffic=Traffic(), timeout=timeout, transport=transport)
             for s in range(servers)]
    grad, flat = torch.full((size,), 1e-3), torch.zeros(size)

    def round_trip() -> None:
        works = []
        for s, link in enumerate(links):
            start, stop = sharding.range(s)
            works += [link.irecv(header.clone(), link.peer_index), link.irecv(flat[start:stop], link.peer_index),
                      link.isend(header, link.peer_index), link.isend(grad[start:stop], link.peer_index)]
        for work in works:
            work.wait()

    for _ in range(warmup):
        round_trip()
    store_barrier(store, "start", workers, timeout)
    begin = time.perf_counter()
    for _ in range(rounds):
        round_trip()
    seconds = time.perf_counter() - begin
    for link in links:
        link.close()
    return seconds


# --- the reference: PyTorch's RPC parameter server ---------------------------------------

_SHARDS: dict[int, Any] = {}


def _ref_update_and_fetch(size, grad):
    """Runs on a reference server: apply SGD to its shard of the ``size`` model under a
    lock, return the shard."""
    with _SHARDS[size]["lock"]:
        _SHARDS[size]["params"].add_(grad, alpha=-1e-6)
        return _SHARDS[size]["params"]


def _rpc(group, workers: int, servers: int, sizes: list[int], rounds: int, warmup: int) -> dict[str, float]:
    import threading

    import torch
    import torch.distributed.rpc as rpc

    from plexus.ps.sharding import RangeSharding

    rank = group.rank
    names = [f"worker{r}" for r in range(workers)] + [f"ps{s}" for s in range(servers)]
    if rank >= workers:
        for size in sizes:
            start, stop = RangeSharding(size, servers).range(rank - workers)
            _SHARDS[size] = {"params": torch.zeros(stop - start), "lock": threading.Lock()}
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{_port_for(group)}",
                                              rpc_timeout=group.timeout)
    rpc.init_rpc(names[rank], rank=rank, world_size=workers + servers, rpc_backend_options=options)
    out = {}
    try:
        for size in sizes:
            if rank >= workers:
                group.barrier()
                continue
            sharding = RangeSharding(size, servers)
            grads = [torch.full((stop - start,), 1e-3) for start, stop in (sharding.range(s) for s in range(servers))]
            flat = torch.zeros(size)

            def round_trip() -> None:
                futures = [rpc.rpc_async(f"ps{s}", _ref_update_and_fetch, args=(size, grads[s]))
                           for s in range(servers)]
                for s, fut in enumerate(futures):
                    start, stop = sharding.range(s)
                    flat[start:stop] = fut.wait()

            for _ in range(warmup):
                round_trip()
            group.barrier()
            begin = time.perf_counter()
            for _ in range(rounds):
                round_trip()
            out[str(size)] = time.perf_counter() - begin
    finally:
        rpc.shutdown()
    return out


def _port_for(group) -> int:
    """A free port for the rpc rendezvous, chosen by rank 0 and shared through the store."""
    key = "bench/rpc-port"
    if group.rank == 0:
        group.store.set(key, str(_free_port()))
    group.store.wait([key])
    return int(group.store.get(key).decode())
