"""Whether a run is learning: ``ok``, ``stalled`` or ``diverging``, and why.

Asynchronous training fails in two quiet ways. It diverges without NaNs: the loss climbs
and stays high. Or it stalls: with server momentum on top of asynchrony, a Downpour run
sat at ln 10, chance on ten classes, for all of its 300 steps without one warning (issue
12's sweep). ``Health`` watches one worker's training losses for both; ``hint`` names the
likely cause from the effective configuration and the flag to change.

Rules (pure; the runner feeds them, tests drive them directly):
- diverging: a training loss above ``DIVERGED`` times the first one at ``SPIKE + 1``
  observed steps in a row: a spike of one or two steps that the loss leaves at once is not
  divergence (Adagrad's first steps at 0.05 under asp over 8 workers threw a worker's loss
  from 2.3 to 25-42 at its second step, back to 3-5 at its third, and the run ended at
  94-97 %);
- stalled: once ``fraction`` of the run has passed (and at least ``2 * window`` steps),
  the mean loss of the last ``window`` steps is no better than at the start (above
  ``1 - min_gain`` times the mean of the first ``window`` losses), or no better than
  chance (above ``1 - min_gain`` times ln(classes), the loss of a uniform guess), at
  ``window`` steps in a row: a plateau that the loss leaves within them is not announced
  (short runs' early plateaus used to warn at their first judged step, then say "learning
  again" a few steps later);
- a stalled run that falls below both bars again is ``ok`` again (a slow start is not a
  stall); diverging stays;
- the summary also calls a run stalled whose final test accuracy is within
  ``CHANCE_MARGIN`` of chance (1 / classes).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from plexus.config.defaults import USER_SOURCES, resolve

__all__ = ["Health", "HealthState", "DIVERGED", "CHANCE_MARGIN", "hint", "worst"]

HealthState = Literal["ok", "stalled", "diverging"]

# A training loss this many times its first value means the run is diverging...
DIVERGED = 10.0
# ...unless it lasts no more than this many observed steps in a row.
SPIKE = 2
# A final test accuracy below chance plus this is no better than chance.
CHANCE_MARGIN = 0.05
_ORDER = {"ok": 0, "stalled": 1, "diverging": 2}


@dataclass
class Health:
    """Feed ``observe(step, loss)`` every step; it returns the new state when it changes."""

    total_steps: int
    classes: int | None = None
    fraction: float = 0.3
    window: int = 10
    min_gain: float = 0.03
    state: HealthState = "ok"
    step: int | None = None

    def __post_init__(self) -> None:
        self._first: list[float] = []
        self._recent: deque[float] = deque(maxlen=self.window)
        self._below = 0  # judged steps in a row at which the loss has been no better than its bars
        self._above = 0  # observed steps in a row with the loss above DIVERGED times the first

    @property
    def chance_loss(self) -> float | None:
        return math.log(self.classes) if self.classes and self.classes > 1 else None

    def observe(self, step: int, loss: float) -> HealthState | None:
        if len(self._first) < self.window:
            self._first.append(loss)
        self._recent.append(loss)
        if self.state == "diverging":
            return None
        self._above = self._above + 1 if loss > DIVERGED * max(self._first[0], 0.1) else 0
        if self._above > SPIKE:
            return self._become("diverging", step)
        if step >= max(self.fraction * self.total_steps, 2 * self.window):
            recent = sum(self._recent) / len(self._recent)
            start = sum(self._first) / len(self._first)
            bar = 1.0 - self.min_gain
            chance = self.chance_loss
            stalled = recent > bar * start or (chance is not None and recent > bar * chance)
            self._below = self._below + 1 if stalled else 0
            if self._below >= self.window and self.state == "ok":
                return self._become("stalled", step)
            if not stalled and self.state == "stalled":
                return self._become("ok", step)
        return None

    def baseline(self, loss: float) -> None:
        """Judge against ``loss`` as the start, for a worker that joined a job midway (its
        first losses are the job's current ones, not the job's start)."""
        self._first = [loss] * self.window

    def diverged(self, step: int) -> None:
        """A non-finite loss at ``step``: diverging, whatever came before."""
        self._become("diverging", step)

    def _become(self, state: HealthState, step: int) -> HealthState:
        self.state, self.step = state, step
        return state


def worst(states: list[tuple[HealthState, int | None]]) -> tuple[HealthState, int | None]:
    """The worst state of several workers, with the earliest step it was seen at."""
    state = max((s for s, _ in states), key=_ORDER.__getitem__, default="ok")
    steps = [step for s, step in states if s == state and step is not None]
    return state, min(steps) if steps else None


def _given(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The values the user set, by key."""
    return {key: s["value"] for key, s in settings.items() if s["source"] in USER_SOURCES}


def _optimizer_with_rate(settings: Mapping[str, Any]) -> str:
    """The optimizer the same run gets when the user adds ``--lr`` to what they set."""
    from plexus.config import field_default
    given = _given(settings)
    decided, _ = resolve({**given, "lr": settings["lr"]["value"]})
    return {**decided, **given}.get("optimizer", field_default("optimizer"))


def _default_rate(settings: Mapping[str, Any]) -> float:
    """The rate the defaults table gives the same run with its optimizer and no ``--lr``."""
    from plexus.config import field_default
    given = {key: value for key, value in _given(settings).items() if key != "lr"}
    decided, _ = resolve({**given, "optimizer": settings["optimizer"]["value"]})
    return decided.get("lr", field_default("lr"))


def hint(state: HealthState, settings: Mapping[str, Any], asynchronous: bool, staleness_mean: float | None = None
         ) -> str:
    """The likely cause of ``state`` under the effective configuration, and the flag to change."""
    value = lambda key: settings[key]["value"]  # noqa: E731
    source = lambda key: settings[key]["source"]  # noqa: E731
    lr, momentum = value("lr"), value("momentum")
    if asynchronous and value("optimizer") == "sgd" and momentum > 0:
        return (f"momentum {momentum:g} ({source('momentum')}) under asynchronous updates: asynchrony already acts "
                f"as momentum (Mitliagkas et al. 2016); pass --momentum 0 (the default here)")
    if asynchronous and not value("staleness_lr"):
        stale = f" for the measured staleness (mean {staleness_mean:.1f})" if staleness_mean else ""
        # Where a rate set alone selects another optimizer (under asynchrony, Adagrad in place
        # of the default Adam: config/defaults.py), lowering this one's rate takes both flags.
        moves = _optimizer_with_rate(settings) != value("optimizer")
        keep = f" with --optimizer {value('optimizer')}" if moves else ""
        default = _default_rate(settings)
        lower = f" (the default here is {default:g})" if source("lr") in USER_SOURCES and default < lr else ""
        return (f"the learning rate {lr:g} ({source('lr')}) may be too large{stale}; lower --lr{keep}{lower} or "
                f"pass --staleness-lr (Zhang et al. 2016)")
    if state == "diverging":
        return f"the learning rate {lr:g} ({source('lr')}) is probably too large; lower --lr"
    return (f"the loss did not fall below its start or chance: check the data and model, or change --lr "
            f"(now {lr:g}, {source('lr')})")
