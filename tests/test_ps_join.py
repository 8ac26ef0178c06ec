"""Membership from outside the job: ``plexus worker --join`` adds a worker to a running asp
job, which starts from the current weights and contributes; a client that sends a
malformed header loses its own link only, and the job finishes for everyone else."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm_cli
from plexus.train.metrics import read_events

PY = sys.executable
HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(port: int, token: str) -> None:
    """Raise the job's stop flag (what ``Strategy.agree`` sets on a time limit or target)."""
    from plexus.cluster.rendezvous import ProcessInfo, connect_store
    info = ProcessInfo(role="worker", rank=-1, world_size=0, master_addr="127.0.0.1", master_port=port, token=token)
    connect_store(info, 10).set("ps/stop", "1")


@pytest.mark.slow
def test_worker_joins_a_running_job_and_a_malformed_client_is_cut_off(tmp_path):
    port, token, out = _free_port(), "join-test-token", tmp_path / "run"
    env = {**os.environ, "PLEXUS_TOKEN": token}
    # The job and the joiner are forked from the tests' warm helper (warm_cli.popen).
    job = warm_cli.popen(["train", "--strategy", "ps", "--consistency", "asp", "--workers", "2", "--servers", "2",
                          "--dataset", "digits", "--hidden", "32", "--lr", "0.1", "--momentum", "0",
                          "--batch-size", "32", "--steps", "1000000", "--time-limit", "120", "--eval-every", "200",
                          "--log-every", "20", "--port", str(port), "--timeout", "30", "--peer-timeout", "5",
                          "--out", str(out), "--quiet", "--json"], env=env)
    joiner = None
    try:
        _wait_for(lambda: bool(read_events(out, "train")), 90, "training started", job)
        attack = subprocess.Popen([PY, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import ps_fns; "
                                   f"print(ps_fns.malicious_join('127.0.0.1', {port}, {token!r}, 'unknown-op'))"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        joiner = warm_cli.popen(["worker", "--join", f"127.0.0.1:{port}", "--timeout", "30"], env=env)
        attack_out, attack_err = attack.communicate(timeout=90)
        # Once the joiner has trained a while, end the job as a reached target would.
        _wait_for(lambda: any(e["worker"] >= 2 and e["step"] >= 40 for e in read_events(out, "train")), 90,
                  "the joined worker's progress", job)
        _stop(port, token)
        join_out, join_err = joiner.communicate(timeout=120)
        job_out, job_err = job.communicate(timeout=120)
    finally:
        for proc in (job, joiner):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert attack_out.strip().splitlines()[-1] == "ERROR", attack_err
    assert joiner.returncode == 0, join_err
    assert job.returncode == 0, job_err
    summary = json.loads(job_out.strip().splitlines()[-1])
    assert len(summary["joined_workers"]) == 1, summary
    joined = summary["joined_workers"][0]
    intruder = ({2, 3} - {joined}).pop()
    assert summary["lost_workers"] == [intruder] and summary["protocol_errors"] == 1
    assert "protocol error from worker" in job_err and f"worker {intruder}" in job_err
    # The joiner started from the weights of the running job and its pushes were applied.
    assert summary["join_versions"][str(joined)] > 0
    assert summary["updates_applied_by_worker"][str(joined)] > 0
    assert summary["updates_applied"] == summary["pushes_acknowledged"]
    assert any(e["worker"] == joined for e in read_events(out, "train"))
    assert summary["final_test_accuracy"] > 0.5
    # The joiner's steps count in the job's samples, and so do the others' at evaluations.
    logged = {}
    for e in read_events(out, "train"):
        logged[e["worker"]] = max(logged.get(e["worker"], 0), e["step"])
    assert summary["samples"] >= sum(logged.values()) * 16 and logged[joined] >= 40, (summary, logged)
    evals = read_events(out, "eval")
    assert evals and all(e["samples"] > e["step"] * 16 for e in evals[:-1] if e["step"] >= 200), evals


@pytest.mark.parametrize("args, env, words", [
    (["--join", "localhost"], {"PLEXUS_TOKEN": "x"}, "HOST:PORT"),
    (["--join", "127.0.0.1:1"], {"PLEXUS_TOKEN": ""}, "PLEXUS_TOKEN"),
])
def test_join_usage_errors_are_one_line_and_status_2(args, env, words):
    result = warm_cli.run(["worker", *args], timeout=60, env={**os.environ, **env})
    assert result.returncode == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
