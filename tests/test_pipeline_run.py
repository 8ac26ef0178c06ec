"""plexus train --stages K --microbatches M --schedule S: each replica's batch pipelined
through its stages in micro-batches (parallel/executor.py, parallel/schedules.py).

The oracle is a one-process run of the same job: a synchronous schedule makes one
optimizer step per batch on the gradient of the whole batch's mean loss, so K stages and
M micro-batches must give the same model to float32 rounding. Each cut edge carries one
message per micro-batch, the plan's bytes in all, and a stage holds at most the
activations its schedule keeps in flight (GPipe: M; 1F1B: K - k on stage k; zb-h1: what
``ZeroBubbleH1.max_in_flight`` counts, each micro-batch held until its W)."""
from __future__ import annotations

import subprocess

import pytest

from plexus.parallel.schedules import Interleaved, ZeroBubbleH1
from test_cli import assert_usage_error
from test_stages_run import _train, assert_same_model

STEPS = 20


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one"), "one", model="deep-mlp", workers=1)[1]


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_a_synchronous_pipeline_equals_one_process(schedule, stages, microbatches, one_process, tmp_path):
    summary, got = _train(tmp_path, "pipe", model="deep-mlp", stages=stages, microbatches=microbatches,
                          schedule=schedule)
    assert_same_model(got, one_process)
    assert summary["traffic_matches_plan"] is True
    for row in summary["stage_traffic"]:
        assert row["messages_sent"] == STEPS * microbatches  # one message per micro-batch and edge
    pipeline = summary["pipeline"]
    assert (pipeline["schedule"], pipeline["microbatches"]) == (schedule, microbatches)
    # zb-h1 idles (K-1)(f+b-w) per stage, f = b = w: (K-1)/(3M+K-1) (Qi et al. 2023).
    fill = 3 * microbatches if schedule == "zb-h1" else microbatches
    assert pipeline["bubble_predicted"] == pytest.approx((stages - 1) / (fill + stages - 1))
    assert 0 <= pipeline["bubble_simulated"] < 1 and 0 <= pipeline["bubble_measured"] < 1
    # each recorded step's ops line up with the schedule's lists (the replay needs them all)
    assert 0 <= pipeline["bubble_replayed"] < 1
    held = {s["stage"]: s["max_in_flight"] for s in summary["stages"]}
    assert held == {s["stage"]: s["planned_in_flight"] for s in summary["stages"]}  # what the plan's memory counts
    # The plan counts what autograd saves, each storage once, the loss's too, and the
    # values received: exactly, but for the loss's scalar weight (4 bytes), which the plan
    # shares out over the micro-batches like the rest of a batch's loss.
    *inner, last = summary["stages"]
    assert all(s["peak_activation_bytes"] == s["planned_activation_bytes"] for s in inner)
    assert 0 <= last["peak_activation_bytes"] - last["planned_activation_bytes"] <= 4 * last["max_in_flight"]
    if schedule == "gpipe":
        assert held == {k: microbatches for k in range(stages)}
    elif schedule == "1f1b":  # stage k starts K - k micro-batches before its first backward
        assert held == {k: min(stages - k, microbatches) for k in range(stages)}
    else:  # a micro-batch's activations stay until its W, which stage k defers by k backwards
        schedule_object = ZeroBubbleH1(stages=stages, microbatches=microbatches)
        assert held == {k: schedule_object.max_in_flight(k) for k in range(stages)}
        assert all(s["weight_op_seconds"] > 0 for s in summary["stages"])


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("stages, microbatches, chunks", [(2, 2, 2), (2, 4, 3), (2, 8, 2), (3, 6, 2), (4, 4, 2), (4, 8, 2),
                                                         (4, 4, 3)])
def test_an_interleaved_pipeline_equals_one_process(stages, microbatches, chunks, one_process, tmp_path):
    """--schedule interleaved --chunks v: the model cut into K x v stages, process s running
    virtual stages s, K + s, ...; the same model as one process (K = 3 at batch 48, which
    M = 6 divides, against its own one-process run), each process holding what
    ``Interleaved.max_in_flight`` counts, one message per micro-batch and cut edge."""
    batch = dict(batch_size=48) if stages == 3 else {}
    want = _train(tmp_path, "one", model="deep-mlp", workers=1, **batch)[1] if batch else one_process
    summary, got = _train(tmp_path, "pipe", model="deep-mlp", stages=stages, microbatches=microbatches,
                          schedule="interleaved", chunks=chunks, **batch)
    assert_same_model(got, want)
    schedule = Interleaved(stages=stages, microbatches=microbatches, chunks=chunks)
    assert summary["pipeline"]["bubble_predicted"] == pytest.approx(
        (stages - 1) / (chunks * microbatches + stages - 1))
    assert 0 <= summary["pipeline"]["bubble_replayed"] < 1  # its chunk ops line up with the lists
    assert {s["stage"]: s["max_in_flight"] for s in summary["stages"]} == \
        {k: schedule.max_in_flight(k) for k in range(stages)}
    # The plan counts each chunk's most at once, which the process's most never exceeds.
    assert all(s["max_in_flight"] <= s["planned_in_flight"] for s in summary["stages"])
    assert summary["traffic_matches_plan"] is True and len(summary["stages"]) == stages
    # Each pair of processes carries the cuts between their chunks, one message per micro-batch each.
    assert all(row["messages_sent"] > 0 and row["messages_sent"] % (STEPS * microbatches) == 0
               for row in summary["stage_traffic"])
    assert len({(row["src"], row["dst"]) for row in summary["stage_traffic"]}) >= 2 * (stages - 1)


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("cut", [dict(partition="time"), dict(partition="manual", split_points="net.4,net.8,net.12")])
def test_an_interleaved_pipeline_cut_by_time_or_by_hand_equals_one_process(cut, one_process, tmp_path):
    """--schedule interleaved with --partition time (stage 0 profiles the K x v chunks and
    the others cut where it did) or manual (K x v - 1 split points): the model of one
    process; under time each process's prediction is its chunks' sum."""
    summary, got = _train(tmp_path, "pipe", model="deep-mlp", stages=2, microbatches=4, schedule="interleaved",
                          chunks=2, **cut)
    assert_same_model(got, one_process)
    assert summary["traffic_matches_plan"] is True and len(summary["stages"]) == 2
    nodes = {s["stage"]: s["nodes"] for s in summary["stages"]}
    assert sorted(nodes[0] + nodes[1]) == sorted(f"net_{i}" for i in range(16))
    if cut["partition"] == "manual":  # process 0 runs chunks 0 and 2, process 1 chunks 1 and 3
        assert nodes == {0: [*(f"net_{i}" for i in range(4)), *(f"net_{i}" for i in range(8, 12))],
                         1: [*(f"net_{i}" for i in range(4, 8)), *(f"net_{i}" for i in range(12, 16))]}
    else:
        assert all(s["predicted_seconds"] >= s["predicted_compute_seconds"] > 0 for s in summary["stages"])


@pytest.mark.slow
@pytest.mark.parallel
def test_padded_ops_and_spinning_receives_leave_the_model_alone(one_process, tmp_path, monkeypatch):
    """PLEXUS_PIPELINE_OP_MS (benchmarks/pipeline_bubble.py --op-ms) makes each op last at
    least its padding, and --spin on makes every receive poll before it sleeps; neither
    changes what is computed."""
    monkeypatch.setenv("PLEXUS_PIPELINE_OP_MS", "3,2,1")
    summary, got = _train(tmp_path, "padded", model="deep-mlp", stages=2, microbatches=4, schedule="zb-h1",
                          spin="on")
    assert_same_model(got, one_process)
    for stage in summary["stages"]:  # mean seconds of a forward, a B and a W
        assert stage["forward_op_seconds"] >= 0.003 and stage["backward_op_seconds"] >= 0.002
        assert stage["weight_op_seconds"] >= 0.001


@pytest.mark.parametrize("args, needles", [
    (["--stages", "2", "--microbatches", "3"], ("--microbatches 3 must divide each replica's batch",)),
    (["--stages", "4", "--microbatches", "2", "--schedule", "interleaved", "--chunks", "2"],
     ("must be a multiple of --stages K (4", "--microbatches 8")),
    (["--microbatches", "4"], ("microbatches", "--stages K, K at least 2")),
    (["--stages", "2", "--recompute"], ("recompute", "applies to pipelines")),
    (["--stages", "2", "--workers", "2", "--batch-size", "36", "--microbatches", "4"],
     ("each replica's batch (18 = --batch-size 36 / 2 replicas)",)),
    (["--stages", "2", "--microbatches", "4", "--chunks", "2"], ("chunks applies to --schedule interleaved",)),
    (["--stages", "2", "--microbatches", "4", "--schedule", "interleaved"], ("chunks must be at least 2",)),
    (["--stages", "3", "--microbatches", "4", "--schedule", "interleaved", "--chunks", "2"],
     ("must be a multiple of --stages K (3", "--microbatches 6")),
    (["--stages", "2", "--microbatches", "4", "--schedule", "interleaved", "--chunks", "2", "--model", "deep-mlp",
      "--hidden", "256", "--stage-memory", "1.5MB"],
     ("4 model chunks (--stages 2 x --chunks 2) cannot hold the model under --stage-memory 1.5 MB; pass a larger",
      "one of these chunks alone needs")),
    (["--stages", "2", "--microbatches", "4", "--schedule", "interleaved", "--chunks", "2", "--model", "towers"],
     ("value flatten goes from virtual stage 0 to 2, two chunks of process 0",)),  # before any process starts
    (["--stages", "2", "--microbatches", "4", "--schedule", "interleaved", "--chunks", "2", "--partition", "manual",
      "--split-points", "net.4"], ("split_points must number --stages K x --chunks v - 1", "name 3 split points")),
])
def test_bad_pipeline_input_is_one_line_and_status_2(args, needles, capsys, tmp_path):
    from plexus.cli import main
    status = main(["train", "--dataset", "digits", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert_usage_error(subprocess.CompletedProcess([], status, "", err), *needles)


@pytest.mark.slow
@pytest.mark.parallel
def test_pipelined_replicas_equal_allreduce(tmp_path):
    """2 replicas, each 2 stages pipelined over 4 micro-batches, stage k of both
    all-reducing its accumulated gradient: the model of allreduce over 2 workers."""
    _, want = _train(tmp_path, "ar", model="mlp", strategy="allreduce", workers=2)
    summary, got = _train(tmp_path, "pipe", model="mlp", workers=2, stages=2, microbatches=4)
    assert_same_model(got, want)
    assert summary["replicas"] == 2 and summary["pipeline"]["max_in_flight"] == 2


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("flags", [dict(strategy="ps", consistency="bsp"), dict(strategy="ps", consistency="asp"),
                                   dict(strategy="local-sgd")], ids=lambda f: " ".join(f.values()))
def test_pipelined_replicas_learn_under_servers_and_local_sgd(flags, tmp_path):
    from plexus.train.job import run
    defaults = dict(dataset="digits", quiet=True, no_report=True, eval_every=0, workers=2)
    flat = run({**defaults, **flags, "out": str(tmp_path / "flat")})
    piped = run({**defaults, **flags, "stages": 2, "microbatches": 4, "out": str(tmp_path / "piped")})
    assert piped["steps"] == flat["steps"]
    assert piped["final_test_accuracy"] >= 0.9 * flat["final_test_accuracy"] > 0.5
    if flags.get("consistency") == "asp":
        # Each stage replica pushes on its own clock (HetPipe's workers): staleness per stage.
        assert all(g["staleness_mean"] > 0 for g in piped["stage_groups"])


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_recomputation_trades_activations_for_compute(schedule, one_process, tmp_path):
    """--recompute: a micro-batch keeps only its inputs until its backward runs its forward
    again; the model is the same, and the activations held shrink to the inputs'."""
    kept, _ = _train(tmp_path, "kept", model="deep-mlp", stages=2, microbatches=4, schedule=schedule)
    summary, got = _train(tmp_path, "again", model="deep-mlp", stages=2, microbatches=4, schedule=schedule,
                          recompute=True)
    assert_same_model(got, one_process)
    held = {s["stage"]: s["max_in_flight"] for s in summary["stages"]}
    bytes_held = {s["stage"]: s["peak_activation_bytes"] for s in summary["stages"]}
    # Stage 0's inputs: 8 samples of 64 float32 features per micro-batch held.
    assert bytes_held[0] == held[0] * 8 * 64 * 4
    for before, after in zip(kept["stages"], summary["stages"]):
        assert after["peak_activation_bytes"] < before["peak_activation_bytes"]
        # the plan counts the inputs held and one micro-batch's activations rebuilt (the same
        # as without recompute where a stage holds one micro-batch), its loss's too
        assert after["peak_activation_bytes"] <= after["planned_activation_bytes"] + 4 * after["max_in_flight"]
        assert after["planned_activation_bytes"] <= before["planned_activation_bytes"]
    assert summary["pipeline"]["recompute"] is True


def test_a_backward_sends_its_input_gradient_before_it_adds_its_parameters_gradients():
    """The previous stage waits for a micro-batch's input gradient and nobody waits for
    the sum of its parameters' gradients, so the send comes first (``_send_back``), and
    the op's time still covers both parts."""
    import torch

    from plexus.parallel.executor import StageExecutor
    from plexus.parallel.partition import Transfer

    class Stage:  # the attributes _send_back uses
        stages = 2
        _pad_op = StageExecutor._pad_op

        def __init__(self) -> None:
            self.sent, self._ops, self._pad = [], [], {}

        def _tag(self, transfer, microbatch, grad):
            return microbatch

        def _send(self, peer, tag, value):
            self.sent.append((peer, tag, value.clone(), [g.clone() for g in grads]))

    stage = Stage()
    grads = [torch.ones(3)]
    transfer = Transfer(producer="x", src=0, dst=1, shape=(1, 4), dtype="float32", nbytes=16, grad=True)
    StageExecutor._send_back(stage, 0.0, [(transfer, torch.zeros(1, 4))], [torch.full((1, 4), 2.0)], 5, grads,
                             [torch.full((3,), 10.0)], [])
    ((peer, tag, value, grads_when_sent),) = stage.sent
    assert (peer, tag) == (0, 5) and torch.equal(value, torch.full((1, 4), 2.0))
    assert torch.equal(grads_when_sent[0], torch.ones(3))  # not yet added when the gradient left
    assert torch.equal(grads[0], torch.full((3,), 11.0))
    assert [kind for kind, _, _ in stage._ops] == ["backward", "accumulate"]
