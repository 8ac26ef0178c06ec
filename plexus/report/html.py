"""An HTML report of one or more run directories (contract 3 of ARCHITECTURE.md).

``write_report`` reads each run's ``config.json``, ``summary.json`` and ``metrics.jsonl``,
writes the plots of ``plexus.report.plots`` and an ``index.html`` beside them: a summary
table with one row per run, then the plots. The page is self-contained (inline CSS, no
script, no network), so it can be opened from a results folder or mailed as it is.
Everything that comes from a run directory is HTML-escaped: a strategy name is a user
string (``pkg.module:function`` factories are allowed) and must not inject markup.
"""
from __future__ import annotations

import html
import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from plexus.errors import ConfigError
from plexus.report.plots import Plot, PlotRun, byte_unit, write_plots
from plexus.train.metrics import read_events

__all__ = ["RunDir", "load_run", "run_labels", "write_report"]

MISSING = "–"  # shown for absent or null values

# Config keys that never tell runs apart in a useful way (paths, ports, output flags),
# or that the label already shows, so they stay out of labels.
_LABEL_IGNORED = {
    ("strategy", "strategy"), ("strategy", "algorithm"), ("run", "out"), ("run", "json"),
    ("run", "quiet"), ("run", "debug"), ("run", "save_model"), ("cluster", "host"), ("cluster", "port"),
}
# Distinguishing keys shown first, the ones a comparison most often varies; at most
# _LABEL_MAX_KEYS of them keep a legend entry on one line.
_LABEL_PRIORITY = ("workers", "servers", "dataset", "model", "optimizer", "lr", "batch_size")
_LABEL_MAX_KEYS = 3


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


def load_run(run_dir: str | Path) -> RunDir:
    """Read a run directory; raise ConfigError naming the directory and what it lacks."""
    directory = Path(run_dir)
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


def _dig(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _base_label(run: RunDir) -> str:
    """``strategy[/algorithm]``: the summary's values, else the config's."""
    strategy = run.summary.get("strategy") or _dig(run.config, "strategy", "strategy") or "run"
    # A summary's null algorithm means the strategy has none (a parameter server); only
    # an old summary without the key falls back to the config's default.
    if "algorithm" in run.summary:
        algorithm = run.summary["algorithm"]
    else:
        algorithm = _dig(run.config, "strategy", "algorithm")
    return f"{strategy}/{algorithm}" if algorithm else str(strategy)


def _flatten(config: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Leaf values of a nested config, keyed by path, as compact JSON text."""
    out: dict[tuple[str, ...], str] = {}
    for key, value in config.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path))
        else:
            out[path] = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return out


def _show(path: tuple[str, ...], text: str) -> str:
    # Field names are unique across components (plexus.config), so the component is
    # dropped: "workers=4", not "cluster.workers=4".
    name = ".".join(path[1:]) or path[0]
    value = json.loads(text)
    return f"{name}={value if isinstance(value, str) else text}"


def run_labels(runs: Sequence[RunDir]) -> list[str]:
    """Short, distinct legend labels: strategy[/algorithm] plus the config that differs.

    Runs whose labels still collide (same strategy and same shown config) fall back to
    their directory names.
    """
    flats = [_flatten(run.config) for run in runs]
    keys = [k for k in dict.fromkeys(k for flat in flats for k in flat) if k not in _LABEL_IGNORED]
    differing = [k for k in keys if len({flat.get(k) for flat in flats}) > 1]
    rank = {name: i for i, name in enumerate(_LABEL_PRIORITY)}
    differing.sort(key=lambda k: rank.get(k[-1], len(rank)))  # stable: config order otherwise
    shown = differing[:_LABEL_MAX_KEYS]
    labels = []
    for run, flat in zip(runs, flats):
        parts = [_base_label(run)] + [_show(k, flat[k]) for k in shown if k in flat]
        labels.append(" ".join(parts))
    counts = Counter(labels)
    labels = [run.directory.resolve().name if counts[label] > 1 else label for run, label in zip(runs, labels)]
    # Directory names can collide too (a/run, b/run): number the repeats.
    seen: Counter[str] = Counter()
    counts = Counter(labels)
    out = []
    for label in labels:
        seen[label] += 1
        out.append(f"{label} #{seen[label]}" if counts[label] > 1 else label)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(spec: str, suffix: str = "") -> Callable[[Any], str]:
    """A formatter for numbers; anything else from the file is shown as text."""
    def fmt(value: Any) -> str:
        return f"{value:{spec}}{suffix}" if _is_number(value) else str(value)
    return fmt


def _percent(value: Any) -> str:
    return f"{value * 100:.2f} %" if _is_number(value) else str(value)


def _bytes(value: Any) -> str:
    if not _is_number(value):
        return str(value)
    divisor, unit = byte_unit(value)
    return f"{value:.0f} B" if unit == "B" else f"{value / divisor:.2f} {unit}"


def _workers_list(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    return str(value)


# (header, summary key, formatter) of each summary-table column after the run's label.
_COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("strategy", "strategy", str),
    ("algorithm", "algorithm", str),
    ("workers", "workers", str),
    ("servers", "servers", str),
    ("dataset", "dataset", str),
    ("model", "model", str),
    ("steps", "steps", str),
    ("health", "health", str),
    ("final test accuracy", "final_test_accuracy", _percent),
    ("final test loss", "final_test_loss", _fmt(".4f")),
    ("wall time", "wall_seconds", _fmt(".1f", " s")),
    ("samples/s", "samples_per_second", _fmt(",.1f")),
    ("time to target", "time_to_target_seconds", _fmt(".1f", " s")),
    ("bytes sent", "bytes_sent_total", _bytes),
    ("updates applied", "updates_applied", str),
    ("staleness mean", "staleness_mean", _fmt(".2f")),
    ("staleness max", "staleness_max", str),
    ("lost workers", "lost_workers", _workers_list),
)


def _cell(summary: dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
    value = summary.get(key)
    text = MISSING if value is None else html.escape(fmt(value))
    if key == "health" and value not in (None, "ok"):
        # A run that does not learn is marked where the eye lands, with the hint on hover.
        why = f"{value} at step {summary.get('health_step')}: {summary.get('health_hint') or ''}"
        return f'<td class="unhealthy" title="{html.escape(why)}">{text}</td>'
    if key == "bytes_sent_total" and isinstance(summary.get("bytes_sent_per_worker"), list):
        per_worker = ", ".join(_bytes(v) if v is not None else MISSING for v in summary["bytes_sent_per_worker"])
        return f'<td title="{html.escape("per worker: " + per_worker)}">{text}</td>'
    return f"<td>{text}</td>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; }
td.label, td.dir { text-align: left; }
td.dir { font-family: monospace; }
td.unhealthy { background: #fdd; color: #900; font-weight: bold; }
figure { display: inline-block; margin: 1em 1em 0 0; }
figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; }
"""


def _page(title: str, runs: Sequence[RunDir], labels: Sequence[str], plots: Sequence[Plot],
          out_dir: Path) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h, _, _ in _COLUMNS)
    rows = []
    for run, label in zip(runs, labels):
        cells = "".join(_cell(run.summary, key, fmt) for _, key, fmt in _COLUMNS)
        rows.append(f'<tr><td class="label">{esc(label)}</td><td class="dir">{esc(str(run.directory))}</td>'
                    f"{cells}</tr>")
    figures = []
    for plot in plots:
        # Relative paths keep the report movable together with its folder.
        src = quote(Path(os.path.relpath(plot.path, out_dir)).as_posix())
        figures.append(f'<figure><img src="{esc(src)}" alt="{esc(plot.caption)}">'
                       f"<figcaption>{esc(plot.caption)}</figcaption></figure>")
    body_plots = "\n".join(figures) if figures else "<p>No run logged the events the plots need.</p>"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(title)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{esc(title)}</h1>
<h2>Summary</h2>
<table>
<thead><tr><th>run</th><th>directory</th>{head}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody>
</table>
<h2>Plots</h2>
{body_plots}
</body>
</html>
"""


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None,
                 title: str = "plexus report") -> Path:
    """Write the plots and ``index.html`` of one or more runs; return the HTML's path.

    ``out_dir`` defaults to the run directory when there is one run; with several it is
    required, since no run's folder is a better home for the comparison than another's.
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
    runs = [load_run(d) for d in run_dirs]
    labels = run_labels(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_runs = [PlotRun(label=label, events=run.events,
                         target_accuracy=_dig(run.config, "run", "target_accuracy"))
                 for run, label in zip(runs, labels)]
    plots = write_plots(plot_runs, out)
    index = out / "index.html"
    index.write_text(_page(title, runs, labels, plots, out), encoding="utf-8")
    return index
