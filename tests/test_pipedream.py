"""plexus train --stages K --schedule pipedream | pipedream-2bw: the asynchronous
pipelines with weight stashing (parallel/executor.py ``_asynchronous_loss``,
parallel/stash.py).

Neither equals a one-process run of plain SGD, so the oracle is each one's update rule
computed in one process on the whole model: step t applies, on each stage s, the gradient
of mini-batch t's loss taken with every stage's weights at the version its forward used,
with the stage's optimizer. PipeDream: version t-(K-1-s), or t-(K-1) everywhere under
--vertical-sync; 2BW: t-1 everywhere (Narayanan et al. 2021's W(t+1) = W(t) - lr
grad f(W(t-1))), the gradient accumulated over M micro-batches. With delay compensation
(the default), a stage D steps behind (D = K-1-s, K-1, or 1) steps with lr / (1 + 2D),
spike compensated (``SpikeCompensatedSGD``), and its version v's weights are those
predicted D steps on, W(v) + D (W(v) - W(v-1)). The
stashed weights also give the unit-level check: a backward differentiates the weights its
forward ran on, not the ones stepped since, and the two gradients differ."""
from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch
import torch.nn.functional as F

from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.parallel.executor import make_plan
from plexus.parallel.stages import build_stages
from plexus.parallel.stash import WeightStash, delay_lr_scale
from plexus.strategies.base import SpikeCompensatedSGD, make_optimizer
from plexus.train.batches import GlobalBatches
from plexus.train.data import load_dataset
from plexus.train.models import build_model
from test_cli import assert_usage_error
from test_stages_run import BASE, _train, assert_same_model


def test_a_stashed_backward_differentiates_the_forwards_weights():
    """The forward runs on version 0's copy; the live weights then take a step; the
    stashed backward gives the gradient at version 0, the unstashed one that of the new
    weights at the old activations, and the two differ."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    old = {name: p.detach().clone() for name, p in net.named_parameters()}

    def at(weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        leaves = {name: w.clone().requires_grad_(True) for name, w in weights.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
        return list(torch.autograd.grad(loss, list(leaves.values())))

    want_old = at(old)
    results = {}
    for stashing in (True, False):
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(old[name])
        stash = WeightStash(net)
        stash.keep(0)
        loss = F.cross_entropy(stash.call(0, x), y)
        with torch.no_grad():  # the optimizer steps before this input's backward
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        got, _ = stash.gradients(0, [loss], [torch.ones_like(loss)], stashing=stashing)
        results[stashing] = got
        stash.drop(held=set(), next_forward=None)  # no input in flight, no forward left
        assert stash.copies == {} and stash.peak == stash.peak_copies == 1
    for g, w in zip(results[True], want_old):
        torch.testing.assert_close(g, w)
    # Without stashing the first layer's gradient goes back through the stepped second
    # layer's weights: another number, by far more than rounding.
    assert (results[False][0] - want_old[0]).norm() > 0.1 * want_old[0].norm()


def test_a_stash_ahead_predicts_each_version_from_the_last_step():
    """With ``ahead`` = D, version v's copy is W(v) + D (W(v) - W(v-1)) (the change per
    step when versions were skipped), version 0's the weights as they are, and the live
    weights are untouched; the stage's lr is scaled by 1 / (1 + 2D)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    stash, history = WeightStash(net, ahead=2), []

    def step(size: float) -> None:
        history.append([p.detach().clone() for p in net.parameters()])
        with torch.no_grad():
            for p in net.parameters():
                p.add_(size)

    stash.keep(0)
    step(0.5)
    stash.keep(1)
    step(0.25)
    step(0.25)
    stash.keep(3)
    history.append([p.detach().clone() for p in net.parameters()])
    for got, w in zip(stash.copies[0], history[0]):
        torch.testing.assert_close(got, w)
    for got, w in zip(stash.copies[1], history[1]):
        torch.testing.assert_close(got, w + 1.0)  # the last step (+0.5) twice more
    for got, w in zip(stash.copies[3], history[3]):
        torch.testing.assert_close(got, w + 0.5)  # +0.25 a step over versions 1 to 3
    for got, w in zip(stash.live, history[3]):
        torch.testing.assert_close(got.detach(), w)
    assert (stash.peak, stash.peak_copies) == (3, 4)  # and the weights the next prediction starts from
    assert [delay_lr_scale(d) for d in (0, 1, 2, 3)] == [1.0, 1 / 3, 1 / 5, 1 / 7]


@pytest.mark.parametrize("delay", [1, 2, 3])
def test_a_spike_compensated_gradient_moves_the_weights_as_an_undelayed_one(delay):
    """One gradient, D steps late, under SpikeCompensatedSGD: on arrival the weights have
    moved as far as they would have D + 1 steps after an undelayed one, and each later
    step (no further gradient) moves them as the undelayed run's step D later does."""
    g, lr, beta = torch.tensor([1.0, -2.0]), 0.1, 0.9

    def run(optimizer_of, gradient_at: int, steps: int) -> list[torch.Tensor]:
        w = torch.nn.Parameter(torch.zeros(2))
        optimizer, path = optimizer_of([w]), []
        for t in range(steps):
            w.grad = g.clone() if t == gradient_at else torch.zeros(2)
            optimizer.step()
            path.append(w.detach().clone())
        return path

    plain = run(lambda ps: torch.optim.SGD(ps, lr=lr, momentum=beta), 0, delay + 6)
    late = run(lambda ps: SpikeCompensatedSGD(ps, lr=lr, momentum=beta, weight_decay=0.0, delay=delay), 0, 6)
    for t in range(6):
        torch.testing.assert_close(late[t], plain[delay + t])
    cfg = dataclasses.replace(JobConfig.from_flat({"momentum": beta}).optim, delay_steps=delay)
    assert isinstance(make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg), SpikeCompensatedSGD)
    assert type(make_optimizer([torch.nn.Parameter(torch.zeros(1))], dataclasses.replace(cfg, momentum=0.0))) \
        is torch.optim.SGD
    with pytest.raises(ConfigError, match=r"delay_steps \(file\) is set per pipeline stage"):
        JobConfig.from_flat({"delay_steps": delay}, {"delay_steps": "file"})
    assert JobConfig.from_flat({"delay_steps": 0}).optim.delay_steps == 0  # as config.json records it


def _reference(tmp_path, steps: int, stages: int, vertical_sync: bool = False, schedule: str = "pipedream",
               delay_compensation: bool = True, **flat) -> dict[str, torch.Tensor]:
    """The update rule of ``schedule`` in one process (see the module docstring), on the
    whole model: each parameter takes, at step t, the version of its stage that
    mini-batch t's forward used (predicted ahead under ``delay_compensation``)."""
    cfg = JobConfig.from_flat({**BASE, **flat, "steps": steps, "stages": stages, "schedule": schedule,
                               "vertical_sync": vertical_sync, "delay_compensation": delay_compensation,
                               "out": str(tmp_path / "reference")})

    def delay(s: int) -> int:
        if schedule == "pipedream-2bw":
            return 1
        return stages - 1 if vertical_sync else stages - 1 - s

    def weight(t: int, s: int, name: str) -> torch.Tensor:
        v, d = max(0, t - delay(s)), delay(s) if delay_compensation else 0
        w = history[v][name]
        return w + d * (w - history[v - 1][name]) if d and v > 0 else w

    data = load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    graph, plan = make_plan(cfg, model, data.x_train[:cfg.run.batch_size])
    stage_of = {name: program.index for program in build_stages(graph, plan)
                for name, _ in program.module.named_parameters()}
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    params = dict(model.named_parameters())
    assert stage_of.keys() == params.keys()
    # Each stage's optimizer: with compensation, lr / (1 + 2D) and spike compensated.
    optimizers = [make_optimizer([p for name, p in params.items() if stage_of[name] == s],
                                 dataclasses.replace(cfg.optim, lr=cfg.optim.lr / (1 + 2 * delay(s)),
                                                     delay_steps=delay(s)) if delay_compensation else cfg.optim)
                  for s in range(stages)]
    history = [{name: p.detach().clone() for name, p in params.items()}]  # version v: after v steps
    batches = GlobalBatches(len(data.x_train), cfg.run.batch_size, cfg.run.seed)
    for t in range(steps):
        idx = batches.worker_indices(t, 0, 1)
        weights = {name: weight(t, s, name).clone().requires_grad_(True) for name, s in stage_of.items()}
        loss = F.cross_entropy(torch.func.functional_call(model, weights, (data.x_train[idx],)), data.y_train[idx])
        for p, g in zip(params.values(), torch.autograd.grad(loss, list(weights.values()))):
            p.grad = g
        for optimizer in optimizers:
            optimizer.step()
        history.append({name: p.detach().clone() for name, p in params.items()})
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("stages, vertical_sync, compensation",
                         [(2, False, True), (3, False, True), (4, False, True), (3, True, True), (3, False, False),
                          (3, True, False)],
                         ids=["K2", "K3", "K4", "K3-vertical-sync", "K3-uncompensated", "K3-vertical-uncompensated"])
def test_pipedream_applies_its_update_rule(stages, vertical_sync, compensation, tmp_path):
    """K stages, momentum SGD, 20 steps: the pipeline's model is the one-process
    reference's to float32 rounding, with delay compensation and without; each stage
    holds K - k inputs, stage 0 K weight versions, and the pipeline never flushes (each
    edge one message per step)."""
    flat = dict(model="deep-mlp", momentum=0.9)
    summary, got = _train(tmp_path, "pipe", stages=stages, schedule="pipedream", vertical_sync=vertical_sync,
                          delay_compensation=compensation, **flat)
    assert_same_model(got, _reference(tmp_path, BASE["steps"], stages, vertical_sync,
                                      delay_compensation=compensation, **flat))
    pipeline = summary["pipeline"]
    assert (pipeline["schedule"], pipeline["weight_stashing"], pipeline["vertical_sync"],
            pipeline["delay_compensation"]) == ("pipedream", True, vertical_sync, compensation)
    delays = [(stages - 1 if vertical_sync else stages - 1 - k) if compensation else 0 for k in range(stages)]
    assert pipeline["predicted_ahead"] == delays
    assert pipeline["lr_scale"] == [1 / (1 + 2 * d) for d in delays]
    assert {s["stage"]: s["max_in_flight"] for s in summary["stages"]} == {k: stages - k for k in range(stages)}
    assert pipeline["weight_versions"] == stages
    # Stage k copies its weights K - k times (K under vertical sync), once more while it
    # predicts, as the plan's memory counts them.
    versions = [stages if vertical_sync else stages - k for k in range(stages)]
    assert [s["weight_copies"] for s in summary["stages"]] == [v + (d > 0) for v, d in zip(versions, delays)]
    assert all((s["planned_weight_copies"], s["planned_in_flight"]) == (s["weight_copies"], s["max_in_flight"])
               for s in summary["stages"])
    # what autograd saves, with the received values and the loss's tensors: the plan's count
    assert [s["peak_activation_bytes"] for s in summary["stages"]] == \
        [s["planned_activation_bytes"] for s in summary["stages"]]
    assert summary["traffic_matches_plan"] is True
    assert all(row["messages_sent"] == BASE["steps"] for row in summary["stage_traffic"])


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("stages, microbatches, compensation", [(2, 2, True), (3, 4, True), (4, 4, True),
                                                                 (3, 4, False)],
                         ids=["K2-M2", "K3-M4", "K4-M4", "K3-M4-uncompensated"])
def test_pipedream_2bw_applies_its_update_rule(stages, microbatches, compensation, tmp_path):
    """2BW over K stages, M micro-batches a batch, momentum SGD, 20 steps: the model of
    W(t+1) = W(t) - lr grad f(W(t-1)) computed in one process (each stage one step ahead
    and lr / 3 with delay compensation); two weight versions copied at most, K - k
    micro-batches held on stage k, one message per micro-batch."""
    flat = dict(model="deep-mlp", momentum=0.9)
    summary, got = _train(tmp_path, "pipe", stages=stages, microbatches=microbatches, schedule="pipedream-2bw",
                          delay_compensation=compensation, **flat)
    assert_same_model(got, _reference(tmp_path, BASE["steps"], stages, schedule="pipedream-2bw",
                                      microbatches=microbatches, delay_compensation=compensation, **flat))
    assert summary["pipeline"]["weight_versions"] == 2
    assert summary["pipeline"]["predicted_ahead"] == [1 if compensation else 0] * stages
    assert all(s["weight_copies"] == s["planned_weight_copies"] == 2 + compensation for s in summary["stages"])
    assert {s["stage"]: s["max_in_flight"] for s in summary["stages"]} == {k: stages - k for k in range(stages)}
    assert summary["traffic_matches_plan"] is True
    assert all(row["messages_sent"] == BASE["steps"] * microbatches for row in summary["stage_traffic"])


@pytest.mark.slow
@pytest.mark.parallel
def test_without_weight_stashing_the_update_is_another(tmp_path):
    """--no-weight-stashing backpropagates with the newest weights: no longer the
    reference's model (by far more than rounding), while stashing is (the test above)."""
    flat = dict(model="deep-mlp", momentum=0.9)
    summary, got = _train(tmp_path, "unstashed", stages=3, schedule="pipedream", weight_stashing=False, **flat)
    want = _reference(tmp_path, BASE["steps"], 3, **flat)
    assert summary["pipeline"]["weight_stashing"] is False
    worst = max(((got[key] - want[key]).norm() / want[key].norm()).item() for key in want)
    assert worst > 1e-3


MNIST1D_PIPELINE = dict(dataset="mnist1d", model="mlp", stages=3, steps=1200, quiet=True, no_report=True,
                        eval_every=0, seed=0)


@pytest.fixture(scope="module")
def mnist1d_1f1b(once):
    """The steps and accuracy of the synchronous pipeline both schedules below are compared
    with, trained once per session (under pytest-xdist the other worker waits for it)."""
    from plexus.train.job import run

    def train(out):
        summary = run({**MNIST1D_PIPELINE, "microbatches": 4, "schedule": "1f1b", "out": str(out)})
        return {key: summary[key] for key in ("steps", "final_test_accuracy")}
    return once("pipedream-mnist1d-1f1b", train, timeout=900)


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_pipedream_learns_mnist1d_as_the_synchronous_pipeline_does(schedule, mnist1d_1f1b, tmp_path):
    """At equal samples (the same steps of the same batches), pipedream's accuracy is at
    least 0.9x that of the 1f1b pipeline over the same stages, each with its defaults
    (both momentum 0.9; the asynchronous ones delay compensated). 1200 steps, seed 0:
    pipedream 0.717 against 0.707 (1.01x), 2bw 0.657 (0.93x); without compensation, at
    momentum 0.5, pipedream reached 0.624 (0.88x) and 2bw 0.895x."""
    from plexus.train.job import run
    sync = mnist1d_1f1b
    piped = run({**MNIST1D_PIPELINE, "schedule": schedule, "microbatches": 4 if schedule == "pipedream-2bw" else 1,
                 "out": str(tmp_path / schedule)})
    assert piped["settings"]["momentum"] == {"value": 0.9, "source": "default"}
    assert piped["pipeline"]["delay_compensation"] is True
    assert piped["steps"] == sync["steps"] == 1200
    assert piped["final_test_accuracy"] >= 0.9 * sync["final_test_accuracy"] > 0.3


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("model, stages", [("deep-mlp", 3), ("cnn", 3), ("mlp", 4)])
def test_asynchronous_pipelines_learn_digits_with_their_defaults(model, stages, tmp_path):
    """With only the flags that select them, pipedream and 2bw learn every built-in dense
    model over 3-4 stages at the default 300 steps. Under momentum 0.9 without delay
    compensation each of these sat at chance or diverged (docs/results/pipedream-defaults.md);
    with it (the default), seed 0, pipedream reached 0.94-0.98 and 2bw 0.97-0.98."""
    from plexus.train.job import run
    flat = dict(model=model, stages=stages, quiet=True, no_report=True, eval_every=0, seed=0)
    sync = run({**flat, "microbatches": 4, "out": str(tmp_path / "1f1b")})
    piped = run({**flat, "schedule": "pipedream", "out": str(tmp_path / "pipedream")})
    twobw = run({**flat, "schedule": "pipedream-2bw", "microbatches": 4, "out": str(tmp_path / "2bw")})
    assert piped["final_test_accuracy"] >= 0.9 * sync["final_test_accuracy"] > 0.5
    assert twobw["final_test_accuracy"] > 0.6  # 6x chance
    assert piped["health"] == twobw["health"] == "ok"


@pytest.mark.slow
@pytest.mark.parallel
def test_pipedream_replicas_learn_under_ps_asp(tmp_path):
    """2 replicas of 2 pipedream stages under ps asp, each stage's replicas pushing to the
    servers of their stage on their own clocks: learns digits as 2 whole-model ps asp
    workers do, over the same steps."""
    from plexus.train.job import run
    defaults = dict(dataset="digits", quiet=True, no_report=True, eval_every=0, workers=2, strategy="ps",
                    consistency="asp")
    flat = run({**defaults, "out": str(tmp_path / "flat")})
    piped = run({**defaults, "stages": 2, "schedule": "pipedream", "out": str(tmp_path / "piped")})
    assert piped["steps"] == flat["steps"]
    assert piped["final_test_accuracy"] >= 0.9 * flat["final_test_accuracy"] > 0.5
    assert piped["replicas"] == 2 and piped["pipeline"]["schedule"] == "pipedream"


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_an_asynchronous_pipeline_stops_on_time_over_sockets(schedule, tmp_path):
    """--time-limit stops the stages with forward values in flight that no stage will
    receive; over sockets (gloo, whose send completes once received) waiting for them
    hung the stages until the link timeout. The schedule's run is 2**62 steps long here,
    made one op at a time."""
    from plexus.train.job import run
    summary = run(dict(dataset="digits", stages=3, schedule=schedule, microbatches=4 if schedule != "pipedream" else 1,
                       time_limit=2, transport="socket", timeout=20, eval_every=0, quiet=True, no_report=True,
                       out=str(tmp_path / "run")))
    assert summary["status"] == "completed" and summary["steps"] > 10
    assert summary["pipeline"]["minibatches"] == summary["steps"]
    # Stage k ran K - k forwards (of micro-batches) ahead of its backwards, one more than
    # stage k + 1: each forward edge is left with one micro-batch's values that no stage
    # took, and the traffic still matches the schedule's.
    for row in summary["stage_traffic"]:
        flying = 1 if row["dst"] == row["src"] + 1 else 0
        assert row["messages_in_flight_at_stop"] == flying, row
        assert row["messages_sent"] == row["predicted_messages"] == row["messages_received"] + flying
        assert row["bytes_sent"] == row["predicted_bytes"] == row["bytes_received"] + row["bytes_in_flight_at_stop"]
    assert summary["traffic_matches_plan"]


@pytest.mark.parametrize("args, needles", [
    (["--stages", "2", "--schedule", "pipedream", "--workers", "2"],
     ("--schedule pipedream with 2 replicas needs an asynchronous strategy", "synchronous allreduce")),
    (["--stages", "2", "--schedule", "pipedream", "--workers", "2", "--strategy", "ps", "--consistency", "bsp"],
     ("--schedule pipedream with 2 replicas", "synchronous ps bsp")),
    (["--stages", "2", "--schedule", "pipedream", "--microbatches", "4"], ("microbatches must be 1",)),
    (["--schedule", "pipedream"], ("schedule pipelines the stages of --stages K",)),
    (["--stages", "2", "--microbatches", "4", "--vertical-sync"], ("vertical_sync applies to --schedule pipedream",)),
    (["--stages", "2", "--microbatches", "4", "--no-weight-stashing"], ("weight_stashing can be turned off only",)),
    (["--stages", "2", "--microbatches", "4", "--no-delay-compensation"],
     ("delay_compensation can be turned off only under --schedule pipedream or pipedream-2bw",)),
    (["--stages", "2", "--schedule", "pipedream", "--no-weight-stashing", "--vertical-sync"],
     ("vertical_sync keeps old weight versions",)),
    (["--stages", "4", "--schedule", "pipedream-2bw", "--microbatches", "2"],
     ("microbatches must be at least --stages K (4) under --schedule pipedream-2bw", "--microbatches 4")),
    (["--stages", "2", "--schedule", "pipedream-2bw", "--microbatches", "2", "--workers", "2"],
     ("--schedule pipedream-2bw with 2 replicas needs an asynchronous strategy",)),
])
def test_bad_pipedream_input_is_one_line_and_status_2(args, needles, capsys, tmp_path):
    from plexus.cli import main
    status = main(["train", "--dataset", "digits", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert_usage_error(subprocess.CompletedProcess([], status, "", err), *needles)


def test_the_report_names_an_asynchronous_pipelines_mini_batches_and_stashing():
    from plexus.report.stages import pipeline_line
    base = {"schedule": "pipedream", "microbatches": 1, "bubble_measured": 0.3, "bubble_predicted": 0.01,
            "bubble_simulated": 0.1, "max_in_flight": 3, "peak_activation_bytes": 2**20}
    line = pipeline_line({"pipeline": {**base, "minibatches": 600, "weight_stashing": False, "vertical_sync": True}})
    assert line.startswith("pipedream over 600 mini-batches, never flushed, weight stashing off, vertical sync:")
    line = pipeline_line({"pipeline": {**base, "minibatches": 600, "weight_stashing": True, "delay_compensation": True}})
    assert line.startswith("pipedream over 600 mini-batches, never flushed, weight stashing on, delay compensated:")
    assert pipeline_line({"pipeline": {**base, "schedule": "1f1b", "microbatches": 4}}).startswith(
        "1f1b over 4 micro-batches:")
