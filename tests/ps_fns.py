"""Functions run inside spawned processes by the parameter-server tests.

``ps_cases`` turns one spawned job of W + S processes into workers 0..W-1 and servers
0..S-1 and runs many small training jobs in it, one after another, each in its own store
namespace: a case with P <= W workers and S' <= S servers uses the first P and S' of them,
the others skip it. Starting Python and torch once for many cases keeps the multi-process
tests within minutes on a small machine.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch


def ps_cases(group, workers: int, servers: int, cases: list[dict[str, Any]], timeout: float = 60.0,
             aggregators: int = 0) -> list:
    """Run every case (a flat config with ``out``); worker 0 writes each case's summary.json.
    Processes are the workers, then the servers, then the aggregators (tree-ps)."""
    import torch.distributed as dist

    from plexus.cluster.rendezvous import ProcessInfo
    from plexus.config import JobConfig
    from plexus.strategies import strategy_class
    from plexus.train.data import load_dataset
    from plexus.train.runner import role_main, worker_main
    from plexus.train.summary import assemble_summary, collect_records

    base = ProcessInfo.from_env()
    me = group.rank
    role, rank = ("worker", me) if me < workers else ("server", me - workers) if me < workers + servers \
        else ("aggregator", me - workers - servers)
    datasets: dict[tuple, Any] = {}
    done = []
    for i, flat in enumerate(cases):
        cfg = JobConfig.from_flat(flat)
        counts = {"worker": cfg.cluster.workers, **dict(strategy_class(cfg.strategy.strategy).extra_roles(cfg))}
        count = counts.get(role, 0)
        if rank >= count:
            continue
        store = dist.PrefixStore(f"case{i}/", group.store)
        out = Path(flat["out"])
        out.mkdir(parents=True, exist_ok=True)
        info = dataclasses.replace(base, role=role, rank=rank, world_size=cfg.cluster.workers)
        if role != "worker":
            role_main(cfg, info, store, out)
        else:
            key = (cfg.data.dataset, cfg.data.num_samples, cfg.run.seed)
            if key not in datasets:
                datasets[key] = load_dataset(cfg.data, cfg.run.seed)
            worker_main(cfg, info, store, out, datasets[key])
            if rank == 0:
                summary = assemble_summary(cfg, collect_records(cfg, store, wait=timeout))
                (out / "summary.json").write_text(json.dumps(summary))
        done.append(i)
    return done


def malicious_join(host: str, port: int, token: str, attack: str, timeout: float = 30.0) -> str:
    """Join a running ps job as a new worker, then send server 0 a malformed request;
    returns what the server answered (its status name) or the error that ended the link."""
    from plexus.cluster.group import Link
    from plexus.cluster.rendezvous import ProcessInfo, connect_store
    from plexus.cluster.traffic import Traffic
    from plexus.config import JobConfig
    from plexus.errors import CommError
    from plexus.ps.protocol import HEADER_LEN, Header, Op, Status, decode, encode
    from plexus.strategies.downpour import DownpourStrategy

    probe = ProcessInfo(role="worker", rank=-1, world_size=0, master_addr=host, master_port=port, token=token)
    store = connect_store(probe, timeout)
    cfg = JobConfig.from_dict(DownpourStrategy.job_record(store, timeout)["config"])
    rank = DownpourStrategy.admit(store, cfg)
    link = Link(store, f"worker {rank}", "server 0", traffic=Traffic(), timeout=timeout)
    if attack == "unknown-op":
        message = encode(Header(op=Op.INIT, sender=rank, shard=0))
        message[1] = 99  # the op field
        message[-1] = _resign(message)
    elif attack == "long-header":
        message = torch.cat([encode(Header(op=Op.CLOCK, sender=rank, shard=0)), torch.zeros(8, dtype=torch.int64)])
    elif attack == "wrong-sender":
        message = encode(Header(op=Op.CLOCK, sender=rank + 5, shard=0))
    else:
        raise ValueError(attack)
    answer = torch.empty(HEADER_LEN, dtype=torch.int64)
    try:
        link.send_to_peer(message)
        link.recv_from_peer(answer)
        result = Status(decode(answer).status).name
    except CommError as exc:
        result = f"{type(exc).__name__}: {exc}"
    link.close()
    return result


def _resign(message: torch.Tensor) -> int:
    """The checksum a well-formed header with these fields would carry."""
    from plexus.ps.protocol import _checksum
    return _checksum(message[:-1].tolist())
