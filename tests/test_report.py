"""Tests of plexus.report on fake run directories (no training: fast, no processes)."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from plexus.errors import ConfigError
from plexus.report import load_run, run_labels, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, name: str, *, strategy: str = "allreduce", algorithm: str | None = "ring",
             workers: int = 2, lr: float = 0.1, staleness: bool = True, target: float | None = 0.8,
             summary_extra: dict[str, Any] | None = None) -> Path:
    """A run directory like ``plexus train --out`` writes: 2 workers, 5 logged steps, 3 evals."""
    run = root / name
    run.mkdir(parents=True)
    config = {
        "data": {"dataset": "digits", "data_dir": None, "num_samples": None},
        "model": {"model": "mlp", "hidden": 128},
        "optim": {"optimizer": "sgd", "lr": lr, "momentum": 0.0, "weight_decay": 0.0},
        "cluster": {"workers": workers, "servers": 0, "host": "127.0.0.1", "port": 0,
                    "slow": [], "kill": [], "net": {"bandwidth": None, "latency": 0.0}},
        "strategy": {"strategy": strategy, "algorithm": algorithm or "native", "bucket_mb": 25.0},
        "run": {"batch_size": 64, "steps": 50, "target_accuracy": target, "out": str(run)},
    }
    events = []
    for step in range(10, 60, 10):
        for worker in range(2):
            events.append({"event": "train", "time": step * 0.1 + worker * 0.01, "worker": worker,
                           "step": step, "loss": 2.0 / step + worker * 0.01, "samples": step * 64,
                           "bytes_sent": step * 1000 * (worker + 1), "bytes_recv": step * 1000,
                           "staleness": 1 if staleness else None})
    for i, step in enumerate((20, 40, 50)):
        events.append({"event": "eval", "time": step * 0.1, "step": step, "samples": step * 64,
                       "test_accuracy": 0.5 + 0.15 * i, "test_loss": 1.0 - 0.2 * i, "model": "global"})
    if staleness:
        events.append({"event": "staleness_histogram", "time": 2.0, "counts": [3, 1]})
        events.append({"event": "staleness_histogram", "time": 5.0, "counts": [6, 3, 1]})
    summary = {
        "strategy": strategy, "algorithm": algorithm, "workers": workers, "servers": 0,
        "dataset": "digits", "model": "mlp", "steps": 50, "samples": 3200,
        "final_test_accuracy": 0.8, "final_test_loss": 0.6, "wall_seconds": 5.02,
        "samples_per_second": 637.45, "time_to_target_seconds": 5.0, "bytes_sent_total": 150_000,
        "bytes_sent_per_worker": [50_000, 100_000], "updates_applied": 50,
        "staleness_mean": 0.5, "staleness_max": 2, "lost_workers": [],
    }
    summary.update(summary_extra or {})
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def images(index: Path) -> list[Path]:
    """The files the page's <img> tags point at, resolved next to the page."""
    srcs = re.findall(r'<img src="([^"]+)"', index.read_text())
    return [index.parent / html.unescape(src) for src in srcs]


def assert_pngs(paths: list[Path]) -> None:
    assert paths, "the report references no plot"
    for path in paths:
        assert path.is_file(), path
        assert path.read_bytes()[:8] == PNG_MAGIC, path


def test_single_run_report(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a")
    index = write_report([run])
    assert index == run / "index.html"
    page = index.read_text()
    assert "<title>plexus report</title>" in page
    assert "allreduce/ring" in page
    for text in ("digits", "mlp", "80.00 %", "0.6000", "5.0 s", "637.5", "146.48 KiB", "0.50", "none"):
        assert text in page, text
    assert 'title="per worker: 48.83 KiB, 97.66 KiB"' in page
    pngs = images(index)
    assert_pngs(pngs)
    assert {p.name for p in pngs} == {"accuracy_time.png", "accuracy_samples.png", "loss_time.png",
                                      "throughput.png", "bytes_sent.png", "staleness.png"}
    assert "http" not in page and "<script" not in page and "<link" not in page  # self-contained


def test_overlay_two_runs(tmp_path: Path) -> None:
    a = make_run(tmp_path, "a", workers=2)
    b = make_run(tmp_path, "b", strategy="ps", algorithm=None, workers=4, staleness=False,
                 summary_extra={"servers": 1, "time_to_target_seconds": None, "lost_workers": [3]})
    out = tmp_path / "compare"
    index = write_report([a, b], out_dir=out, title="ring vs ps")
    assert index == out / "index.html"
    page = index.read_text()
    assert "<h1>ring vs ps</h1>" in page
    # Labels: strategy[/algorithm] plus the config that differs (workers).
    assert "allreduce/ring workers=2" in page and "ps workers=4" in page
    assert page.count("<tr><td") == 2
    assert "–" in page  # b's null time to target
    assert_pngs(images(index))
    # The staleness plot exists because one of the runs has a histogram.
    assert (out / "staleness.png").is_file()
    assert not (a / "index.html").exists()  # nothing is written into the runs' folders


def test_plots_without_data_are_skipped(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a", staleness=False)
    index = write_report([run])
    names = {p.name for p in images(index)}
    assert "staleness.png" not in names and "accuracy_time.png" in names


def test_labels_fall_back_to_directory_names(tmp_path: Path) -> None:
    runs = [load_run(make_run(tmp_path, name)) for name in ("first", "second")]
    assert run_labels(runs) == ["first", "second"]
    runs = [load_run(make_run(tmp_path, "x", lr=0.1)), load_run(make_run(tmp_path, "y", lr=0.05))]
    assert run_labels(runs) == ["allreduce/ring lr=0.1", "allreduce/ring lr=0.05"]


def test_missing_files_raise_config_error(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a")
    (run / "summary.json").unlink()
    with pytest.raises(ConfigError, match=r"'.*a' has no summary\.json"):
        write_report([run])
    (run / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"no summary\.json and no metrics\.jsonl"):
        write_report([run])
    with pytest.raises(ConfigError, match="does not exist"):
        write_report([tmp_path / "nowhere"])


def test_several_runs_need_out_dir(tmp_path: Path) -> None:
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b", workers=4)
    with pytest.raises(ConfigError, match="out_dir"):
        write_report([a, b])


def test_malformed_json_raises_config_error(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a")
    (run / "summary.json").write_text("{not json")
    with pytest.raises(ConfigError, match="summary"):
        write_report([run])


def test_html_escapes_strings_from_files(tmp_path: Path) -> None:
    evil = '<script>alert("x")</script>'
    run = make_run(tmp_path, "a", strategy=evil, summary_extra={"dataset": "<b>d&d</b>"})
    page = write_report([run], title="<i>t</i>").read_text()
    assert "<script" not in page and "<b>" not in page and "<i>t</i>" not in page
    assert html.escape(evil) in page
    assert "&lt;b&gt;d&amp;d&lt;/b&gt;" in page


def test_throughput_and_bytes_curves() -> None:
    from plexus.report.plots import _bytes_curve, _throughput_curve

    # Two synchronous workers log each step 10 ms apart: the second log adds no samples
    # and must not read as a drop in throughput; 640 samples every second throughout.
    events = [{"time": step * 0.1 + w * 0.01, "worker": w, "samples": step * 64, "bytes_sent": step * (w + 1)}
              for step in range(10, 60, 10) for w in range(2)]
    ts, rates = _throughput_curve(events)
    assert list(ts) == pytest.approx([2.0, 3.0, 4.0, 5.0])
    assert list(rates) == pytest.approx([640.0] * 4)
    # Bytes: each worker's latest cumulative counter, summed.
    ts, totals = _bytes_curve(events)
    assert list(totals[:4]) == [10, 30, 40, 60]
    assert totals[-1] == 50 + 100
