"""plexus train --stages K --workers R: R model-parallel replicas x K stages (parallel/executor.py).

The oracle is the unpartitioned data-parallel run of the same job (--strategy allreduce
--workers R, same seed and global batch, plain SGD): replica r reads worker r's slice of
every global batch and stage k of every replica all-reduces its gradients (mean) with
the others, so the saved model must be the same to float32 rounding. The cut edges'
counters must equal the plan's per-replica prediction times R, the all-reduce counted apart."""
from __future__ import annotations

import subprocess

import pytest

from plexus.config import JobConfig
from plexus.train.plan import format_plan, role_plan
from test_cli import assert_usage_error
from test_stages_run import BASE, _train, assert_same_model


@pytest.mark.slow
@pytest.mark.parallel
def test_two_replicas_of_two_stages_equal_allreduce(tmp_path):
    _, want = _train(tmp_path, "ar", model="mlp", strategy="allreduce", workers=2)
    summary, got = _train(tmp_path, "hybrid", model="mlp", workers=2, stages=2)
    assert_same_model(got, want)
    assert summary["processes"] == 4 and summary["replicas"] == 2 and len(summary["stages"]) == 4
    assert {(s["replica"], s["stage"]) for s in summary["stages"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # mlp, --hidden 32: the cut carries 32 floats per sample each way, 16 samples per replica.
    assert summary["traffic_matches_plan"] is True
    rows = {(r["src"], r["dst"]): r for r in summary["stage_traffic"]}
    assert set(rows) == {(0, 1), (1, 0)}
    for row in rows.values():
        assert row["messages_sent"] == row["messages_received"] == row["predicted_messages"] == 2 * 20
        assert row["bytes_sent"] == row["bytes_received"] == row["predicted_bytes"] == 2 * 20 * 16 * 32 * 4
    # Each stage group all-reduces its own parameters only, apart from the edges' bytes.
    groups = {g["stage"]: g for g in summary["stage_groups"]}
    assert set(groups) == {0, 1} and all(g["replicas"] == 2 for g in groups.values())
    for k, group in groups.items():
        assert group["bytes_sent"] == group["bytes_recv"] >= 20 * group["params"] * 4
    for stage in summary["stages"]:
        assert stage["bytes_sent"] == 20 * 16 * 32 * 4  # the edge only: no all-reduce bytes in it
    assert summary["bytes_sent_per_worker"][0] == summary["bytes_sent_per_worker"][1] > 0
    # Small buckets: all-reduces start during backward, beside the edges' sends; same model.
    _, got = _train(tmp_path, "buckets", model="mlp", workers=2, stages=2, bucket_mb=0.001, algorithm="ring")
    assert_same_model(got, want)


@pytest.mark.slow
@pytest.mark.parallel
def test_replicas_of_stages_learn_as_allreduce_does(tmp_path):
    flat = dict(model="mlp", steps=300, save_model=False, lr=0.1)
    ar, _ = _train_nosave(tmp_path, "ar", strategy="allreduce", workers=2, **flat)
    hybrid, _ = _train_nosave(tmp_path, "hybrid", workers=2, stages=2, **flat)
    assert ar["final_test_accuracy"] > 0.5
    assert hybrid["final_test_accuracy"] >= 0.9 * ar["final_test_accuracy"]


# Each data-parallel strategy over 2 replicas x 2 stages, with its own defaults (digits,
# mlp), against the same strategy over 2 unpartitioned workers at equal steps.
STRATEGIES = [
    dict(strategy="ps", consistency="bsp", servers=2),
    dict(strategy="ps", consistency="asp", servers=2),
    dict(strategy="gossip"),
    dict(strategy="local-sgd"),
    dict(strategy="tree-ps"),
    dict(strategy="easgd"),
]


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("flags", STRATEGIES, ids=lambda f: " ".join(str(v) for v in f.values()))
def test_every_strategy_trains_replicas_of_stages(flags, tmp_path):
    from plexus.train.job import run
    defaults = dict(dataset="digits", quiet=True, no_report=True, eval_every=0)
    flat = run({**defaults, **flags, "workers": 2, "out": str(tmp_path / "flat")})
    cut = run({**defaults, **flags, "workers": 2, "stages": 2, "out": str(tmp_path / "cut")})
    assert flat["status"] == cut["status"] == "completed"
    # Every group but gossip's and local SGD's has a server of its own.
    assert cut["steps"] == flat["steps"] and cut["processes"] == 4 + 2 * (flags["strategy"] not in ("gossip", "local-sgd"))
    assert cut["final_test_accuracy"] >= 0.9 * flat["final_test_accuracy"] > 0.5
    groups = cut["stage_groups"]
    assert [g["stage"] for g in groups] == [0, 1] and all(g["bytes_sent"] > 0 for g in groups)
    if flags["strategy"] == "ps":
        # Stage k pushes to and pulls from its own group's server only (stage i = r*2 + k).
        assert {stage: list(row) for stage, row in cut["stage_server_traffic"].items()} == {
            "stage 0": ["server 0"], "stage 1": ["server 1"], "stage 2": ["server 0"], "stage 3": ["server 1"]}
        assert all(g["updates_applied"] == flat["updates_applied"] for g in groups)


def _train_nosave(tmp_path, name, **flat):
    from plexus.train.job import run
    summary = run({**BASE, **flat, "out": str(tmp_path / name)})
    assert summary["status"] == "completed"
    return summary, None


@pytest.mark.slow
@pytest.mark.parallel
def test_two_replicas_of_three_tower_stages_traffic_equals_plan(tmp_path):
    """towers cut into 3 stages (fan-out and a skip edge), 2 replicas, another algorithm:
    every edge carries the plan's per-replica traffic twice."""
    summary, _ = _train(tmp_path, "fan", model="towers", workers=2, stages=3, partition="manual",
                        split_points="towers.0,towers.1", steps=7, algorithm="rhd")
    assert summary["traffic_matches_plan"] is True and summary["processes"] == 6
    assert summary["algorithm"] == "rhd"
    rows = {(r["src"], r["dst"]): r for r in summary["stage_traffic"]}
    assert set(rows) == {(0, 1), (0, 2), (1, 2), (2, 1)}
    for row in rows.values():
        assert row["messages_sent"] == row["messages_received"] == row["predicted_messages"] == 2 * 7
        assert row["bytes_sent"] == row["bytes_received"] == row["predicted_bytes"] > 0
    assert rows[(0, 1)]["bytes_sent"] == rows[(0, 2)]["bytes_sent"] == 2 * 7 * 16 * 64 * 4  # digits: 64 floats
    groups = {g["stage"]: g for g in summary["stage_groups"]}
    for k, group in groups.items():
        assert (group["bytes_sent"] > 0) == (group["params"] > 0)


def test_the_role_plan_gives_each_stage_its_replica():
    cfg = JobConfig.from_flat({"dataset": "digits", "stages": 3, "workers": 2})
    slots = role_plan(cfg)
    assert [s.name for s in slots] == [f"stage {i}" for i in range(6)]
    text = format_plan(slots, None, 3)
    assert "rank   4  stage 4  (replica 1, stage 1)" in text


@pytest.mark.parametrize("args, needles", [
    (["--stages", "2", "--workers", "2", "--strategy", "sandblaster"],
     ("strategy sandblaster over --stages 2 is not supported", "--strategy allreduce")),
    (["--stages", "3", "--workers", "2", "--strategy", "ps", "--servers", "2"],
     ("--servers 2 under --stages 3", "pass --servers 3 or more")),
    (["--stages", "2", "--replicas", "2", "--elastic"], ("--elastic with --stages 2 is not supported yet",)),
    (["--stages", "2", "--replicas", "2", "--workers", "3"], ("--replicas 2 and --workers 3",)),
    (["--stages", "2", "--workers", "2", "--checkpoint-every", "5"], ("--checkpoint-every with --stages 2",)),
])
def test_bad_replica_input_is_one_line_and_status_2(args, needles, capsys, tmp_path):
    from plexus.cli import main
    status = main(["train", "--dataset", "digits", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert_usage_error(subprocess.CompletedProcess([], status, "", err), *needles)


@pytest.mark.slow
def test_a_failing_replica_fails_the_job_without_a_hang(tmp_path, capfd):
    """A non-finite loss on an output stage ends every replica's stages (each loses its
    links or its replica group), with one line naming a stage."""
    from plexus.errors import JobFailed
    from plexus.train.job import run
    with pytest.raises(JobFailed, match=r"stage \d exited with status [13]"):
        run({**BASE, "model": "mlp", "workers": 2, "stages": 2, "lr": 1e6, "timeout": 20,
              "out": str(tmp_path / "nan")})
    assert "the training loss became nan" in capfd.readouterr().err
