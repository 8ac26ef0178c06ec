"""Partition plans and stage programs (plexus/parallel), checked against the whole model.

The oracle: the stages run in one process (``forward_backward``) give the loss and every
parameter's gradient of the unpartitioned model, and 20 SGD steps of the stages end
where 20 steps of the whole model end. Transfers are counted send-once, and bad input
is one ConfigError line (status 2 through the CLI).
"""
from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plexus.cli import main
from plexus.config import PARTITION_METHODS, DataConfig, JobConfig, ModelConfig, parse_size
from plexus.errors import ConfigError
from plexus.parallel import (METHODS, build_stages, forward_backward, merge_state_dicts, plan_partitions,
                             trace_model)
from plexus.train.data import load_dataset
from plexus.train.models import CharTransformer, Towers, build_model

BATCH = 16


@pytest.fixture(scope="module")
def digits():
    return load_dataset(DataConfig(dataset="digits"), seed=0)


def _model(name: str, data, hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(model=name, hidden=hidden), data)


def _batch(data, step: int = 0):
    lo = (step * BATCH) % (len(data.x_train) - BATCH)
    return data.x_train[lo:lo + BATCH], data.y_train[lo:lo + BATCH]


def _stage_params(stages) -> dict[str, torch.Tensor]:
    return {name: p for s in stages for name, p in s.module.named_parameters()}


MODELS = ("mlp", "cnn", "towers", "deep-mlp")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stages", (2, 3, 4))
def test_stages_give_the_whole_models_loss_and_gradients(digits, name, stages):
    model = _model(name, digits)
    x, y = _batch(digits)
    graph = trace_model(model, x)
    for method in ("uniform", "params"):
        plan = plan_partitions(graph, stages, method)
        programs = build_stages(graph, plan)
        traffic: dict = {}
        loss, out = forward_backward(programs, {"x": x}, lambda o: F.cross_entropy(o, y), traffic)
        # Every value passed between stages, forward and back, is what the plan predicted.
        assert traffic == plan.traffic()
        whole = copy.deepcopy(model)
        expected_out = whole(x)
        expected = F.cross_entropy(expected_out, y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(out, expected_out.detach(), rtol=1e-5, atol=1e-7)
        grads = {k: p.grad for k, p in _stage_params(programs).items()}
        assert set(grads) == {k for k, _ in whole.named_parameters()}
        for key, p in whole.named_parameters():
            torch.testing.assert_close(grads[key], p.grad, rtol=1e-5, atol=1e-7, msg=f"{name} {method} {key}")
        # The stages' state_dicts make the model's own (strict load).
        state = merge_state_dicts(s.module.state_dict() for s in programs)
        copy.deepcopy(model).load_state_dict(state, strict=True)


@pytest.mark.parametrize("name", MODELS)
def test_twenty_sgd_steps_of_stages_equal_the_whole_model(digits, name):
    model = _model(name, digits)
    graph = trace_model(model, _batch(digits)[0])
    plan = plan_partitions(graph, 3, "uniform")
    programs = build_stages(graph, plan)
    whole = copy.deepcopy(model)
    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.05, momentum=0.9)
    opts = [torch.optim.SGD(s.module.parameters(), lr=0.05, momentum=0.9) for s in programs]
    for step in range(20):
        x, y = _batch(digits, step)
        for opt in (opt_whole, *opts):
            opt.zero_grad()
        F.cross_entropy(whole(x), y).backward()
        forward_backward(programs, {"x": x}, lambda o: F.cross_entropy(o, y))
        for opt in (opt_whole, *opts):
            opt.step()
    state = merge_state_dicts(s.module.state_dict() for s in programs)
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # The traced model itself was not trained: stages hold copies.
    trained = whole.state_dict()
    assert all(not torch.equal(value, trained[key]) for key, value in model.state_dict().items())


def test_branches_on_different_stages_form_a_dag(digits):
    """Towers' columns come one after the other in the topological order: cutting at the
    second column's first layer and at the join puts the columns on stages 0 and 1 and
    the head on stage 2, and the flattened input skips from stage 0 to stage 1."""
    model = _model("towers", digits)
    x, y = _batch(digits)
    graph = trace_model(model, x)
    plan = plan_partitions(graph, 3, "manual", split_points=("towers.1", "cat"))
    assert [p.compute[0] for p in plan.partitions] == ["flatten", "towers_1_0", "cat"]
    edges = {(t.producer, t.src, t.dst) for t in plan.transfers}
    assert edges == {("flatten", 0, 1), ("towers_0_3", 0, 2), ("towers_1_3", 1, 2)}
    programs = build_stages(graph, plan)
    loss, _ = forward_backward(programs, {"x": x}, lambda o: F.cross_entropy(o, y))
    whole = copy.deepcopy(model)
    expected = F.cross_entropy(whole(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    grads = _stage_params(programs)
    for key, p in whole.named_parameters():
        torch.testing.assert_close(grads[key].grad, p.grad, rtol=1e-5, atol=1e-7)


def test_a_value_read_by_several_nodes_of_a_stage_is_sent_once(digits):
    """flatten's output feeds both columns' first layers; with both on stage 1 it crosses
    the cut once, where counting consumers would send it twice."""
    model = _model("towers", digits, hidden=8)
    x, _ = _batch(digits)
    graph = trace_model(model, x)
    plan = plan_partitions(graph, 2, "manual", split_points=("towers.0.0",))
    flat = graph.by_name["flatten"]
    assert flat.out_bytes == x.numel() * 4
    consumers = [n for n in graph.nodes if "flatten" in n.inputs and plan.assignment[n.name] == 1]
    assert len(consumers) == 2  # the naive count: one message per consuming node
    sent = [t for t in plan.transfers if t.producer == "flatten"]
    assert len(sent) == 1 and sent[0].nbytes == flat.out_bytes and (sent[0].src, sent[0].dst) == (0, 1)
    assert plan.partitions[1].bytes_in == flat.out_bytes == plan.partitions[0].bytes_out
    # flatten(x) depends on no parameter: no gradient goes back, one message per step.
    assert plan.traffic() == {(0, 1): (1, flat.out_bytes)}
    # The stage program takes it as one input and stage 0 returns it once.
    stages = build_stages(graph, plan)
    assert stages[0].outputs == ("flatten",) and stages[1].inputs == ("flatten",)
    traffic: dict = {}
    forward_backward(stages, {"x": x}, lambda o: o.sum(), traffic)
    assert traffic == {(0, 1): (1, flat.out_bytes)}


def test_traffic_counts_gradients_back(digits):
    model = _model("mlp", digits, hidden=8)
    x, _ = _batch(digits)
    graph = trace_model(model, x)
    plan = plan_partitions(graph, 2, "manual", split_points=("net.3",))
    (t,) = plan.transfers
    assert t.producer == "net_2" and t.grad and t.nbytes == BATCH * 8 * 4
    assert plan.traffic() == {(0, 1): (1, t.nbytes), (1, 0): (1, t.nbytes)}


def test_methods_and_config_agree():
    assert METHODS == PARTITION_METHODS


def test_uniform_counts_computing_nodes_only(digits):
    graph = trace_model(_model("deep-mlp", digits), _batch(digits)[0])
    assert len(graph.compute) == 16  # flatten, 8 Linear, 7 ReLU; the placeholder does not count
    plan = plan_partitions(graph, 4, "uniform")
    assert [len(p.compute) for p in plan.partitions] == [4, 4, 4, 4]
    assert "x" in plan.partitions[0].nodes


def _brute_force(graph, stages: int, cost) -> float:
    """The smallest largest cost over every cut of the computing nodes into ``stages``
    contiguous non-empty ranges."""
    from itertools import combinations
    n = len(graph.compute)
    best = float("inf")
    for inner in combinations(range(1, n), stages - 1):
        plan = plan_partitions(graph, stages, "manual", split_points=[graph.compute[i].name for i in inner])
        best = min(best, max(cost(p) for p in plan.partitions))
    return best


def test_params_and_time_are_exact_min_max_cuts(digits):
    graph = trace_model(_model("deep-mlp", digits, hidden=64), _batch(digits)[0], profile=True, repeats=1)
    for stages in (2, 3):
        plan = plan_partitions(graph, stages, "params")
        assert max(p.param_bytes for p in plan.partitions) == _brute_force(graph, stages, lambda p: p.param_bytes)
        plan = plan_partitions(graph, stages, "time")
        assert max(p.time_s for p in plan.partitions) == pytest.approx(
            _brute_force(graph, stages, lambda p: p.time_s), rel=1e-12)


def test_time_method_profiles_and_respects_the_memory_cap(digits):
    model = _model("deep-mlp", digits, hidden=128)
    x, _ = _batch(digits)
    graph = trace_model(model, x, profile=True, repeats=1)
    assert all(n.forward_s > 0 for n in graph.compute)
    free = plan_partitions(graph, 3, "time")
    assert all(p.time_s > 0 for p in free.partitions)
    # The tightest cap any 3-stage cut meets forces the time plan onto a cut that meets it...
    tightest = int(_brute_force(graph, 3, lambda p: p.memory_bytes))
    assert tightest < max(p.memory_bytes for p in plan_partitions(graph, 3, "uniform").partitions)
    capped = plan_partitions(graph, 3, "time", memory_cap=tightest)
    assert max(p.memory_bytes for p in capped.partitions) == tightest
    assert max(p.time_s for p in capped.partitions) >= max(p.time_s for p in free.partitions)
    # ... and one byte less leaves no legal 3-stage cut: the fewest stages that fit are named.
    with pytest.raises(ConfigError, match=r"3 stages cannot hold the model under --stage-memory .* it needs at "
                                          r"least [4-9]; pass --stages [4-9]"):
        plan_partitions(graph, 3, "time", memory_cap=tightest - 1)
    # uniform is refused when a stage exceeds the cap (it does not search).
    with pytest.raises(ConfigError, match="stage [0-2] of the uniform plan needs .* more than --stage-memory"):
        plan_partitions(graph, 3, "uniform", memory_cap=tightest)


def test_interleaved_chunks_of_one_process_fit_the_memory_cap_together():
    """--schedule interleaved: process s holds chunks s, K + s, ...; --stage-memory caps
    their sum. Layers whose activations, not parameters, take the memory make params'
    cut, chosen under the cap per chunk, put more than the cap on one process; the plan
    cuts again under cap / v per chunk, which fits; a cap no cut meets is refused."""
    torch.manual_seed(0)
    widths = [64, 512, 8, 512, 32, 512, 10]
    layers = [m for a, b in zip(widths[:-1], widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1]
    graph = trace_model(nn.Sequential(*layers), torch.randn(512, 64))
    cap = 3_400_000

    def per_process(plan, processes=2):
        return [sum(p.memory_bytes for p in plan.partitions[s::processes]) for s in range(processes)]

    assert max(per_process(plan_partitions(graph, 4, "params", memory_cap=cap))) > cap  # chunks alone fit
    plan = plan_partitions(graph, 4, "params", memory_cap=cap, chunks=2)
    assert max(per_process(plan)) <= cap and all(p.memory_bytes <= cap / 2 for p in plan.partitions)
    unlimited = plan_partitions(graph, 4, "params", chunks=2)  # no cap, no second cut
    assert unlimited.assignment == plan_partitions(graph, 4, "params").assignment
    # Each chunk fits 1.6 MB, but no cut fits two on a process, nor 0.8 MB per chunk.
    with pytest.raises(ConfigError, match=r"process [01] would hold model chunks (0, 2|1, 3) of --schedule "
                                          r"interleaved, .* more than --stage-memory 1.6 MB: pass a larger"):
        plan_partitions(graph, 4, "params", memory_cap=1_600_000, chunks=2)
    # A cap no chunk meets says what the fullest chunk of the best cut needs.
    with pytest.raises(ConfigError, match=r"4 model chunks \(--stages 2 x --chunks 2\) cannot hold the model under "
                                          r"--stage-memory 1.0 MB; pass a larger --stage-memory \(one of these "
                                          r"chunks alone needs 1.6 MB"):
        plan_partitions(graph, 4, "params", memory_cap=1_000_000, chunks=2)
    with pytest.raises(ConfigError, match=r"process [01] would hold model chunks"):  # uniform cannot cut again
        plan_partitions(graph, 4, "uniform", memory_cap=max(p.memory_bytes for p in plan_partitions(
            graph, 4, "uniform").partitions), chunks=2)


def test_profile_times_the_optimizer_step_of_each_nodes_parameters(digits):
    """A stage's compute includes its optimizer's step, so a profile given the optimizer
    prices it on the nodes that own parameters, and leaves the model as it was."""
    model = _model("deep-mlp", digits, hidden=64)
    before = copy.deepcopy(model.state_dict())
    graph = trace_model(model, _batch(digits)[0], profile=True, repeats=1,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert all((n.step_s > 0) == bool(n.params) for n in graph.compute)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    plan = plan_partitions(graph, 3, "time")
    for part in plan.partitions:
        nodes = [graph.by_name[n] for n in part.nodes]
        assert part.compute_s == pytest.approx(sum(n.forward_s + n.backward_s + n.step_s for n in nodes))
        assert part.time_s >= part.compute_s > 0
    # Without an optimizer the step is not priced (and not profiled at all unprofiled).
    assert all(n.step_s == 0 for n in trace_model(model, _batch(digits)[0], profile=True, repeats=1).nodes)


class _Clock:
    """A clock that only the model moves, so every phase's seconds are known exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def __deepcopy__(self, memo) -> "_Clock":  # the stage programs' copies of a module share it
        return self


class _Slow(nn.Module):
    """Costs ``forward`` seconds of ``clock`` forward and ``backward`` back. Its branch
    on a value makes fx fall back to the Sequential's children: it stays one node."""

    def __init__(self, clock: _Clock, forward: float, backward: float) -> None:
        super().__init__()
        self.clock, self.costs = clock, (forward, backward)

    def forward(self, x):
        self.clock.now += self.costs[0]
        y = x * 1.0
        if y.requires_grad:
            y.register_hook(self._back)
        return y

    def _back(self, grad):
        self.clock.now += self.costs[1]


class _SlowStep:
    """An optimizer whose step costs ``seconds`` of ``clock``."""

    def __init__(self, params, clock: _Clock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def step(self) -> None:
        self.clock.now += self.seconds


def test_pricing_times_each_stage_program_and_keeps_the_cut():
    """price_plan charges each stage the seconds its own program spends in a step (its
    forward, its backward and its optimizer's step), keeps the cut, the transfers'
    price, memory and traffic, and leaves the model and the generator as they were."""
    from plexus.parallel.executor import price_plan

    clock = _Clock()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Slow(clock, 2.0, 3.0), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x, six = torch.randn(5, 4), torch.randn(6, 4)
    graph = trace_model(model, x)
    assert [n.target for n in graph.compute] == ["0", "1", "2", "3", "4"]
    plan = plan_partitions(graph, 3, "manual", split_points=("1", "3"))
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    priced = price_plan(graph, plan, x, lambda params: _SlowStep(params, clock, 0.5), steps=5, clock=clock)
    assert priced.priced and not plan.priced
    # Stage 1 holds the slow layer: 2 s forward, 3 s back, 0.5 s its step; the others
    # only their steps.
    assert [p.compute_s for p in priced.partitions] == [0.5, 5.5, 0.5]
    for old, new in zip(plan.partitions, priced.partitions):
        assert new.time_s - new.compute_s == pytest.approx(old.time_s - old.compute_s, abs=1e-15)
        assert dataclasses.replace(new, compute_s=old.compute_s, time_s=old.time_s) == old
    assert (priced.assignment, priced.transfers) == (plan.assignment, plan.transfers)
    # A pipeline's step: each of M micro-batches' forward and backward, one optimizer step.
    piped = price_plan(graph, plan, six, lambda params: _SlowStep(params, clock, 0.5), steps=5,
                       clock=clock, microbatches=3)
    assert [p.compute_s for p in piped.partitions] == [0.5, 3 * 5.0 + 0.5, 0.5]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_a_time_plan_is_priced_on_its_own_cut(digits):
    """--partition time: make_plan cuts by the node profile and prices that cut on its
    stage programs; the cut is the one the profile chose, every stage costs time."""
    from plexus.parallel.executor import make_plan

    cfg = JobConfig.from_flat(dict(dataset="digits", model="deep-mlp", hidden=64, batch_size=BATCH, stages=3,
                                   partition="time", optimizer="sgd", momentum=0.9))
    x, _ = _batch(digits)
    graph, plan = make_plan(cfg, _model("deep-mlp", digits, hidden=64), x,
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert plan.priced and graph.profiled
    assert plan.assignment == plan_partitions(graph, 3, "time", optimizer_slots=1).assignment
    assert all(p.time_s >= p.compute_s > 0 for p in plan.partitions)
    # uniform and params are not profiled, so not priced.
    assert not make_plan(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, partition="params")),
                         _model("deep-mlp", digits, hidden=64), x)[1].priced


def test_a_layer_larger_than_the_cap_has_no_legal_cut(digits):
    graph = trace_model(_model("deep-mlp", digits, hidden=256), _batch(digits)[0])
    with pytest.raises(ConfigError, match=r"node net_3 \(net\.3\) alone needs .* no cut is legal") as err:
        plan_partitions(graph, 4, "params", memory_cap=300_000)
    assert "\n" not in str(err.value)


def test_bad_input_is_one_config_error_line(digits):
    graph = trace_model(_model("mlp", digits), _batch(digits)[0])
    cases = [
        (dict(stages=7, method="uniform"), "stages must lie in \\[1, 6\\]"),
        (dict(stages=0, method="params"), "stages must lie"),
        (dict(stages=2, method="manual", split_points=("nope",)), "split point 'nope' is neither"),
        (dict(stages=2, method="manual", split_points=("net.0",)), "first node"),
        (dict(stages=3, method="manual", split_points=("net.3",)), "one stage more than split points"),
        (dict(stages=3, method="manual", split_points=("net.3", "net_3")), "same node twice"),
        (dict(stages=2, method="random"), "partition must be one of"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as err:
            plan_partitions(graph, kwargs.pop("stages"), kwargs.pop("method"), **kwargs)
        assert "\n" not in str(err.value)


def test_an_untraceable_model_names_the_offending_call():
    model = CharTransformer(vocab=10, max_len=8, hidden=8)
    with pytest.raises(ConfigError, match=r"CharTransformer\.forward of the model itself at models\.py:\d+ "
                                          r"`if x\.dtype != torch\.int64") as err:
        trace_model(model, torch.zeros(2, 8, dtype=torch.long))
    assert "\n" not in str(err.value)

    class Gate(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    inner = nn.Sequential(nn.Linear(4, 4), Gate())
    with pytest.raises(ConfigError, match=r"Gate\.forward of inner\.1 at test_partition\.py:\d+ `return x if"):
        trace_model(_Wrap(inner), torch.randn(3, 4))


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


def test_an_untraceable_sequential_falls_back_to_its_children():
    class Gate(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Gate(), nn.Linear(6, 3))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    graph = trace_model(model, x)
    assert [n.target for n in graph.compute] == ["0", "1", "2"]
    plan = plan_partitions(graph, 3, "uniform")
    programs = build_stages(graph, plan)
    loss, _ = forward_backward(programs, {graph.nodes[0].name: x}, lambda o: F.cross_entropy(o, y))
    whole = copy.deepcopy(model)
    expected = F.cross_entropy(whole(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)


def test_towers_model_joins_its_columns_late(digits):
    model = _model("towers", digits)
    assert isinstance(model, Towers) and len(model.towers) == 2
    assert model(_batch(digits)[0]).shape == (BATCH, 10)


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("512MB") == 512 * 10**6
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("1000") == 1000
    for bad in ("2XB", "-1GB", "", "GB"):
        with pytest.raises(ConfigError, match="stage_memory must be a positive size"):
            parse_size(bad)


def test_config_checks_the_parallel_fields():
    cfg = JobConfig.from_flat({"stages": 3, "partition": "manual", "split_points": "net.3, net.5"})
    assert cfg.parallel.split_point_names == ("net.3", "net.5") and cfg.parallel.partition == "manual"
    assert JobConfig.from_flat({}).parallel.partition == "params" and JobConfig.from_flat({}).parallel.stages == 1
    assert JobConfig.from_flat({"stage_memory": "2GB"}).parallel.stage_memory_bytes == 2 * 10**9
    assert JobConfig.from_dict(JobConfig.from_flat({"stages": 2}).to_dict()).parallel.stages == 2
    for flat, pattern in [({"stages": 0}, "stages must be at least 1"),
                          ({"partition": "manual"}, "split_points must name at least one node"),
                          ({"partition": "manual", "split_points": "a,b"}, "stages must be one more than the 2"),
                          ({"stages": 2, "microbatches": 4, "schedule": "interleaved", "chunks": 2,
                            "partition": "manual", "split_points": "a"},
                           r"split_points must number --stages K x --chunks v - 1 \(2 x 2 - 1 = 3\)"),
                          ({"split_points": "a"}, "split_points apply to --partition manual only"),
                          ({"stage_memory": "lots"}, "stage_memory must be a positive size")]:
        with pytest.raises(ConfigError, match=pattern):
            JobConfig.from_flat(flat)


def test_cli_print_partition(capsys):
    assert main(["train", "--model", "towers", "--stages", "3", "--print-partition", "--batch-size", "32",
                 "--hidden", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("towers on digits: 3 stages by --partition params, 11 computing nodes, batch 32")
    assert out[1].split() == ["stage", "nodes", "params", "pred", "ms", "memory", "in/step", "out/step"]
    rows = [line.split() for line in out[2:5]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert rows[0][1].startswith("flatten..") and rows[2][1].endswith("..head")
    assert sum(int(r[3].replace(",", "")) for r in rows) == sum(
        p.numel() for p in _model("towers", load_dataset(DataConfig(dataset="digits")), hidden=16).parameters())
    assert out[5].startswith("transfers (each value once per receiving stage, per step of batch 32): flatten 0->1")


def test_cli_deep_mlp_needs_several_stages_under_a_small_stage_memory(capsys):
    flags = ["--model", "deep-mlp", "--hidden", "256", "--stage-memory", "1MB", "--print-partition"]
    assert main(["train", *flags, "--stages", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "1 stage cannot hold the model under --stage-memory 1.0 MB: it needs at least 7" in err
    assert main(["train", *flags, "--stages", "7", "--partition", "time"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:9]
    units = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    memory = [float(r.split()[-6]) * units[r.split()[-5]] for r in rows]  # memory, in/step, out/step: 2 words each
    assert [r.split()[0] for r in rows] == [str(i) for i in range(7)] and all(0 < m <= 1e6 for m in memory)


def test_cli_print_partition_of_interleaved_chunks(capsys):
    """--print-partition under --schedule interleaved prints the K x v chunks the run
    cuts, by any method, and which process runs which."""
    base = ["train", "--model", "deep-mlp", "--stages", "2", "--microbatches", "4", "--schedule", "interleaved",
            "--chunks", "2", "--print-partition"]
    assert main([*base, "--partition", "manual", "--split-points", "net.4,net.8,net.12"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("deep-mlp on digits: 4 model chunks (2 processes, process s running chunks s, 2 + s")
    assert [line.split()[1] for line in out[2:6]] == ["net_0..net_3", "net_4..net_7", "net_8..net_11",
                                                        "net_12..net_15"]
    assert main([*base, "--partition", "time"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "4 model chunks" in out[0] and all(float(line.split()[4]) > 0 for line in out[2:6])


def test_cli_print_partition_time_and_manual(capsys):
    assert main(["train", "--model", "cnn", "--stages", "2", "--partition", "manual", "--split-points", "net.4",
                 "--print-partition"]) == 0
    out = capsys.readouterr().out
    assert "net_0..net_3 (4)" in out and "net_4..net_8 (5)" in out
    assert main(["train", "--model", "mlp", "--stages", "2", "--partition", "time", "--print-partition"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(float(line.split()[4]) > 0 for line in out[2:4])


@pytest.mark.parametrize("argv, pattern", [
    (["--stages", "99", "--print-partition"], "stages must lie in [1, 6]"),
    (["--stages", "2", "--partition", "manual", "--split-points", "nope", "--print-partition"],
     "split point 'nope' is neither"),
    (["--model", "lm", "--dataset", "text", "--num-samples", "40", "--stages", "2", "--print-partition"],
     "CharTransformer.forward of the model itself"),
    (["--model", "deep-mlp", "--hidden", "256", "--stages", "4", "--stage-memory", "300kB", "--print-partition"],
     "alone needs"),
    (["--stages", "2", "--workers", "2", "--strategy", "sandblaster"], "strategy sandblaster over --stages 2 is not"),
    (["--stages", "9"], "stages must lie in [1, 6]"),  # refused before any process starts
])
def test_cli_bad_partition_exits_2_with_one_line(capsys, argv, pattern):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and pattern in err, err


class _Tied(nn.Module):
    """Two layers sharing one weight (tie, untie) and a layer called twice (mid)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 6, bias=False)
        self.tie = nn.Linear(6, 6)
        self.untie = nn.Linear(6, 6)
        self.untie.weight = self.tie.weight

    def forward(self, x):
        return self.untie(self.dec(self.mid(self.mid(self.enc(self.tie(x))))))


def test_weights_used_from_two_stages_are_refused():
    graph = trace_model(_Tied(), torch.randn(3, 6))
    assert [n.name for n in graph.compute] == ["tie", "enc", "mid", "mid_1", "dec", "untie"]
    with pytest.raises(ConfigError, match="module mid is used in stages 0 and 1"):
        plan_partitions(graph, 2, "manual", split_points=("mid_1",))
    with pytest.raises(ConfigError, match=r"parameter untie.weight \(tied to tie.weight\) is used in stages 0 and 1"):
        plan_partitions(graph, 2, "manual", split_points=("dec",))
    # The tied parameter is owned once: by the first node that uses it.
    assert graph.by_name["tie"].params == ("tie.weight", "tie.bias")
    assert graph.by_name["untie"].params == ("untie.bias",)


def test_new_models_refuse_token_data():
    text = load_dataset(DataConfig(dataset="text", num_samples=40), seed=0)
    for name in ("towers", "deep-mlp"):
        with pytest.raises(ConfigError, match=f"model '{name}' needs dense float inputs"):
            _model(name, text)


def _naive_range(graph, costs, lo: int, hi: int) -> tuple[float, int, int, int, int]:
    """measure(lo, hi) from sets, the definition the incremental sweep must equal: the
    storages the range's nodes save, each once, apart from those of its inputs and
    received values, which count as those."""
    inside = [n for n in graph.nodes if lo <= costs.pos[n.name] < hi]
    names = {n.name for n in inside}
    received = [graph.by_name[i] for i in sorted({i for n in inside for i in n.inputs if i not in names})]
    sent = [n for n in inside if any(u not in names for u in costs.users[n.name])]
    crossing = received + sent
    params = sum(n.param_bytes for n in inside)
    inputs = [n for n in inside if n.op == "placeholder"]
    given = {k for v in received + inputs for k in v.out_storages}
    saved = {k: b for n in inside for k, b in n.saved if k not in given}
    memory = 3 * params + sum(saved.values()) + sum(v.out_bytes for v in inputs + received)
    comm = sum(1 + v.out_grad for v in crossing) * 1e-4 + sum(v.out_bytes * (1 + v.out_grad) for v in crossing) / 1e8
    seconds = sum(n.forward_s + n.backward_s + n.step_s for n in inside) + comm
    return seconds, memory, params, sum(v.out_bytes for v in received), sum(v.out_bytes for v in sent)


@pytest.mark.parametrize("name", ("towers", "cnn"))
def test_incremental_range_costs_equal_their_definition(digits, name):
    from plexus.parallel.partition import _Costs
    graph = trace_model(_model(name, digits), _batch(digits)[0], profile=True, repeats=1)
    costs = _Costs(graph, optimizer_slots=1, bandwidth=1e8, latency=1e-4)
    n = len(graph.compute)
    for lo in range(n):
        for hi, r in enumerate(costs.sweep(lo), lo + 1):
            figures = (r.seconds, costs.memory(r), r.params, r.received, r.sent)
            expected = _naive_range(graph, costs, lo, hi)
            assert figures[1:] == expected[1:] and figures[0] == pytest.approx(expected[0], rel=1e-12), (lo, hi)


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        a = self.l1(x)
        return self.l2(x) + a.detach()


def test_a_received_value_the_stage_does_not_differentiate_sends_zeros_back():
    """l1's output needs a gradient when it leaves stage 0, but stage 1 detaches it: the
    gradient message the plan counts still goes back, as zeros."""
    torch.manual_seed(0)
    model, x = _Detached(), torch.randn(5, 4)
    graph = trace_model(model, x)
    plan = plan_partitions(graph, 2, "manual", split_points=("l2",))
    assert [(t.producer, t.grad) for t in plan.transfers] == [("x", False), ("l1", True)]
    traffic: dict = {}
    stages = build_stages(graph, plan)
    forward_backward(stages, {"x": x}, lambda o: o.square().sum(), traffic)
    assert traffic == plan.traffic() == {(0, 1): (2, 5 * 4 * 4 + 5 * 3 * 4), (1, 0): (1, 5 * 3 * 4)}
    grads = _stage_params(stages)
    assert torch.count_nonzero(grads["l1.weight"].grad) == 0 and torch.count_nonzero(grads["l2.weight"].grad) > 0
    whole = copy.deepcopy(model)
    whole(x).square().sum().backward()
    assert whole.l1.weight.grad is None
    torch.testing.assert_close(grads["l2.weight"].grad, whole.l2.weight.grad, rtol=1e-5, atol=0)


class _Chunks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        a, b = torch.chunk(self.lin(x), 2, dim=1)
        return a * b


def test_a_value_that_is_not_one_tensor_cannot_cross_a_cut():
    graph = trace_model(_Chunks(), torch.randn(3, 4))
    names = [n.name for n in graph.compute]
    assert names == ["lin", "chunk", "getitem", "getitem_1", "mul"]
    with pytest.raises(ConfigError,
                       match="value chunk .* would cross from stage 0 to stage 1, but it is not one tensor"):
        plan_partitions(graph, 2, "manual", split_points=("getitem",))
    plan = plan_partitions(graph, 2, "manual", split_points=("chunk",))
    assert [(t.producer, t.shape, t.dtype) for t in plan.transfers] == [("lin", (3, 6), "float32")]


def test_transfers_know_which_dimension_is_the_batch(digits):
    model = _model("cnn", digits)
    x, _ = _batch(digits)
    graph = trace_model(model, x)
    plan = plan_partitions(graph, 2, "manual", split_points=("net.4",))
    (t,) = plan.transfers
    assert t.producer == "net_3" and t.batch_dim == 0 and t.shape[0] == BATCH
    assert t.shape_for(3) == (3, *t.shape[1:])
    assert t.nbytes == BATCH * t.shape[1] * t.shape[2] * t.shape[3] * 4

    class Scale(nn.Module):  # a value with no batch dimension crosses the cut
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            s = self.lin(x).mean(0)
            return x * s

    graph = trace_model(Scale(), torch.randn(5, 4))
    plan = plan_partitions(graph, 2, "manual", split_points=("mul",))
    sent = {t.producer: t for t in plan.transfers}
    assert sent["mean"].batch_dim is None and sent["mean"].shape_for(7) == (4,)
    assert sent["x"].batch_dim == 0 and sent["x"].shape_for(7) == (7, 4)


def test_tracing_leaves_batch_norm_statistics_and_the_generator_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
    before, x = copy.deepcopy(model.state_dict()), torch.randn(8, 4)
    state = torch.get_rng_state()
    graph = trace_model(model, x, profile=True, repeats=1)
    assert torch.equal(torch.get_rng_state(), state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert "1.running_mean" in merge_state_dicts(
        s.module.state_dict() for s in build_stages(graph, plan_partitions(graph, 2, "uniform")))


def test_a_pipeline_stage_counts_the_micro_batches_and_weight_copies_it_holds():
    """A range's memory under a Holding: the parameters with their gradients, optimizer
    state and weight copies, and the share of a batch's activations (with its inputs and
    received values) held at once; under recompute only the inputs and received values of
    that share, and one micro-batch's activations rebuilt."""
    from plexus.parallel.partition import Holding, _Costs
    torch.manual_seed(0)
    graph = trace_model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)),
                        torch.randn(32, 8))
    costs = _Costs(graph, optimizer_slots=1, bandwidth=1e9, latency=0.0)
    whole, tail = list(costs.sweep(0))[-1], list(costs.sweep(2))[-1]  # every node; from the second Linear on
    assert (whole.inputs, whole.received) == (32 * 8 * 4, 0) and tail.received == 32 * 64 * 4
    # Each ReLU's output, which the next Linear saves too; the first Linear saves the input.
    assert (whole.activations, tail.activations) == (2 * 32 * 64 * 4, 32 * 64 * 4)
    assert costs.memory(whole) == 3 * whole.params + whole.activations + whole.inputs
    assert costs.memory(whole, Holding(held=2, microbatches=4)) == \
        3 * whole.params + (whole.activations + whole.inputs) // 2
    assert costs.memory(whole, Holding(held=3, microbatches=1, weight_copies=4)) == \
        7 * whole.params + 3 * (whole.activations + whole.inputs)
    assert costs.memory(tail, Holding(held=2, microbatches=4, recompute=True)) == \
        3 * tail.params + tail.received // 2 + tail.activations // 4
    with pytest.raises(ValueError):
        Holding(held=0)


def test_the_memory_cap_counts_what_each_stage_of_a_pipeline_holds():
    """Under pipedream stage k holds K - k batches and K - k weight versions (one more
    for the prediction while it is delayed). A cap the plain 3-stage cut meets twice over
    moves the cut towards stage 0; fewer stages need more, and so, past a point, do more
    stages (stage 0, one node at least, holds K batches and K + 1 copies of it), and each
    message names the count that fits and the cap the count asked for needs. A cap the
    plain cut meets once no number of pipedream stages meets."""
    from plexus.parallel.partition import Holding
    torch.manual_seed(0)
    graph = trace_model(nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())]),
                        torch.randn(64, 64))

    def pipedream(ranges):
        return [Holding(held=ranges - k, weight_copies=ranges - k + (k < ranges - 1)) for k in range(ranges)]

    plain = plan_partitions(graph, 3, "params")
    cap = max(p.memory_bytes for p in plain.partitions)
    assert plan_partitions(graph, 3, "params", memory_cap=cap).assignment == plain.assignment
    assert all(p.holding == Holding() for p in plain.partitions)
    piped = plan_partitions(graph, 3, "params", memory_cap=2 * cap, holdings=pipedream)
    assert [p.holding for p in piped.partitions] == pipedream(3)
    assert all(p.memory_bytes <= 2 * cap for p in piped.partitions)
    assert [len(p.compute) for p in plain.partitions] == [3, 4, 5]
    assert [len(p.compute) for p in piped.partitions] == [1, 4, 7]  # stage 0 holds the most
    for stages, advice in ((2, "it needs at least 3"), (9, "it fits in 3")):
        with pytest.raises(ConfigError, match=rf"^{stages} stages cannot hold the model under --stage-memory .*: "
                                              rf"{advice}; pass --stages 3, or --stage-memory (.*) for {stages}$") as err:
            plan_partitions(graph, stages, "params", memory_cap=2 * cap, holdings=pipedream)
        least = parse_size(re.search(r"--stage-memory ([^ ]+ [kMG]?B) for", str(err.value)).group(1).replace(" ", ""))
        fits = plan_partitions(graph, stages, "params", memory_cap=int(least * 1.001), holdings=pipedream)
        assert max(p.memory_bytes for p in fits.partitions) <= least * 1.001
    assert len(plan_partitions(graph, 8, "params", memory_cap=2 * cap, holdings=pipedream).partitions) == 8
    with pytest.raises(ConfigError, match=r"^3 stages cannot hold the model under --stage-memory .*, nor does any "
                                          r"number of stages up to 12, .*: pass --stage-memory .* or more$"):
        plan_partitions(graph, 3, "params", memory_cap=cap, holdings=pipedream)


@pytest.mark.parametrize("flags, held, copies", [
    (dict(schedule="pipedream"), [3, 2, 1], [4, 3, 1]),
    (dict(schedule="pipedream", vertical_sync=True), [3, 2, 1], [4, 4, 4]),
    (dict(schedule="pipedream", delay_compensation=False), [3, 2, 1], [3, 2, 1]),
    (dict(schedule="pipedream-2bw", microbatches=4), [3, 2, 1], [3, 3, 3]),
    (dict(schedule="pipedream-2bw", microbatches=4, delay_compensation=False), [3, 2, 1], [2, 2, 2]),
    (dict(schedule="gpipe", microbatches=4), [4, 4, 4], [0, 0, 0]),
    (dict(schedule="1f1b", microbatches=4), [3, 2, 1], [0, 0, 0]),
    (dict(schedule="1f1b", microbatches=2), [2, 2, 1], [0, 0, 0]),
    (dict(schedule="zb-h1", microbatches=4), [3, 3, 3], [0, 0, 0]),
], ids=["pipedream", "vertical-sync", "pipedream-plain", "2bw", "2bw-plain", "gpipe", "1f1b", "1f1b-M2", "zb-h1"])
def test_stage_holdings_follow_the_schedule(flags, held, copies):
    from plexus.parallel.executor import stage_holdings
    cfg = JobConfig.from_flat(dict(model="deep-mlp", stages=3, **flags))
    got = stage_holdings(cfg)(3)
    assert [h.held for h in got] == held and [h.weight_copies for h in got] == copies
    assert all(h.microbatches == cfg.parallel.microbatches and not h.recompute for h in got)
    assert stage_holdings(JobConfig.from_flat(dict(model="deep-mlp", stages=3))) is None  # no pipeline
    recompute = stage_holdings(JobConfig.from_flat(dict(model="deep-mlp", stages=3, microbatches=4,
                                                        recompute=True)))(3)
    assert all(h.recompute for h in recompute)
    # interleaved: each of process s's chunks holds what the schedule keeps of that chunk
    cfg = JobConfig.from_flat(dict(model="deep-mlp", stages=2, microbatches=4, schedule="interleaved", chunks=2))
    assert [h.held for h in stage_holdings(cfg)(4)] == [4, 3, 2, 1]  # chunk 0 on each process, then chunk 1
    assert stage_holdings(cfg)(6) is None  # 3 processes: M = 4 is not a multiple of K


def test_the_output_node_holds_what_its_loss_saves():
    """``trace_model(loss=...)``: the tensors the loss saves for its backward count as the
    output node's, here a cross-entropy's log-softmax (the logits' size) and targets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    x = torch.randn(12, 8)
    plain = trace_model(model, x)
    with_loss = trace_model(model, x, loss=lambda out: F.cross_entropy(out, torch.zeros(12, dtype=torch.long)))
    before, after = (sum(b for _, b in g.by_name[g.output].saved) for g in (plain, with_loss))
    assert after - before >= 12 * 5 * 4 + 12 * 8
    assert after - before <= 12 * 5 * 4 + 12 * 8 + 8  # and at most a scalar or two
    # the other nodes' saves are the same bytes
    assert [sum(b for _, b in n.saved) for n in plain.nodes if n.name != plain.output] == \
        [sum(b for _, b in n.saved) for n in with_loss.nodes if n.name != with_loss.output]
