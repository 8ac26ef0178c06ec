"""Tensor parallelism: large layers split inside themselves across the T processes of a
group, each holding a slice of every split layer's parameters (Shoeybi et al. 2019,
Megatron-LM, section 3; Krizhevsky et al. 2012 split AlexNet's convolutions by channel).

Pure planning and a rank's module, no processes of its own: ``plan_tensor_split`` reads a
model's torch.fx graph and decides how each ``nn.Linear`` and convolution splits;
``shard_module`` builds one rank's module from the plan, with autograd-aware collectives
over the ``Group`` it is given; ``predict_traffic`` says what those collectives send per
step, exactly as the group's ``Traffic`` counts it; ``merge_tensor_states`` assembles the
ranks' state_dicts into the original model's.

How a layer splits, T ways:

- ``column`` + ``row``, a pair: the first Linear split by output features, the second by
  input features, when only elementwise ops (ReLU, GELU, tanh, dropout ...) stand between
  them and nothing else reads the values in between. Each rank computes its slice of the
  hidden features and a partial output; one all-reduce (sum) makes the output, and the
  second layer's bias is added once, after it. The pair's input gradient is all-reduced
  in the backward pass (Megatron's f and g operators).
- ``column+gather``: a Linear that is not the first of a pair, split by output features
  whose slices are all-gathered along the last dimension; its input gradient is
  all-reduced as for a pair.
- ``channels+gather``: a Conv1d/Conv2d split by output channels, gathered along dim 1.

A layer whose split dimension T does not divide, a grouped convolution and a module
called from more than one place stay whole: every rank holds all of it and computes it
on the same input, so its gradient is the same on every rank without communication.
That is why every rank of a group must get the same input batch, and why the model must
be built from the same seed on every rank before sharding.

Traffic: a backend all-reduce of B bytes is counted by ``Endpoint.all_reduce_backend`` as
the ring's 2(T-1)/T * B bytes per rank, sent and received, split evenly over the T-1
peers (one message each way per peer). The all-gather here counts what each rank's slice
of B/T bytes costs: sent to and received from each peer once (T-1 messages of B/T bytes,
the ring all-gather's (T-1)/T * B).
"""
from __future__ import annotations

import copy
import datetime as dt
import math
import time
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from plexus.cluster.group import Endpoint, Work, translate_error
from plexus.errors import ConfigError
from plexus.parallel.partition import _symbolic, format_bytes

__all__ = ["SplitKind", "SplitLayer", "TensorPlan", "plan_tensor_split", "shard_module", "predict_traffic",
           "join_tensor_plans", "merge_tensor_states", "format_tensor_plan", "CopyToParallel", "GatherFromParallel",
           "RowParallelLinear"]

SplitKind = Literal["column", "row", "column+gather", "channels+gather"]

# Modules, functions and tensor methods that act on each feature alone, so that they
# commute with a split of the features: what may stand between the two layers of a pair.
_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Mish, nn.LeakyReLU, nn.ELU,
                        nn.SELU, nn.CELU, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Dropout,
                        nn.Identity)
_ELEMENTWISE_FUNCTIONS = (F.relu, F.relu6, F.gelu, F.silu, F.mish, F.leaky_relu, F.elu, F.selu, F.softplus,
                          F.hardtanh, F.dropout, torch.relu, torch.tanh, torch.sigmoid, F.sigmoid, F.tanh)
_ELEMENTWISE_METHODS = ("relu", "tanh", "sigmoid")
_CONVS = (nn.Conv1d, nn.Conv2d)


@dataclass(frozen=True)
class SplitLayer:
    """How one layer splits, and the per-sample sizes that price its collectives."""

    # The module's qualified name in the model (``net.1``): its parameters keep their keys.
    name: str
    kind: SplitKind
    # The full weight's shape and the slice each rank holds.
    weight_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    # Elements per sample of the layer's whole output (all-reduced after a row layer,
    # all-gathered after a gather layer).
    out_numel: int
    # The fx node of the layer's input, and its elements per sample. Column and gather
    # layers all-reduce its gradient in the backward pass, once per input value however
    # many split layers read it, when it has one: ``input_grad``, as it had on the
    # plan's example.
    input_node: str
    in_numel: int
    input_grad: bool
    # Bytes per element of the activations.
    itemsize: int


@dataclass(frozen=True)
class TensorPlan:
    """Which layers of a model split T ways, in graph order; the rest stay whole."""

    model: str
    ways: int
    layers: tuple[SplitLayer, ...]
    # Linear and convolution layers left whole, with the reason (``out 10 % 3``).
    whole: tuple[tuple[str, str], ...]

    def layer(self, name: str) -> SplitLayer | None:
        return next((l for l in self.layers if l.name == name), None)


def _is_elementwise(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[node.target], _ELEMENTWISE_MODULES)
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _pair_end(node: fx.Node, modules: Mapping[str, nn.Module]) -> fx.Node | None:
    """The Linear that reads ``node``'s output through elementwise ops only, each value on
    the way read by nothing else; None when there is none."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "call_module" and isinstance(modules[user.target], nn.Linear) and user.args[0] is node:
            return user
        if not _is_elementwise(user, modules) or user.args[0] is not node:
            return None
        node = user
    return None


def _kept_whole(node: fx.Node, layer: nn.Module, calls: Mapping[str, int], owners: Mapping[int, int]) -> str:
    """Why a layer cannot be split whatever T is, or "" when it can."""
    if calls[node.target] > 1:
        return "called from several places"
    if any(owners[id(p)] > 1 for p in layer.parameters()):
        return "shares a parameter with another module"
    if len(node.args) != 1 or node.kwargs:
        return "its input is not one positional tensor"
    if isinstance(layer, _CONVS) and layer.groups != 1:
        return f"groups {layer.groups}"
    return ""


def _per_sample(node: fx.Node, batch: int) -> tuple[int, int]:
    """(elements per sample, bytes per element) of a node's tensor output."""
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        raise ConfigError(f"--tensor-parallel: layer input or output {node.name} is not one tensor: "
                          f"tensor parallelism splits layers that map a tensor to a tensor")
    numel = math.prod(meta.shape)
    if numel % batch:
        raise ConfigError(f"--tensor-parallel: {node.name} has {numel} elements for a batch of {batch}: "
                          f"the batch must be dimension 0 of every activation")
    return numel // batch, torch.empty(0, dtype=meta.dtype).element_size()


def _trace(module: nn.Module, examples: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    """The module's graph with each node's output shape and requires_grad recorded, from
    one forward on ``examples`` that leaves buffers and the random generator as they were."""
    if isinstance(module, fx.GraphModule):
        # A copy of the graph, so that the shapes recorded leave the caller's as it was.
        gm = fx.GraphModule(module, copy.deepcopy(module.graph), type(module).__name__)
    else:
        gm = _symbolic(module)
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        ShapeProp(gm).propagate(*examples)
    with torch.no_grad():
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])
    return gm


def plan_tensor_split(module: nn.Module, T: int, example: torch.Tensor | Sequence[torch.Tensor]) -> TensorPlan:
    """Decide how each Linear and convolution of ``module`` splits ``T`` ways.

    ``module``: an nn.Module that torch.fx can trace, or an fx.GraphModule (a stage
    program of ``build_stages``). ``example``: one batch of its inputs (a tuple for
    several), batch first, each with ``requires_grad`` as in training: a stage's received
    values that carry a gradient back must require it, since that decides whether a split
    layer's input gradient is all-reduced. Raises ConfigError, one line, when no layer
    splits.
    """
    if T < 2:
        raise ConfigError(f"--tensor-parallel must be at least 2 to split a layer, got {T}")
    examples = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    batch = examples[0].shape[0]
    gm = _trace(module, examples)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    # A parameter shared by two modules (tied weights) would come apart if sliced in one.
    owners: dict[int, int] = {}
    for _, p in gm.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    layers: list[SplitLayer] = []
    whole: list[tuple[str, str]] = []
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], (nn.Linear, *_CONVS)):
            continue
        name, layer = node.target, modules[node.target]
        if name in seen:
            continue
        seen.add(name)
        linear = isinstance(layer, nn.Linear)
        out = layer.out_features if linear else layer.out_channels
        why = _kept_whole(node, layer, calls, owners) or (f"out {out} % {T} = {out % T}" if out % T else "")
        if why:
            whole.append((name, why))
            continue
        source = node.args[0]
        in_numel, itemsize = _per_sample(source, batch)
        input_grad = bool(source.meta["tensor_meta"].requires_grad)
        end = _pair_end(node, modules) if linear else None
        if end is not None and not _kept_whole(end, modules[end.target], calls, owners):
            second = modules[end.target]
            layers.append(SplitLayer(name, "column", tuple(layer.weight.shape), (out // T, layer.in_features),
                                     _per_sample(node, batch)[0], source.name, in_numel, input_grad, itemsize))
            seen.add(end.target)
            mid, _ = _per_sample(end.args[0], batch)
            layers.append(SplitLayer(end.target, "row", tuple(second.weight.shape),
                                     (second.out_features, second.in_features // T), _per_sample(end, batch)[0],
                                     end.args[0].name, mid, False, itemsize))
            continue
        shard = (out // T, *layer.weight.shape[1:])
        layers.append(SplitLayer(name, "column+gather" if linear else "channels+gather", tuple(layer.weight.shape),
                                 shard, _per_sample(node, batch)[0], source.name, in_numel, input_grad, itemsize))
    if not layers:
        found = ", ".join(f"{n} ({why})" for n, why in whole)
        if not found:
            raise ConfigError(f"--tensor-parallel {T}: model {type(module).__name__} has no Linear, Conv1d or Conv2d "
                              f"layer to split: tensor parallelism splits those only; pass --tensor-parallel 1")
        raise ConfigError(f"--tensor-parallel {T}: model {type(module).__name__} has no Linear or Conv layer whose "
                          f"output features divide by {T} and that can be split: {found}; pass a --tensor-parallel "
                          f"that divides a layer's output features, or 1 to keep every layer whole")
    return TensorPlan(type(module).__name__, T, tuple(layers), tuple(whole))


def _all_reduce(group: Endpoint, tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the group in place (counted as the backend ring's cost)."""
    group.all_reduce_backend(tensor).wait()
    return tensor


def _all_gather(group: Endpoint, shard: torch.Tensor, dim: int) -> torch.Tensor:
    """Every member's ``shard`` (all the same shape), concatenated along ``dim`` in member
    order. The Group has no all-gather of its own: this runs the backend's and counts what
    each member's slice costs, sent to and received from each peer once."""
    shard = shard.contiguous()
    parts = [torch.empty_like(shard) for _ in range(group.size)]
    nbytes = shard.numel() * shard.element_size()
    others = [n for i, n in enumerate(group.names) if i != group.rank]
    if group.net is not None:
        # A ring all-gather passes T-1 slices in sequence.
        time.sleep(len(others) * group.net.delay(nbytes))
    what = f"all-gather of {nbytes} bytes each"
    try:
        work = group.pg.allgather(parts, shard, dt.timedelta(seconds=group.timeout))
    except RuntimeError as exc:
        raise translate_error(exc, group.me, what, "the group", group.timeout) from None

    def count() -> None:
        for name in others:
            group.traffic.sent(name, nbytes)
            group.traffic.received(name, nbytes)

    Work(work, group, what, f"one of {', '.join(others)}", on_done=count).wait()
    return torch.cat(parts, dim)


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; the gradient summed over the group backward (Megatron's f): each
    rank's slice of the next layer contributes part of its input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Endpoint) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(ctx.group, grad.clone(memory_format=torch.contiguous_format)), None


class _ReduceFromParallel(torch.autograd.Function):
    """The partial outputs summed over the group forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Endpoint) -> torch.Tensor:
        return _all_reduce(group, x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """The ranks' slices concatenated along ``dim`` forward; this rank's slice of the
    gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Endpoint, dim: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.width = dim, group.rank, x.shape[dim]
        return _all_gather(group, x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width), None, None


class CopyToParallel(nn.Module):
    """Graph node before column and gather layers: sums their input's gradient."""

    def __init__(self, group: Endpoint) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToParallel.apply(x, self.group)


class GatherFromParallel(nn.Module):
    """Graph node after a column+gather or channels+gather layer."""

    def __init__(self, group: Endpoint, dim: int) -> None:
        super().__init__()
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherFromParallel.apply(x, self.group, self.dim)


class RowParallelLinear(nn.Module):
    """The second Linear of a pair: this rank's input features in, the partial output
    all-reduced, then the whole bias added once (every rank holds the same bias)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Endpoint) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromParallel.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]} (of {self.weight.shape[1] * self.group.size}), " \
               f"out_features={self.weight.shape[0]}, bias={self.bias is not None}"


def _slice(param: torch.Tensor, dim: int, rank: int, T: int) -> nn.Parameter:
    """This rank's contiguous slice of ``param`` along ``dim``: an exact copy of its values."""
    width = param.shape[dim] // T
    piece = param.detach().narrow(dim, rank * width, width).clone()
    return nn.Parameter(piece, requires_grad=param.requires_grad)


def _sharded_layer(layer: nn.Module, split: SplitLayer, rank: int, T: int, group: Endpoint) -> nn.Module:
    """``layer`` (this rank's own copy, changed in place) cut down to its slice."""
    if split.kind == "row":
        return RowParallelLinear(_slice(layer.weight, 1, rank, T), layer.bias, group)
    layer.weight = _slice(layer.weight, 0, rank, T)
    if layer.bias is not None:
        layer.bias = _slice(layer.bias, 0, rank, T)
    if isinstance(layer, nn.Linear):
        layer.out_features //= T
    else:
        layer.out_channels //= T
    return layer


def shard_module(module: nn.Module, plan: TensorPlan, rank: int, T: int, group: Endpoint) -> fx.GraphModule:
    """Rank ``rank``'s part of ``module`` (traced as ``plan_tensor_split`` traced it): each
    split layer replaced by its slice, collectives over ``group`` (T members, this
    process at ``rank``) inserted where the plan says. Parameters keep the original's
    qualified names; split ones are exact slices of the original's values, the others
    copies. Every rank must pass a module built from the same seed and, in training, the
    same inputs."""
    if T != plan.ways or group.size != T or group.rank != rank:
        raise ConfigError(f"shard_module: the plan splits {plan.ways} ways, T is {T}, and the group has "
                          f"{group.size} members with this process at {group.rank}, not {rank}: they must agree")
    if isinstance(module, fx.GraphModule):
        gm = fx.GraphModule(copy.deepcopy(module), copy.deepcopy(module.graph), type(module).__name__)
    else:
        gm = _symbolic(copy.deepcopy(module))
    graph = gm.graph
    # The node that carries each value whole: the gather after a gathered layer.
    full = {node.name: node for node in graph.nodes}
    splits = {split.name: split for split in plan.layers}
    copies: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        split = splits.get(node.target) if node.op == "call_module" else None
        if split is None:
            continue
        gm.set_submodule(node.target, _sharded_layer(gm.get_submodule(node.target), split, rank, T, group))
        if split.kind != "row":
            # One all-reduce of the gradient per input value, however many layers read it.
            # Inserted whether or not the plan's example needed a gradient there: autograd
            # skips it when none is wanted, and a missing one would leave each rank with
            # its partial gradient. ``input_grad`` only prices it.
            source = full[split.input_node]
            if split.input_node not in copies:
                name = f"tp_copy_{len(copies)}"
                gm.add_submodule(name, CopyToParallel(group))
                with graph.inserting_after(source):
                    copies[split.input_node] = graph.call_module(name, (source,))
            node.replace_input_with(source, copies[split.input_node])
        if split.kind.endswith("+gather"):
            name = f"tp_gather_{node.target.replace('.', '_')}"
            gm.add_submodule(name, GatherFromParallel(group, -1 if split.kind == "column+gather" else 1))
            with graph.inserting_after(node):
                gathered = graph.call_module(name, (node,))
            node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
            full[node.name] = gathered
    graph.lint()
    gm.recompile()
    return gm


def predict_traffic(plan: TensorPlan, batch: int, T: int) -> dict[str, int]:
    """What one rank's collectives send per training step of ``batch`` samples, as the
    group's Traffic counts it: ``forward_messages``, ``forward_bytes``,
    ``backward_messages``, ``backward_bytes``, ``messages`` and ``bytes``, summed over its
    T-1 peers. It receives exactly as many messages and bytes."""
    if T != plan.ways:
        raise ConfigError(f"predict_traffic: the plan splits {plan.ways} ways, not {T}")
    peers = T - 1

    def all_reduce(numel: int, itemsize: int) -> tuple[int, int]:
        # Endpoint.all_reduce_backend: 2(T-1)/T of the bytes, in equal whole parts per peer.
        per_peer = 2 * peers * numel * itemsize // T // peers
        return peers, per_peer * peers

    forward = [0, 0]
    backward = [0, 0]
    reduced: set[str] = set()
    for split in plan.layers:
        if split.input_grad and split.input_node not in reduced:
            reduced.add(split.input_node)
            messages, nbytes = all_reduce(split.in_numel * batch, split.itemsize)
            backward[0] += messages
            backward[1] += nbytes
        if split.kind == "row":
            messages, nbytes = all_reduce(split.out_numel * batch, split.itemsize)
            forward[0] += messages
            forward[1] += nbytes
        elif split.kind.endswith("+gather"):
            forward[0] += peers
            forward[1] += peers * split.out_numel * batch // T * split.itemsize
    return {"forward_messages": forward[0], "forward_bytes": forward[1], "backward_messages": backward[0],
            "backward_bytes": backward[1], "messages": forward[0] + backward[0], "bytes": forward[1] + backward[1]}


def join_tensor_plans(plans: Sequence[TensorPlan]) -> TensorPlan:
    """The plans of one process's model chunks (--schedule interleaved) as one: their
    layers and whole layers together, which ``predict_traffic`` prices as one pass of
    every chunk per micro-batch and ``merge_tensor_states`` merges by qualified name. A
    chunk's fx node names are the whole model's, and a chunk reads nothing from another
    chunk of its process (``join_chunks``), so no input value is counted twice."""
    if len(plans) == 1:
        return plans[0]
    layers = tuple(layer for plan in plans for layer in plan.layers)
    inputs = [{layer.input_node for layer in plan.layers} for plan in plans]
    if len({layer.name for layer in layers}) != len(layers) or \
            len(set().union(*inputs)) != sum(len(names) for names in inputs):
        raise ValueError("join_tensor_plans: two chunks' plans share a layer or an input value")
    return TensorPlan(model=plans[0].model, ways=plans[0].ways, layers=layers,
                      whole=tuple(item for plan in plans for item in plan.whole))


def merge_tensor_states(states: Sequence[Mapping[str, torch.Tensor]], plan: TensorPlan) -> dict[str, torch.Tensor]:
    """The T ranks' state_dicts, in rank order, as one that loads (strict) into the
    original module: split weights and biases concatenated along their split dimension,
    everything else (replicated, the same on every rank) taken from rank 0."""
    if len(states) != plan.ways:
        raise ConfigError(f"merge_tensor_states: the plan splits {plan.ways} ways but {len(states)} state_dicts "
                          f"were given: pass one per rank, in rank order")
    keys = list(states[0])
    for rank, state in enumerate(states[1:], 1):
        if set(state) != set(keys):
            raise ConfigError(f"merge_tensor_states: rank {rank}'s state_dict keys differ from rank 0's: "
                              f"{sorted(set(state) ^ set(keys))[:4]}; states must come from one plan's shards")
    merged: dict[str, torch.Tensor] = {}
    for key in keys:
        owner, _, param = key.rpartition(".")
        split = plan.layer(owner)
        if split is None or (split.kind == "row" and param == "bias"):
            merged[key] = states[0][key]
        else:
            dim = 1 if split.kind == "row" else 0
            merged[key] = torch.cat([state[key] for state in states], dim)
    return merged


def format_tensor_plan(plan: TensorPlan) -> str:
    """The plan as a table for ``--print-partition``: each split layer's kind, full and
    shard weight shapes, and the collective it adds per sample."""
    rows = [("layer", "kind", "weight", "shard", "per sample")]
    for split in plan.layers:
        comms = []
        if split.kind == "row":
            comms.append(f"all-reduce {format_bytes(split.out_numel * split.itemsize)}")
        elif split.kind.endswith("+gather"):
            comms.append(f"all-gather {format_bytes(split.out_numel * split.itemsize)}")
        if split.input_grad:
            comms.append(f"grad all-reduce {format_bytes(split.in_numel * split.itemsize)}")
        comm = "; ".join(comms) or "-"
        rows.append((split.name, split.kind, "x".join(map(str, split.weight_shape)),
                     "x".join(map(str, split.shard_shape)), comm))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    if plan.whole:
        lines.append("whole on every rank: " + ", ".join(f"{n} ({why})" for n, why in plan.whole))
    lines.append(f"{plan.ways} ranks each; every rank gets the same input batch")
    return "\n".join(lines)
