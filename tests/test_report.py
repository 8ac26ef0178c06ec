"""Tests of plexus.report on fake run directories (no training: fast, no processes)."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
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
    for text in ("digits", "mlp", "80.00 %", "0.6000", "5.0 s", "637", "0.14 MiB", "0.50", "none"):
        assert text in page, text
    assert 'title="per worker: 0.05 MiB, 0.10 MiB"' in page
    pngs = images(index)
    assert_pngs(pngs)
    assert {p.name for p in pngs} == {"accuracy_time.png", "accuracy_samples.png", "loss_time.png",
                                      "throughput.png", "bytes_sent.png", "staleness.png"}
    # Self-contained: the only script is the inline sorter, and nothing is fetched.
    assert "http" not in page and page.count("<script") == 1 and "<script src" not in page and "<link" not in page


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
    assert page.count('<tr><td data-sort="1">') == 2  # one row in the ranking, one in the summary
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
    # The sources kept in config.json are not settings: they never make a label.
    a, b = make_run(tmp_path, "s1"), make_run(tmp_path, "s2")
    for run, source in ((a, "flag"), (b, "default")):
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**config, "sources": {"lr": source}}))
    assert run_labels([load_run(a), load_run(b)]) == ["s1", "s2"]


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
    assert evil not in page and "<b>" not in page and "<i>t</i>" not in page
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


# --- issue 19: honest figures, and a comparison that helps decide --------------------------

def test_bytes_split_by_role_and_in_mib(tmp_path: Path) -> None:
    """The table says which bytes are the workers' and which the servers', in MiB (the
    CLI's unit too), and the bytes plot draws the workers' alone, ending at their total."""
    from plexus.report.plots import PlotRun, plot_series
    run = make_run(tmp_path, "a", summary_extra={
        "bytes_sent_workers": 150_000, "bytes_sent_by_role": {"worker": 150_000, "server": 3 * 2**20},
        "bytes_sent_total": 150_000 + 3 * 2**20})
    page = write_report([run]).read_text()
    assert "MiB sent, workers" in page and "MiB sent, servers + aggregators" in page
    assert ">0.14 MiB<" in page and ">3.00 MiB<" in page and ">3.14 MiB<" in page
    assert "KiB" not in page and " MB" not in page
    ts, mib = plot_series(PlotRun(label="a", events=load_run(run).events))["mib_sent_workers"]
    assert mib[-1] * 2**20 == pytest.approx(150_000)


def test_async_plot_series_match_the_summary(tmp_path: Path) -> None:
    """Two asynchronous workers: train events carry the job's samples (the store's sum) and
    each worker's own; the plots' job samples end at the summary's, and throughput is the
    job's (not one worker's)."""
    from plexus.report.plots import PlotRun, plot_series
    events = []
    for step in range(10, 110, 10):
        for w in range(2):
            events.append({"event": "train", "time": step * 0.01 + w * 0.005, "worker": w, "step": step,
                           "loss": 1.0, "samples": (2 * step - (1 - w) * 10) * 32, "worker_samples": step * 32,
                           "bytes_sent": step * 100, "bytes_recv": 0, "staleness": 1})
    events[-2]["samples"] = events[-1]["samples"] = 2 * 100 * 32  # the last adds complete the total
    series = plot_series(PlotRun(label="ps", events=events))
    assert series["samples"][1][-1] == 6400  # = summary samples: 2 workers x 100 steps x 32
    ts, rates = series["throughput"]
    # Both workers' 3,200 samples/s each, not one worker's 3,200.
    assert (series["samples"][1][-1] - series["samples"][1][0]) / (ts[-1] - series["samples"][0][0]) \
        == pytest.approx(6400, rel=0.1)
    assert np.median(rates) == pytest.approx(6400, rel=0.25)


def test_target_reached_then_fell_back_says_so(tmp_path: Path) -> None:
    from plexus.cli import _summary_line
    summary = {"final_test_accuracy": 0.9499, "final_test_loss": 0.2, "steps": 300, "steps_kind": "global",
               "steps_per_worker": [300, 300], "wall_seconds": 4.0, "samples_per_second": 4800.0,
               "time_to_target_seconds": 3.1, "target_accuracy": 0.95, "bytes_sent_total": 31_227_248}
    line = _summary_line(summary)
    assert "target 95% reached at 3.1 s (final 94.99%)" in line
    assert "29.78 MiB sent" in line and "MB " not in line  # 31,227,248 bytes = 29.78 MiB
    run = make_run(tmp_path, "a", target=0.95, summary_extra={
        "final_test_accuracy": 0.9499, "time_to_target_seconds": 3.1, "target_accuracy": 0.95})
    assert "3.1 s (final 94.99%)" in write_report([run]).read_text()


def test_steps_say_whose() -> None:
    from plexus.cli import _summary_line
    base = {"final_test_accuracy": 0.9, "final_test_loss": 0.3, "wall_seconds": 2.0, "samples_per_second": 9600.0}
    assert "1200 worker steps (300 per worker)" in _summary_line(
        {**base, "steps": 1200, "steps_kind": "worker", "steps_per_worker": [300] * 4})
    assert " 300 steps " in _summary_line({**base, "steps": 300, "steps_kind": "global",
                                           "steps_per_worker": [300] * 4})
    assert "samples/s, all workers" in _summary_line({**base, "steps": 1, "steps_kind": "global"})


def test_labels_show_only_knobs_that_apply() -> None:
    from plexus.report.analysis import knob_labels
    def config(strategy: str, **strategy_keys: Any) -> dict[str, Any]:
        return {"strategy": {"strategy": strategy, "algorithm": "ring", "consistency": "asp", **strategy_keys},
                "optim": {"lr": 0.05 if strategy == "ps" else 0.1}, "cluster": {"workers": 4, "port": 0}}
    labels = knob_labels([config("ps", consistency="asp"), config("ps", consistency="bsp"), config("allreduce")])
    assert labels == ["ps consistency=asp lr=0.05", "ps consistency=bsp lr=0.05", "allreduce/ring lr=0.1"]


def test_ranking_and_thresholds(tmp_path: Path) -> None:
    from plexus.report.analysis import rank, time_to_accuracy
    fast = make_run(tmp_path, "fast", target=None, summary_extra={"final_test_accuracy": 0.8})
    slow = make_run(tmp_path, "slow", target=None, workers=4)
    runs = [load_run(slow), load_run(fast)]
    ev = runs[1].events
    for e in ev:  # 'fast' reaches every accuracy twice as early
        if e["event"] == "eval":
            e["time"] /= 2
    assert time_to_accuracy(ev, 0.8) == 2.5 and time_to_accuracy(ev, 0.95) is None
    ranked = rank([r.summary for r in runs], [r.config for r in runs], [r.events for r in runs])
    assert [r.index for r in ranked] == [1, 0] and ranked[0].target == 0.8
    assert ranked[0].why.startswith("first to 80% (2.50 s)") and "2.0x the time of #1" in ranked[1].why
    failed = load_run(tmp_path / "nowhere", error="the job failed (status 137)")
    ranked = rank([failed.summary, runs[0].summary], [{}, runs[0].config], [[], runs[0].events])
    assert ranked[-1].failed and ranked[-1].why == "failed: the job failed (status 137)"


def test_report_ranks_diffs_and_sorts(tmp_path: Path) -> None:
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", strategy="ps", algorithm=None, summary_extra={"health": "diverging",
                                                                              "health_hint": "lower --lr"})
    config = json.loads((b / "config.json").read_text())
    config["strategy"]["consistency"] = "asp"
    (b / "config.json").write_text(json.dumps(config))
    page = write_report([a, b], tmp_path / "out", errors=None).read_text()
    ranking = page[page.index("<h2>Ranking</h2>"):page.index("<h2>Summary</h2>")]
    assert 'class="sortable ranking"' in ranking and "why" in ranking
    for th in ("time to 80%", "to 90%", "to 95%", "time to best", "MiB sent"):
        assert th in ranking, th
    assert 'class="unhealthy"' in ranking and "DIVERGING: lower --lr" in ranking
    diff = page[page.index("<h2>Configuration differences</h2>"):page.index("<h2>Plots</h2>")]
    assert ">consistency<" in diff and "does not apply" in diff  # allreduce has no consistency
    assert page.count('<div class="scroll">') == 3 and "addEventListener('click'" in page


def test_failed_run_becomes_a_row(tmp_path: Path) -> None:
    ok = make_run(tmp_path, "ok")
    broken = tmp_path / "broken"
    broken.mkdir()
    page = write_report([ok, broken], tmp_path / "out", errors={broken: "the job failed (status 137)"}).read_text()
    assert page.count("FAILED") >= 2 and "failed: the job failed (status 137)" in page


def test_averaged_model_and_worker0_side_by_side(tmp_path: Path) -> None:
    from plexus.report.plots import PlotRun, plot_series
    run = make_run(tmp_path, "g", strategy="gossip", algorithm=None,
                   summary_extra={"worker0_test_accuracy": 0.75, "averaged_test_accuracy": 0.8})
    with open(run / "metrics.jsonl", "a") as f:
        for step in (20, 40, 50):
            f.write(json.dumps({"event": "eval", "time": step * 0.1, "step": step, "samples": step * 64,
                                "test_accuracy": 0.4 + step / 200, "test_loss": 1.0, "model": "worker0"}) + "\n")
    page = write_report([run]).read_text()
    assert "80.00 % / 75.00 %" in page
    series = plot_series(PlotRun(label="g", events=load_run(run).events))
    assert {"accuracy_global", "accuracy_worker0"} <= series.keys()


def test_compare_table_never_cuts_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plexus.cli import _print_compare
    a = make_run(tmp_path, "a", strategy="ps", algorithm=None, lr=0.05)
    b = make_run(tmp_path, "b", strategy="ps", algorithm=None, lr=0.5)
    for run, consistency in ((a, "asp"), (b, "bsp")):
        config = json.loads((run / "config.json").read_text())
        config["strategy"]["consistency"] = consistency
        (run / "config.json").write_text(json.dumps(config))
    rows = [(f"ps:consistency={c},lr={lr}", run, json.loads((run / "summary.json").read_text()), None)
            for run, c, lr in ((a, "asp", 0.05), (b, "bsp", 0.5))]
    _print_compare(rows)
    out = capsys.readouterr().out  # not a terminal
    assert "ps consistency=asp lr=0.05" in out and "ps consistency=bsp lr=0.5" in out
    assert "ps:consistency=asp,lr=0.05" in out and "…" not in out
    assert "MiB sent/worker" in out and f"{75_000 / 2**20:.2f}" in out


def test_compare_validates_every_spec_before_training(tmp_path: Path) -> None:
    """The second spec names a dataset that does not exist: the job must stop before the
    first one trains (it used to train it, then fail)."""
    from plexus.cli import main
    code = main(["compare", "allreduce", "allreduce:dataset=nope", "--workers", "1", "--steps", "5",
                 "--out", str(tmp_path / "cmp")])
    assert code == 2
    assert not list((tmp_path / "cmp").glob("*/summary.json"))
    assert not (tmp_path / "cmp" / "index.html").exists()


@pytest.mark.slow
def test_async_run_plots_agree_with_its_summary(tmp_path: Path) -> None:
    """ps asp with two workers: the throughput plot used to take one worker's samples as the
    job's, and drew half the summary's samples/s."""
    from plexus.report.plots import PlotRun, plot_series
    from test_cli import plexus_cli
    out = tmp_path / "ps"
    result = plexus_cli("train", "--strategy", "ps", "--workers", "2", "--steps", "60", "--log-every", "5",
                        "--eval-every", "20", "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_kind"] == "worker" and summary["steps_per_worker"] == [60, 60]
    assert summary["steps"] == 120 and summary["samples"] == 120 * 32
    assert summary["bytes_sent_total"] == sum(summary["bytes_sent_by_role"].values())
    series = plot_series(PlotRun(label="ps", events=load_run(out).events))
    ts, samples = series["samples"]
    assert samples[-1] == summary["samples"]
    # The plot's mean rate over the run is the summary's, up to the first log's offset.
    assert samples[-1] / ts[-1] == pytest.approx(summary["samples_per_second"], rel=0.1)
    assert series["mib_sent_workers"][1][-1] <= summary["bytes_sent_workers"] / 2**20 + 1e-9
    assert all(c is not None and 0 < c <= s for c, s in zip(summary["compute_seconds_per_worker"],
                                                            summary["step_seconds_per_worker"]))
    assert "worker steps (60 per worker)" in result.stdout and "MiB sent" in result.stdout


@pytest.mark.slow
def test_ranking_table_fits_1400px_in_chromium(tmp_path: Path) -> None:
    """The report of a seven-run comparison, opened in headless Chromium at 1,400 x 900 px,
    shows the whole ranking table (README screenshot: benchmarks/report_screenshot.py)."""
    from plexus.report.screenshot import find_chromium, measure, screenshot
    if find_chromium() is None:
        pytest.skip("no Chromium on PATH: install the system package chromium (apt-get install chromium)")
    runs = [make_run(tmp_path, f"r{i}", strategy=s, algorithm="ring" if s == "allreduce" else None, lr=lr)
            for i, (s, lr) in enumerate((("ps", 0.05), ("ps", 0.1), ("tree-ps", 0.05), ("allreduce", 0.1),
                                         ("gossip", 0.1), ("local-sgd", 0.1), ("easgd", 0.1)))]
    page = write_report(runs, tmp_path / "out", title="plexus compare")
    box = measure(page, "table.ranking")
    assert box["right"] <= 1400 and box["bottom"] <= 900 and box["page_width"] <= 1400, box
    png = screenshot(page, tmp_path / "report.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_compare_goes_on_after_a_failed_spec(tmp_path: Path) -> None:
    """A spec that fails while training becomes a failed row; the others finish and the
    table and report cover them all (compare used to abort and throw the table away)."""
    from test_cli import plexus_cli
    result = plexus_cli("compare", "allreduce:kill=worker:1@step=5", "allreduce:algorithm=ring", "--workers", "2",
                        "--steps", "20", "--out", str(tmp_path / "cmp"), "--json")
    assert result.returncode == 1, result.stderr
    rows = json.loads(result.stdout.splitlines()[-1])
    assert [r.get("status") for r in rows] == ["failed", "completed"]
    assert "1 of 2 specs failed: allreduce:kill=worker:1@step=5" in result.stderr
    assert "FAILED" in result.stdout and "allreduce/ring" in result.stdout
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert "FAILED" in page and "failed: the job failed" in page


def test_time_split_series() -> None:
    """The time line's split comes from the cumulative compute and step seconds of train
    events: compute, then the rest of the step (communication and waiting), then the rest."""
    from plexus.report.plots import time_split_series
    events = [{"event": "train", "time": 1.0, "worker": 0, "compute_seconds": 0.2, "step_seconds": 0.7},
              {"event": "train", "time": 2.0, "worker": 0, "compute_seconds": 0.5, "step_seconds": 1.5}]
    split = time_split_series(events)
    assert split[0][0] == pytest.approx((0.0, 1.0, 0.2, 0.5, 0.3))
    assert split[0][1] == pytest.approx((1.0, 2.0, 0.3, 0.5, 0.2))


# --- model-parallel runs: the stage time line and the traffic across the cut ------------

def add_stages(run: Path, *, replicas: int = 1, timeline: bool = True, mismatch: bool = False) -> Path:
    """Give ``run`` the summary keys of ``plexus train --stages 2 [--workers R]``: two stage
    processes per replica, each with a hand-made timeline of three pipelined steps."""
    summary = json.loads((run / "summary.json").read_text())
    stages = []
    for replica in range(replicas):
        for stage in range(2):
            entry = {"stage": stage, "replica": replica, "nodes": [f"net_{2 * stage}", f"net_{2 * stage + 1}"],
                     "compute_seconds": 0.25 + stage, "idle_seconds": 0.125 + stage, "params": 1000 * (stage + 1),
                     "peak_memory_bytes": (100 + stage) * 2**20, "peak_memory_measure": "ru_maxrss",
                     "bytes_sent": 3 * 2**20, "bytes_recv": 3 * 2**20, "sync_bytes_sent": 0}
            if timeline:
                spans = []
                for step in range(3):
                    t = 4.0 + 0.1 * step
                    spans += [["compute", t, t + 0.03], ["wait", t + 0.03, t + 0.08]] if stage == 0 else \
                        [["wait", t, t + 0.03], ["compute", t + 0.03, t + 0.08]]
                    if replicas > 1:
                        spans.append(["sync", t + 0.08, t + 0.1])
                entry["timeline"] = spans
            stages.append(entry)
    traffic = [{"src": src, "dst": dst, "messages_sent": 30 * replicas, "bytes_sent": 983040 * replicas,
                "messages_received": 30 * replicas, "bytes_received": 983040 * replicas,
                "predicted_messages": 30 * replicas, "predicted_bytes": 983040 * replicas}
               for src, dst in ((0, 1), (1, 0))]
    if mismatch:
        traffic[1]["bytes_received"] -= 4  # four bytes lost: invisible in MiB, so the match column must say it
    summary.update(stages=stages, stage_traffic=traffic, traffic_matches_plan=not mismatch)
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def section(page: str, start: str, end: str) -> str:
    return page[page.index(start):page.index(end, page.index(start))]


def test_stage_time_line_and_cut_traffic(tmp_path: Path) -> None:
    run = add_stages(make_run(tmp_path, "pipe"))
    index = write_report([run])
    pngs = images(index)
    assert_pngs(pngs)
    assert "stage_time_line.png" in {p.name for p in pngs}
    page = index.read_text()
    cut = section(page, "<h3>Traffic across the cut</h3>", "</table>")
    rows = re.findall(r"<tr><td.*?</tr>", cut)
    assert len(rows) == 2
    assert ">stage 0 → stage 1<" in rows[0] and ">stage 1 → stage 0<" in rows[1]
    for row in rows:  # measured sent, received and predicted: 30 messages, 0.94 MiB each
        assert row.count(">30<") == 3 and row.count(">0.94<") == 3 and row.count('title="983,040 bytes"') == 3
        assert row.endswith('<td data-sort="yes">yes</td></tr>')
    per_stage = section(page, "<h3>Per stage</h3>", "</table>")
    rows = re.findall(r"<tr><td.*?</tr>", per_stage)
    assert len(rows) == 2 and ">stage 0<" in rows[0] and ">stage 1<" in rows[1]
    # compute s, idle s, peak memory MiB of stage 1
    assert ">1.250<" in rows[1] and ">1.125<" in rows[1] and ">101.00<" in rows[1]
    assert 'title="net_2, net_3"' in rows[1] and not any("replica" in row for row in rows)


def test_cut_traffic_off_the_plan_is_marked(tmp_path: Path) -> None:
    run = add_stages(make_run(tmp_path, "pipe"), mismatch=True)
    cut = section(write_report([run]).read_text(), "<h3>Traffic across the cut</h3>", "</table>")
    rows = re.findall(r"<tr><td.*?</tr>", cut)
    assert rows[0].endswith(">yes</td></tr>")
    assert 'class="unhealthy"' in rows[1] and rows[1].endswith(">NO</td></tr>")
    assert 'title="983,036 bytes"' in rows[1]


def test_cut_traffic_in_flight_at_an_early_stop_still_matches() -> None:
    """An asynchronous pipeline stopped by --time-limit: the forward edge's receiver took
    one message fewer than was sent and predicted, and the row says how many were in
    flight; the same shortfall without that count does not match."""
    from plexus.report.stages import traffic_cells
    row = {"src": 0, "dst": 1, "messages_sent": 31, "bytes_sent": 31 * 8192, "messages_received": 30,
           "bytes_received": 30 * 8192, "predicted_messages": 31, "predicted_bytes": 31 * 8192,
           "messages_in_flight_at_stop": 1, "bytes_in_flight_at_stop": 8192}
    assert traffic_cells({"stage_traffic": [row]})[0][1]
    lost = {key: value for key, value in row.items() if "in_flight" not in key}
    assert not traffic_cells({"stage_traffic": [lost]})[0][1]


def test_runs_without_stages_have_no_stage_views(tmp_path: Path) -> None:
    index = write_report([make_run(tmp_path, "plain")])
    page = index.read_text()
    assert not (tmp_path / "plain" / "stage_time_line.png").exists()
    assert "stage_time_line.png" not in page and "Traffic across the cut" not in page and "Per stage" not in page
    # Stages without a timeline (an older summary): the tables, but no figure.
    run = add_stages(make_run(tmp_path, "old"), timeline=False)
    page = write_report([run]).read_text()
    assert not (run / "stage_time_line.png").exists() and "Traffic across the cut" in page


def test_stage_lanes_name_replicas() -> None:
    """One lane per stage process, in replica then stage order, named by replica only when
    there are several; spans keep their kind and times, malformed ones are dropped."""
    from plexus.report.stages import timeline_lanes
    summary = {"stages": [
        {"stage": 1, "replica": 1, "timeline": [["sync", 2.0, 2.5], ["compute", 1.0, 2.0]]},
        {"stage": 0, "replica": 1, "timeline": [["compute", 1.0, 1.5]]},
        {"stage": 1, "replica": 0, "timeline": [["wait", 1.0, 1.2], ["nap", 1.2, 1.3], ["compute", 2.0, 1.0]]},
        {"stage": 0, "replica": 0, "timeline": "not a list"}]}
    lanes = timeline_lanes(summary)
    assert [lane.label for lane in lanes] == ["replica 0 stage 0", "replica 0 stage 1",
                                              "replica 1 stage 0", "replica 1 stage 1"]
    assert lanes[0].spans == [] and lanes[1].spans == [("wait", 1.0, 1.2)]
    assert lanes[3].spans == [("compute", 1.0, 2.0), ("sync", 2.0, 2.5)]
    assert [lane.label for lane in timeline_lanes({"stages": [{"stage": 0, "timeline": [["compute", 0, 1]]}]})] \
        == ["stage 0"]
    assert timeline_lanes({"stages": [{"stage": 0, "replica": 0}]}) == []
    assert timeline_lanes({}) == []


def test_stage_time_line_of_several_runs(tmp_path: Path) -> None:
    """Two model-parallel runs and one data-parallel run: one figure, whose panels are the
    two pipelines (the plot sees each run's summary through PlotRun)."""
    from plexus.report.plots import PlotRun, write_plots
    a = add_stages(make_run(tmp_path, "a"))
    b = add_stages(make_run(tmp_path, "b", workers=4), replicas=2)
    plain = make_run(tmp_path, "c")
    out = tmp_path / "compare"
    page = write_report([a, b, plain], out_dir=out).read_text()
    assert (out / "stage_time_line.png").read_bytes()[:8] == PNG_MAGIC
    assert ">replica 1 stage 1<" in section(page, "<h3>Per stage</h3>", "</table>")
    runs = [PlotRun(label=r.name, events=load_run(r).events, summary=load_run(r).summary) for r in (a, b, plain)]
    plots = {p.path.name for p in write_plots(runs, tmp_path / "plots")}
    assert "stage_time_line.png" in plots
    # The same runs without their summaries: no figure (it draws from the summary alone).
    plots = {p.path.name for p in write_plots([PlotRun(label=r.label, events=r.events) for r in runs],
                                              tmp_path / "bare")}
    assert "stage_time_line.png" not in plots and "loss_time.png" in plots


def test_pipeline_line_and_shard_names():
    from plexus.report.stages import pipeline_line, stage_name
    summary = {"pipeline": {"schedule": "1f1b", "microbatches": 8, "bubble_measured": 0.356,
                            "bubble_predicted": 0.2, "bubble_simulated": 0.226, "max_in_flight": 3,
                            "peak_activation_bytes": 3 * 2**20, "recompute": False}}
    assert pipeline_line(summary) == ("1f1b over 8 micro-batches: bubble 0.356 measured, 0.200 by the closed form, "
                                      "0.226 simulated from the stages' measured op costs; at most 3 micro-batches "
                                      "(3.00 MiB of activations) held by a stage")
    summary["pipeline"]["bubble_replayed"] = 0.301
    assert "0.226 simulated from the stages' measured op costs, 0.301 replayed with each op's own duration; " \
        in pipeline_line(summary)
    assert pipeline_line({}) is None and pipeline_line({"pipeline": {"schedule": "gpipe"}}) is None
    shard = {"stage": 1, "replica": 0, "shard": 1, "tensor_bytes_sent": 10}
    assert stage_name(shard, False) == "stage 1 shard 1"
    assert stage_name({"stage": 1, "replica": 1, "shard": 0}, True) == "replica 1 stage 1"


def test_a_pipelined_stage_shows_its_activations_beside_the_plan_on_hover() -> None:
    from plexus.report.stages import STAGE_HEAD, stage_cells
    stage = {"stage": 0, "peak_memory_bytes": 2**30, "peak_memory_measure": "ru_maxrss"}
    column = [head for head, _ in STAGE_HEAD].index("peak memory MiB")
    assert stage_cells({"stages": [stage]})[0][column][2] == "measured by ru_maxrss"
    piped = {**stage, "peak_activation_bytes": 3 * 2**19, "planned_activation_bytes": 2**21}
    assert stage_cells({"stages": [piped]})[0][column] == (
        "1,024.00", 2**30, "measured by ru_maxrss; activations held at once 1.50 MiB, planned 2.00 MiB")
