"""Tensor parallelism (plexus/parallel/tensor.py): plans, and T = 2 real processes
checked against one.

The oracle: two processes on loopback, each training its shard of a model built from the
same seed on the same batches, end where one process training the whole model ends
(losses and the merged state_dict, relative 1e-5 after 20 SGD steps), and their Traffic
counters equal ``predict_traffic`` times the steps exactly. The children run
``train_shards`` below through ``plexus.cluster.spawn``.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plexus.cluster.spawn import spawn
from plexus.config import DataConfig, ModelConfig
from plexus.errors import ConfigError
from plexus.parallel import build_stages, forward_backward, merge_state_dicts, plan_partitions, trace_model
from plexus.parallel.tensor import (format_tensor_plan, merge_tensor_states, plan_tensor_split, predict_traffic,
                                    shard_module)
from plexus.train.data import load_dataset
from plexus.train.models import build_model

BATCH = 32
STEPS = 20
T = 2


def _digits():
    return load_dataset(DataConfig(dataset="digits"), seed=0)


@pytest.fixture(scope="module")
def digits():
    return _digits()


class FanOut(nn.Module):
    """One hidden value read by two heads: neither pairs with the layer before, and the
    hidden value's gradient is all-reduced once for both."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.body = nn.Linear(in_features, hidden)
        self.a, self.b = nn.Linear(hidden, num_classes), nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(self.flatten(x)))
        return self.a(h) + self.b(h)


def _model(name: str, data, hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    if name == "fanout":
        return FanOut(data.x_train[0].numel(), hidden, data.num_classes)
    return build_model(ModelConfig(model=name, hidden=hidden), data)


def _batch(data, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    lo = (step * BATCH) % (len(data.x_train) - BATCH)
    return data.x_train[lo:lo + BATCH], data.y_train[lo:lo + BATCH]


def _kinds(plan) -> dict[str, str]:
    return {layer.name: layer.kind for layer in plan.layers}


# --- plans -------------------------------------------------------------------------


def test_mlp_pairs_its_first_two_layers_and_gathers_the_head(digits):
    plan = plan_tensor_split(_model("mlp", digits), T, _batch(digits)[0])
    assert _kinds(plan) == {"net.1": "column", "net.3": "row", "net.5": "column+gather"}
    first, second, head = plan.layers
    assert (first.weight_shape, first.shard_shape) == ((16, 64), (8, 64))
    assert (second.weight_shape, second.shard_shape) == ((16, 16), (16, 8))
    # The input batch carries no gradient, so only the head's input gradient is reduced.
    assert [layer.input_grad for layer in plan.layers] == [False, False, True]
    table = format_tensor_plan(plan)
    assert "net.3  row" in table and "16x8" in table and "all-gather" in table


def test_a_pair_needs_elementwise_ops_only_and_one_reader():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.up(x))
            h = self.down(h) + h          # h read twice: up cannot pair with down
            return self.b(F.gelu(self.a(h)) * 2.0)  # a multiply by a constant is not listed

    plan = plan_tensor_split(Residual(), T, torch.randn(4, 8))
    assert _kinds(plan) == {"up": "column+gather", "down": "column+gather", "a": "column+gather",
                            "b": "column+gather"}


def test_a_value_read_by_two_split_layers_reduces_its_gradient_once(digits):
    plan = plan_tensor_split(_model("fanout", digits), T, _batch(digits)[0])
    assert _kinds(plan) == {"body": "column+gather", "a": "column+gather", "b": "column+gather"}
    traffic = predict_traffic(plan, BATCH, T)
    # Three gathers forward (one message each to the one peer); one all-reduce back of
    # the hidden value's gradient: 2(T-1)/T of 32 x 16 float32.
    assert traffic["forward_messages"] == 3 and traffic["forward_bytes"] == BATCH * (16 + 10 + 10) // 2 * 4
    assert (traffic["backward_messages"], traffic["backward_bytes"]) == (1, BATCH * 16 * 4)


def test_convolutions_split_by_output_channels(digits):
    plan = plan_tensor_split(_model("cnn", digits), T, _batch(digits)[0])
    assert _kinds(plan) == {"net.1": "channels+gather", "net.4": "channels+gather", "net.8": "column+gather"}
    conv = plan.layer("net.4")
    assert (conv.weight_shape, conv.shard_shape) == ((16, 16, 3, 3), (8, 16, 3, 3))


def test_a_layer_T_does_not_divide_stays_whole(digits):
    plan = plan_tensor_split(_model("mlp", digits), 4, _batch(digits)[0])
    assert _kinds(plan) == {"net.1": "column", "net.3": "row"}
    assert plan.whole == (("net.5", "out 10 % 4 = 2"),)
    assert "whole on every rank: net.5" in format_tensor_plan(plan)


def test_shared_layers_and_grouped_convolutions_stay_whole():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 8, 3, groups=2)
            self.twice, self.tied, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
            self.head.weight = self.tied.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv(x).flatten(1)[:, :6]
            return self.head(self.tied(self.twice(self.twice(h))))

    with pytest.raises(ConfigError) as info:
        plan_tensor_split(Shared(), T, torch.randn(4, 4, 5))
    assert str(info.value).endswith("conv (groups 2), twice (called from several places), tied (shares a "
                                    "parameter with another module), head (shares a parameter with another "
                                    "module); pass a --tensor-parallel that divides a layer's output features, "
                                    "or 1 to keep every layer whole")


def test_no_splittable_layer_is_one_clear_line(digits):
    with pytest.raises(ConfigError) as info:
        plan_tensor_split(_model("mlp", digits), 3, _batch(digits)[0])
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("--tensor-parallel 3: model MLP has no Linear or Conv layer whose output features "
                           "divide by 3 and that can be split: net.1 (out 16 % 3 = 1), net.3 (out 16 % 3 = 1), "
                           "net.5 (out 10 % 3 = 1)")
    with pytest.raises(ConfigError, match="no Linear, Conv1d or Conv2d layer to split"):
        plan_tensor_split(nn.Sequential(nn.Flatten(), nn.ReLU()), T, torch.randn(4, 8))
    with pytest.raises(ConfigError, match="at least 2"):
        plan_tensor_split(_model("mlp", digits), 1, _batch(digits)[0])


def test_merging_wants_one_state_per_rank(digits):
    model = _model("mlp", digits)
    plan = plan_tensor_split(model, T, _batch(digits)[0])
    with pytest.raises(ConfigError, match="splits 2 ways but 1 state_dicts"):
        merge_tensor_states([model.state_dict()], plan)
    with pytest.raises(ConfigError, match="rank 1's state_dict keys differ"):
        merge_tensor_states([model.state_dict(), {}], plan)


# --- T = 2 processes against one ---------------------------------------------------


def _stage_examples(programs, x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each stage's inputs for ``x``, received values requiring a gradient where their
    transfer carries one back, as the executor's stages receive them."""
    values: dict[str, torch.Tensor] = {"x": x}
    examples = []
    with torch.no_grad():
        for program in programs:
            grad = {t.producer: t.grad for t in program.receives}
            args = tuple(values[name].detach().requires_grad_(grad.get(name, False)) for name in program.inputs)
            examples.append(args)
            values.update(zip(program.outputs, program.module(*args)))
    return examples


def _setup(name: str, data) -> tuple[nn.Module, list, list]:
    """The whole model and, per tensor-parallel program (the model, or each of its two
    stages), its plan and what ``shard_module`` takes."""
    model = _model(name, data)
    x = _batch(data)[0]
    if name != "deep-mlp":
        return model, [model], [plan_tensor_split(model, T, x)]
    graph = trace_model(model, x)
    programs = build_stages(graph, plan_partitions(graph, 2, "uniform"))
    plans = [plan_tensor_split(p.module, T, ex) for p, ex in zip(programs, _stage_examples(programs, x))]
    return model, programs, plans


def _train(step, params, data) -> list[float]:
    """20 steps of SGD with momentum; ``step(x, y)`` returns the loss after its backward."""
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        losses.append(step(*_batch(data, i)).item())
        opt.step()
    return losses


def train_shards(group, name: str, out: str) -> dict:
    """One rank's run (in a spawned child): shard, train, save its state_dicts."""
    data = _digits()
    _, programs, plans = _setup(name, data)
    if name == "deep-mlp":
        shards = [dataclasses.replace(p, module=shard_module(p.module, plan, group.rank, T, group))
                  for p, plan in zip(programs, plans)]
        modules = [s.module for s in shards]

        def step(x, y):
            return forward_backward(shards, {"x": x}, lambda o: F.cross_entropy(o, y))[0]
    else:
        modules = [shard_module(programs[0], plans[0], group.rank, T, group)]

        def step(x, y):
            loss = F.cross_entropy(modules[0](x), y)
            loss.backward()
            return loss
    torch.save([m.state_dict() for m in modules], Path(out) / f"initial{group.rank}.pt")
    group.traffic.reset()
    losses = _train(step, [p for m in modules for p in m.parameters()], data)
    torch.save([m.state_dict() for m in modules], Path(out) / f"rank{group.rank}.pt")
    return {"losses": losses, "traffic": group.traffic.snapshot()}


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("name", ("mlp", "cnn", "fanout", "deep-mlp"))
def test_two_processes_train_as_one(digits, name, tmp_path):
    results = spawn("test_tensor_parallel:train_shards", T, {"name": name, "out": str(tmp_path)}, timeout=60)
    model, _, plans = _setup(name, digits)
    whole = copy.deepcopy(model)

    def step(x, y):
        loss = F.cross_entropy(whole(x), y)
        loss.backward()
        return loss

    expected = _train(step, list(whole.parameters()), digits)

    def assemble(prefix: str) -> dict[str, torch.Tensor]:
        ranks = [torch.load(tmp_path / f"{prefix}{r}.pt") for r in range(T)]
        return merge_state_dicts(merge_tensor_states([states[k] for states in ranks], plan)
                                 for k, plan in enumerate(plans))

    # The shards start as exact slices of the one model every rank built from the seed.
    initial = assemble("initial")
    assert initial.keys() == model.state_dict().keys()
    assert all(torch.equal(initial[key], value) for key, value in model.state_dict().items())
    merged = assemble("rank")
    # The assembled state_dict is the original model's: it loads strict.
    copy.deepcopy(model).load_state_dict(merged, strict=True)
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    predicted = [predict_traffic(plan, BATCH, T) for plan in plans]
    messages = sum(p["messages"] for p in predicted) * STEPS
    nbytes = sum(p["bytes"] for p in predicted) * STEPS
    assert messages and nbytes
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert result["traffic"] == {f"worker {1 - rank}": {"bytes_sent": nbytes, "bytes_recv": nbytes,
                                                            "msgs_sent": messages, "msgs_recv": messages}}
