"""``allreduce``: synchronous data parallelism, gradients averaged every step.

Gradients are averaged in buckets whose all-reduce starts during backward, as soon as the
bucket's last gradient is accumulated (``collectives/bucketing.py``), with the algorithm
chosen by ``--algorithm``. Every worker then runs the same optimizer on the same averaged
gradient, so the replicas stay identical; with the global batch split evenly (contract 1)
training equals one process training with the whole batch, up to float rounding.

Per step the strategy skips two costs that a general all-reduce call must pay, because a
bucket is the same on every rank at every step (the measured ratio to DDP, ``plexus bench
ddp``, went from about 0.7 to parity with a small MLP on 2 workers):

- The argument check (``collectives/check.py``: ceil(log2 P) latency-bound message
  rounds per call) runs once per bucket at setup (``AllReduce.persistent``). Every rank
  builds the same model, so the same buckets, and reduces them in the same order every
  step, which is how DDP verifies parameter shapes once at construction.
- The last bucket of a backward pass runs in the training thread (there is nothing left
  to overlap with), not on the communication thread (two thread hand-offs).
"""
from __future__ import annotations

from typing import Any

import torch

from plexus.collectives import get_algorithm
from plexus.collectives.base import Handle
from plexus.config import JobConfig
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
        algorithm = get_algorithm(ctx.cfg.strategy.algorithm, ctx.cfg.strategy)
        self.algorithm = algorithm
        bucket_bytes = int(ctx.cfg.strategy.bucket_mb * 2**20)
        self.buckets = GradientBuckets(list(model.parameters()), bucket_bytes, self._launch)
        # One checked, reusable mean all-reduce per bucket buffer, in bucket order on every rank.
        self.reductions = {id(b.buffer): algorithm.persistent(b.buffer, self.group, "mean")
                           for b in self.buckets.buckets}
        self.optimizer = make_optimizer(model.parameters(), ctx.cfg.optim)

    def _launch(self, buffer: torch.Tensor, last: bool) -> Handle:
        """Start the mean all-reduce of one bucket; the last one runs in this thread."""
        reduction = self.reductions[id(buffer)]
        if last:
            reduction()
            return Handle()
        return reduction.start()

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

    def final_record(self) -> dict[str, Any]:
        """``--algorithm auto``: the choice per bucket size and its reason."""
        decisions = getattr(self.algorithm, "decisions", None)
        return {"auto_decisions": decisions()} if decisions is not None else {}

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        worker0 = records["worker"].get(0, {})
        if "auto_decisions" not in worker0:
            return {}
        return {"auto_decisions": worker0["auto_decisions"],
                "auto_chose": sorted({d["chose"] for d in worker0["auto_decisions"]})}

    def close(self) -> None:
        self.buckets.remove()
        self.group.close()
