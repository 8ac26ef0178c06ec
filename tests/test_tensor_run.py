"""plexus train --tensor-parallel T (with or without --stages K): each stage's layers split
across T processes (parallel/tensor.py, wired by train/stage_runner.py).

The oracle is a one-process run of the same job: T-way and K x T training must give the
same model to float32 rounding, the saved state_dict must load into the unpartitioned
module, and each shard's collectives and each lane's cut edges must send exactly what
the plans predict."""
from __future__ import annotations

import pytest
import torch

from plexus.config import JobConfig
from plexus.train.plan import format_plan, role_plan
from test_cli import assert_usage_error
from test_stages_run import _train, assert_same_model


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("model, stages", [("mlp", 1), ("cnn", 1), ("deep-mlp", 2)])
def test_tensor_parallel_equals_one_process(model, stages, tmp_path):
    one, want = _train(tmp_path, "one", model=model, workers=1)
    summary, got = _train(tmp_path, "tp", model=model, stages=stages, tensor_parallel=2)
    assert_same_model(got, want)
    assert summary["processes"] == 2 * stages and len(summary["stages"]) == 2 * stages
    assert summary["tensor_traffic_matches_plan"] is True and summary["traffic_matches_plan"] is True
    assert summary["final_test_accuracy"] == pytest.approx(one["final_test_accuracy"], abs=1e-9)
    for stage in summary["stages"]:
        assert stage["tensor_bytes_sent"] == stage["predicted_tensor_bytes"] > 0
        assert {kind for _, kind in stage["tensor_layers"]} & {"column", "row", "column+gather"}
    if stages == 2:  # each shard's lane carries the cut's values: the plan's traffic, twice
        rows = {(r["src"], r["dst"]): r for r in summary["stage_traffic"]}
        assert rows[(0, 1)]["messages_sent"] == 2 * 20
    # The saved model loads into the unpartitioned module.
    from plexus.train.data import load_dataset
    from plexus.train.models import build_model
    cfg = JobConfig.from_flat({"dataset": "digits", "model": model, "hidden": 32})
    build_model(cfg.model, load_dataset(cfg.data, 5)).load_state_dict(got, strict=True)


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("schedule", [dict(schedule="1f1b"), dict(schedule="zb-h1"),
                                      dict(schedule="interleaved", chunks=2), dict(schedule="1f1b", recompute=True)],
                         ids=["1f1b", "zb-h1", "interleaved", "1f1b-recompute"])
def test_tensor_parallel_pipelines_equal_one_process(schedule, tmp_path):
    """--tensor-parallel 2 under a pipeline of 2 stages and 4 micro-batches, 1f1b, zb-h1
    and interleaved (each process's two model chunks split, one plan of their layers): the
    model of one process, each shard's collectives as predicted once per micro-batch (under
    zb-h1, no all-reduce of the model input's gradient, which B would drop; under
    --recompute, each forward's collectives twice)."""
    _, want = _train(tmp_path, "one", model="deep-mlp", workers=1)
    summary, got = _train(tmp_path, "tp", model="deep-mlp", stages=2, tensor_parallel=2, microbatches=4, **schedule)
    assert_same_model(got, want)
    assert summary["processes"] == 4 and summary["pipeline"]["schedule"] == schedule["schedule"]
    assert summary["tensor_traffic_matches_plan"] is True and summary["traffic_matches_plan"] is True
    layers = {stage["stage"]: [int(name.split(".")[1]) for name, _ in stage["tensor_layers"]]
              for stage in summary["stages"]}  # net.N: the N-th module of deep-mlp's Sequential
    assert all(len(found) == len(set(found)) >= 2 for found in layers.values())
    if "chunks" in schedule:  # process 0's second chunk comes after process 1's first
        assert max(layers[0]) > min(layers[1]) and min(layers[0]) < min(layers[1])
    else:
        assert max(layers[0]) < min(layers[1])


@pytest.mark.slow
@pytest.mark.parallel
def test_two_replicas_of_tensor_parallel_stages_equal_allreduce(tmp_path):
    _, want = _train(tmp_path, "ar", model="mlp", strategy="allreduce", workers=2)
    summary, got = _train(tmp_path, "hybrid", model="mlp", workers=2, tensor_parallel=2)
    assert_same_model(got, want)
    assert summary["processes"] == 4 and summary["replicas"] == 2
    # One group per shard of the stage, each over that shard's parameters.
    assert [(g["group"], g["shard"], g["replicas"]) for g in summary["stage_groups"]] == [(0, 0, 2), (1, 1, 2)]


def test_role_plan_names_replica_stage_and_shard():
    cfg = JobConfig.from_flat({"dataset": "digits", "stages": 2, "tensor_parallel": 2, "workers": 2})
    slots = role_plan(cfg)
    assert [s.name for s in slots] == [f"stage {i}" for i in range(8)]
    assert "rank   5  stage 5  (replica 1, stage 0, shard 1)" in format_plan(slots, None, 2, 2)


@pytest.mark.parametrize("args, needles", [
    (["--tensor-parallel", "3", "--hidden", "32"], ("--tensor-parallel 3", "divide by 3")),
    (["--tensor-parallel", "4", "--stages", "2", "--model", "deep-mlp", "--hidden", "30"],
     ("stage 0 of 2: --tensor-parallel 4", "divide by 4")),
    (["--tensor-parallel", "2", "--workers", "2", "--strategy", "ps"],
     ("--tensor-parallel 2 with 2 replicas runs under a synchronous allreduce",)),
    (["--tensor-parallel", "0"], ("tensor_parallel must be at least 1",)),
])
def test_bad_tensor_parallel_input_is_one_line_and_status_2(args, needles, capsys, tmp_path):
    import subprocess
    from plexus.cli import main
    status = main(["train", "--dataset", "digits", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert_usage_error(subprocess.CompletedProcess([], status, "", err), *needles)


def test_a_sharded_layer_copies_share_their_group():
    """Strategies copy their model (gossip's and local SGD's averages): a copy of a
    tensor-parallel module must share the connection, never copy it."""
    import copy
    from plexus.cluster.group import Endpoint
    endpoint = Endpoint.__new__(Endpoint)
    holder = torch.nn.Module()
    holder.group = endpoint
    assert copy.deepcopy(holder).group is endpoint
