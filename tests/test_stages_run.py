"""plexus train --stages K: one replica cut into K stage processes (parallel/executor.py).

The oracle is a one-process run of the same job (--workers 1, same seed and batch, plain
SGD): K-stage synchronous training must give the same model to float32 rounding, and the
links' per-edge counters must equal the partitioner's prediction exactly."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from plexus.train.job import run
from test_cli import assert_usage_error

BASE = dict(dataset="digits", optimizer="sgd", lr=0.05, momentum=0.0, batch_size=32, steps=20, eval_every=0,
            save_model=True, seed=5, hidden=32, quiet=True, no_report=True)


def _train(tmp_path, name: str, **flat) -> tuple[dict, dict[str, torch.Tensor]]:
    summary = run({**BASE, **flat, "out": str(tmp_path / name)})
    assert summary["status"] == "completed"
    return summary, torch.load(tmp_path / name / "model.pt", weights_only=True)


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        rel = ((got[key] - want[key]).norm() / want[key].norm()).item()
        assert rel < 1e-5, f"{key}: relative difference {rel:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("model, stage_counts", [("mlp", (2, 3, 4)), ("towers", (2,))])
def test_stages_equal_one_process(model, stage_counts, tmp_path):
    one, want = _train(tmp_path, f"{model}-1", model=model, workers=1)
    for k in stage_counts:
        summary, got = _train(tmp_path, f"{model}-{k}", model=model, stages=k)
        assert_same_model(got, want)
        assert summary["processes"] == k and len(summary["stages"]) == k
        assert summary["traffic_matches_plan"] is True
        assert summary["final_test_accuracy"] == pytest.approx(one["final_test_accuracy"], abs=1e-9)
        for stage in summary["stages"]:
            assert stage["compute_seconds"] > 0 and stage["idle_seconds"] >= 0 and stage["peak_memory_bytes"] > 0


@pytest.mark.slow
def test_skip_and_transposed_values_across_cuts(tmp_path):
    """userpkg.staged: a transposed (non-contiguous, batch in dimension 1) value crosses a
    cut, and one value goes to two stages, its two gradients summed on the way back."""
    flat = dict(model="userpkg.staged:make_model", steps=10)
    _, want = _train(tmp_path, "one", workers=1, **flat)
    summary, got = _train(tmp_path, "cut", stages=3, partition="manual", split_points="t_1,c", **flat)
    assert_same_model(got, want)
    rows = {(r["src"], r["dst"]): r for r in summary["stage_traffic"]}
    assert rows[(0, 1)]["messages_sent"] == 20 and rows[(1, 0)]["messages_sent"] == 20  # relu and t, each way
    assert rows[(0, 2)]["messages_sent"] == rows[(2, 0)]["messages_sent"] == 10
    assert summary["traffic_matches_plan"] is True


@pytest.mark.slow
def test_time_partition_is_profiled_once_and_shared(tmp_path):
    """--partition time: stage 0 profiles and the others cut where it did; the run still
    equals one process and its traffic the (shared) plan's."""
    _, want = _train(tmp_path, "one", model="mlp", workers=1, steps=5)
    summary, got = _train(tmp_path, "time", model="mlp", stages=3, partition="time", steps=5)
    assert_same_model(got, want)
    assert summary["traffic_matches_plan"] is True and len(summary["stages"]) == 3
    # Each stage names its nodes (together, every computing node once, in order) and the
    # profiled plan's prediction for the steps made, beside what it measured.
    nodes = [n for stage in summary["stages"] for n in stage["nodes"]]
    assert len(nodes) == len(set(nodes)) and all(stage["nodes"] for stage in summary["stages"])
    for stage in summary["stages"]:
        assert stage["predicted_seconds"] >= stage["predicted_compute_seconds"] > 0


@pytest.mark.slow
def test_towers_fan_out_traffic_equals_plan(tmp_path):
    """Stage 0's input goes to both towers' stages (one value, two receivers: one message
    each), and tower 0's output skips from stage 1 to stage 2."""
    summary, _ = _train(tmp_path, "fan", model="towers", stages=3, partition="manual",
                        split_points="towers.0,towers.1", steps=7)
    rows = {(r["src"], r["dst"]): r for r in summary["stage_traffic"]}
    assert set(rows) == {(0, 1), (0, 2), (1, 2), (2, 1)}  # no gradient back to stage 0's input
    for row in rows.values():
        assert row["messages_sent"] == row["messages_received"] == row["predicted_messages"] == 7
        assert row["bytes_sent"] == row["bytes_received"] == row["predicted_bytes"] > 0
    assert rows[(0, 1)]["bytes_sent"] == rows[(0, 2)]["bytes_sent"] == 7 * 32 * 64 * 4  # digits: 64 floats
    assert summary["traffic_matches_plan"] is True
    written = json.loads((tmp_path / "fan" / "summary.json").read_text())
    assert written["stage_traffic"] == summary["stage_traffic"]


@pytest.mark.slow
def test_snapshots_and_target_accuracy_stop_every_stage(tmp_path):
    """Snapshots of the whole model gathered every --eval-every steps are evaluated; a
    target accuracy reached ends every stage after the same step, well before --steps."""
    summary = run({**BASE, "model": "mlp", "stages": 3, "lr": 0.1, "momentum": 0.9, "steps": 2000,
                   "eval_every": 5, "log_every": 5, "target_accuracy": 0.8, "save_model": False,
                   "out": str(tmp_path / "target")})
    assert summary["status"] == "completed" and summary["target_reached"] is True
    assert summary["steps"] < 2000 and summary["evaluations"] >= 2
    assert summary["traffic_matches_plan"] is True  # (when the evaluator answers is timing: no step asserted)
    events = [json.loads(line) for line in (tmp_path / "target" / "metrics.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "eval" for e in events) == summary["evaluations"]


@pytest.mark.slow
def test_a_failing_stage_fails_the_job_and_is_named(tmp_path, capfd):
    """A non-finite loss on the output stage ends the job (its peers lose their links and
    stop too, no hang) with one line naming a stage. Which one is named is the earliest
    time of death in the store; the failing stage records its own first, but once, on a
    loaded machine, the job named stage 1 (status 1, the link it lost): not asserted."""
    from plexus.errors import JobFailed
    with pytest.raises(JobFailed, match=r"stage \d exited with status [13]"):
        run({**BASE, "model": "mlp", "stages": 3, "lr": 1e6, "out": str(tmp_path / "nan")})
    assert "stage 2: the training loss became nan" in capfd.readouterr().err
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("args, needle", [
    (["--stages", "2", "--workers", "2", "--strategy", "ps", "--servers", "1"],
     "--servers 1 under --stages 2: each stage's parameters live on servers of their own"),
    (["--stages", "9"], "stages must lie in [1, 6]"),
    (["--stages", "2", "--strategy", "sandblaster"], "strategy sandblaster over --stages 2 is not supported"),
    (["--stages", "2", "--workers", "2", "--strategy", "ps", "--backup-workers", "1", "--consistency", "bsp"],
     "--backup-workers with --stages 2 is not supported yet"),
    (["--stages", "2", "--algorithm", "ring"], "--algorithm does not apply to --stages 2"),
    (["--stages", "2", "--launcher", "ray"], "--stages 2 with --launcher ray is not supported yet"),
    (["--stages", "2", "--checkpoint-every", "5"], "--checkpoint-every with --stages 2 is not supported yet"),
])
def test_bad_stage_input_is_one_line_and_status_2(args, needle, capsys, tmp_path):
    from plexus.cli import main
    status = main(["train", "--dataset", "digits", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert_usage_error(subprocess.CompletedProcess([], status, "", err), needle)


@pytest.mark.slow
def test_torchrun_runs_a_pipeline_as_the_local_launcher_does(tmp_path):
    """torchrun's world of 2 is one replica's 2 stages; the last stage writes the run
    directory. Same model as our own launcher, bit for bit (across hosts:
    tests/test_many_hosts.py)."""
    import os
    import sys
    from test_cli import plexus_cli
    common = ["--stages", "2", "--microbatches", "4", "--steps", "20", "--save-model", "--quiet", "--json"]
    ours = plexus_cli("train", *common, "--out", str(tmp_path / "ours"))
    assert ours.returncode == 0, ours.stderr
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "plexus.cli", "train", *common, "--out", str(tmp_path / "torchrun")],
                            capture_output=True, text=True, timeout=180,
                            env={**os.environ, "PLEXUS_TOKEN": "t", "TMPDIR": str(tmp_path)})  # torchelastic_* there
    assert theirs.returncode == 0, theirs.stderr
    summary = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["pipeline"]["schedule"] == "1f1b"
    a, b = torch.load(tmp_path / "ours" / "model.pt"), torch.load(tmp_path / "torchrun" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_compare_runs_stages_beside_one_process(tmp_path):
    from test_cli import plexus_cli
    result = plexus_cli("compare", "allreduce", "allreduce:stages=2", "--dataset", "digits", "--steps", "20",
                        "--hidden", "32", "--no-report", "--quiet", "--out", str(tmp_path / "cmp"))
    assert result.returncode == 0, result.stderr
    one, two = (json.loads(p.read_text()) for p in sorted((tmp_path / "cmp").glob("*/summary.json")))
    assert two["processes"] == 2 and two["traffic_matches_plan"] is True
    assert two["final_test_accuracy"] == one["final_test_accuracy"]


def test_the_simulator_refuses_stages_in_one_line(capsys):
    from plexus.cli import main
    status = main(["simulate", "--stages", "2"])
    assert_usage_error(subprocess.CompletedProcess([], status, "", capsys.readouterr().err),
                       "the simulator does not run a cut model yet")
