"""Elastic all-reduce (strategies/elastic.py): survivors of a killed worker re-form the
group without restarting and equal the uninterrupted run; a worker joins at a step
boundary; algorithms that cannot be abandoned halfway are refused."""
from __future__ import annotations

import json
import os

import pytest
import torch

import warm_cli
from test_ps_join import _free_port, _wait_for
from plexus.strategies.elastic import Generation
from plexus.train.batches import GlobalBatches
from plexus.train.metrics import read_events

JOB = ["--strategy", "allreduce", "--dataset", "digits", "--model", "mlp", "--batch-size", "64", "--timeout", "30",
       "--quiet", "--json"]


def _train(out, *args: str, env: dict | None = None) -> dict:
    result = warm_cli.run(["train", *JOB, *args, "--out", str(out)], timeout=240, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _relative_gap(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)


def test_shares_cover_the_global_batch_when_workers_do_not_divide_it():
    batches = GlobalBatches(1000, 64, seed=3)
    parts = [batches.worker_indices(5, r, 3) for r in range(3)]
    assert sorted(len(p) for p in parts) == [21, 21, 22]
    assert torch.equal(torch.cat(parts), batches.indices(5))
    # Where P divides B the slices are the same as ever: B/P each.
    assert [len(batches.worker_indices(5, r, 4)) for r in range(4)] == [16] * 4


def test_the_reference_is_the_member_with_most_steps_then_the_lowest_rank():
    assert Generation(1, [0, 1, 3], steps={0: 40, 1: 41, 3: 41}).reference() == 1
    assert Generation(1, [1, 2], steps={1: 7, 2: 7}).reference() == 1
    assert Generation(2, [0, 1, 4], steps={0: 9, 1: 9, 4: -1}).reference() == 0  # 4 joined


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic") / "whole"
    summary = _train(out, "--workers", "4", "--steps", "60", "--elastic", "--save-model")
    return summary, torch.load(out / "model.pt")


@pytest.mark.parallel
@pytest.mark.parametrize("algorithm, killed, step", [("ring", 1, 23), ("rhd", 0, 5), ("dbtree", 3, 40),
                                                     ("master", 0, 31), ("ps", 2, 17)])
def test_survivors_reform_and_equal_the_uninterrupted_run(tmp_path, uninterrupted, algorithm, killed, step):
    whole, weights = uninterrupted
    summary = _train(tmp_path, "--workers", "4", "--steps", "60", "--elastic", "--algorithm", algorithm,
                     "--kill", f"worker:{killed}@step={step}", "--save-model")
    assert summary["status"] == "completed" and summary["lost_workers"] == [killed]
    elastic = summary["elastic"]
    assert elastic["final_members"] == sorted({0, 1, 2, 3} - {killed})
    [regroup] = elastic["regroups"]
    assert regroup["lost"] == [killed] and regroup["step"] in (step, step + 1)
    assert 0 <= regroup["first_step_seconds"] < 10
    # The failed step was redone over three workers with the global batch kept: the run
    # is the uninterrupted one, to float rounding (the sums go in other orders).
    assert _relative_gap(weights, torch.load(tmp_path / "model.pt")) < 1e-5
    assert summary["final_test_accuracy"] == pytest.approx(whole["final_test_accuracy"], abs=0.01)


@pytest.mark.parallel
def test_an_elastic_run_without_faults_is_the_fixed_group_run(tmp_path, uninterrupted):
    _, weights = uninterrupted
    _train(tmp_path, "--workers", "4", "--steps", "60", "--algorithm", "ring", "--save-model")
    assert _relative_gap(weights, torch.load(tmp_path / "model.pt")) == 0.0


@pytest.mark.slow
def test_a_worker_joins_at_a_step_boundary_and_trains_with_the_group(tmp_path):
    port, token, out = _free_port(), "elastic-join-token", tmp_path / "run"
    env = {**os.environ, "PLEXUS_TOKEN": token, "PLEXUS_NO_REPORT": "1"}
    job = warm_cli.popen(["train", *JOB, "--workers", "2", "--elastic", "--steps", "4000", "--log-every", "20",
                          "--port", str(port), "--out", str(out)], env=env)  # forked warm, as the joiner is
    try:
        _wait_for(lambda: bool(read_events(out, "train")), 90, "training started", job)
        joiner = warm_cli.run(["worker", "--join", f"127.0.0.1:{port}", "--timeout", "30"], env=env, timeout=180)
        job_out, job_err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
    assert joiner.returncode == 0, joiner.stderr[-2000:]
    assert "joined the job" in joiner.stderr and "stalled" not in joiner.stderr
    assert job.returncode == 0, job_err[-2000:]
    summary = json.loads(job_out.strip().splitlines()[-1])
    [regroup] = summary["elastic"]["regroups"]
    assert regroup["joined"] == [2] and summary["elastic"]["final_members"] == [0, 1, 2]
    steps = {e["worker"]: e["step"] for e in read_events(out, "train")}
    assert steps[2] == 4000 and steps[0] == 4000
    assert summary["final_test_accuracy"] > 0.9


@pytest.mark.parametrize("args, words", [
    (["--elastic", "--algorithm", "native"], ["--elastic cannot re-form", "ring, rhd, dbtree, master, ps"]),
    (["--elastic", "--algorithm", "hier"], ["--algorithm hier"]),
    (["--elastic", "--strategy", "ps"], ["--elastic does not apply to strategy ps"]),
])
def test_elastic_bad_input_is_one_line_and_status_2(args, words):
    result = warm_cli.run(["train", "--steps", "5", *args], timeout=120)
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err


@pytest.mark.parallel
def test_a_timed_kill_ends_a_process_that_counts_no_steps_and_the_job_names_it(tmp_path):
    """``--kill ROLE:K@time=S``: easgd's centre server dies a second into training."""
    result = warm_cli.run(["train", "--strategy", "easgd", "--workers", "2", "--steps", "100000", "--kill",
                           "server:0@time=1", "--dataset", "digits", "--timeout", "30", "--out", str(tmp_path),
                           "--quiet"], timeout=120)
    assert result.returncode == 137, result.stderr[-2000:]
    assert "killed on purpose 1 s after training started" in result.stderr
    assert "the job failed (server 0 exited with status 137)" in result.stderr
