"""``local-sgd``: periodic parameter averaging, post-local SGD and AdaComm.

Each worker trains its own replica on its slice of every global batch (contract 1) for
``--period H`` steps, then the replicas' parameters are averaged with an all-reduce of
the collectives library (``--algorithm``), so a worker sends the all-reduce's bytes once
every H steps instead of every step (Stich 2019; Lin et al. 2020). With H = 1 and SGD
(momentum or not) the average follows synchronous SGD exactly: momentum and weight decay
are linear, so averaging parameters after the step equals stepping with the averaged
gradient, and the replicas are equal again after every step (tested against one-process
SGD).

Options:

- ``--average-optimizer-state`` averages the optimizer's per-parameter buffers with the
  parameters (momentum: twice the bytes; Adam's two moments: three times), in the same
  all-reduce. Without it each replica keeps its own momentum, as in Lin et al. (2020).
- ``--warmup-steps K``: post-local SGD (Lin et al. 2020): the first K steps average
  gradients every step (synchronous SGD), then local SGD starts.
- ``--adaptive``: AdaComm (Wang and Joshi 2019): the period starts at H0 = ``--period``
  and shrinks as the training loss falls, H = ceil(sqrt(F_now / F_start) * H0)
  (``decentral/adacomm.py``). Every worker must pick the same H, so the round's mean
  loss rides as one extra element on the parameter all-reduce.

Every averaging reduces the same buffers (the flat parameters; for the warm-up, the
gradients; with optimizer state or AdaComm, one buffer holding all parts), so their
arguments are checked across the group once, at the first averaging
(``AllReduce.persistent``), as the allreduce strategy checks its buckets once: not
ceil(log2 P) latency-bound rounds at every averaging.

The global model evaluated is the average of the replicas, computed at each snapshot
over an uncounted probe group (``replicas.py``); worker 0's own replica is evaluated too.
"""
from __future__ import annotations

from typing import Any

import torch

from plexus.collectives.base import Persistent
from plexus.config import JobConfig
from plexus.decentral.adacomm import AveragingSchedule
from plexus.decentral.averaging import FlatParameters, optimizer_buffers
from plexus.strategies.base import Context, LossFn, Strategy, StepStats, algorithm_for, algorithm_ran, make_optimizer
from plexus.strategies.replicas import ReplicaProbe, replica_summary

__all__ = ["LocalSgdStrategy"]


class LocalSgdStrategy(Strategy):
    name = "local-sgd"
    synchronous = True

    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        s = ctx.cfg.strategy
        self.model, self.loss_fn, self.ctx = model, loss_fn, ctx
        self.params = FlatParameters(model)
        self.group = ctx.worker_group()
        self.algorithm = algorithm_for(ctx, self.group)
        self.algorithm.connect(self.group, ctx.cfg.cluster.transport)
        self.optimizer = make_optimizer(model.parameters(), ctx.cfg.optim)
        self.schedule = AveragingSchedule(s.period, s.warmup_steps, s.adaptive)
        self.average_state = s.average_optimizer_state
        self.probe = ReplicaProbe(ctx, "local-sgd", model)
        self.steps = 0
        self.averagings = 0
        self.round_loss = 0.0
        self.round_steps = 0
        # The buffer every averaging reduces, by name, with its checked reduction.
        self.reductions: dict[str, tuple[torch.Tensor, Persistent]] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        self.optimizer.zero_grad()
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.model, x, y)
            loss.backward()
        value = loss.item()
        if self.schedule.warmup(self.steps):
            self._average_gradients()
            self.optimizer.step()
        else:
            self.optimizer.step()
            self.round_loss += value
            self.round_steps += 1
            if self.schedule.local_step_done():
                self._average_parameters()
        self.steps += 1
        return StepStats(loss=value)

    def _mean(self, name: str, tensor: torch.Tensor) -> None:
        """Average ``tensor`` (the same storage at every call under one ``name``) across the
        workers; its arguments are checked at the first call only."""
        held = self.reductions.get(name)
        if held is None or held[0] is not tensor:
            held = self.reductions[name] = (tensor, self.algorithm.persistent(tensor, self.group, "mean"))
        held[1]()

    def _buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer ``_mean`` reduced under ``name`` last time, if it still fits (so that
        its reduction stays checked), else a new one."""
        held = self.reductions.get(name)
        if held is not None and held[0].numel() == numel:
            return held[0]
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def _average_gradients(self) -> None:
        """One synchronous step of post-local SGD's warm-up: mean of the gradients."""
        grads = self.params.grads()
        flat = self._buffer("gradients", self.params.numel, self.params.flat)
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        self._mean("gradients", flat)
        offset = 0
        for p, g in zip(self.params.params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    @torch.no_grad()
    def _average_parameters(self) -> None:
        """Average parameters (and optimizer buffers, and the round's loss for AdaComm)."""
        flat = self.params.flat
        extras = optimizer_buffers(self.optimizer, self.params.params) if self.average_state else []
        adaptive = self.schedule.rule is not None
        round_loss = self.round_loss / max(self.round_steps, 1)
        if not extras and not adaptive:
            self._mean("parameters", flat)
            mean_loss = round_loss
        else:
            parts = [flat] + [b.reshape(-1) for b in extras]
            if adaptive:
                parts.append(torch.tensor([round_loss], dtype=flat.dtype, device=flat.device))
            buf = self._buffer("averaged", sum(part.numel() for part in parts), flat)
            torch.cat(parts, out=buf)
            self._mean("averaged", buf)
            offset = 0
            for part in parts[:1 + len(extras)]:
                n = part.numel()
                part.copy_(buf[offset:offset + n].view_as(part))
                offset += n
            mean_loss = float(buf[-1]) if adaptive else round_loss
        self.averagings += 1
        self.round_loss, self.round_steps = 0.0, 0
        self.schedule.averaged(mean_loss)

    def global_model(self) -> torch.nn.Module:
        return self.probe.holder

    def replica(self) -> torch.nn.Module:
        return self.model

    def prepare_snapshot(self, final: bool = False) -> dict[str, Any]:
        fields = self.probe.average(self.params.flat)  # a collective: every worker takes part
        return fields if self.ctx.info.rank == 0 else {}

    def agree(self, flag: bool) -> bool:
        return self.probe.agree(flag, self.ctx.device)

    def final_record(self) -> dict[str, Any]:
        # JSON keys are strings: {"8": rounds at H = 8, ...}.
        return {"algorithm": self.algorithm.name, "averagings": self.averagings,
                "rounds_per_period": {str(h): n for h, n in sorted(self.schedule.rounds.items())},
                "period_final": self.schedule.period, **self.probe.last}

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        first = records["worker"].get(0, {})
        return {**replica_summary(records), "period": cfg.strategy.period, "adaptive": cfg.strategy.adaptive,
                "warmup_steps": cfg.strategy.warmup_steps,
                "average_optimizer_state": cfg.strategy.average_optimizer_state,
                "averagings": first.get("averagings"), "rounds_per_period": first.get("rounds_per_period"),
                "period_final": first.get("period_final"),
                "consensus_distance": first.get("consensus_distance"),
                "consensus_distance_relative": first.get("consensus_distance_relative"),
                **algorithm_ran(cfg, first)}

    def close(self) -> None:
        self.probe.close()
        self.group.close()
