"""Stage programs: one fx GraphModule per partition of a plan, and an in-process run.

A stage's module takes the values it receives across cuts (and the model inputs that
belong to it) and returns the values it sends, each once however many stages or nodes
read it, then the model's output if it holds it. ``forward_backward`` runs the stages
in dataflow order in one process, as the partitioned executor will run them in several:
forward, the loss at the output's stage, then backward in reverse order, each stage's
received values being leaf tensors whose ``.grad`` is what it sends back. Its gradients
and loss equal the whole model's (tests/test_partition.py), which makes it the oracle
for the multi-process executor.

A stage program returns everything it sends at the end of its forward. So two branches
placed on stages 0 and 1 overlap in time only across micro-batches (a pipeline), not
within one: stage 1 waits for stage 0's whole forward even when it needs only a value
stage 0 computed first. Sending each value as soon as it is computed would need the
stage cut further, at its send points; nothing here does that yet.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import fx

from plexus.errors import ConfigError
from plexus.parallel.partition import ModelGraph, PartitionPlan

__all__ = ["StageProgram", "build_stages", "forward_backward", "merge_state_dicts"]


@dataclass(frozen=True, eq=False)
class StageProgram:
    index: int
    # Takes the values named by ``inputs`` positionally and returns a tuple of the values
    # named by ``outputs``. Parameter names are the original model's qualified names.
    module: fx.GraphModule
    # Model inputs (placeholder names) and received values (producer node names), in
    # the order the module takes them.
    inputs: tuple[str, ...]
    # Values sent to other stages, each once, then the model output if this stage holds it.
    outputs: tuple[str, ...]
    # Which of the inputs are model inputs rather than values received from a stage.
    model_inputs: frozenset[str]


def build_stages(graph: ModelGraph, plan: PartitionPlan, *, share: bool = False) -> list[StageProgram]:
    """One StageProgram per partition of ``plan``. Their parameters are copies of the
    traced model's unless ``share`` (then training a stage trains the model passed to
    ``trace_model``)."""
    root = graph.module if share else copy.deepcopy(graph.module)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    sent = {t.producer for t in plan.transfers}
    stages = []
    for part in plan.partitions:
        mine = set(part.nodes)
        placeholders = [n for n in part.nodes if graph.by_name[n].op == "placeholder"]
        received = sorted({t.producer for t in plan.transfers if t.dst == part.index}, key=order.__getitem__)
        outputs = [n for n in part.nodes if n in sent]
        if graph.output in mine and graph.output not in outputs:
            outputs.append(graph.output)
        g = fx.Graph()
        env: dict[str, fx.Node] = {}
        for name in (*placeholders, *received):
            env[name] = g.placeholder(name)
        for node in graph.module.graph.nodes:
            if node.name in mine and node.op != "placeholder":
                env[node.name] = g.node_copy(node, lambda n: env[n.name])
        g.output(tuple(env[name] for name in outputs))
        module = fx.GraphModule(root, g, f"Stage{part.index}")
        stages.append(StageProgram(index=part.index, module=module, inputs=(*placeholders, *received),
                                   outputs=tuple(outputs), model_inputs=frozenset(placeholders)))
    return stages


def _dataflow_order(stages: Sequence[StageProgram]) -> list[StageProgram]:
    """Stages in an order where each runs after every stage it receives from."""
    produced = {name for s in stages for name in s.outputs}
    ready: set[str] = set()
    left, order = list(stages), []
    while left:
        runnable = [s for s in left if all(i in s.model_inputs or i in ready for i in s.inputs)]
        if not runnable:
            missing = sorted(i for s in left for i in s.inputs if i not in ready and i not in s.model_inputs)
            raise ConfigError(f"stages wait on each other in a cycle or on values no stage sends "
                              f"({', '.join(missing)}): the plan's stages must form a DAG")
        for s in runnable:
            order.append(s)
            ready.update(o for o in s.outputs if o in produced)
            left.remove(s)
    return order


def forward_backward(stages: Sequence[StageProgram], inputs: Mapping[str, torch.Tensor],
                     loss_fn: Callable[[torch.Tensor], torch.Tensor], output: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step's forward and backward through ``stages`` in this process.

    ``inputs`` maps the model's placeholder names to tensors; ``output`` names the node
    the model returns (``ModelGraph.output``); ``loss_fn`` maps the output to a scalar.
    Parameters' ``.grad`` accumulate as ``loss.backward()`` on the whole model would.
    Returns (loss, output), both detached.
    """
    order = _dataflow_order(stages)
    values: dict[str, torch.Tensor] = {}
    leaves: dict[int, list[tuple[str, torch.Tensor]]] = {}
    outs: dict[int, tuple[torch.Tensor, ...]] = {}
    for s in order:
        args, leaves[s.index] = [], []
        for name in s.inputs:
            if name in s.model_inputs:
                args.append(inputs[name])
                continue
            value = values[name]
            leaf = value.detach().requires_grad_(value.requires_grad)  # each stage its own copy, as if sent
            leaves[s.index].append((name, leaf))
            args.append(leaf)
        outs[s.index] = s.module(*args)
        values.update(zip(s.outputs, outs[s.index]))
    loss = loss_fn(values[output])
    pending: dict[str, torch.Tensor] = {}  # gradient of each sent value, summed over its receivers
    for s in reversed(order):
        tensors, grads = [], []
        for name, value in zip(s.outputs, outs[s.index]):
            if name == output:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
            elif name in pending and value.requires_grad:
                tensors.append(value)
                grads.append(pending.pop(name))
        if tensors:
            torch.autograd.backward(tensors, grads)
        for name, leaf in leaves[s.index]:
            if leaf.grad is not None:
                pending[name] = pending[name] + leaf.grad if name in pending else leaf.grad
    return loss.detach(), values[output].detach()


def merge_state_dicts(states: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The stages' state_dicts as one that loads (strict) into the original module: their
    keys are already the model's qualified names, and no key may come from two stages."""
    merged: dict[str, torch.Tensor] = {}
    for index, state in enumerate(states):
        for key, value in state.items():
            if key in merged:
                raise ConfigError(f"state_dict key {key} comes from two stages (the second is stage {index}): "
                                  f"stages must hold disjoint parameters")
            merged[key] = value
    return merged
