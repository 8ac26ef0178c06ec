"""Functions run inside spawned worker processes by the decentralized-training tests."""
from __future__ import annotations

from pathlib import Path

from torch import nn


def linear_model(data) -> nn.Module:
    """Softmax regression: a convex problem, for the consensus-distance test."""
    return nn.Sequential(nn.Flatten(), nn.Linear(data.input_shape[0], data.num_classes))


def train_cases(group, cases: list[dict]) -> list[dict]:
    """Run the real training loop once per case (flat config with an ``out`` folder), each
    in its own store namespace, in the processes of one spawned job; return this worker's
    final record of every case (bytes sent, consensus distance, ...)."""
    import torch.distributed as dist

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
