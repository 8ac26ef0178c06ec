"""``allreduce``: synchronous data parallelism, gradients averaged every step.

Gradients are averaged in buckets whose all-reduce starts during backward, as soon as the
bucket's last gradient is accumulated (``collectives/bucketing.py``), with the algorithm
chosen by ``--algorithm``. Every worker then runs the same optimizer on the same averaged
gradient, so the replicas stay identical; with the global batch split evenly (contract 1)
training equals one process training with the whole batch, up to float rounding.
"""
from __future__ import annotations

import torch

from plexus.collectives import get_algorithm
from plexus.collectives.bucketing import GradientBuckets
from plexus.strategies.base import Context, LossFn, Strategy, StepStats, make_optimizer

__all__ = ["AllReduceStrategy"]


class AllReduceStrategy(Strategy):
    name = "allreduce"
    synchronous = True

    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.ctx = ctx
        self.group = ctx.worker_group()
        self.algorithm = get_algorithm(ctx.cfg.strategy.algorithm, ctx.cfg.strategy)
        bucket_bytes = int(ctx.cfg.strategy.bucket_mb * 2**20)
        self.buckets = GradientBuckets(list(model.parameters()), bucket_bytes,
                                       lambda buf: self.algorithm.all_reduce_async(buf, self.group, "mean"))
        self.optimizer = make_optimizer(model.parameters(), ctx.cfg.optim)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        self.buckets.zero()
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.model, x, y)
            loss.backward()
        self.buckets.finish()
        self.optimizer.step()
        return StepStats(loss=loss.item())

    def global_model(self) -> torch.nn.Module:
        return self.model

    def agree(self, flag: bool) -> bool:
        votes = torch.tensor([1.0 if flag else 0.0], device=self.ctx.device)
        self.group.all_reduce_backend(votes, count_bytes=0).wait()
        return bool(votes.item() > 0)

    def close(self) -> None:
        self.buckets.remove()
        self.group.close()
