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

An algorithm's messages between workers on one machine go over shared memory (``--transport
auto``, ``Group.connect``), not gloo's sockets: on a machine with a busy process per core,
each socket message wakes gloo's I/O thread, which preempts a computing process, and a
two-worker ring all-reduce of 92 KB inside a step took 1.4 ms that way against 0.47 ms.
Each generation of an ``--elastic`` group connects its own; a member's death ends the
others' waits on its links at once (the FIFO's end-of-file), as on the sockets.

A group of one (``--workers 1``, or a stage of a single replica under ``--stages K``)
keeps no buckets at all: the mean over one member is the gradient itself, so there is
nothing to reduce, and the buckets would still cost every step a memset of every
gradient and an add of backward's result into it (about 1 ms of a 10 ms step for two
1024 x 1024 Linears at batch 64, one thread, this machine). Its gradients are set to
None before the forward and written afresh by backward instead: bit-identical.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from plexus.cluster.group import Group
from plexus.cluster.liveness import exit_time
from plexus.cluster.rendezvous import store_get_json, store_set_json, wait_keys
from plexus.collectives import get_algorithm
from plexus.collectives.base import Handle
from plexus.config import JobConfig
from plexus.collectives.bucketing import GradientBuckets
from plexus.errors import CommError, ConfigError
from plexus.strategies.base import (Context, LossFn, Regrouped, Strategy, StepStats, algorithm_for,
                                    algorithm_ran, make_optimizer)
from plexus.strategies.elastic import ELASTIC_ALGORITHMS, JOB_KEY, RANKS_KEY, Membership, discard
from plexus.train.feed import Feed, GlobalFeed

__all__ = ["AllReduceStrategy"]

logger = logging.getLogger(__name__)


class AllReduceStrategy(Strategy):
    name = "allreduce"
    synchronous = True

    @classmethod
    def check_config(cls, cfg: JobConfig) -> None:
        if cfg.strategy.elastic and cfg.strategy.algorithm not in ELASTIC_ALGORITHMS:
            raise ConfigError(f"--elastic cannot re-form the group under --algorithm {cfg.strategy.algorithm}: "
                              f"it can with {', '.join(ELASTIC_ALGORITHMS)} (point-to-point messages, which a "
                              f"survivor can abandon halfway; native's run in the backend's own threads)")

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        return role == "worker" and cfg.strategy.elastic

    # --- workers that join (plexus worker --join) ---------------------------------------

    @classmethod
    def job_record(cls, store, timeout: float) -> dict[str, Any]:
        """The running job's configuration and run directory, as worker 0 published them."""
        wait_keys(store, [JOB_KEY], timeout, "worker 0 of an --elastic allreduce job")
        return store_get_json(store, JOB_KEY)

    @classmethod
    def joined_workers(cls, store) -> int:
        return int(store.add(RANKS_KEY, 0))

    @classmethod
    def admit(cls, store, cfg: JobConfig) -> int:
        """A rank for a worker that joins: the leader adds it at the next step boundary."""
        if not cfg.strategy.elastic:
            raise ConfigError("an allreduce job admits workers only with --elastic: its group is fixed otherwise")
        return cfg.cluster.workers + int(store.add(RANKS_KEY, 1)) - 1

    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.ctx = ctx
        self.algorithm = get_algorithm(ctx.cfg.strategy.algorithm, ctx.cfg.strategy)
        bucket_bytes = int(ctx.cfg.strategy.bucket_mb * 2**20)
        # A fixed group of one reduces nothing (module docstring); an --elastic one may grow.
        alone = ctx.info.world_size == 1 and not ctx.cfg.strategy.elastic
        self.buckets = None if alone else GradientBuckets(list(model.parameters()), bucket_bytes, self._launch)
        self.optimizer = make_optimizer(model.parameters(), ctx.cfg.optim)
        self.membership: Membership | None = None
        self.steps = 0
        if ctx.cfg.strategy.elastic:
            rank = ctx.info.rank
            if rank == 0:  # what a worker that joins reads first (plexus worker --join)
                store_set_json(ctx.store, JOB_KEY, {"config": ctx.cfg.to_dict(),
                                                    "run_dir": os.environ.get("PLEXUS_RUN_DIR")})
            self.membership = Membership(ctx.store, rank, ctx.info.world_size, ctx.cfg.cluster.timeout)
            self.recoveries: list[dict[str, Any]] = []
            self._failed_at: float | None = None
            self._steps_before = 0
            if rank >= ctx.info.world_size:  # a worker that joined: it enters at the next generation
                self._regroup(-1)
                return
        if self.membership is None:
            group = ctx.worker_group()
            self.algorithm = algorithm_for(ctx, group)  # the default's choice needs the group
            self._attach(group)
        else:
            self._attach(self._generation_group())

    def _generation_group(self) -> Group:
        gen = self.membership.current
        return Group(self.ctx.store, f"workers-g{gen.number}", gen.members.index(self.ctx.info.rank),
                     [f"worker {r}" for r in gen.members], traffic=self.ctx.traffic,
                     timeout=self.ctx.cfg.cluster.timeout, backend=self.ctx.backend, net=self.ctx.cfg.cluster.net)

    def _attach(self, group: Group) -> None:
        """Reduce the buckets over ``group`` from now on."""
        self.group = group
        self.algorithm.connect(group, self.ctx.cfg.cluster.transport)
        # One checked, reusable mean all-reduce per bucket buffer, in bucket order on every rank.
        self.reductions = {id(b.buffer): self.algorithm.persistent(b.buffer, group, "mean")
                           for b in (self.buckets.buckets if self.buckets is not None else ())}

    def _launch(self, buffer: torch.Tensor, last: bool) -> Handle:
        """Start the mean all-reduce of one bucket; the last one runs in this thread."""
        reduction = self.reductions[id(buffer)]
        if last:
            reduction()
            return Handle()
        return reduction.start()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        if self.buckets is None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.buckets.zero()
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.model, x, y)
            if self.membership is None:
                loss.backward()
            else:  # shares differ when P does not divide B: weight each by its size
                (loss * (len(x) * self.membership.size / self.ctx.cfg.run.batch_size)).backward()
        if self.membership is None:
            if self.buckets is not None:
                self.buckets.finish()
        else:
            failure = None
            try:
                self.buckets.finish()
            except CommError as exc:
                failure = str(exc)  # recover outside: the traceback's frames hold the broken group
            if failure is not None:
                self._recover(failure)
                # The step is done when the reference had finished it (its state was adopted).
                raise Regrouped(completed=self.steps > self._steps_before, loss=loss.item())
        self.optimizer.step()
        self.steps += 1
        if self.membership is not None and self._failed_at is not None:
            self.recoveries[-1]["first_step_seconds"] = time.time() - self._failed_at
            self._failed_at = None
        return StepStats(loss=loss.item())

    # --- checkpoints: every replica is worker 0's ------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        if self.ctx.info.rank != 0:
            return {}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def restore_checkpoint(self, mine: dict[str, Any], read) -> None:
        replica = mine if "model" in mine else read("worker-0")
        self.model.load_state_dict(replica["model"])
        self.optimizer.load_state_dict(replica["optimizer"])
        self.steps = int(mine["steps"])

    # --- elastic ------------------------------------------------------------------------

    def feed(self, ctx: Context, samples: int, shared_budget: bool = True) -> Feed:
        """Slices of global batches, as every synchronous strategy's; an elastic group
        names the slice at each step (``share``), and a worker that joined it starts at
        the job's step (known once ``setup`` returns)."""
        return GlobalFeed(ctx.cfg, ctx.store, ctx.info.rank, ctx.info.world_size, samples, share=self.share,
                          first=self.steps)

    def share(self, step: int, rank: int, workers: int) -> tuple[int, int]:
        """(index, count): this worker trains on slice ``index`` of ``count`` of global
        batch ``step``. Called at each step boundary; the elastic group may re-form here,
        before the step, when workers join."""
        if self.membership is None:
            return rank, workers
        self.membership.plan_growth(step)
        if self.membership.growth_due(step) is not None:
            self._failed_at = time.time()  # the pause, up to the first step after it
            self._regroup(self.steps)
        return self.membership.index, self.membership.size

    def _recover(self, failure: str) -> None:
        """After a failed collective: let the other buckets' calls end, drop the broken
        group and form the next generation (strategies/elastic.py)."""
        self._failed_at = time.time()  # when this worker saw it
        logger.warning("%s; re-forming the group", failure)
        self.buckets.abandon()
        self._steps_before = self.steps
        self._regroup(self.steps, cause=failure)

    def _regroup(self, steps_done: int, cause: str | None = None) -> None:
        old = getattr(self, "group", None)
        self.group, self.reductions = None, {}
        if old is not None:
            discard(old)
        while True:
            gen = self.membership.next(steps_done)
            try:
                self._attach(self._generation_group())
                break
            except CommError as exc:  # a member died while the group formed: once more without it
                logger.warning("worker %d: %s; re-forming the group again", self.ctx.info.rank, exc)
                self.group, self.reductions = None, {}
        self.steps = self.membership.share_state(self.model, self.optimizer, max(steps_done, 0))
        event = {**self.membership.history[-1], "step": self.steps, "cause": cause}
        lost = event["lost"]
        exited = [t for t in (exit_time(self.ctx.store, f"worker {r}") for r in lost) if t != float("inf")]
        if exited and self._failed_at is not None:
            # Recovery counts from the death the launcher saw, not from its detection here.
            event["detect_seconds"] = max(0.0, self._failed_at - min(exited))
            self._failed_at = min(exited)
        self.recoveries.append(event)
        logger.warning("worker %d: generation %d of the group: workers %s (lost %s, joined %s) at step %d",
                       self.ctx.info.rank, gen.number, gen.members, lost or "none", event["joined"] or "none",
                       self.steps)

    def global_model(self) -> torch.nn.Module:
        return self.model

    def agree(self, flag: bool) -> bool:
        votes = torch.tensor([1.0 if flag else 0.0], device=self.ctx.device)
        if self.membership is None:
            self.group.all_reduce_backend(votes, count_bytes=0).wait()
            return bool(votes.item() > 0)
        failure = None
        try:  # the backend's collective cannot be abandoned halfway: the algorithm's can
            self.algorithm(votes, self.group, "sum")
        except CommError as exc:
            failure = str(exc)
        if failure is not None:
            self._recover(failure)
            return self.agree(flag)
        return bool(votes.item() > 0)

    def evaluates(self, rank: int) -> bool:
        return rank == (0 if self.membership is None else self.membership.current.leader)

    def final_model(self, rank: int) -> torch.nn.Module | None:
        return self.model if self.evaluates(rank) else None

    def final_record(self) -> dict[str, Any]:
        """The algorithm that ran (``algorithm_for``); ``--algorithm auto``: the choice per
        bucket size and its reason; ``--elastic``: the generations this worker saw."""
        record: dict[str, Any] = {"algorithm": self.algorithm.name}
        decisions = getattr(self.algorithm, "decisions", None)
        if decisions is not None:
            record["auto_decisions"] = decisions()
        if self.membership is not None:
            record["elastic"] = {"generation": self.membership.current.number,
                                 "members": self.membership.current.members, "regroups": self.recoveries}
        return record

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        workers = records["worker"]
        worker0 = workers.get(0, {})
        fields.update(algorithm_ran(cfg, worker0))
        if "auto_decisions" in worker0:
            fields.update(auto_decisions=worker0["auto_decisions"],
                          auto_chose=sorted({d["chose"] for d in worker0["auto_decisions"]}))
        if cfg.strategy.elastic:
            # The regroups as the final generation's leader saw them (it saw every one).
            final = [w["elastic"] for w in workers.values() if "elastic" in w]
            last = max(final, key=lambda e: (e["generation"], -min(e["members"])), default=None)
            if last is not None:
                fields["elastic"] = {"generations": last["generation"] + 1, "final_members": last["members"],
                                     "regroups": [{k: v for k, v in e.items() if k != "cause"}
                                                  for e in last["regroups"]]}
        return fields

    def close(self) -> None:
        if self.buckets is not None:
            self.buckets.remove()
        if self.group is not None:
            self.group.close()
