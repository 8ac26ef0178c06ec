"""Functions run inside spawned worker processes by the multi-process tests."""
from __future__ import annotations

import torch

from plexus.collectives import get_algorithm


def allreduce_check(group, algorithm: str, length: int, dtype: str, op: str = "sum") -> dict:
    """Each rank contributes rank-dependent values; compare with the exact sum."""
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1000 + group.rank)
    mine = torch.randn(length, generator=gen, dtype=torch.float64)
    expected = sum(torch.randn(length, generator=torch.Generator().manual_seed(1000 + r), dtype=torch.float64)
                   for r in range(group.size))
    if op == "mean":
        expected = expected / group.size
    tensor = mine.to(dt)
    get_algorithm(algorithm)(tensor, group, op)
    err = (tensor.double() - expected).abs().max().item() if length else 0.0
    return {"max_err": err, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}


def train_cases(group, cases: list[dict]) -> list[dict]:
    """Run the real training loop once per case (flat config with an ``out`` folder),
    each in its own store namespace, in the processes of an already spawned job; return
    this worker's final record of every case (bytes sent, strategy fields, ...)."""
    import torch.distributed as dist
    from pathlib import Path

    from plexus.cluster.rendezvous import ProcessInfo, store_get_json
    from plexus.config import JobConfig
    from plexus.train.runner import worker_main

    info = ProcessInfo.from_env()
    records = []
    for i, flat in enumerate(cases):
        cfg = JobConfig.from_flat({**flat, "workers": group.size})
        store = dist.PrefixStore(f"case{i}/", group.store)
        out = Path(flat["out"])
        out.mkdir(parents=True, exist_ok=True)
        worker_main(cfg, info, store, out)
        records.append(store_get_json(store, f"stats/worker/{info.rank}"))
    return records


def recv_timeout(group, timeout: float) -> str:
    """Rank 0 waits for a message rank 1 never sends; returns the error text."""
    from plexus.errors import CommTimeout

    if group.rank == 0:
        try:
            group.recv(torch.zeros(4), 1, timeout=timeout)
        except CommTimeout as exc:
            return f"{type(exc).__name__}: {exc} [peer={exc.peer}]"
        return "no error"
    return "idle"


def count_traffic(group, numel: int, messages: int) -> dict:
    """Ring of sends; returns this process's counters."""
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    out, into = torch.ones(numel), torch.empty(numel)
    for _ in range(messages):
        recv = group.irecv(into, left)
        group.isend(out, right).wait()
        recv.wait()
    return group.traffic.snapshot()


def timed_sends(group, numel: int, messages: int) -> float:
    """Seconds rank 0 takes to send ``messages`` tensors to rank 1 (with --net emulation)."""
    import time
    buf = torch.zeros(numel)
    start = time.perf_counter()
    for _ in range(messages):
        if group.rank == 0:
            group.send(buf, 1)
        else:
            group.recv(buf, 0)
    return time.perf_counter() - start


def link_pair(group) -> dict:
    """Two processes open a Link lazily by name and exchange one tensor each way."""
    from plexus.cluster.group import Link
    from plexus.cluster.traffic import Traffic
    me, peer = group.names[group.rank], group.names[1 - group.rank]
    traffic = Traffic()
    link = Link(group.store, me, peer, traffic=traffic, timeout=10)
    got = torch.empty(3)
    if group.rank == 0:
        link.send_to_peer(torch.tensor([1.0, 2.0, 3.0]))
        link.recv_from_peer(got)
    else:
        link.recv_from_peer(got)
        link.send_to_peer(got * 10)
    link.close()
    return {"got": got.tolist(), "traffic": traffic.snapshot(), "transport": link.transport}


def incast(group, numel: int) -> dict:
    """Ranks 1 and 2 send ``numel`` floats each to rank 0 at once, over shared memory (with
    --net): the seconds from a barrier until rank 0 has the first and the second."""
    import time
    group.connect([0] if group.rank else [1, 2], "shm")
    group.barrier()
    start = time.monotonic()
    if group.rank:
        group.send(torch.full((numel,), float(group.rank)), 0)
        return {}
    bufs = [torch.empty(numel), torch.empty(numel)]
    works = [group.irecv(bufs[0], 1), group.irecv(bufs[1], 2)]
    works[0].wait()
    first = time.monotonic() - start
    works[1].wait()
    return {"first": first, "second": time.monotonic() - start, "sums": [float(b.sum()) for b in bufs]}
