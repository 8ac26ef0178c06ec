"""An HTML report of one or more run directories (contract 3 of ARCHITECTURE.md).

``write_report`` reads each run's ``config.json``, ``summary.json`` and ``metrics.jsonl``,
writes the plots of ``plexus.report.plots`` and an ``index.html`` beside them: a ranking
of the runs with the reason for each place (``plexus.report.analysis``), a summary table
with one row per run, the settings that differ, then the plots. Given configurations run
over several seeds (``plexus compare --seeds N``), the page opens with their judging table
(``plexus.report.judging``). The page is
self-contained (inline CSS and a few lines of inline script that sort the tables; no
network), so it can be opened from a results folder or mailed as it is. Wide tables
scroll inside their own box, so the page itself fits a 1,400 px window.
Everything that comes from a run directory is HTML-escaped: a strategy name is a user
string (``pkg.module:function`` factories are allowed) and must not inject markup.
"""
from __future__ import annotations

import html
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from plexus.errors import ConfigError
from plexus.report.analysis import MIB, THRESHOLDS, config_diff, knob_labels, rank, seconds_text, time_to_accuracy
from plexus.report.judging import TABLE_HEAD, Judged, judge, table_cells, target_heading
from plexus.report.plots import Plot, PlotRun, write_plots
from plexus.report.stages import STAGE_HEAD, TRAFFIC_HEAD, pipeline_line, stage_cells, traffic_cells
from plexus.train.metrics import FIGURES, read_events

__all__ = ["RunDir", "load_run", "run_labels", "write_report"]

MISSING = "–"  # shown for absent or null values

@dataclass(frozen=True)
class RunDir:
    """The contents of one run directory."""

    directory: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    events: list[dict[str, Any]]


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be read as JSON ({exc}): "
                          f"rewrite it with plexus train --out DIR") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def load_run(run_dir: str | Path, error: str | None = None) -> RunDir:
    """Read a run directory; raise ConfigError naming the directory and what it lacks.

    With ``error`` (the run failed), whatever the directory holds is read and the summary
    is marked ``failed`` with that error."""
    directory = Path(run_dir)
    if error is not None:
        return _load_failed(directory, error)
    if not directory.is_dir():
        raise ConfigError(f"run directory {str(directory)!r} does not exist: pass a directory "
                          f"written by plexus train --out DIR")
    missing = [name for name in ("summary.json", "metrics.jsonl") if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"run directory {str(directory)!r} has no {' and no '.join(missing)}: pass a "
                          f"directory written by a finished plexus train --out DIR")
    summary = _read_json_object(directory / "summary.json", "summary")
    # config.json only feeds labels and the target line, so a run without one still reports.
    config_path = directory / "config.json"
    config = _read_json_object(config_path, "config") if config_path.is_file() else {}
    try:
        events = read_events(directory)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"event log {str(directory / 'metrics.jsonl')!r} has a line that is not "
                          f"JSON ({exc}): each line must be one JSON event") from None
    return RunDir(directory=directory, config=config, summary=summary, events=events)


def _load_failed(directory: Path, error: str) -> RunDir:
    def read(name: str) -> dict[str, Any]:
        try:
            return _read_json_object(directory / name, name)
        except ConfigError:
            return {}
    try:
        events = read_events(directory)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        events = []
    summary = {**read("summary.json"), "status": "failed", "error": error}
    return RunDir(directory=directory, config=read("config.json"), summary=summary, events=events)


def _dig(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _label_config(run: RunDir) -> dict[str, Any]:
    """The run's config.json, or what its summary says of the strategy when it has none."""
    if _dig(run.config, "strategy", "strategy"):
        return run.config
    return {**run.config, "strategy": {"strategy": run.summary.get("strategy") or "run",
                                        "algorithm": run.summary.get("algorithm")}}


def run_labels(runs: Sequence[RunDir]) -> list[str]:
    """Distinct labels: ``strategy[/algorithm]`` plus every knob that applies to the run
    and differs between the runs (``analysis.knob_labels``), never cut short.

    Runs whose labels still collide (the same configuration twice) fall back to their
    directory names, numbered if those collide too.
    """
    labels = knob_labels([_label_config(run) for run in runs])
    # A simulated run's times are simulated seconds (plexus simulate): its label says so.
    labels = [f"{label} (simulated)" if run.summary.get("simulated") else label for run, label in zip(runs, labels)]
    counts = Counter(labels)
    labels = [run.directory.resolve().name if counts[label] > 1 else label for run, label in zip(runs, labels)]
    seen: Counter[str] = Counter()
    counts = Counter(labels)
    out = []
    for label in labels:
        seen[label] += 1
        out.append(f"{label} #{seen[label]}" if counts[label] > 1 else label)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _percent(value: Any) -> str:
    return f"{value * 100:.2f} %" if _is_number(value) else MISSING


def _seconds(value: Any) -> str:
    return seconds_text(value) if _is_number(value) else MISSING


def _mib(value: Any) -> str:
    return f"{value / MIB:,.2f} MiB" if _is_number(value) else MISSING


def _workers_list(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    return MISSING if value is None else str(value)


def _td(text: str, sort: Any = None, cls: str = "", title: str = "") -> str:
    """A cell; ``sort`` is the value the column sorts by (numbers sort as numbers)."""
    attrs = ""
    if sort is not None:
        attrs += f' data-sort="{html.escape(str(sort))}"'
    if cls:
        attrs += f' class="{cls}"'
    if title:
        attrs += f' title="{html.escape(title)}"'
    return f"<td{attrs}>{html.escape(text)}</td>"


def _num_or_blank(value: Any) -> Any:
    return value if _is_number(value) else ""


def _target_text(summary: dict[str, Any]) -> tuple[str, str]:
    """Time to target as text, with the final accuracy when it fell back below the target."""
    ttt, target, final = summary.get("time_to_target_seconds"), summary.get("target_accuracy"), \
        summary.get("final_test_accuracy")
    if not _is_number(ttt):
        return (MISSING if not _is_number(target) else f"not reached ({target:.0%})"), ""
    text = f"{ttt:.1f} s"
    if _is_number(target) and _is_number(final) and final < target:
        text += f" (final {final:.2%})"
        return text, f"a snapshot reached {target:.0%}, then the final model fell back to {final:.2%}"
    return text, ""


def _accuracy_cell(summary: dict[str, Any]) -> str:
    """Final accuracy; for replica strategies, the averaged model and worker 0's side by side."""
    acc, own = summary.get("final_test_accuracy"), summary.get("worker0_test_accuracy")
    text = _percent(acc)
    if _is_number(own):
        text = f"{text} / {_percent(own)}"
        return _td(text, _num_or_blank(acc), title="averaged model / worker 0's replica")
    return _td(text, _num_or_blank(acc))


def _health_cell(summary: dict[str, Any]) -> str:
    if summary.get("status") == "failed":
        return _td("FAILED", "failed", "unhealthy", summary.get("error") or "the job failed")
    value = summary.get("health")
    if value not in (None, "ok"):
        # A run that does not learn is marked where the eye lands, with the hint on hover.
        why = f"{value} at step {summary.get('health_step')}: {summary.get('health_hint') or ''}"
        return _td(str(value), str(value), "unhealthy", why)
    return _td(MISSING if value is None else str(value), str(value))


def _steps_cell(summary: dict[str, Any]) -> str:
    steps, kind, per = summary.get("steps"), summary.get("steps_kind"), summary.get("steps_per_worker")
    if not _is_number(steps):
        return _td(MISSING)
    text = f"{steps:,}"
    if kind == "worker":
        text += " (sum over workers)"
    per_text = ", ".join(MISSING if p is None else str(p) for p in per) if isinstance(per, list) else MISSING
    return _td(text, steps, title=f"per worker: {per_text}")


def _summary_row(run: RunDir, label: str, number: int) -> str:
    s = run.summary
    by_role = s.get("bytes_sent_by_role") if isinstance(s.get("bytes_sent_by_role"), dict) else {}
    workers_bytes = s.get("bytes_sent_workers")
    others = sum(v for k, v in by_role.items() if k != "worker" and _is_number(v)) if by_role else None
    if workers_bytes is None and _is_number(s.get("bytes_sent_total")) and not by_role:
        others = None  # an old summary: the total is all we know
    per_worker = s.get("bytes_sent_per_worker")
    per_text = ", ".join(_mib(v) for v in per_worker) if isinstance(per_worker, list) else ""
    ttt_text, ttt_title = _target_text(s)
    cells = [
        _td(str(number), number), _td(label, label, "label"), _td(str(run.directory), str(run.directory), "dir"),
        _health_cell(s), _td(str(s.get("workers", MISSING)), _num_or_blank(s.get("workers"))),
        _td(str(s.get("servers", MISSING)), _num_or_blank(s.get("servers"))),
        _td(str(s.get("dataset", MISSING))), _td(str(s.get("model", MISSING))), _steps_cell(s),
        _td(f"{s['samples']:,}" if _is_number(s.get("samples")) else MISSING, _num_or_blank(s.get("samples"))),
        _accuracy_cell(s),
        _td(f"{s['final_test_loss']:.4f}" if _is_number(s.get("final_test_loss")) else MISSING,
            _num_or_blank(s.get("final_test_loss"))),
        _td(_seconds(s.get("wall_seconds")), _num_or_blank(s.get("wall_seconds"))),
        _td(f"{s['samples_per_second']:,.0f}" if _is_number(s.get("samples_per_second")) else MISSING,
            _num_or_blank(s.get("samples_per_second"))),
        _td(ttt_text, _num_or_blank(s.get("time_to_target_seconds")), title=ttt_title),
        _td(_mib(workers_bytes), _num_or_blank(workers_bytes), title="per worker: " + per_text if per_text else ""),
        _td(_mib(others) if by_role else MISSING, _num_or_blank(others)),
        _td(_mib(s.get("bytes_sent_total")), _num_or_blank(s.get("bytes_sent_total"))),
        _td(str(s.get("updates_applied", MISSING)), _num_or_blank(s.get("updates_applied"))),
        _td(f"{s['staleness_mean']:.2f}" if _is_number(s.get("staleness_mean")) else MISSING,
            _num_or_blank(s.get("staleness_mean"))),
        _td(str(s.get("staleness_max", MISSING)), _num_or_blank(s.get("staleness_max"))),
        _td(_workers_list(s.get("lost_workers"))),
    ]
    return f"<tr>{''.join(cells)}</tr>"


# Header and hover text of each summary column, in _summary_row's order.
_SUMMARY_HEAD = (
    ("#", "the run's number, as in the ranking"), ("run", "strategy and the knobs that differ"),
    ("directory", ""), ("health", "ok, stalled, diverging, or FAILED"), ("workers", ""), ("servers", ""),
    ("dataset", ""), ("model", ""),
    ("steps", "synchronous: global steps; asynchronous: every worker's own steps, summed (per worker on hover)"),
    ("samples", "consumed by all workers together"),
    ("final test acc", "averaged model / worker 0's replica where the strategy keeps replicas"),
    ("final test loss", ""), ("wall", "training clock: every worker joined to the last one's end"),
    ("samples/s", "job throughput: samples / wall, the sum over workers"),
    ("time to target", "first snapshot at --target-accuracy; the final accuracy when it fell back"),
    ("MiB sent, workers", "1 MiB = 2^20 bytes; per worker on hover"),
    ("MiB sent, servers + aggregators", ""), ("MiB sent, all", "every process"),
    ("updates applied", "optimizer updates made to the evaluated model"), ("staleness mean", ""),
    ("staleness max", ""), ("lost workers", ""),
)


def _ranking_rows(runs: Sequence[RunDir], labels: Sequence[str], numbers: Sequence[int]) -> tuple[str, str]:
    ranked = rank([r.summary for r in runs], [r.config for r in runs], [r.events for r in runs])
    target = ranked[0].target if ranked else None
    rows = []
    for r in ranked:
        run = runs[r.index]
        cells = [_td(str(r.place), r.place), _td(str(numbers[r.index]), numbers[r.index]),
                 _td(labels[r.index], labels[r.index], "label"), _health_cell(run.summary),
                 _td(_seconds(r.time_to_target), _num_or_blank(r.time_to_target)),
                 _accuracy_cell(run.summary),
                 _td(_seconds(r.time_to_best), _num_or_blank(r.time_to_best),
                     title=f"best {r.best_accuracy:.2%}" if r.best_accuracy is not None else "")]
        for th in THRESHOLDS:
            t = time_to_accuracy(run.events, th)
            cells.append(_td(_seconds(t), _num_or_blank(t)))
        cells.append(_td(f"{r.mib_sent:,.2f}" if r.mib_sent is not None else MISSING, _num_or_blank(r.mib_sent)))
        cells.append(_td(r.why, r.why, "why"))
        rows.append(f"<tr>{''.join(cells)}</tr>")
    what = f"{target:.0%}" if target is not None else "the target"
    head = "".join(f'<th title="{esc(t)}">{esc(h)}</th>' for h, t in (
        ("place", ""), ("#", "the run's number in the summary"), ("run", ""), ("health", ""),
        (f"time to {what}", "first snapshot of the evaluated model at or above it (training clock)"),
        ("final test acc", "averaged model / worker 0's replica where the strategy keeps replicas"),
        ("time to best", "first snapshot at the run's best accuracy (shown on hover)"),
        *((f"to {th:.0%}", "") for th in THRESHOLDS), ("MiB sent", "every process, 1 MiB = 2^20 bytes"),
        ("why", "")))
    return head, "\n".join(rows)


def _judging_section(judged: Sequence[Judged]) -> str:
    """The judging table: one row per configuration, best first, with its reason."""
    if not judged:
        return ""
    heads = [(target_heading(judged) if name == "time to target s" else name, hover) for name, hover in TABLE_HEAD]
    head = "".join(f'<th title="{esc(t)}">{esc(h)}</th>' for h, t in (*heads, ("why", "")))
    rows = []
    for j in judged:
        cells = []
        for (name, _), (text, sort) in zip(TABLE_HEAD, table_cells(j)):
            if name == "configuration":
                cells.append(_td(text, text, "label"))
            elif name == "extra hyper-params":
                cells.append(_td(text, _num_or_blank(sort), title=", ".join(j.hyperparameters or ())))
            else:
                cells.append(_td(text, _num_or_blank(sort)))
        cells.append(_td(j.why, j.why, "why"))
        rows.append(f"<tr>{''.join(cells)}</tr>")
    seeds = sorted({j.runs for j in judged})
    return (f"<h2>Judging ({'/'.join(map(str, seeds))} seeds per configuration)</h2>\n"
            '<p class="note">Each configuration over its seeds: time to the best test error and to the target '
            "(mean ± sd), hyper-parameters beyond SGD (from the config schema; names on hover), stability (sd "
            "of the final accuracy, runs that stalled or diverged) and cost (process-seconds = processes x wall "
            "seconds, CPU-seconds, bytes sent). The target is --target-accuracy, else the highest of "
            f"{', '.join(f'{t:.0%}' for t in THRESHOLDS)} that every run reached. Ranked by the share of seeds at "
            "the target, then time to it; times within one standard error are tied and ordered by fewer "
            "hyper-parameters, then stability, then CPU-seconds.</p>\n"
            f'<div class="scroll"><table class="sortable ranking judging">\n<thead><tr>{head}</tr></thead>\n'
            f"<tbody>\n{chr(10).join(rows)}\n</tbody>\n</table></div>")


def _stages_section(runs: Sequence[RunDir], labels: Sequence[str], numbers: Sequence[int]) -> str:
    """The model-parallel runs' traffic across the cut, measured beside the plan, and their
    per-stage figures (``plexus.report.stages``); empty when no run has stages."""
    traffic, per_stage, pipelines = [], [], []
    for run, label, n in zip(runs, labels, numbers):
        who = [_td(str(n), n), _td(label, label, "label")]
        line = pipeline_line(run.summary)
        if line is not None:
            pipelines.append(f"<li>{esc(n)}. {esc(label)}: {esc(line)}</li>")
        for cells, matches in traffic_cells(run.summary):
            tds = [_td(text, sort, title=hover) for text, sort, hover in cells[:-1]]
            text, sort, hover = cells[-1]
            tds.append(_td(text, sort, "" if matches else "unhealthy", hover))
            traffic.append(f"<tr>{''.join(who + tds)}</tr>")
        for cells in stage_cells(run.summary):
            per_stage.append(f"<tr>{''.join(who + [_td(text, sort, title=hover) for text, sort, hover in cells])}</tr>")
    if not traffic and not per_stage:
        return ""

    def table(heads: Sequence[tuple[str, str]], rows: list[str]) -> str:
        head = "".join(f'<th title="{esc(t)}">{esc(h)}</th>' for h, t in (("#", ""), ("run", ""), *heads))
        return (f'<div class="scroll"><table class="sortable stages"><thead><tr>{head}</tr></thead>\n'
                f"<tbody>\n{chr(10).join(rows)}\n</tbody></table></div>")
    out = ["<h2>Model-parallel stages</h2>"]
    if pipelines:
        out += ["<h3>Pipeline</h3>", f"<ul>{''.join(pipelines)}</ul>"]
    if traffic:
        out += ["<h3>Traffic across the cut</h3>",
                '<p class="note">Each direction of a cut edge, summed over the replicas: messages and bytes the '
                "sending stage counted, those the receiving stage counted, and the partition plan's prediction "
                "for the steps made. A row that does not match is marked.</p>", table(TRAFFIC_HEAD, traffic)]
    if per_stage:
        out += ["<h3>Per stage</h3>", table(STAGE_HEAD, per_stage)]
    return "\n".join(out)


def esc(text: Any) -> str:
    return html.escape(str(text))


def _diff_table(runs: Sequence[RunDir], numbers: Sequence[int]) -> str:
    diff = config_diff([run.config for run in runs])
    if len(runs) < 2:
        return ""
    if not diff:
        return "<p>The runs have the same configuration.</p>"
    head = "".join(f"<th>#{n}</th>" for n in numbers)
    rows = []
    for key, cells in diff:
        tds = "".join(_td("does not apply", "", "na") if c is None else _td(c[0], c[0], title=f"source: {c[1]}")
                      for c in cells)
        rows.append(f"<tr>{_td(key, key, 'label')}{tds}</tr>")
    return (f'<div class="scroll"><table class="sortable"><thead><tr><th>setting</th>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>"
            "<p class=\"note\">Hover a value for its source (flag, spec, file, default, default for a rule).</p>")


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1360px; }
.scroll { overflow-x: auto; max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; cursor: pointer; position: sticky; top: 0; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.label { text-align: left; white-space: normal; min-width: 12em; max-width: 26em; }
td.why { text-align: left; white-space: normal; min-width: 16em; max-width: 30em; }
td.dir { text-align: left; font-family: monospace; }
td.na { color: #aaa; }
td.unhealthy { background: #fdd; color: #900; font-weight: bold; }
table.ranking tr:first-child td { background: #efe; }
table.judging th { white-space: normal; vertical-align: bottom; }
table.judging td.label { min-width: 6em; }
p.note { font-size: 0.85em; color: #555; }
figure { display: inline-block; margin: 1em 1em 0 0; vertical-align: top; }
figcaption { font-size: 0.9em; color: #555; max-width: 770px; }
img { max-width: 100%; }
dl { font-size: 0.85em; } dt { font-weight: bold; }
"""

# Click a header to sort by it; numbers (data-sort) sort as numbers, blanks last.
_SCRIPT = """
document.querySelectorAll('table.sortable').forEach(function (table) {
  table.querySelectorAll('thead th').forEach(function (th, col) {
    th.addEventListener('click', function () {
      var asc = !th.classList.contains('sorted-asc');
      table.querySelectorAll('thead th').forEach(function (h) { h.classList.remove('sorted-asc', 'sorted-desc'); });
      th.classList.add(asc ? 'sorted-asc' : 'sorted-desc');
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[col], v = cell ? (cell.getAttribute('data-sort') ?? cell.textContent) : '';
        var n = parseFloat(v);
        return v === '' ? null : (isNaN(n) || String(n) !== String(v).trim() && isNaN(Number(v)) ? v : n);
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null) return 1; if (y === null) return -1;
        var c = (typeof x === 'number' && typeof y === 'number') ? x - y : String(x).localeCompare(String(y));
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""


def _page(title: str, runs: Sequence[RunDir], labels: Sequence[str], plots: Sequence[Plot],
          out_dir: Path, judged: Sequence[Judged] = ()) -> str:
    numbers = list(range(1, len(runs) + 1))
    rank_head, rank_rows = _ranking_rows(runs, labels, numbers)
    sum_head = "".join(f'<th title="{esc(t)}">{esc(h)}</th>' for h, t in _SUMMARY_HEAD)
    sum_rows = "\n".join(_summary_row(run, label, n) for run, label, n in zip(runs, labels, numbers))
    figures = []
    for plot in plots:
        # Relative paths keep the report movable together with its folder.
        src = quote(Path(os.path.relpath(plot.path, out_dir)).as_posix())
        figures.append(f'<figure><img src="{esc(src)}" alt="{esc(plot.caption)}">'
                       f"<figcaption>{esc(plot.caption)}</figcaption></figure>")
    body_plots = "\n".join(figures) if figures else "<p>No run logged the events the plots need.</p>"
    diff = _diff_table(runs, numbers)
    diff_section = f"<h2>Configuration differences</h2>\n{diff}" if diff else ""
    figures_doc = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in FIGURES.items())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(title)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{esc(title)}</h1>
{_judging_section(judged)}
<h2>Ranking</h2>
<p class="note">Ranked by time to the target (the runs' --target-accuracy, else the highest of
{", ".join(f"{t:.0%}" for t in THRESHOLDS)} that any run reached), then final accuracy, time to best and
MiB sent; failed runs last. Times are on the training clock. Click a header to sort.</p>
<div class="scroll"><table class="sortable ranking">
<thead><tr>{rank_head}</tr></thead>
<tbody>
{rank_rows}
</tbody>
</table></div>
<h2>Summary</h2>
<div class="scroll"><table class="sortable">
<thead><tr>{sum_head}</tr></thead>
<tbody>
{sum_rows}
</tbody>
</table></div>
{_stages_section(runs, labels, numbers)}
{diff_section}
<h2>Plots</h2>
{body_plots}
<details><summary>How the figures are defined</summary><dl>{figures_doc}</dl></details>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None,
                 title: str = "plexus report", errors: Mapping[str | Path, str] | None = None,
                 configurations: Sequence[tuple[str, Sequence[str | Path]]] | None = None) -> Path:
    """Write the plots and ``index.html`` of one or more runs; return the HTML's path.

    ``out_dir`` defaults to the run directory when there is one run; with several it is
    required, since no run's folder is a better home for the comparison than another's.
    ``errors`` maps the directories of runs that failed to their error: those become
    failed rows, with whatever their directories hold. ``configurations`` groups the runs,
    as (name, the directories of its seeds): the page then opens with the judging table.
    """
    if isinstance(run_dirs, (str, Path)):  # one path given bare: not a sequence of paths
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ConfigError("write_report needs at least one run directory: pass the --out DIR of a run")
    if out_dir is None:
        if len(run_dirs) > 1:
            raise ConfigError(f"comparing {len(run_dirs)} run directories needs an output directory: "
                              f"pass out_dir (the report is not written into any one run's folder)")
        out_dir = run_dirs[0]
    failed = {str(Path(k)): v for k, v in (errors or {}).items()}
    runs = [load_run(d, error=failed.get(str(Path(d)))) for d in run_dirs]
    labels = run_labels(runs)
    judged: list[Judged] = []
    if configurations:
        by_dir = {str(Path(d)): run for d, run in zip(run_dirs, runs)}
        unknown = [str(d) for _, dirs in configurations for d in dirs if str(Path(d)) not in by_dir]
        if unknown:
            raise ConfigError(f"configuration run {unknown[0]!r} is not one of the report's run directories: "
                              f"pass every configuration's runs in run_dirs too")
        judged = judge([(name, [by_dir[str(Path(d))] for d in dirs]) for name, dirs in configurations])
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create report folder {str(out)!r}: {exc.strerror}: pass another --out") from None
    plot_runs = [PlotRun(label=_plot_label(n, label), events=run.events,
                         target_accuracy=_dig(run.config, "run", "target_accuracy"), summary=run.summary)
                 for n, (run, label) in enumerate(zip(runs, labels), 1)]
    plots = write_plots(plot_runs, out)
    index = out / "index.html"
    index.write_text(_page(title, runs, labels, plots, out, judged), encoding="utf-8")
    return index


def _plot_label(number: int, label: str) -> str:
    """A legend entry: the run's label, or its number and strategy when the label is long
    (the tables give the whole label by number)."""
    return label if len(label) <= 24 else f"#{number} {label.split(' ')[0]}"
