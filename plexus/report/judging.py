"""The judging report of ``plexus compare --seeds N``: every configuration run over N seeds
and judged on the four criteria of ARCHITECTURE.md section 4.

1. **Speed.** Time to the best test error (the first snapshot at the run's own best test
   accuracy; error = 1 - accuracy) and time to the target (``judging_target``), mean +- sd
   over the seeds. The best accuracy is given beside its time, so a run that stops
   improving early at a poor error is seen as such.
2. **Hyper-parameters** the configuration adds beyond SGD, counted from the config
   schema (``extra_hyperparameters``).
3. **Stability.** The sd across seeds of the final test accuracy, and the runs that
   stalled or diverged (``summary.json``'s ``health``) or failed.
4. **Cost**, mean per run: process-seconds (the job's processes x its wall seconds: what
   the job holds), CPU-seconds (user + system time its processes used), and bytes sent
   by every process.

The ranking (``judge``): configurations that reached the target in more of their seeds
come first; among those, the faster mean time to the target. A speed difference smaller
than the noise (one standard error of the difference of the means) is no difference:
such configurations are tied on speed and ordered by the next criteria in turn, fewer
hyper-parameters, then fewer unstable runs, then a smaller sd, then fewer CPU-seconds.
Configurations that never reached the target are ordered the same way by their best
accuracy; those whose every run failed come last. Pure functions of the run directories'
contents: ``plexus compare`` prints the table, the HTML report shows it.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from plexus.config import StrategyConfig
from plexus.config.applies import STRATEGY_NAMES, applies
from plexus.report.analysis import MIB, THRESHOLDS, eval_models, time_to_accuracy, time_to_best

__all__ = ["Run", "Stat", "Judged", "extra_hyperparameters", "judging_target", "judge", "TABLE_HEAD", "table_cells",
           "target_heading"]

# Health values (train/health.py) that count against a configuration's stability.
UNSTABLE = ("stalled", "diverging")


class Run(Protocol):
    """What judging reads of a run directory (``plexus.report.RunDir`` has it)."""

    summary: Mapping[str, Any]
    config: Mapping[str, Any]
    events: Sequence[Mapping[str, Any]]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (n - 1 in the denominator) of one figure over
    the runs of a configuration that have it; ``sd`` is None below two values."""

    mean: float | None
    sd: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[Any]) -> "Stat":
        numbers = [float(v) for v in values if _is_number(v)]
        if not numbers:
            return cls(None, None, 0)
        return cls(statistics.fmean(numbers), statistics.stdev(numbers) if len(numbers) > 1 else None, len(numbers))

    def text(self, fmt: Callable[[float], str] = "{:.2f}".format) -> str:
        """``1.23 ± 0.04``; the mean alone from one value; ``–`` from none."""
        if self.mean is None:
            return "–"
        return fmt(self.mean) if self.sd is None else f"{fmt(self.mean)} ± {fmt(self.sd)}"


def extra_hyperparameters(strategy: str | None) -> tuple[str, ...] | None:
    """The knobs ``strategy`` adds beyond SGD, read off the schema: the fields of
    ``StrategyConfig`` that ``config.applies.APPLIES`` says the strategy reads and the
    ``allreduce`` strategy does not.

    Why this rule. The strategy component holds the knobs of the training algorithm; the
    cluster's shape (servers, placement, peer timeout) and the model (dtype) live in other
    components and are not tuned for accuracy. ``allreduce`` is SGD: with any all-reduce
    algorithm and bucket size it trains the one-process SGD model (contract 1), so what it
    reads (the SGD optimizer, lr, momentum, batch size, and the all-reduce's own knobs,
    which change speed only) adds nothing; the same all-reduce knobs under local-sgd add
    nothing either. A knob that only some settings of a strategy read (``staleness``
    outside ssp) counts, as ``APPLIES`` counts it: the user who picks the strategy faces
    it. None for a strategy the schema does not know (a user's factory)."""
    if strategy not in STRATEGY_NAMES:
        return None
    return tuple(f.name for f in dataclasses.fields(StrategyConfig)
                 if f.name != "strategy" and applies(f.name, strategy) and not applies(f.name, "allreduce"))


@dataclass(frozen=True)
class Judged:
    """One configuration's figures over its runs, its place and why."""

    index: int                      # position of the configuration in the input
    name: str                       # as the user wrote it (a compare spec)
    strategy: str | None
    runs: int                       # seeds run
    failed: int                     # runs that did not complete
    target: float | None            # the accuracy timed (fraction), the same for every configuration
    reached: int                    # completed runs that reached the target
    time_to_target: Stat            # s, over the runs that reached it
    best_accuracy: Stat             # fraction: each run's best snapshot
    time_to_best: Stat              # s: each run's first snapshot at its best accuracy
    final_accuracy: Stat            # fraction
    hyperparameters: tuple[str, ...] | None  # beyond SGD (extra_hyperparameters)
    unstable: int                   # completed runs that stalled or diverged
    process_seconds: Stat           # processes x wall seconds, per run
    cpu_seconds: Stat               # user + system CPU seconds of every process, per run
    mib_sent: Stat                  # MiB (2**20 bytes) sent by every process, per run
    place: int = 0                  # 1 = best
    why: str = ""

    @property
    def completed(self) -> int:
        return self.runs - self.failed

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hyperparameter_count": _count(self)}


def _count(j: Judged) -> int | None:
    return None if j.hyperparameters is None else len(j.hyperparameters)


def _judge_one(index: int, name: str, runs: Sequence[Run], target: float | None) -> Judged:
    ok = [r for r in runs if r.summary.get("status", "completed") == "completed"]
    bests = [time_to_best(r.events) for r in ok]
    times = [time_to_accuracy(r.events, target) for r in ok] if target is not None else []
    strategies = {r.summary.get("strategy") or r.config.get("strategy", {}).get("strategy") for r in runs}
    strategy = strategies.pop() if len(strategies) == 1 else None
    processes = [r.summary.get("processes") for r in ok]
    walls = [r.summary.get("wall_seconds") for r in ok]
    return Judged(
        index=index, name=name, strategy=strategy, runs=len(runs), failed=len(runs) - len(ok), target=target,
        reached=sum(t is not None for t in times), time_to_target=Stat.of(times),
        best_accuracy=Stat.of([acc for _, acc in bests]), time_to_best=Stat.of([t for t, _ in bests]),
        final_accuracy=Stat.of([r.summary.get("final_test_accuracy") for r in ok]),
        hyperparameters=extra_hyperparameters(strategy),
        unstable=sum(r.summary.get("health") in UNSTABLE for r in ok),
        process_seconds=Stat.of([p * w if _is_number(p) and _is_number(w) else None
                                 for p, w in zip(processes, walls)]),
        cpu_seconds=Stat.of([r.summary.get("cpu_seconds") for r in ok]),
        mib_sent=Stat.of([b / MIB if _is_number(b) else None
                          for b in (r.summary.get("bytes_sent_total") for r in ok)]),
    )


def _speed(j: Judged) -> Stat:
    """What speed is measured by: time to the target, else (no run reached it) the best
    accuracy, negated so that smaller is better for both."""
    if j.reached:
        return j.time_to_target
    best = j.best_accuracy
    return Stat(None if best.mean is None else -best.mean, best.sd, best.n)


def _noise(a: Stat, b: Stat) -> float:
    """One standard error of the difference of two means (0 when either has one value)."""
    if a.sd is None or b.sd is None:
        return 0.0
    return math.sqrt(a.sd ** 2 / a.n + b.sd ** 2 / b.n)


def _inf(value: float | None) -> float:
    return math.inf if value is None else value


# The criteria that order configurations tied on speed, in turn: (key, what it says).
_TIE_BREAKS: tuple[tuple[Callable[[Judged], float], Callable[[Judged, Judged], str]], ...] = (
    (lambda j: _inf(_count(j)),
     lambda a, b: f"fewer hyper-parameters ({_count(a)} vs {_count(b)})"),
    (lambda j: (j.unstable + j.failed) / j.runs,
     lambda a, b: f"fewer stalled, diverged or failed runs ({a.unstable + a.failed}/{a.runs} vs "
                  f"{b.unstable + b.failed}/{b.runs})"),
    (lambda j: j.final_accuracy.sd or 0.0,
     lambda a, b: f"a steadier final accuracy (sd {100 * (a.final_accuracy.sd or 0):.2f} vs "
                  f"{100 * (b.final_accuracy.sd or 0):.2f} pp)"),
    (lambda j: _inf(j.cpu_seconds.mean),
     lambda a, b: f"fewer CPU-seconds ({a.cpu_seconds.text()} vs {b.cpu_seconds.text()})"),
    (lambda j: _inf(_speed(j).mean),
     lambda a, b: "a faster mean time"),
)


def _tie_key(j: Judged) -> tuple[float, ...]:
    return tuple(key(j) for key, _ in _TIE_BREAKS)


def _decider(a: Judged, b: Judged) -> str:
    """Why ``a`` went ahead of ``b``, which it was tied with on speed."""
    for key, say in _TIE_BREAKS:
        if key(a) != key(b):
            return say(a, b)
    return "the order given"


def _tiers(judged: Sequence[Judged]) -> list[list[Judged]]:
    """Configurations grouped by speed: the same share of seeds at the target, and a mean
    within noise of the group's fastest. Groups in order; members not yet ordered."""
    alive = [j for j in judged if j.completed]
    alive.sort(key=lambda j: (-j.reached / j.runs, _speed(j).mean is None, _inf(_speed(j).mean)))
    tiers: list[list[Judged]] = []
    for j in alive:
        lead = tiers[-1][0] if tiers else None
        if (lead is not None and lead.reached / lead.runs == j.reached / j.runs and _speed(j).mean is not None
                and _speed(lead).mean is not None
                and _speed(j).mean - _speed(lead).mean <= _noise(_speed(lead), _speed(j))):
            tiers[-1].append(j)
        else:
            tiers.append([j])
    dead = [j for j in judged if not j.completed]
    return tiers + ([dead] if dead else [])


def judging_target(runs: Sequence[Run]) -> float | None:
    """The accuracy whose time is judged: the runs' --target-accuracy, else the highest of
    80/90/95% that every run with an evaluation reached, else 80% (None: no evaluation).

    Not the per-run ranking's "highest that any run reached": near the runs' ceiling,
    whether a seed touches the target is a coin flip, and two repeats of the same
    five-strategy compare ranked differently at 95% (docs/results/judging.md). A target
    that every run reached times every run; one that some runs miss counts against them."""
    targets = [t for r in runs if _is_number(t := r.config.get("run", {}).get("target_accuracy"))]
    if targets:
        return max(targets)
    evaluated = [r.events for r in runs if eval_models(r.events)]
    if not evaluated:
        return None
    everyone = [th for th in THRESHOLDS if all(time_to_accuracy(ev, th) is not None for ev in evaluated)]
    return max(everyone, default=THRESHOLDS[0])


def judge(configurations: Sequence[tuple[str, Sequence[Run]]]) -> list[Judged]:
    """Judge each (name, its runs over the seeds) and rank them (see the module's
    docstring); returns them best first, each with its place and a short reason."""
    target = judging_target([r for _, rs in configurations for r in rs
                             if r.summary.get("status", "completed") == "completed"])
    judged = [_judge_one(i, name, rs, target) for i, (name, rs) in enumerate(configurations)]
    ordered: list[Judged] = []
    tied: dict[int, tuple[Judged, bool]] = {}  # index -> (the neighbour it was tied with, ahead of it?)
    for tier in _tiers(judged):
        tier.sort(key=_tie_key)
        if tier[0].completed:
            for k, j in enumerate(tier):
                if len(tier) > 1:
                    tied[j.index] = (tier[1], True) if k == 0 else (tier[k - 1], False)
        ordered.extend(tier)
    places = {j.index: place for place, j in enumerate(ordered, 1)}
    cpu = [j.cpu_seconds.mean for j in ordered if j.completed and j.cpu_seconds.mean is not None]
    sent = [j.mib_sent.mean for j in ordered if j.completed and j.mib_sent.mean is not None]
    out = []
    for place, j in enumerate(ordered, 1):
        reasons = [_speed_reason(j, ordered)]
        if j.index in tied:
            other, ahead = tied[j.index]
            reasons.append(f"tied on speed with #{places[other.index]} (within noise), "
                           + (f"ahead on {_decider(j, other)}" if ahead else f"which has {_decider(other, j)}"))
        if j.unstable:
            reasons.append(f"{j.unstable}/{j.runs} runs stalled or diverged")
        if j.failed and j.completed:
            reasons.append(f"{j.failed}/{j.runs} runs failed")
        if _clearly_least(j.cpu_seconds.mean, cpu):
            reasons.append(f"least CPU ({j.cpu_seconds.mean:.2f} s)")
        if _clearly_least(j.mib_sent.mean, sent):
            reasons.append(f"fewest bytes ({j.mib_sent.mean:,.1f} MiB)")
        out.append(dataclasses.replace(j, place=place, why="; ".join(reasons)))
    return out


def _clearly_least(value: float | None, values: Sequence[float]) -> bool:
    """``value`` is the least of ``values`` by more than 5% of the next: a cost worth naming."""
    ordered = sorted(values)
    return value is not None and len(ordered) > 1 and value == ordered[0] and value < 0.95 * ordered[1]


def _speed_reason(j: Judged, judged: Sequence[Judged]) -> str:
    """The speed clause of a reason: the time to the target over the seeds that reached
    it, against the configurations that reached it in as many of their seeds."""
    if not j.completed:
        return f"every run failed ({j.runs}/{j.runs})"
    if j.target is None:
        return "no evaluation logged"
    if not j.reached:
        return f"never reached {j.target:.0%}; best {j.best_accuracy.text(_pct)} %"
    share, seeds, mean = j.reached / j.runs, f"{j.reached}/{j.runs} seeds", j.time_to_target.mean
    said = f"{j.target:.0%} in {_secs(j.time_to_target)} s ({seeds})"
    rivals = [o for o in judged if o.index != j.index and o.completed]
    if rivals and all(o.reached / o.runs < share for o in rivals):
        said += ", the most seeds at the target"
    peers = [o.time_to_target.mean for o in rivals if o.reached and o.reached / o.runs == share
             and o.time_to_target.mean is not None]
    if peers and mean is not None:
        among = "" if all(o.reached / o.runs == share for o in rivals) else f" at {seeds}"
        fastest = min(peers)
        said += f", the fastest{among}" if mean <= fastest else f", {mean / fastest:.1f}x the fastest{among}"
    return said


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f}"


def _secs(stat: Stat) -> str:
    """Seconds, mean ± sd, with the digits the mean needs to tell short runs apart (0.071,
    4.56, 12.3); the sd takes the mean's."""
    mean = abs(stat.mean or 0.0)
    decimals = 3 if mean < 1 else 2 if mean < 10 else 1
    return stat.text(f"{{:.{decimals}f}}".format)


# The judging table's columns and what each says (the CLI prints them, the HTML report
# shows the hover text), in ``table_cells``' order.
TABLE_HEAD: tuple[tuple[str, str], ...] = (
    ("place", "1 = best; see why"),
    ("configuration", "the compare spec"),
    ("runs ok", "completed runs / seeds"),
    ("best test acc %", "each run's best snapshot, mean ± sd over seeds (test error = 100 - it)"),
    ("time to best s", "first snapshot at the run's best accuracy, training clock, mean ± sd"),
    ("time to target s", "first snapshot at the target, mean ± sd over the seeds that reached it (how many)"),
    ("extra hyper-params", "knobs beyond SGD, from the config schema (judging.extra_hyperparameters)"),
    ("final acc sd pp", "sd across seeds of the final test accuracy, percentage points"),
    ("stalled or diverged", "runs whose health was stalled or diverging, of the seeds"),
    ("process-s", "processes x wall seconds, mean per run"),
    ("CPU-s", "user + system CPU seconds of every process, mean per run"),
    ("MiB sent", "bytes sent by every process, mean per run, 1 MiB = 2^20 bytes"),
)


def table_cells(j: Judged) -> list[tuple[str, Any]]:
    """(text, sort value) of each column of ``TABLE_HEAD`` for one configuration."""
    count = _count(j)
    ttt = _secs(j.time_to_target)
    if j.target is not None:
        ttt = f"{ttt} ({j.reached}/{j.runs})" if j.reached else f"not reached ({j.runs} seeds)"
    sd = j.final_accuracy.sd
    return [
        (str(j.place), j.place),
        (j.name, j.name),
        (f"{j.completed}/{j.runs}", j.completed / j.runs if j.runs else 0),
        (j.best_accuracy.text(_pct), j.best_accuracy.mean),
        (_secs(j.time_to_best), j.time_to_best.mean),
        (ttt, j.time_to_target.mean),
        ("?" if count is None else str(count), count),
        ("–" if sd is None else f"{100 * sd:.2f}", sd),
        (f"{j.unstable}/{j.runs}", j.unstable / j.runs if j.runs else None),
        (j.process_seconds.text(), j.process_seconds.mean),
        (j.cpu_seconds.text(), j.cpu_seconds.mean),
        (j.mib_sent.text("{:,.2f}".format), j.mib_sent.mean),
    ]


def target_heading(judged: Sequence[Judged]) -> str:
    """``time to 90% s``: the target column's heading with the target the table timed."""
    target = judged[0].target if judged else None
    return "time to target s" if target is None else f"time to {target:.0%} s"
