"""Progress everywhere (issue 19, item 5): off a terminal ``plexus train`` prints what
start-up is doing and then a line every few seconds, with the job's throughput; and it
warns when the processes outnumber the cores by more than 2x."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import warm_cli

from plexus.config import JobConfig
from plexus.train.progress import MetricsTail, Snapshot, describe, oversubscription

PY = sys.executable


def _write_events(path, events) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_throughput_is_the_jobs_summed_over_asynchronous_workers(tmp_path):
    """Asynchronous workers each log their own step, and ``samples`` is the job's total as
    the worker knows it: the rate is that total over the training clock, as in the summary,
    not one worker's share (the report's old 3-4x understatement)."""
    events = [
        {"event": "train", "time": 1.0, "worker": 0, "step": 10, "loss": 2.0, "samples": 640, "worker_samples": 320},
        {"event": "train", "time": 1.1, "worker": 1, "step": 10, "loss": 2.1, "samples": 960, "worker_samples": 320},
        {"event": "train", "time": 2.0, "worker": 1, "step": 20, "loss": 1.1, "samples": 1600, "worker_samples": 640},
        {"event": "eval", "time": 2.0, "step": 20, "samples": 1600, "test_accuracy": 0.5, "model": "global"},
        {"event": "eval", "time": 2.0, "step": 20, "samples": 1600, "test_accuracy": 0.1, "model": "worker0"},
        {"event": "train", "time": 2.1, "worker": 0, "step": 20, "loss": 1.0, "samples": 1920, "worker_samples": 640},
    ]
    _write_events(tmp_path / "metrics.jsonl", events[:2])
    tail = MetricsTail(tmp_path)
    assert tail.read().samples == 960
    with open(tmp_path / "metrics.jsonl", "a") as f:  # appended later, and a half-written line
        f.write("".join(json.dumps(e) + "\n" for e in events[2:]) + '{"event": "tra')
    s = tail.read()
    assert (s.step, s.loss, s.samples, s.time, s.accuracy) == (20, 1.0, 1920, 2.1, 0.5)
    assert s.rate == pytest.approx(1920 / 2.1)
    line = describe(s, elapsed=3.0, steps_total=100, time_limit=None)
    assert line == "step 20/100  914 samples/s  loss 1.0000  test acc 50.00%  elapsed 3.0 s  ETA 8.4 s"
    assert describe(Snapshot(), 0.5, None, 10.0).endswith("ETA 10.0 s")  # bounded by --time-limit


def test_oversubscription_counts_every_role_against_the_cores():
    ps = JobConfig.from_flat({"strategy": "ps", "workers": 4, "servers": 1})
    line = oversubscription(ps, cores=2)
    assert line is not None and line.startswith("5 processes (4 workers, 1 server) on 2 cores: more than 2 per core")
    assert "pass fewer --workers (at most 3 here)" in line
    assert oversubscription(ps, cores=4) is None
    assert oversubscription(JobConfig.from_flat({"strategy": "allreduce", "workers": 4}), cores=2) is None  # 2x
    tree = JobConfig.from_flat({"strategy": "tree-ps", "variant": "adv", "fanout": 2, "workers": 8})
    assert re.match(r"\d+ processes \(8 workers, 1 server, \d+ aggregators\) on 2 cores", oversubscription(tree, 2))


@pytest.mark.slow
def test_off_a_terminal_train_prints_start_up_phases_progress_lines_and_the_crowding_warning(tmp_path):
    """stderr is a pipe here, as in CI or `2> log`: before, nothing at all was printed until
    the end. One core for 3 processes (2 workers and a server) is oversubscribed."""
    env = {**os.environ, "PLEXUS_PROGRESS_EVERY": "0.3", "MPLCONFIGDIR": "/tmp/plexus-mpl"}
    result = subprocess.run([PY, "-m", "plexus.cli", "train", "--strategy", "ps", "--workers", "2", "--steps", "1500",
                             "--out", str(tmp_path / "run"), "--json"], capture_output=True, text=True, timeout=300,
                            env=env, preexec_fn=lambda: os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}))
    assert result.returncode == 0, result.stderr
    err = result.stderr.splitlines()
    warning = [line for line in err if "processes (2 workers, 1 server) on 1 core" in line]
    assert len(warning) == 1 and warning[0].startswith("plexus: warning: 3 processes"), result.stderr
    assert any(line.startswith("plexus: start-up: ") for line in err), result.stderr
    steps = [line for line in err if re.match(r"plexus: step \d+/1500  [\d,]+ samples/s  loss [\d.]+  .*"
                                                 r"elapsed [\d.]+ s  ETA [\d.]+ s$", line)]
    assert steps, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    last = int(steps[-1].split("samples/s")[0].split()[-1].replace(",", ""))
    # The job's rate (both workers), not one worker's half of it.
    assert last > 0.6 * summary["samples_per_second"], (steps, summary["samples_per_second"])
    quiet = warm_cli.run(["train", "--workers", "1", "--steps", "200", "--quiet", "--out", str(tmp_path / "quiet")],
                         timeout=300, env=env)
    assert quiet.returncode == 0 and "plexus: step" not in quiet.stderr and "start-up" not in quiet.stderr
