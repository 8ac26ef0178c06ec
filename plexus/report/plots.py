"""The report's plots: one PNG per quantity, every run overlaid on the same axes.

Inputs are the events of ``metrics.jsonl`` (see ``plexus.train.metrics``) already read
and labelled, and each run's summary for what only it holds (the stage time line); this
module knows nothing about run directories. A plot whose data no run has is skipped
rather than drawn empty, so a strategy without staleness or a run that never evaluated
still gets a report.

Figures are built with ``matplotlib.figure.Figure`` rather than ``pyplot``: they never
enter pyplot's global registry of open figures, so nothing needs closing, nothing
accumulates across calls in a long session, and no GUI backend is ever selected (the
PNG is rendered by Agg whatever the default backend is).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from plexus.report.stages import KINDS, timeline_lanes

__all__ = ["PlotRun", "Plot", "write_plots", "byte_unit", "plot_series", "throughput_series", "bytes_series",
           "job_samples_series", "time_split_series"]

MIB = float(2**20)  # the one byte unit of the plots, the tables and the CLI

# Fraction of a run's duration over which throughput is averaged: short enough to show
# a slowdown (a straggler, a lost worker), long enough that the uneven spacing of log
# events from several processes does not turn the derivative into noise.
_THROUGHPUT_WINDOW = 0.1

_FIGSIZE = (7.0, 4.2)  # inches; at 110 dpi a plot fits a laptop screen beside the table
_DPI = 110


@dataclass(frozen=True)
class PlotRun:
    """One run as the plots see it: a legend label and its events."""

    label: str
    # metrics.jsonl events in file order (any kinds; each plot picks its own).
    events: list[dict[str, Any]] = field(default_factory=list)
    # Target test accuracy as a fraction in (0, 1], or None when the run had none.
    target_accuracy: float | None = None
    # The run's summary.json, for the figures of a whole run rather than of events (the
    # stage time line of a model-parallel run); empty when there is none.
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plot:
    """A written plot: its PNG and a one-line caption for the report."""

    path: Path
    caption: str


def byte_unit(nbytes: float) -> tuple[float, str]:
    """The IEC unit (divisor, name) that shows ``nbytes`` with 1 to 4 integer digits."""
    for power, name in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(nbytes) >= 1024**power:
            return float(1024**power), name
    return 1.0, "B"


def _number(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing or not a number (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _of_kind(run: PlotRun, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.events if isinstance(e, dict) and e.get("event") == kind]


def _evals(run: PlotRun) -> list[tuple[list[dict[str, Any]], str]]:
    """The eval events to plot, by model: the global (averaged) model first, then worker
    0's own replica where the strategy keeps one (gossip, local-sgd, easgd), so that the
    two are drawn side by side; a run without a global model shows its first replica."""
    evals = [e for e in _of_kind(run, "eval") if _number(e.get("test_accuracy")) is not None]
    models = sorted({str(e.get("model", "global")) for e in evals}, key=lambda m: (m != "global", m))
    if "global" not in models:
        models = models[:1]
    return [([e for e in evals if str(e.get("model", "global")) == m], m) for m in models[:2]]


def _series(events: list[dict[str, Any]], x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the events where both are numbers, sorted by x."""
    pairs = sorted((_number(e.get(x)), _number(e.get(y))) for e in events
                   if _number(e.get(x)) is not None and _number(e.get(y)) is not None)
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def _new_figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, ax: Any, path: Path) -> Path:
    ax.legend(fontsize="small")
    fig.savefig(path, format="png")
    return path


def _color(index: int) -> str:
    # The run's index, not its position among runs that have this plot's data, picks the
    # colour, so one run keeps one colour across every plot of the report.
    return f"C{index % 10}"


def _eval_label(run: PlotRun, model: str) -> str:
    if model == "global":
        # Beside a replica's line, the global model is the average of the replicas.
        has_replica = any(e.get("model", "global") != "global" for e in _of_kind(run, "eval"))
        return f"{run.label} (averaged)" if has_replica else run.label
    return f"{run.label} ({model.replace('worker', 'worker ')}'s replica)"


def _accuracy_vs(runs: Sequence[PlotRun], x: str, out: Path, xlabel: str, title: str,
                 with_target: bool) -> Path | None:
    fig, ax = _new_figure(title, xlabel, "test accuracy (%)")
    drawn = False
    for i, run in enumerate(runs):
        for evals, model in _evals(run):
            xs, ys = _series(evals, x, "test_accuracy")
            if len(xs):
                # The averaged model solid, worker 0's replica dashed, in the run's colour.
                ax.plot(xs, ys * 100, marker="o" if model == "global" else None, markersize=3,
                        linestyle="-" if model == "global" else "--", color=_color(i),
                        label=_eval_label(run, model))
                drawn = True
    if not drawn:
        return None
    if with_target:
        targets = sorted({run.target_accuracy for run in runs if _number(run.target_accuracy) is not None})
        for target in targets:
            ax.axhline(target * 100, linestyle="--", color="0.4", linewidth=1,
                       label=f"target {target * 100:g} %")
    return _save(fig, ax, out)


def _loss(runs: Sequence[PlotRun], out: Path) -> Path | None:
    fig, ax = _new_figure("Training loss", "time (s)", "training loss (mean over workers at each step)")
    drawn = False
    for i, run in enumerate(runs):
        # Mean over the workers that logged a step, at the mean of their times: for
        # synchronous strategies they log together; for asynchronous ones a step is each
        # worker's own count, and the mean still tracks the job. A lost worker simply
        # stops contributing.
        by_step: dict[float, list[tuple[float, float]]] = defaultdict(list)
        for e in _of_kind(run, "train"):
            step, t, loss = _number(e.get("step")), _number(e.get("time")), _number(e.get("loss"))
            if step is not None and t is not None and loss is not None:
                by_step[step].append((t, loss))
        if not by_step:
            continue
        points = sorted((float(np.mean([p[0] for p in ps])), float(np.mean([p[1] for p in ps])))
                        for ps in by_step.values())
        ax.plot([p[0] for p in points], [p[1] for p in points], color=_color(i), label=run.label)
        drawn = True
    return _save(fig, ax, out) if drawn else None


def job_samples_series(events: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(time, samples the whole job has consumed) at every train event: the running
    maximum of the events' ``samples``, each the job's total as one worker knows it (for
    asynchronous strategies the sum of every worker's count, kept in the store), so the
    last value is the summary's ``samples`` and the curve stays defined when a worker is
    lost."""
    ts, ss = _series([e for e in events if e.get("event", "train") == "train"], "time", "samples")
    return ts, (np.maximum.accumulate(ss) if len(ss) else ss)


def _throughput_curve(events: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Smoothed d(samples)/d(time) of the job, in samples per second: the sum over
    workers, the summary's ``samples_per_second`` over a window instead of the run.

    Each train event carries the job's sample count as one worker knows it
    (``job_samples_series``). Only the moments the progress first reaches a new
    count are kept: the other workers logging the same step a few milliseconds later add
    no samples, and would otherwise read as zero throughput. The rate at each kept point
    is the slope back to the last point at least ``_THROUGHPUT_WINDOW`` of the run
    earlier (or to the first point), a moving average of the derivative.
    """
    ts, progress = job_samples_series(events)
    if len(ts) < 2:
        return np.array([]), np.array([])
    rises = np.concatenate(([True], progress[1:] > progress[:-1]))
    ts, progress = ts[rises], progress[rises]
    span = ts[-1] - ts[0]
    if len(ts) < 2 or span <= 0:
        return np.array([]), np.array([])
    window = span * _THROUGHPUT_WINDOW
    prev = np.maximum(np.searchsorted(ts, ts - window, side="right") - 1, 0)
    valid = ts > ts[prev]  # the first point, and any sharing its time, have no slope yet
    rates = (progress[valid] - progress[prev[valid]]) / (ts[valid] - ts[prev[valid]])
    return ts[valid], rates


def _throughput(runs: Sequence[PlotRun], out: Path) -> Path | None:
    fig, ax = _new_figure("Throughput of the job (sum over workers)", "time (s)",
                          f"samples/s, all workers (window {_THROUGHPUT_WINDOW:.0%} of run)")
    drawn = False
    for i, run in enumerate(runs):
        ts, rates = _throughput_curve(_of_kind(run, "train"))
        if len(ts):
            ax.plot(ts, rates, color=_color(i), label=run.label)
            drawn = True
    if drawn:
        ax.set_ylim(bottom=0)
    return _save(fig, ax, out) if drawn else None


def _bytes_curve(events: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Total bytes sent by all workers over time (servers and aggregators log no train
    events, so they are not in it: the summary's ``bytes_sent_workers``, not ``_total``).

    ``bytes_sent`` is each process's cumulative counter; at every event the job's total
    is the sum of each worker's latest value, so workers logging at different moments
    are neither double-counted nor dropped.
    """
    rows = sorted((t, str(e.get("worker")), b) for e in events
                  if (t := _number(e.get("time"))) is not None and (b := _number(e.get("bytes_sent"))) is not None)
    latest: dict[str, float] = {}
    ts, totals = [], []
    for t, worker, sent in rows:
        latest[worker] = sent
        ts.append(t)
        totals.append(sum(latest.values()))
    return np.array(ts), np.array(totals)


def _bytes_sent(runs: Sequence[PlotRun], out: Path) -> Path | None:
    curves = [(i, run, *_bytes_curve(_of_kind(run, "train"))) for i, run in enumerate(runs)]
    curves = [c for c in curves if len(c[2])]
    if not curves:
        return None
    fig, ax = _new_figure("Bytes sent by the workers", "time (s)",
                          "cumulative MiB sent by the workers (not servers, aggregators)")
    for i, run, ts, totals in curves:
        ax.step(ts, totals / MIB, where="post", color=_color(i), label=run.label)
    return _save(fig, ax, out)


def time_split_series(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, float, float, float]]]:
    """Per worker, each interval between two of its train events as (start s, end s,
    compute s, communication and waiting s, other s): compute is forward + backward,
    communication and waiting the rest of ``Strategy.step``, other the time outside it
    (data, logging, snapshots). From the cumulative ``compute_seconds`` and
    ``step_seconds`` of train events (``plexus.train.timing``); empty for runs without."""
    out: dict[int, list[tuple[float, float, float, float, float]]] = {}
    last: dict[int, tuple[float, float, float]] = {}
    rows = sorted((t, w, c, st) for e in events if e.get("event", "train") == "train"
                  and (t := _number(e.get("time"))) is not None and isinstance(w := e.get("worker"), int)
                  and (c := _number(e.get("compute_seconds"))) is not None
                  and (st := _number(e.get("step_seconds"))) is not None)
    for t, w, c, st in rows:
        t0, c0, s0 = last.get(w, (0.0, 0.0, 0.0))
        span = t - t0
        if span > 0:
            compute, inside = max(c - c0, 0.0), max(st - s0, 0.0)
            comm = max(inside - compute, 0.0)
            out.setdefault(w, []).append((t0, t, min(compute, span), min(comm, span - min(compute, span)),
                                          max(span - inside, 0.0)))
        last[w] = (t, c, st)
    return out


_SPLIT_COLOURS = (("compute (forward + backward)", "#4c72b0"),
                  ("communication and waiting", "#dd8452"),
                  ("outside the step (data, logs)", "#cccccc"))


def _time_line(runs: Sequence[PlotRun], out: Path) -> Path | None:
    """One lane per worker of every run; along time, each lane is split into bands whose
    heights are the shares of compute, communication and waiting, and the rest."""
    lanes = [(run, w, intervals) for run in runs for w, intervals in sorted(time_split_series(run.events).items())]
    if not lanes:
        return None
    fig = Figure(figsize=(_FIGSIZE[0], max(2.5, 0.32 * len(lanes) + 1.4)), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Where each worker's time goes")
    ax.set_xlabel("time (s)")
    # One collection of rectangles per colour: a bar each (ax.bar) made a patch per interval,
    # and a few thousand patches took seconds to lay out and draw.
    from matplotlib.collections import PolyCollection
    boxes: list[list[np.ndarray]] = [[] for _ in _SPLIT_COLOURS]
    end = 0.0
    for lane, (run, w, intervals) in enumerate(lanes):
        y = len(lanes) - 1 - lane
        arr = np.array(intervals)  # columns: start, end, compute, communication, other
        left, right = arr[:, 0], arr[:, 1]
        end = max(end, float(right.max()))
        bottom = np.full(len(arr), y - 0.4)
        for col in range(len(_SPLIT_COLOURS)):
            top = bottom + 0.8 * arr[:, col + 2] / (right - left)
            boxes[col].append(np.stack([np.stack([left, bottom], 1), np.stack([right, bottom], 1),
                                        np.stack([right, top], 1), np.stack([left, top], 1)], 1))
            bottom = top
    for (_, colour), parts in zip(_SPLIT_COLOURS, boxes):
        ax.add_collection(PolyCollection(np.concatenate(parts), facecolors=colour, linewidths=0))
    ax.set_yticks(range(len(lanes)), [f"{run.label} w{w}" for run, w, _ in reversed(lanes)], fontsize="small")
    ax.set_xlim(0, end * 1.02 if end > 0 else 1.0)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colour, label=name) for name, colour in _SPLIT_COLOURS], fontsize="x-small",
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    fig.savefig(out, format="png")
    return out


# Compute and waiting in the colours of _time_line; the replicas' synchronisation apart.
_STAGE_COLOURS = {"compute": "#4c72b0", "forward": "#64b5cd", "backward": "#8172b3", "wait": "#dd8452",
                  "sync": "#55a868"}
_STAGE_KIND_NAMES = {"compute": "compute (forward, backward, optimizer)", "forward": "a micro-batch's forward",
                     "backward": "a micro-batch's backward", "wait": "waiting for other stages",
                     "sync": "sync across replicas"}


def _stage_time_line(runs: Sequence[PlotRun], out: Path) -> Path | None:
    """One row per stage process of each model-parallel run, a bar per span of its
    summary's ``timeline`` (the last few steps): where a pipeline's stages compute, wait
    for each other and synchronise. One panel per run, each on its own clock."""
    panels = [(run, lanes) for run in runs if (lanes := timeline_lanes(run.summary))]
    if not panels:
        return None
    rows = sum(len(lanes) for _, lanes in panels)
    fig = Figure(figsize=(_FIGSIZE[0], max(2.5, 0.35 * rows + 1.2 * len(panels) + 0.6)), dpi=_DPI,
                 layout="constrained")
    # A last, empty row holds the legend: fig.legend outside the axes needs matplotlib 3.7.
    axes = fig.subplots(len(panels) + 1, 1, squeeze=False,
                        height_ratios=[len(lanes) + 1.5 for _, lanes in panels] + [0.6])[:, 0]
    for ax, (run, lanes) in zip(axes, panels):
        for row, lane in enumerate(lanes):
            for kind in KINDS:
                bars = [(start, end - start) for k, start, end in lane.spans if k == kind]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), color=_STAGE_COLOURS[kind], linewidth=0)
        ax.set_yticks(range(len(lanes)), [lane.label for lane in lanes], fontsize="small")
        ax.set_ylim(len(lanes) - 0.5, -0.5)  # stage 0 on top: the forward pass reads downwards
        ax.set_title(f"Stage time line: {run.label}" if len(panels) > 1 else "Stage time line (last steps)",
                     fontsize="medium")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-2].set_xlabel("time (s)")
    from matplotlib.patches import Patch
    axes[-1].axis("off")
    drawn = [k for k in KINDS if any(span[0] == k for _, lanes in panels for lane in lanes for span in lane.spans)]
    axes[-1].legend(handles=[Patch(color=_STAGE_COLOURS[k], label=_STAGE_KIND_NAMES[k]) for k in drawn],
                    fontsize="x-small", loc="center", ncol=min(len(drawn), 3), frameon=False)
    fig.savefig(out, format="png")
    return out


def throughput_series(events: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(time, job samples/s) as the throughput plot draws it."""
    return _throughput_curve([e for e in events if e.get("event", "train") == "train"])


def bytes_series(events: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(time, MiB sent by the workers) as the bytes plot draws it."""
    ts, totals = _bytes_curve([e for e in events if e.get("event", "train") == "train"])
    return ts, totals / MIB


def plot_series(run: PlotRun) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every series the plots draw for ``run``, by name, so that tests (and users) can
    check them against ``summary.json``: ``samples`` (job total), ``throughput`` (job
    samples/s), ``mib_sent_workers``, and ``accuracy_<model>`` (time, fraction)."""
    out = {"samples": job_samples_series(run.events), "throughput": throughput_series(run.events),
           "mib_sent_workers": bytes_series(run.events)}
    for evals, model in _evals(run):
        out[f"accuracy_{model}"] = _series(evals, "time", "test_accuracy")
    return out


def _staleness(runs: Sequence[PlotRun], out: Path) -> Path | None:
    hists: list[tuple[int, PlotRun, list[float]]] = []
    for i, run in enumerate(runs):
        events = _of_kind(run, "staleness_histogram")
        counts = events[-1].get("counts") if events else None  # the last one covers the whole run
        if isinstance(counts, list):
            values = [_number(c) or 0.0 for c in counts]
            if any(values):
                hists.append((i, run, values))
    if not hists:
        return None
    fig, ax = _new_figure("Staleness of applied updates", "staleness (versions behind)", "updates applied")
    # Grouped bars: each run gets a slice of the unit width around each staleness value.
    width = 0.8 / len(hists)
    for slot, (i, run, values) in enumerate(hists):
        xs = np.arange(len(values)) + (slot - (len(hists) - 1) / 2) * width
        ax.bar(xs, values, width=width, color=_color(i), label=run.label)
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _save(fig, ax, out)


def write_plots(runs: Sequence[PlotRun], out_dir: str | Path) -> list[Plot]:
    """Write every plot some run has data for into ``out_dir``; return them in report order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    makers = (
        ("accuracy_time.png", "Test accuracy against wall time",
         lambda p: _accuracy_vs(runs, "time", p, "time (s)", "Test accuracy vs time", with_target=True)),
        ("accuracy_samples.png", "Test accuracy against training samples consumed",
         lambda p: _accuracy_vs(runs, "samples", p, "samples", "Test accuracy vs samples", with_target=False)),
        ("loss_time.png", "Training loss against wall time", lambda p: _loss(runs, p)),
        ("throughput.png", "Throughput of the job: samples/s summed over workers", lambda p: _throughput(runs, p)),
        ("bytes_sent.png", "Cumulative MiB sent by the workers (servers and aggregators not included)",
         lambda p: _bytes_sent(runs, p)),
        ("time_line.png", "Per worker: compute, communication and waiting, and the rest, along time",
         lambda p: _time_line(runs, p)),
        ("stage_time_line.png", "Per stage process of a model-parallel run: computing, waiting for the "
         "other stages and synchronising across replicas, over its last steps", lambda p: _stage_time_line(runs, p)),
        ("staleness.png", "Staleness histogram (last one logged)", lambda p: _staleness(runs, p)),
    )
    written = []
    for name, caption, make in makers:
        path = make(out / name)
        if path is not None:
            written.append(Plot(path=path, caption=caption))
    return written
