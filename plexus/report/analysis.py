"""What a comparison of runs concludes: labels, time to accuracy, a ranking, a config diff.

Pure functions over the contents of run directories (``config.json``, ``summary.json``,
``metrics.jsonl`` events), shared by ``plexus compare``'s table and the HTML report so
that both say the same thing. Every figure follows ``plexus.train.summary.FIGURES``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plexus.config.applies import APPLIES, strategy_keys

__all__ = ["THRESHOLDS", "STRATEGY_KEYS", "MIB", "applies", "flat_config", "knob_labels", "time_to_accuracy",
           "time_to_best", "eval_models", "Ranked", "rank", "config_diff", "mib", "seconds_text"]

# Test accuracies (fractions) at which every report gives the time to reach them.
THRESHOLDS = (0.80, 0.90, 0.95)

MIB = float(2**20)  # bytes in a MiB: the one byte unit of the CLI and the report

# The knobs that only some strategies read, from the one table that also refuses a flag
# the strategy would ignore (``plexus.config.applies``); the rest (workers, lr, dataset)
# apply to every run. A label or a diff shows a knob only for runs it applies to:
# `ps consistency=asp` is a difference, `allreduce consistency=asp` is noise.
STRATEGY_KEYS: Mapping[str, frozenset[str]] = strategy_keys()
_SPECIFIC = frozenset(APPLIES)
# Keys that never tell runs apart usefully (where output goes, how it is shown, ports).
_IGNORED = frozenset({"out", "overwrite", "json", "quiet", "debug", "save_model", "no_report", "host", "port", "strategy"})
# Knobs shown first in a label: the ones a comparison most often varies.
_PRIORITY = ("algorithm", "consistency", "variant", "topology", "async_gossip", "period", "workers", "servers",
             "optimizer", "lr", "momentum", "batch_size")


def applies(key: str, strategy: str | None) -> bool:
    """Whether ``key`` is read by ``strategy`` (unknown strategies: every key applies)."""
    if key not in _SPECIFIC or strategy not in STRATEGY_KEYS:
        return True
    return key in STRATEGY_KEYS[strategy]


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json``'s values by flat key (``lr``, not ``optim.lr``); sources left out."""
    out: dict[str, Any] = {}
    for comp, values in config.items():
        if comp != "sources" and isinstance(values, dict):
            out.update(values)
    return out


def _text(value: Any) -> str:
    """A value as its flag would read: ``worker:1@step=5`` for a kill, ``none`` for no list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            return "none"
        if all(isinstance(v, dict) and {"role", "rank"} <= v.keys() for v in value):
            return ",".join(f"{v['role']}:{v['rank']}" + (f"@step={v['step']}" if v.get("step") is not None else "")
                            + (f"@time={v['seconds']:g}" if v.get("seconds") is not None else "")
                            + (f"={v['factor']:g}" if "factor" in v else "") for v in value)
    if isinstance(value, dict) and set(value) == {"bandwidth", "latency"}:
        if value["bandwidth"] is None and not value["latency"]:
            return "none"
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def knob_labels(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """``strategy`` plus every knob that applies to the run and differs between the runs
    it applies to, as ``key=value``, e.g. ``ps consistency=asp optimizer=adagrad lr=0.05``.

    No knob is dropped to keep a label short: a table wraps it rather than cut it.
    """
    flats = [flat_config(c) for c in configs]
    strategies = [f.get("strategy") for f in flats]
    keys = [k for k in dict.fromkeys(k for f in flats for k in f) if k not in _IGNORED]
    order = {k: i for i, k in enumerate(_PRIORITY)}
    keys.sort(key=lambda k: order.get(k, len(order)))
    shown = []
    for key in keys:
        if key == "algorithm":
            continue  # part of the base label
        values = {_text(f.get(key)) for f, s in zip(flats, strategies) if applies(key, s)}
        if len(values) > 1:
            shown.append(key)
    labels = []
    for flat, strategy in zip(flats, strategies):
        # The all-reduce algorithm names the run where it applies: allreduce/ring.
        base = str(strategy or "run")
        if flat.get("algorithm") and applies("algorithm", strategy) and strategy in STRATEGY_KEYS:
            base += f"/{flat['algorithm']}"
        parts = [base] + [f"{k}={_text(flat.get(k))}" for k in shown if k in flat and applies(k, strategy)]
        labels.append(" ".join(parts))
    return labels


def eval_models(events: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(time, test accuracy) of each evaluated model (``global``, ``worker0``), by time."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("event") != "eval":
            continue
        t, acc = e.get("time"), e.get("test_accuracy")
        if isinstance(t, (int, float)) and isinstance(acc, (int, float)):
            out.setdefault(str(e.get("model", "global")), []).append((float(t), float(acc)))
    return {model: sorted(points) for model, points in out.items()}


def _main_model(models: Mapping[str, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    if "global" in models:
        return models["global"]
    return models[sorted(models)[0]] if models else []


def time_to_accuracy(events: Sequence[Mapping[str, Any]], threshold: float) -> float | None:
    """Training-clock seconds of the first snapshot of the evaluated (global) model at or
    above ``threshold``; None when none reached it."""
    return next((t for t, acc in _main_model(eval_models(events)) if acc >= threshold - 1e-12), None)


def time_to_best(events: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """(seconds, accuracy) of the first snapshot at the run's best test accuracy."""
    points = _main_model(eval_models(events))
    if not points:
        return None, None
    best = max(acc for _, acc in points)
    return next(t for t, acc in points if acc == best), best


def seconds_text(seconds: float) -> str:
    """Seconds with the digits that tell short runs apart: 0.23 s, 4.56 s, 12.3 s."""
    return f"{seconds:.2f} s" if abs(seconds) < 10 else f"{seconds:.1f} s"


def mib(nbytes: Any) -> float | None:
    return nbytes / MIB if isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool) else None


@dataclass(frozen=True)
class Ranked:
    """One run's place in the ranking and the figures it was ranked on."""

    index: int                     # position of the run in the input
    place: int                     # 1 = best
    target: float | None           # the accuracy the ranking timed (fraction)
    time_to_target: float | None   # s
    final_accuracy: float | None   # fraction
    time_to_best: float | None     # s
    best_accuracy: float | None    # fraction
    mib_sent: float | None         # MiB sent by every process
    failed: bool
    why: str


def _ranking_target(configs: Sequence[Mapping[str, Any]], events: Sequence[Sequence[Mapping[str, Any]]]
                    ) -> float | None:
    """The runs' --target-accuracy, else the highest of THRESHOLDS that any run reached."""
    targets = [t for c in configs if isinstance(t := c.get("run", {}).get("target_accuracy"), (int, float))]
    if targets:
        return max(targets)
    reached = [th for th in THRESHOLDS if any(time_to_accuracy(ev, th) is not None for ev in events)]
    return max(reached) if reached else None


def rank(summaries: Sequence[Mapping[str, Any]], configs: Sequence[Mapping[str, Any]],
         events: Sequence[Sequence[Mapping[str, Any]]]) -> list[Ranked]:
    """Order the runs: time to the target (the runs' --target-accuracy, else the highest of
    80/90/95% that any run reached), then final accuracy, time to best, MiB sent. Failed
    runs come last. Each gets a short reason."""
    target = _ranking_target(configs, events)
    rows = []
    for i, (summary, ev) in enumerate(zip(summaries, events)):
        failed = summary.get("status") == "failed"
        ttt = time_to_accuracy(ev, target) if target is not None else None
        tbest, best = time_to_best(ev)
        final = summary.get("final_test_accuracy")
        rows.append(dict(index=i, target=target, time_to_target=ttt,
                         final_accuracy=final if isinstance(final, (int, float)) else None,
                         time_to_best=tbest, best_accuracy=best, mib_sent=mib(summary.get("bytes_sent_total")),
                         failed=failed))

    def key(r: dict[str, Any]) -> tuple:
        inf = math.inf
        return (r["failed"], r["time_to_target"] is None, r["time_to_target"] if r["time_to_target"] is not None
                else inf, -(r["final_accuracy"] or 0.0), r["time_to_best"] if r["time_to_best"] is not None
                else inf, r["mib_sent"] if r["mib_sent"] is not None else inf)

    ordered = sorted(rows, key=key)
    ok = [r for r in ordered if not r["failed"]]
    finals = [r["final_accuracy"] for r in ok if r["final_accuracy"] is not None]
    sent = [r["mib_sent"] for r in ok if r["mib_sent"] is not None]
    first_time = ordered[0]["time_to_target"] if ordered else None
    out = []
    for place, r in enumerate(ordered, 1):
        summary = summaries[r["index"]]
        out.append(Ranked(place=place, why=_why(r, summary, place, first_time, finals, sent), **r))
    return out


def _why(r: dict[str, Any], summary: Mapping[str, Any], place: int, first_time: float | None,
         finals: list[float], sent: list[float]) -> str:
    if r["failed"]:
        return f"failed: {summary.get('error') or 'see its run directory'}"
    reasons = []
    target, ttt, final = r["target"], r["time_to_target"], r["final_accuracy"]
    if target is not None and ttt is not None:
        if place == 1:
            reasons.append(f"first to {target:.0%} ({seconds_text(ttt)})")
        else:
            slower = f", {ttt / first_time:.1f}x the time of #1" if first_time else ""
            reasons.append(f"{target:.0%} in {seconds_text(ttt)}{slower}")
        if final is not None and final < target:
            reasons.append(f"fell back to {final:.2%} at the end")
    elif target is not None:
        reasons.append(f"never reached {target:.0%}")
    if final is not None and finals and final == max(finals) and len(finals) > 1:
        reasons.append(f"best final accuracy ({final:.2%})")
    elif final is not None and (target is None or ttt is None):
        reasons.append(f"final {final:.2%}")
    if r["mib_sent"] is not None and sent and r["mib_sent"] == min(sent) and len(sent) > 1:
        reasons.append(f"fewest bytes ({r['mib_sent']:,.1f} MiB)")
    health = summary.get("health")
    if health not in (None, "ok"):
        reasons.append(f"{str(health).upper()}: {summary.get('health_hint') or 'see the run'}")
    return "; ".join(reasons) or "no evaluation logged"


def config_diff(configs: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[tuple[str, str] | None]]]:
    """The keys whose effective values differ between runs, or that apply to some of them
    only: [(key, [(value, source) or None where the key does not apply to that run's
    strategy])], in config order."""
    flats = [flat_config(c) for c in configs]
    sources = [c.get("sources", {}) if isinstance(c.get("sources"), dict) else {} for c in configs]
    strategies = [f.get("strategy") for f in flats]
    keys = [k for k in dict.fromkeys(k for f in flats for k in f) if k not in _IGNORED - {"strategy"}]
    out = []
    for key in keys:
        cells = [(_text(f.get(key)), str(src.get(key, "default"))) if key in f and applies(key, s) else None
                 for f, src, s in zip(flats, sources, strategies)]
        present = [c for c in cells if c is not None]
        # A knob differs when its values do, or when it applies to some runs only
        # (ps's consistency beside allreduce): both change what the runs did.
        if len({c[0] for c in present}) > 1 or (present and len(present) < len(cells)):
            out.append((key, cells))
    return out
