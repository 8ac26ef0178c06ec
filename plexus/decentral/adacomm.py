"""When local SGD averages: warm-up, a fixed period, or AdaComm's shrinking one (pure).

Local SGD trains each replica alone for H steps and then averages the parameters. A
long period saves communication, but the replicas drift apart and the error floor rises;
AdaComm (Wang and Joshi 2019, "Adaptive communication strategies to achieve the best
error-runtime trade-off in local-update SGD", eq. 16) starts with a long period H0 and
shrinks it as the training loss F falls:

    H = ceil(sqrt(F_now / F_start) * H0)

so that communication is rare while the loss is high and averaging dominates near the
end. Post-local SGD (Lin et al. 2020, "Don't use large mini-batches, use local SGD")
runs ``warmup_steps`` of fully synchronous SGD first, when the replicas would otherwise
diverge fastest.

Choices where the papers leave room, and why:
- F_now is the mean training loss over the round just finished, averaged over workers
  (one number every worker agrees on, so they all pick the same next period; the
  strategy piggybacks it on the parameter all-reduce); F_start is that of the first
  round.
- H stays within [1, H0]: a loss that rises above its start does not make averaging
  rarer than the user asked for.
"""
from __future__ import annotations

import math

from plexus.errors import ConfigError

__all__ = ["AdaComm", "AveragingSchedule"]


class AdaComm:
    """The period rule of Wang and Joshi (2019): ``update(loss)`` returns the next H."""

    def __init__(self, h0: int) -> None:
        if h0 < 1:
            raise ConfigError(f"AdaComm's initial period must be at least 1 step, got {h0}: pass --period 8")
        self.h0 = h0
        self.f_start: float | None = None

    def update(self, loss: float) -> int:
        """The period after a round whose mean training loss was ``loss``."""
        if not math.isfinite(loss):
            return self.h0
        if self.f_start is None:
            self.f_start = loss
        if self.f_start <= 0:
            return self.h0
        ratio = max(loss, 0.0) / self.f_start
        return max(1, min(self.h0, math.ceil(math.sqrt(ratio) * self.h0)))


class AveragingSchedule:
    """Step by step: synchronous warm-up, then local steps, averaging every ``period``.

    ``warmup(step)`` says whether step ``step`` (0-based) averages gradients; after each
    local step call ``local_step_done()``, which says whether to average parameters now;
    after averaging call ``averaged(loss)`` with the round's mean loss.
    """

    def __init__(self, period: int, warmup_steps: int = 0, adaptive: bool = False) -> None:
        if period < 1:
            raise ConfigError(f"period must be at least 1 step, got {period}: pass --period 8")
        if warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be non-negative, got {warmup_steps}: pass --warmup-steps 0")
        self.period = period
        self.warmup_steps = warmup_steps
        self.rule = AdaComm(period) if adaptive else None
        self.since = 0
        # Rounds completed at each period, {H: rounds} (AdaComm's trace for the summary).
        self.rounds: dict[int, int] = {}

    def warmup(self, step: int) -> bool:
        return step < self.warmup_steps

    def local_step_done(self) -> bool:
        """Count one local step; True when the round is complete and parameters must be averaged."""
        self.since += 1
        return self.since >= self.period

    def averaged(self, loss: float | None = None) -> int:
        """Start a new round; with AdaComm the next period comes from ``loss``."""
        self.since = 0
        self.rounds[self.period] = self.rounds.get(self.period, 0) + 1
        if self.rule is not None and loss is not None:
            self.period = self.rule.update(loss)
        return self.period
