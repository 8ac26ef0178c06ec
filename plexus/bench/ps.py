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

For each (workers P, servers S) one job of P + S processes is spawned; inside it, for
each size, the contenders run ``--rounds`` timed round trips per worker after
``--warmup`` untimed ones, in an order that alternates from size to size. A round trip moves the gradient to the
servers and the parameters back: 2 x 4 N bytes for N float32 parameters. Rates are
aggregates over the workers: total round trips divided by the slowest worker's time, the
median over ``--repeats`` runs (a shared machine drifts; alternating spreads the drift).
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
    parser.add_argument("--transport", default="auto", choices=["auto", "socket", "shm"],
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
            budget = 300.0 + 2e-8 * sum(sizes) * (args.rounds + args.warmup) * p * 40 * args.repeats
            results = spawn("plexus.bench.ps:measure", p + s,
                            {"workers": p, "servers": s, "sizes": sizes, "rounds": args.rounds,
                             "warmup": args.warmup, "repeats": args.repeats, "transport": args.transport},
                            timeout=budget, comm_timeout=120.0)
            for size in sizes:
                row = {"size": size, "workers": p, "servers": s, "transport": args.transport}
                for name in ("ours", "rpc", "link"):
                    # Per repeat the slowest worker's time; then the median over repeats.
                    seconds = statistics.median(max(r[str(size)][name][k] for r in results[:p])
                                                for k in range(args.repeats))
                    rate = p * args.rounds / seconds
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

def measure(group, workers: int, servers: int, sizes: list[int], rounds: int, warmup: int, repeats: int,
            transport: str = "auto") -> dict[str, dict[str, list[float]]]:
    """Per size and contender, this worker's timed seconds of each repeat ({} on servers)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict[str, dict[str, list[float]]] = {str(size): {"ours": [], "rpc": [], "link": []} for size in sizes}
    runs = [(size, k) for k in range(repeats) for size in sizes]
    for i, (size, k) in enumerate(runs):
        order = ["ours", "rpc", "link"] if i % 2 == 0 else ["link", "rpc", "ours"]
        for contender in order:
            store = dist.PrefixStore(f"bench/{size}/{k}/{contender}/", group.store)
            if contender == "ours":
                seconds = _ours(store, group.rank, workers, servers, size, rounds, warmup, group.timeout,
                                transport)
            elif contender == "link":
                seconds = _link(store, group.rank, workers, servers, size, rounds, warmup, group.timeout,
                                transport)
            else:
                seconds = _rpc(group.rank, workers, servers, size, rounds, warmup, i, group)
            if seconds is not None:
                out[str(size)][contender].append(seconds)
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

_SHARD: dict[str, Any] = {}


def _ref_update_and_fetch(grad):
    """Runs on a reference server: apply SGD to its shard under a lock, return the shard."""
    with _SHARD["lock"]:
        _SHARD["params"].add_(grad, alpha=-1e-6)
        return _SHARD["params"]


def _rpc(rank: int, workers: int, servers: int, size: int, rounds: int, warmup: int, run: int,
         group) -> float | None:
    import threading

    import torch
    import torch.distributed.rpc as rpc

    from plexus.ps.sharding import RangeSharding

    names = [f"worker{r}" for r in range(workers)] + [f"ps{s}" for s in range(servers)]
    sharding = RangeSharding(size, servers)
    if rank >= workers:
        start, stop = sharding.range(rank - workers)
        _SHARD.update(params=torch.zeros(stop - start), lock=threading.Lock())
    # Every rpc group needs its own rendezvous: the spawn group's store under a fresh prefix.
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{_port_for(group, run)}",
                                              rpc_timeout=group.timeout)
    rpc.init_rpc(names[rank], rank=rank, world_size=workers + servers, rpc_backend_options=options)
    seconds = None
    try:
        if rank < workers:
            grads = [torch.full((stop - start,), 1e-3) for start, stop in (sharding.range(s) for s in range(servers))]
            flat = torch.zeros(size)

            def round_trip() -> None:
                futures = [rpc.rpc_async(f"ps{s}", _ref_update_and_fetch, args=(grads[s],)) for s in range(servers)]
                for s, fut in enumerate(futures):
                    start, stop = sharding.range(s)
                    flat[start:stop] = fut.wait()

            for _ in range(warmup):
                round_trip()
            group.barrier()
            begin = time.perf_counter()
            for _ in range(rounds):
                round_trip()
            seconds = time.perf_counter() - begin
        else:
            group.barrier()
    finally:
        rpc.shutdown()
    return seconds


def _port_for(group, run: int) -> int:
    """A free port for this run's rpc rendezvous, chosen by rank 0 and shared through the store."""
    key = f"bench/rpc-port/{run}"
    if group.rank == 0:
        group.store.set(key, str(_free_port()))
    group.store.wait([key])
    return int(group.store.get(key).decode())
