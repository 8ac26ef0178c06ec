"""What the strategies that keep one replica per worker share (gossip, local-sgd, easgd).

Measuring such a run must not change it. The global model of D-PSGD or local SGD is the
average of the replicas, which exists nowhere until it is computed; ``ReplicaProbe``
computes it (and the consensus distance) over a *second* group of the workers that has
its own byte counters and no ``--net`` delay, so that ``bytes_sent`` and the emulated
network describe the algorithm alone (what the tests check against degree x model bytes
and against ``collectives/cost.py``). Evaluation thus costs the training clock one small
all-reduce per snapshot and nothing else.

Asynchronous strategies cannot take a collective without stalling on their slowest
worker; they agree on stopping through a flag in the job's store (``store_agree``), and
at the end each worker leaves its final replica in the store (``leave_replica``), from
which worker 0 computes the average and the consensus distance of the final replicas of
every worker that finished (``collect_replicas``, ``final_consensus``), waiting at most
the job's timeout, and not for workers known to be lost.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from plexus.cluster.group import Group
from plexus.cluster.traffic import Traffic
from plexus.decentral.averaging import FlatParameters, consensus_distance
from plexus.strategies.base import Context

__all__ = ["ReplicaProbe", "store_agree", "replica_summary", "leave_replica", "collect_replicas",
           "final_consensus"]

logger = logging.getLogger(__name__)

# Final replicas travel through the store as raw bytes (no pickle); above this size they
# are not sent, and the average is worker 0's own replica.
_FINAL_LIMIT_BYTES = 64 << 20
# numpy has no bfloat16: such replicas are not sent either.
_RAW_DTYPES = (torch.float32, torch.float64, torch.float16)


class ReplicaProbe:
    """The averaged global model and the consensus distance of synchronous replicas.

    Every worker must construct it (it forms a group) and call ``average`` together.
    """

    def __init__(self, ctx: Context, name: str, model: torch.nn.Module) -> None:
        size = ctx.info.world_size
        self.group = Group(ctx.store, f"{name}-probe", ctx.info.rank, [f"worker {r}" for r in range(size)],
                           traffic=Traffic(), timeout=ctx.cfg.cluster.timeout, backend=ctx.backend, net=None)
        self.holder = copy.deepcopy(model)
        self.holder_flat = FlatParameters(self.holder)
        self.last: dict[str, float] = {}

    def average(self, flat: torch.Tensor) -> dict[str, float]:
        """Write the mean of every worker's ``flat`` into ``holder`` and return the
        consensus distance (1/P) sum_i ||x_i - x_bar|| (absolute, and relative to
        ||x_bar||), summed in float64 so that it reads 0 when the replicas are equal."""
        total = flat.detach().double()
        self.group.all_reduce_backend(total, count_bytes=0).wait()
        mean = total.div_(self.group.size)
        self.holder_flat.flat.copy_(mean)
        dist_ = (flat.detach().double() - mean).norm().reshape(1)
        self.group.all_reduce_backend(dist_, count_bytes=0).wait()
        distance = float(dist_.item()) / self.group.size
        norm = float(mean.norm())
        self.last = {"consensus_distance": distance,
                     "consensus_distance_relative": distance / norm if norm > 0 else 0.0}
        return dict(self.last)

    def agree(self, flag: bool, device: torch.device) -> bool:
        """True on every worker when any worker's flag is true."""
        votes = torch.tensor([1.0 if flag else 0.0], device=device)
        self.group.all_reduce_backend(votes, count_bytes=0).wait()
        return bool(votes.item() > 0)

    def close(self) -> None:
        self.group.close()


def store_agree(store: dist.Store, key: str, flag: bool) -> bool:
    """Stop flags without a barrier: a worker that wants to stop raises ``key`` in the
    store; every worker stops once it sees it (at its own next check)."""
    if flag:
        store.set(key, "1")
        return True
    return store.check([key])


def replica_summary(records: dict[str, Any]) -> dict[str, Any]:
    """Summary keys every replica strategy reports: the accuracy of the global (averaged or
    centre) model and of worker 0's own replica, from the evaluating worker's record."""
    ev = records.get("eval", {})
    return {"averaged_test_accuracy": ev.get("final_test_accuracy"),
            "worker0_test_accuracy": ev.get("replica_test_accuracy"),
            "worker0_test_loss": ev.get("replica_test_loss")}


def leave_replica(store: dist.Store, prefix: str, rank: int, flat: torch.Tensor) -> bool:
    """Leave this worker's final replica under ``prefix/final/rank`` in the store; False
    (nothing left) when it is too large or of a dtype without raw bytes in numpy."""
    mine = flat.detach().cpu()
    if mine.numel() * mine.element_size() > _FINAL_LIMIT_BYTES or mine.dtype not in _RAW_DTYPES:
        return False
    store.set(f"{prefix}/final/{rank}", mine.contiguous().numpy().tobytes())
    return True


def collect_replicas(store: dist.Store, prefix: str, mine: torch.Tensor, size: int, timeout: float,
                     gone: Callable[[int], bool]) -> dict[int, torch.Tensor]:
    """Worker 0's own replica ``mine`` and the final replicas the other ``size - 1`` workers
    left (``leave_replica``), skipping those for which ``gone(rank)`` says they were lost;
    waits at most ``timeout`` seconds for the rest, then averages without them."""
    replicas = {0: mine.detach().cpu().clone()}
    if mine.dtype not in _RAW_DTYPES or mine.numel() * mine.element_size() > _FINAL_LIMIT_BYTES:
        return replicas
    dtype = replicas[0].numpy().dtype
    pending, deadline = set(range(1, size)), time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for r in sorted(pending):
            if store.check([f"{prefix}/final/{r}"]):
                raw = store.get(f"{prefix}/final/{r}")
                replicas[r] = torch.from_numpy(np.frombuffer(raw, dtype=dtype).copy())
                pending.discard(r)
            elif gone(r):
                pending.discard(r)
        if pending:
            time.sleep(0.05)
    if pending:
        logger.warning("worker 0: no final replica from worker(s) %s within %g s; averaging the others",
                       ", ".join(map(str, sorted(pending))), timeout)
    return replicas


def final_consensus(replicas: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The mean of the final replicas (float64) and the summary's values: the consensus
    distance (1/P) sum_i ||x_i - x_bar|| over them, relative to ||x_bar|| too, and which
    workers' replicas were averaged."""
    order = sorted(replicas)
    mean = torch.stack([replicas[r].double() for r in order]).mean(0)
    distance = consensus_distance(replicas[r] for r in order)
    norm = float(mean.norm())
    return mean, {"consensus_distance": distance,
                  "consensus_distance_relative": distance / norm if norm > 0 else 0.0,
                  "replicas_averaged": order}
