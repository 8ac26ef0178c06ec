"""What a report shows of a model-parallel run (``plexus train --stages K [--workers R]``).

Such a run's ``summary.json`` has ``stages``, one entry per stage process (R x K of them),
and ``stage_traffic``, one row per direction of a cut edge with the messages and bytes
measured at both ends beside the partition plan's prediction, summed over the replicas
(``plexus.parallel.executor.stage_summary``). Each stage entry may carry ``timeline``, a
list of ``[kind, start s, end s]`` on the events' clock covering the process's last few
steps, kind one of ``KINDS``.

This module only reads those figures into lanes and table cells; ``plexus.report.plots``
draws the lanes and ``plexus.report.html`` renders the cells, as ``judging`` does for the
judging table. A summary without stages yields no lanes and no rows, so other runs'
reports are unchanged. Malformed entries (a hand-edited or truncated summary) are
skipped rather than failing the whole report.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from plexus.report.analysis import mib

__all__ = ["KINDS", "Lane", "pipeline_line", "stage_name", "timeline_lanes", "TRAFFIC_HEAD", "traffic_cells",
           "STAGE_HEAD", "stage_cells"]

MISSING = "–"

Kind = Literal["compute", "forward", "backward", "wait", "sync"]
# compute: forward, backward and optimizer step of the stage's layers; in a pipeline
# (--microbatches), forward and backward: one micro-batch's each; wait: blocked on
# activations or gradients from a neighbouring stage; sync: the stage group's strategy
# agreeing with the other replicas (only with --workers R > 1).
KINDS: tuple[Kind, ...] = ("compute", "forward", "backward", "wait", "sync")

Cell = tuple[str, Any, str]  # (text, sort key, hover text); the sort key is "" for a missing value


@dataclass(frozen=True)
class Lane:
    """One stage process on the time line: its name and its spans, in time order."""

    label: str
    # (kind, start s, end s) with end >= start, on the events' clock.
    spans: list[tuple[Kind, float, float]]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _stages(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    stages = summary.get("stages")
    if not isinstance(stages, list):
        return []
    valid = [s for s in stages if isinstance(s, dict) and isinstance(s.get("stage"), int)]
    # A pipeline's forward order; a stage's tensor-parallel shards together.
    return sorted(valid, key=lambda s: (s.get("replica", 0), s["stage"], s.get("shard", 0)))


def stage_name(entry: Mapping[str, Any], replicated: bool) -> str:
    """``stage k``, or ``replica r stage k`` when the run has several replicas; ``shard t``
    after it under --tensor-parallel."""
    stage, replica, shard = entry.get("stage"), entry.get("replica", 0), entry.get("shard")
    name = f"replica {replica} stage {stage}" if replicated else f"stage {stage}"
    return f"{name} shard {shard}" if "tensor_bytes_sent" in entry and isinstance(shard, int) else name


def _replicated(stages: list[dict[str, Any]]) -> bool:
    return len({s.get("replica", 0) for s in stages}) > 1


def _spans(timeline: Any) -> list[tuple[Kind, float, float]]:
    spans = []
    for item in timeline if isinstance(timeline, list) else []:
        if not isinstance(item, (list, tuple)) or len(item) != 3 or item[0] not in KINDS:
            continue
        start, end = _number(item[1]), _number(item[2])
        if start is not None and end is not None and end >= start:
            spans.append((item[0], start, end))
    return sorted(spans, key=lambda s: s[1])


def timeline_lanes(summary: Mapping[str, Any]) -> list[Lane]:
    """One lane per stage process, replica by replica and stage by stage (the order of a
    pipeline's forward pass, top to bottom); empty when no stage has a usable timeline."""
    stages = _stages(summary)
    replicated = _replicated(stages)
    lanes = [Lane(label=stage_name(s, replicated), spans=_spans(s.get("timeline"))) for s in stages]
    return lanes if any(lane.spans for lane in lanes) else []


def _mib(value: Any, hover: str = "") -> Cell:
    """MiB, the report's unit, with the exact bytes on hover (a few bytes off the plan
    would not show in two decimals)."""
    n = mib(value)
    return (f"{n:,.2f}", value, hover or f"{value:,} bytes") if n is not None else (MISSING, "", hover)


def _count(value: Any, hover: str = "") -> Cell:
    return (f"{value:,.0f}", value, hover) if _number(value) is not None else (MISSING, "", hover)


def _secs(value: Any, hover: str = "") -> Cell:
    return (f"{value:.3f}", value, hover) if _number(value) is not None else (MISSING, "", hover)


# Header and hover text of each traffic column, in traffic_cells' order.
TRAFFIC_HEAD = (
    ("cut edge", "the stage that sends → the stage that receives (activations forward, gradients back)"),
    ("messages sent", "counted by the sending stage, summed over replicas"),
    ("messages received", "counted by the receiving stage"),
    ("messages predicted", "the partition plan's count for the steps made"),
    ("MiB sent", "1 MiB = 2^20 bytes; exact bytes on hover"), ("MiB received", ""), ("MiB predicted", ""),
    ("matches plan", "sent, received and predicted all equal, in messages and in bytes (received plus what an "
                     "asynchronous pipeline stopped early left in flight)"),
)


def traffic_cells(summary: Mapping[str, Any]) -> list[tuple[list[Cell], bool]]:
    """Per ``stage_traffic`` row, its cells in ``TRAFFIC_HEAD`` order and whether the
    measured traffic matches the plan (a row missing a figure does not match). Rows are
    sums over replicas, so a match here is necessary, not sufficient: the summary's
    ``traffic_matches_plan`` compares every replica's edges."""
    out = []
    rows = summary.get("stage_traffic")
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        messages = [row.get(k) for k in ("messages_sent", "messages_received", "predicted_messages")]
        nbytes = [row.get(k) for k in ("bytes_sent", "bytes_received", "predicted_bytes")]
        # An asynchronous pipeline stopped early leaves forwards in flight that no stage takes.
        flying = [row.get(k, 0) for k in ("messages_in_flight_at_stop", "bytes_in_flight_at_stop")]
        matches = all(_number(v) is not None for v in messages + nbytes + flying) \
            and messages[0] == messages[2] == messages[1] + flying[0] \
            and nbytes[0] == nbytes[2] == nbytes[1] + flying[1]
        edge = f"stage {row.get('src', '?')} → stage {row.get('dst', '?')}"
        cells = [(edge, edge, ""), *map(_count, messages), *map(_mib, nbytes),
                 ("yes", "yes", "") if matches else ("NO", "no", "the measured traffic differs from the plan's")]
        out.append((cells, matches))
    return out


# Header and hover text of each per-stage column, in stage_cells' order.
STAGE_HEAD = (
    ("process", "one process per stage of each replica"),
    ("layers", "the model's computing nodes this stage holds (names on hover)"),
    ("params", "parameters of the stage's layers"),
    ("compute s", "forward, backward and optimizer step; the plan's prediction on hover where it made one"),
    ("idle s", "waiting for activations or gradients from the neighbouring stages"),
    ("peak memory MiB", "the process's peak resident memory (how it was measured on hover, with a pipeline's "
                        "activations held at once beside the partition plan's count)"),
    ("MiB sent", "over the cut edges"), ("MiB received", "over the cut edges"),
    ("sync MiB sent", "the stage group's synchronisation across replicas (its strategy's all-reduce, pushes "
                      "and pulls...), not counted on the edges"),
)


def stage_cells(summary: Mapping[str, Any]) -> list[list[Cell]]:
    """Per stage process, its cells in ``STAGE_HEAD`` order."""
    stages = _stages(summary)
    replicated = _replicated(stages)
    out = []
    for s in stages:
        name = stage_name(s, replicated)
        nodes = s.get("nodes") if isinstance(s.get("nodes"), list) else None
        predicted = _number(s.get("predicted_compute_seconds"))
        measure = s.get("peak_memory_measure")
        memory_hover = f"measured by {measure}" if isinstance(measure, str) else ""
        held, planned = mib(s.get("peak_activation_bytes")), mib(s.get("planned_activation_bytes"))
        if held is not None and planned is not None:
            memory_hover += f"; activations held at once {held:,.2f} MiB, planned {planned:,.2f} MiB"
        out.append([
            (name, name, ""),
            (str(len(nodes)) if nodes is not None else MISSING, len(nodes) if nodes is not None else "",
             ", ".join(map(str, nodes or []))),
            _count(s.get("params")),
            _secs(s.get("compute_seconds"), f"predicted {predicted:.3f} s" if predicted is not None else ""),
            _secs(s.get("idle_seconds")),
            _mib(s.get("peak_memory_bytes"), memory_hover),
            _mib(s.get("bytes_sent")), _mib(s.get("bytes_recv")), _mib(s.get("sync_bytes_sent")),
        ])
    return out


def pipeline_line(summary: Mapping[str, Any]) -> str | None:
    """A pipelined run's schedule and bubble in one sentence (None without a pipeline)."""
    p = summary.get("pipeline")
    if not isinstance(p, dict):
        return None
    figures = [_number(p.get(k)) for k in ("bubble_measured", "bubble_predicted", "bubble_simulated")]
    if any(f is None for f in figures):
        return None
    measured, predicted, simulated = figures
    replayed = _number(p.get("bubble_replayed"))
    replayed_text = f", {replayed:.3f} replayed with each op's own duration" if replayed is not None else ""
    held = mib(p.get("peak_activation_bytes"))
    # An asynchronous schedule (pipedream) lists the whole run: its mini-batches, never flushed.
    over = (f"{p.get('minibatches')} mini-batches, never flushed, weight stashing "
            f"{'on' if p.get('weight_stashing') else 'off'}{', vertical sync' if p.get('vertical_sync') else ''}"
            f"{', delay compensated' if p.get('delay_compensation') else ''}"
            if "minibatches" in p else f"{p.get('microbatches')} micro-batches")
    return (f"{p.get('schedule')} over {over}"
            f"{' with recomputation' if p.get('recompute') else ''}: bubble {measured:.3f} measured, "
            f"{predicted:.3f} by the closed form, {simulated:.3f} simulated from the stages' measured op costs"
            f"{replayed_text}; "
            f"at most {p.get('max_in_flight')} micro-batches"
            f"{f' ({held:.2f} MiB of activations)' if held is not None else ''} held by a stage")
