"""Stage programs: one fx GraphModule per partition of a plan, and an in-process run.

A stage's module takes the values it receives across cuts (and the model inputs that
belong to it) and returns the values it sends, each once however many stages or nodes
read it, then the model's output if it holds it. ``StageStep`` is one stage's half of a
training step without any transport: the executor receives a stage's values, calls
``forward``, sends what it returns (one message per transfer of the plan), and later
receives the gradients of what it sent, calls ``backward`` and sends back the gradients
of what it received. ``forward_backward`` drives every stage's StageStep in one process
in dataflow order, counting the messages it passes; its loss and gradients equal the
whole model's and its counts equal ``PartitionPlan.traffic()`` (tests/test_partition.py),
which makes it the oracle for the multi-process executor.

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
from plexus.parallel.partition import ModelGraph, PartitionPlan, Transfer

__all__ = ["StageProgram", "StageStep", "build_stages", "forward_backward", "join_chunks", "merge_state_dicts"]


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
    # The plan's transfers into and out of this stage: one message each per step forward,
    # and one back for those with ``grad``.
    receives: tuple[Transfer, ...]
    sends: tuple[Transfer, ...]
    # The node whose value the model returns, when this stage holds it (the loss is
    # computed here), else None.
    output: str | None
    # --schedule interleaved: the process's model chunks (virtual stages c*K + index, in
    # chunk order), whose programs run; ``module`` then holds their layers for the
    # synchroniser. Empty otherwise: the program is its own one chunk.
    chunks: tuple["StageProgram", ...] = ()


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
        receives = tuple(sorted((t for t in plan.transfers if t.dst == part.index),
                                key=lambda t: order[t.producer]))
        received = [t.producer for t in receives]  # one transfer per (producer, dst): no repeats
        outputs = [n for n in part.nodes if n in sent]
        holds_output = graph.output in mine
        if holds_output and graph.output not in outputs:
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
        stages.append(StageProgram(
            index=part.index, module=module, inputs=(*placeholders, *received), outputs=tuple(outputs),
            model_inputs=frozenset(placeholders), receives=receives,
            sends=tuple(t for t in plan.transfers if t.src == part.index),
            output=graph.output if holds_output else None))
    return stages


class StageStep:
    """One stage's forward and backward of a step, given the values it receives; no
    transport. Received values become leaf tensors (gradient wanted when the plan's
    transfer carries one), so that backward can return their gradients to send back."""

    def __init__(self, program: StageProgram) -> None:
        self.program = program
        self._leaves: list[tuple[Transfer, torch.Tensor]] = []
        self._outputs: dict[str, torch.Tensor] = {}

    def forward(self, received: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor] | None = None,
                module: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Run the stage on ``received`` (producer name -> value, one per transfer in)
        and the model ``inputs`` it holds; returns every value it outputs by name: one
        per value sent (send it to each of its transfers' stages) and the model output.
        ``module`` runs instead of the program's own (a copy of it with other weights)."""
        p = self.program
        self._leaves = [(t, received[t.producer].detach().requires_grad_(t.grad)) for t in p.receives]
        leaves = {t.producer: leaf for t, leaf in self._leaves}
        args = [(inputs or {})[name] if name in p.model_inputs else leaves[name] for name in p.inputs]
        self._outputs = dict(zip(p.outputs, (module or p.module)(*args)))
        return dict(self._outputs)

    @property
    def leaves(self) -> list[tuple[Transfer, torch.Tensor]]:
        """The last forward's received values, as the leaf tensors it ran on."""
        return self._leaves

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The values of the last forward, by name."""
        return self._outputs

    def input_gradients(self) -> list[tuple[Transfer, torch.Tensor]]:
        """After a backward that reached this stage's inputs: the gradient of each received
        value whose transfer carries one (zeros where the stage did not depend on it)."""
        back = [(t, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                for t, leaf in self._leaves if t.grad]
        self._leaves, self._outputs = [], {}
        return back

    def backward(self, grads: Iterable[tuple[str, torch.Tensor]], loss: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
        """Backward from ``loss`` (the output stage's) and the gradients received for the
        values this stage sent, as (producer name, gradient) pairs, one per transfer back
        (those of one value are summed). Parameters' ``.grad`` accumulate. Returns the
        gradient of each received value whose transfer carries one: zeros where the stage
        did not depend on it, so that every message the plan counts is sent."""
        summed: dict[str, torch.Tensor] = {}
        for name, grad in grads:
            summed[name] = summed[name] + grad if name in summed else grad
        tensors, seeds = ([loss], [torch.ones_like(loss)]) if loss is not None else ([], [])
        for name, grad in summed.items():
            value = self._outputs[name]
            if value.requires_grad:
                tensors.append(value)
                seeds.append(grad)
        if tensors:
            torch.autograd.backward(tensors, seeds)
        back = {t.producer: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                for t, leaf in self._leaves if t.grad}
        self._leaves, self._outputs = [], {}
        return back


def _graft(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """Put ``module`` at qualified name ``path`` under ``root``, making the modules on the
    way; ConfigError when another module is there already (two chunks sharing a layer)."""
    *parents, last = path.split(".")
    at = root
    for part in parents:
        if not hasattr(at, part):
            at.add_module(part, torch.nn.Module())
        at = getattr(at, part)
    there = getattr(at, last, None)
    if there is not None and there is not module:
        raise ConfigError(f"{path} is used by two model chunks of one process under --schedule interleaved: "
                          f"layers shared between chunks are not supported; use --schedule 1f1b")
    if there is None:
        at.add_module(last, module)


def join_chunks(programs: Sequence[StageProgram], processes: int) -> list[StageProgram]:
    """``programs`` (one per virtual stage of an interleaved plan, K*v of them) as one
    program per process: process s runs virtual stages s, K + s, ... (Narayanan et al.
    2021's assignment). Its ``module`` holds the chunks' layers at their qualified names,
    the same objects, so its state_dict is the chunks' together with the whole model's
    keys and training it trains them. With one chunk per process, ``programs`` as given."""
    if len(programs) == processes:
        return list(programs)
    v = len(programs) // processes
    joined = []
    for s in range(processes):
        chunks = tuple(programs[c * processes + s] for c in range(v))
        root = torch.nn.Module()
        for chunk in chunks:
            for t in chunk.sends:
                if t.dst % processes == s:
                    raise ConfigError(f"value {t.producer} goes from virtual stage {t.src} to {t.dst}, two chunks of "
                                      f"process {s} under --schedule interleaved: values between chunks of one "
                                      f"process are not supported; use --schedule 1f1b or other --chunks")
            for name, module in chunk.module.named_modules():
                own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                if name and own:
                    _graft(root, name, module)
                elif own:
                    raise ConfigError(f"chunk {chunk.index} holds tensors at its root ({own[0][0]}): "
                                      f"--schedule interleaved needs every parameter inside a submodule")
        joined.append(StageProgram(
            index=s, module=root, inputs=(), outputs=(),  # type: ignore[arg-type]
            model_inputs=frozenset().union(*(c.model_inputs for c in chunks)),
            receives=tuple(t for c in chunks for t in c.receives), sends=tuple(t for c in chunks for t in c.sends),
            output=next((c.output for c in chunks if c.output is not None), None), chunks=chunks))
    return joined


def _dataflow_order(stages: Sequence[StageProgram]) -> list[StageProgram]:
    """Stages in an order where each runs after every stage it receives from."""
    done: set[int] = set()
    left, order = list(stages), []
    while left:
        runnable = [s for s in left if all(t.src in done for t in s.receives)]
        if not runnable:
            raise ConfigError(f"stages {', '.join(str(s.index) for s in left)} wait on each other in a cycle or on "
                              f"a stage that is missing: the plan's stages must form a DAG")
        for s in runnable:
            order.append(s)
            done.add(s.index)
            left.remove(s)
    return order


def forward_backward(stages: Sequence[StageProgram], inputs: Mapping[str, torch.Tensor],
                     loss_fn: Callable[[torch.Tensor], torch.Tensor],
                     traffic: dict[tuple[int, int], tuple[int, int]] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step's forward and backward through ``stages`` in this process.

    ``inputs`` maps the model's placeholder names to tensors; ``loss_fn`` maps the
    model's output to a scalar. Parameters' ``.grad`` accumulate as ``loss.backward()``
    on the whole model would. Every value passed between stages is a message, counted
    into ``traffic`` ({(src, dst): (messages, bytes)}, as ``PartitionPlan.traffic``)
    when given. Returns (loss, output), both detached.
    """
    order = _dataflow_order(stages)
    steps = {s.index: StageStep(s) for s in order}
    inbox: dict[int, dict[str, torch.Tensor]] = {s.index: {} for s in order}
    grads_in: dict[int, list[tuple[str, torch.Tensor]]] = {s.index: [] for s in order}

    def post(src: int, dst: int, value: torch.Tensor) -> torch.Tensor:
        if traffic is not None:
            messages, nbytes = traffic.get((src, dst), (0, 0))
            traffic[(src, dst)] = (messages + 1, nbytes + value.numel() * value.element_size())
        return value.detach()

    loss = output = None
    for s in order:
        values = steps[s.index].forward(inbox[s.index], inputs)
        for t in s.sends:
            inbox[t.dst][t.producer] = post(t.src, t.dst, values[t.producer])
        if s.output is not None:
            output = values[s.output]
            loss = loss_fn(output)
    if loss is None or output is None:
        raise ConfigError("no stage holds the model's output: the plan is incomplete")
    for s in reversed(order):
        back = steps[s.index].backward(grads_in[s.index], loss if s.output is not None else None)
        for t in s.receives:
            if t.grad:
                grads_in[t.src].append((t.producer, post(t.dst, t.src, back[t.producer])))
    return loss.detach(), output.detach()


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
