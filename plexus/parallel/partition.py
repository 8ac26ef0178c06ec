"""Partition plans: a model's torch.fx graph cut into K stages, one process each (later).

Pure: no processes, no sockets. ``trace_model`` turns a module into a ``ModelGraph``
(one ``GraphNode`` per fx node, with the parameters it owns, the bytes of its output for
a sample batch and, when profiled, its forward and backward seconds); ``plan_partitions``
cuts it into a ``PartitionPlan``; ``format_plan`` prints the plan.

Every method cuts a *topological order* of the graph (fx's node order, the order of the
forward's code) into K contiguous ranges of computing nodes (call_module, call_function,
call_method). A placeholder or get_attr node goes with its first consumer. Ranges of a
topological order are not only chains: when two independent branches (the columns of
``Towers``) are listed one after the other, a cut between them puts the branches on
different stages, and the plan's transfers form a DAG (the input skips from stage 0 to
stage 2, say). What contiguous ranges cannot express is a stage holding two pieces that
are far apart in that order, and no other order is searched: a forward that
interleaves its branches' calls gets ranges that cut across the branches. Manual split
points are cuts of the same order, so they share the limit. It keeps the exact solver
small: a min-max dynamic programme over the O(n^2) ranges, O(k n^2) steps after pricing
each range in O(n), fine for graphs of hundreds of nodes.

The time method chooses its cut from a node profile (``trace_model(profile=True)``: each
node timed alone, calibrated to a whole step) but does not predict with it: nodes timed
alone run with their weights hot in cache, and the stages of deep-mlp measured 1.04 to
1.25 times that profile's sum. ``executor.make_plan`` prices the chosen cut by running
its stage programs as a step runs them (``executor.price_plan``), and a plan so priced
(``PartitionPlan.priced``) carries those seconds as each stage's ``compute_s``. Only the
chosen cut is priced, not the best few: picking the lowest of several noisy prices would
bias the prediction low again (docs/results/partition.md).

Transfers are counted send-once: a value produced in stage p and read by several nodes
of stage q is one transfer p -> q, carrying the value's bytes once per step (and its
gradient once back, when it has one). The executor's link counters must equal these.
"""
from __future__ import annotations

import copy
import dataclasses
import linecache
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import torch
from torch import fx, nn

from plexus.errors import ConfigError

__all__ = [
    "COMPUTE_OPS",
    "METHODS",
    "GraphNode",
    "ModelGraph",
    "Transfer",
    "Holding",
    "Partition",
    "PartitionPlan",
    "trace_model",
    "plan_partitions",
    "format_plan",
    "format_bytes",
]

# fx node kinds that compute; placeholders, get_attr and the output only name values.
COMPUTE_OPS = ("call_module", "call_function", "call_method")
METHODS = ("uniform", "params", "time", "manual")
Method = Literal["uniform", "params", "time", "manual"]

# Link bandwidth assumed when none is given: a 4 MB push and pull between two processes
# of this machine ran at 1.1 to 1.6 GB/s (ARCHITECTURE.md section 8).
DEFAULT_BANDWIDTH = 1e9


@dataclass(frozen=True)
class GraphNode:
    """One fx node of the traced model."""

    name: str
    # placeholder, get_attr, call_module, call_function or call_method
    op: str
    # The module's qualified name, the attribute's, or the function's or method's name.
    target: str
    # Names of the nodes whose values it reads, in order, each once.
    inputs: tuple[str, ...]
    # Qualified names of the parameters it owns (a parameter read by several nodes is
    # owned by the first), their bytes and element count.
    params: tuple[str, ...] = ()
    param_bytes: int = 0
    param_count: int = 0
    # Bytes of its output (every tensor in it) for the graph's sample batch.
    out_bytes: int = 0
    # The storages its output lies in, and those of the tensors its forward saves for the
    # backward apart from the parameters and buffers, with their bytes, as keys unique
    # within the graph: a value saved by several nodes (a ReLU's output, which the next
    # Linear saves as its input) is one storage, which a stage holds once.
    out_storages: tuple[int, ...] = ()
    saved: tuple[tuple[int, int], ...] = ()
    # Whether a gradient flows back into its output (float and depending on parameters).
    out_grad: bool = False
    # Shape and dtype of its output for the sample batch, when the output is one tensor
    # (None otherwise: such a value cannot cross a cut).
    out_shape: tuple[int, ...] | None = None
    out_dtype: str | None = None
    # The dimension of that output that follows the batch size (None: none does).
    batch_dim: int | None = None
    # Profiled seconds of forward and of backward for the sample batch (0 unprofiled).
    forward_s: float = 0.0
    backward_s: float = 0.0
    # Profiled seconds of the optimizer's step over the parameters it owns (0 unprofiled,
    # profiled without an optimizer, or owning none). A stage's process steps its optimizer
    # inside the compute it is timed for, and for SGD with momentum over a 1024 x 1024
    # Linear that step took 0.9 ms against 3.1 ms for its forward and backward at batch 64
    # (one thread, this machine): left out, plans under-predict by a fifth or more.
    step_s: float = 0.0

    @property
    def computes(self) -> bool:
        return self.op in COMPUTE_OPS


@dataclass(frozen=True, eq=False)
class ModelGraph:
    """A traced model: its GraphModule (which holds the traced model's own parameters,
    not copies), its nodes in topological order (the output node left out) and the node
    whose value the model returns."""

    module: fx.GraphModule
    nodes: tuple[GraphNode, ...]
    output: str
    # Samples in the batch that out_bytes and the profiled times were measured on.
    batch: int
    profiled: bool = False
    # What the profiled node times were multiplied by (1 unprofiled): the median time of
    # a whole training step of the model over the sum of its nodes' isolated times
    # (_whole_step). A node timed alone, the fastest of a few back-to-back runs, runs
    # hotter than it does inside a step: on this machine deep-mlp's (--hidden 1024, batch
    # 64, one thread) summed to 0.82 to 0.87 of its step, and the stages' measured compute
    # was 1.20 to 1.25 times the uncalibrated prediction (docs/results/partition.md).
    calibration: float = 1.0
    by_name: dict[str, GraphNode] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {n.name: n for n in self.nodes})

    @property
    def compute(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.computes)


@dataclass(frozen=True)
class Transfer:
    """Value ``producer`` of stage ``src`` sent to stage ``dst``: one message of
    ``nbytes`` forward per step, and its gradient (same bytes) back when ``grad``.
    ``shape`` and ``dtype`` (torch's name, "float32") are the value's for the plan's
    batch, for the receiver's buffer."""

    producer: str
    src: int
    dst: int
    nbytes: int
    grad: bool
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    # The dimension of ``shape`` that follows the batch size (None: none does).
    batch_dim: int | None = 0

    def shape_for(self, batch: int) -> tuple[int, ...]:
        """The value's shape for a batch (or micro-batch) of ``batch`` samples."""
        if self.batch_dim is None:
            return self.shape
        return (*self.shape[:self.batch_dim], batch, *self.shape[self.batch_dim + 1:])


@dataclass(frozen=True)
class Holding:
    """What a stage's process holds at its peak beyond one step's parameters, gradients
    and optimizer state: a pipeline keeps ``held`` of a batch's ``microbatches``
    micro-batches between their forward and their backward (``Schedule.max_in_flight``),
    each with 1/``microbatches`` of the batch's activations, or, under ``recompute``, only
    their inputs, with one micro-batch's activations rebuilt for its backward; an
    asynchronous pipeline also keeps ``weight_copies`` copies of the stage's parameters
    (its stashed versions and the weights a prediction starts from, parallel/stash.py).
    The default is a stage without a pipeline: one batch, no copies."""

    held: int = 1
    microbatches: int = 1
    weight_copies: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.held < 1 or self.microbatches < 1 or self.weight_copies < 0:
            raise ValueError(f"held and microbatches must be >= 1 and weight_copies >= 0, got {self}")


@dataclass(frozen=True)
class Partition:
    index: int
    # Every node of the stage, topological order (placeholders and get_attr included).
    nodes: tuple[str, ...]
    # Its computing nodes, the ones the cut was chosen over.
    compute: tuple[str, ...]
    params: tuple[str, ...]
    param_bytes: int
    param_count: int
    # Predicted seconds per step: compute_s (0 unprofiled) plus its transfers, forward
    # and gradients back, at the plan's latency and bandwidth, with a value sent to
    # several stages priced once (_Costs.measure).
    time_s: float
    # Predicted bytes: params, grads, optimizer state, activations and received values,
    # as much of them as ``holding`` says the stage keeps at once (_Costs.memory).
    memory_bytes: int
    # Bytes per step received and sent forward (send-once; gradients go the other way).
    bytes_in: int
    bytes_out: int
    # The compute part of time_s, what a stage's process counts as its compute_seconds
    # per step: its nodes' profiled forward + backward + optimizer step, or, in a priced
    # plan (PartitionPlan.priced), the median seconds of the stage's own program run as a
    # training step runs it (executor.price_plan).
    compute_s: float = 0.0
    # The micro-batches and weight copies its memory_bytes counts, and the part of it that
    # is activations (what autograd saves for the backward), inputs and received values.
    holding: Holding = Holding()
    activation_bytes: int = 0


@dataclass(frozen=True)
class PartitionPlan:
    method: str
    batch: int
    partitions: tuple[Partition, ...]
    transfers: tuple[Transfer, ...]
    # Stage of every node, by name.
    assignment: dict[str, int]
    # The stage that holds the model's output (where the loss is computed).
    output_stage: int
    # Whether each partition's compute_s was measured on the stage programs of this very
    # cut (executor.price_plan) rather than summed from the node profile that chose it.
    priced: bool = False

    @property
    def stages(self) -> int:
        return len(self.partitions)

    def traffic(self) -> dict[tuple[int, int], tuple[int, int]]:
        """{(src, dst): (messages, bytes)} per step, both directions: a transfer is one
        message forward and, when it carries a gradient, one back (dst -> src)."""
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for t in self.transfers:
            for key, go in (((t.src, t.dst), True), ((t.dst, t.src), t.grad)):
                if go:
                    messages, nbytes = out.get(key, (0, 0))
                    out[key] = (messages + 1, nbytes + t.nbytes)
        return out


# --- tracing -----------------------------------------------------------------------------

class _ChildrenTracer(fx.Tracer):
    """Traces an nn.Sequential with its direct children as opaque leaves."""

    def __init__(self, root: nn.Sequential) -> None:
        super().__init__()
        self._children = {id(m) for m in root.children()}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self._children or super().is_leaf_module(m, qualname)


def _untraceable(model: nn.Module, exc: BaseException) -> ConfigError:
    """The innermost module call of ``model`` that the tracer failed in, named."""
    names = {id(m): q for q, m in model.named_modules()}
    where = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            where = (names[id(owner)], type(owner).__name__, frame.f_code.co_name, frame.f_code.co_filename, line)
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if where is None:
        call = f"model {type(model).__name__}"
    else:
        qual, kind, func, path, line = where
        code = linecache.getline(path, line).strip()
        call = f"{kind}.{func} of {qual or 'the model itself'} at {path.rsplit('/', 1)[-1]}:{line} `{code}`"
    return ConfigError(f"the model cannot be traced by torch.fx for --stages: {call} failed ({reason}); "
                       f"make that call traceable (no Python control flow on tensor values), build the model as "
                       f"an nn.Sequential of traceable children, or train with --stages 1")


def _symbolic(model: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError... from user code
        if not isinstance(model, nn.Sequential):
            raise _untraceable(model, exc) from None
    # Fall back to the children of an nn.Sequential, each one opaque node.
    tracer = _ChildrenTracer(model)
    return fx.GraphModule(model, tracer.trace(model), type(model).__name__)


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class _Recorder(fx.Interpreter):
    """Runs the graph once, recording each node's output bytes, the storages of its
    output and of what autograd saves in its forward (apart from the model's parameters
    and buffers), and whether a gradient reaches it; with ``repeats`` > 0 it also times
    each computing node's forward and backward alone, on detached copies of its inputs
    (the fastest of ``repeats``, after one untimed run). Every tensor it sees stays alive
    until the run ends, so no storage is freed and its address given to another."""

    def __init__(self, gm: fx.GraphModule, repeats: int) -> None:
        super().__init__(gm)
        self.repeats = repeats
        self.model_storages = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
        self.kept: list[torch.Tensor] = []
        self.out_storages: dict[str, tuple[int, ...]] = {}
        self.saved: dict[str, dict[int, int]] = {}
        self.out_bytes: dict[str, int] = {}
        self.out_grad: dict[str, bool] = {}
        self.out_meta: dict[str, tuple[tuple[int, ...], str]] = {}
        self.times: dict[str, tuple[float, float]] = {}

    def saving(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, recording the storages autograd saves in it as node ``name``'s."""
        saved = self.saved.setdefault(name, {})

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.model_storages:
                saved[storage.data_ptr()] = storage.nbytes()
                self.kept.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return fn()

    def run_node(self, n: fx.Node) -> Any:
        result = self.saving(n.name, lambda: super(_Recorder, self).run_node(n))
        outs = _tensors(result)
        self.kept.extend(outs)
        self.out_storages[n.name] = tuple(dict.fromkeys(t.untyped_storage().data_ptr() for t in outs))
        self.out_bytes[n.name] = _nbytes(result)
        self.out_grad[n.name] = any(t.requires_grad for t in _tensors(result))
        if isinstance(result, torch.Tensor):
            self.out_meta[n.name] = (tuple(result.shape), str(result.dtype).removeprefix("torch."))
        if self.repeats and n.op in COMPUTE_OPS:
            self.times[n.name] = self._time(n)
        return result

    def _time(self, n: fx.Node) -> tuple[float, float]:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        fwd = bwd = math.inf
        for attempt in range(self.repeats + 1):  # the first warms up (backward's first call allocates)
            # No .grad to add into: a stage zeroes its gradients to None every step, so its
            # backward writes each parameter's gradient afresh rather than accumulating.
            self.module.zero_grad(set_to_none=True)
            a, k = fx.node.map_aggregate((args, kwargs), _fresh_leaf)
            start = time.perf_counter()
            out = getattr(self, n.op)(n.target, a, k)
            middle = time.perf_counter()
            outs = [t for t in _tensors(out) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            end = time.perf_counter()
            if attempt:
                fwd, bwd = min(fwd, middle - start), min(bwd, end - middle)
        self.module.zero_grad(set_to_none=True)
        return fwd, (bwd if bwd < math.inf else 0.0)


def _fresh_leaf(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().requires_grad_(v.requires_grad)
    return v


def trace_model(model: nn.Module, sample: torch.Tensor, *, profile: bool = False, repeats: int = 3,
                optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ModelGraph:
    """Trace ``model`` with torch.fx and measure each node on ``sample`` (a batch).

    A model that fx cannot trace raises ConfigError naming the first call that failed,
    unless it is an nn.Sequential: then its direct children become opaque nodes.
    ``profile`` times each node's forward and backward (the ``time`` method needs it)
    and, given ``optimizer`` (a factory over a list of parameters, as each stage makes
    its own), one step of it over copies of the parameters each node owns; then it
    scales every node's times so that they sum to a whole training step of a copy of
    the model (``ModelGraph.calibration``). It leaves the model's parameters with
    ``.grad`` None and their values untouched. ``loss``: the criterion the stage holding
    the output applies to it, whose saved tensors (a cross-entropy's log-softmax and
    targets) that stage holds until its backward too: they count as the output node's.
    """
    gm = _symbolic(model)
    recorder = _Recorder(gm, repeats if profile else 0)
    # A second run on one more sample shows which dimension of each output follows the batch.
    bigger = _Recorder(gm, 0)
    # Measuring must leave no trace: buffers (batch-norm statistics) and the random
    # generator (dropout) are as they were, so a traced model trains as an untraced one.
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        out = recorder.run(sample)
        if loss is not None and isinstance(out, torch.Tensor):
            last = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
            if len(last) == 1:
                recorder.saving(last[0].name, lambda: loss(out))
        bigger.run(torch.cat([sample, sample[:1]]))
        whole = _whole_step(gm, sample, optimizer, repeats) if profile else 0.0
    with torch.no_grad():
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])
    gm.zero_grad(set_to_none=True)
    modules = dict(gm.named_modules())
    owned: set[int] = set()
    nodes: list[GraphNode] = []
    output = ""
    for n in gm.graph.nodes:
        if n.op == "output":
            outs = n.all_input_nodes
            if len(outs) != 1 or n.args[0] is not outs[0]:
                raise ConfigError(f"--stages needs a model that returns one tensor, but {type(model).__name__} "
                                  f"returns {n.args[0]!r}: return the logits only")
            output = outs[0].name
            continue
        named: list[tuple[str, torch.Tensor]] = []
        if n.op == "call_module":
            named = list(modules[n.target].named_parameters(prefix=n.target))
        elif n.op == "get_attr":
            value = gm.get_parameter(n.target) if _is_param(gm, n.target) else None
            named = [(n.target, value)] if value is not None else []
        mine = [(q, p) for q, p in named if id(p) not in owned]
        owned.update(id(p) for _, p in mine)
        fwd, bwd = recorder.times.get(n.name, (0.0, 0.0))
        step = _time_step(optimizer, [p for _, p in mine], repeats) if profile and optimizer and mine else 0.0
        shape, dtype = recorder.out_meta.get(n.name, (None, None))
        batch_dim = _batch_dim(shape, bigger.out_meta.get(n.name, (None, None))[0])
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        nodes.append(GraphNode(
            name=n.name, op=n.op, target=target, inputs=tuple(i.name for i in n.all_input_nodes),
            params=tuple(q for q, _ in mine), param_bytes=sum(p.numel() * p.element_size() for _, p in mine),
            param_count=sum(p.numel() for _, p in mine), out_bytes=recorder.out_bytes.get(n.name, 0),
            out_storages=recorder.out_storages.get(n.name, ()),
            saved=tuple(recorder.saved.get(n.name, {}).items()),
            out_grad=recorder.out_grad.get(n.name, False), out_shape=shape, out_dtype=dtype, batch_dim=batch_dim,
            forward_s=fwd, backward_s=bwd, step_s=step))
    scale = 1.0
    isolated = sum(n.forward_s + n.backward_s + n.step_s for n in nodes)
    if profile and whole > 0 and isolated > 0:
        scale = whole / isolated
        nodes = [dataclasses.replace(n, forward_s=n.forward_s * scale, backward_s=n.backward_s * scale,
                                     step_s=n.step_s * scale) for n in nodes]
    return ModelGraph(module=gm, nodes=tuple(nodes), output=output, batch=int(sample.shape[0]), profiled=profile,
                      calibration=scale)


def _whole_step(gm: fx.GraphModule, sample: torch.Tensor,
                optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, repeats: int) -> float:
    """Median seconds of a whole training step of a copy of the model on ``sample``
    (of ``repeats`` steps, at least 5, after two untimed ones): zero the gradients to
    None, forward, backward seeded with ones (as the nodes are timed), and a step of
    ``optimizer`` when given."""
    model = copy.deepcopy(gm)
    params = list(model.parameters())
    opt = optimizer(params) if optimizer is not None and params else None
    times = []
    for attempt in range(max(5, repeats) + 2):  # a step is long: a median of 5 or more is steady
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        outs = [t for t in _tensors(model(sample)) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        if opt is not None:
            opt.step()
        if attempt >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_step(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], params: list[nn.Parameter],
               repeats: int) -> float:
    """Seconds of one step of ``optimizer`` over copies of ``params`` with made-up
    gradients: the fastest of ``repeats`` after one untimed step, which creates the
    optimizer's state (momentum buffers, Adam's moments) as a run's first step does."""
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for c in copies:
        c.grad = torch.full_like(c, 1e-3)
    opt = optimizer(copies)
    best = math.inf
    for attempt in range(max(1, repeats) + 1):
        start = time.perf_counter()
        opt.step()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def _batch_dim(shape: tuple[int, ...] | None, bigger: tuple[int, ...] | None) -> int | None:
    """The one dimension that grew by one sample between the two runs; None when none did
    (a parameter, a batch-wide reduction) or the shapes are not comparable."""
    if shape is None or bigger is None or len(shape) != len(bigger):
        return None
    grew = [d for d, (a, b) in enumerate(zip(shape, bigger)) if a != b]
    return grew[0] if len(grew) == 1 and bigger[grew[0]] == shape[grew[0]] + 1 else None


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


# --- ranges and their costs ----------------------------------------------------------------

class _Range(NamedTuple):
    """A range's figures per step of the graph's batch: profiled seconds with its
    transfers', parameter bytes, bytes of what its nodes save for the backward (each
    storage once, and not the inputs or received values they save), of its inputs
    (placeholders), and of the values it receives and sends forward, each once."""

    seconds: float
    params: int
    activations: int
    inputs: int
    received: int
    sent: int


class _Costs:
    """Per-range figures over the computing nodes c_0..c_{n-1}; a non-computing node
    (placeholder, get_attr) counts at its first consumer's position."""

    def __init__(self, graph: ModelGraph, optimizer_slots: int, bandwidth: float, latency: float) -> None:
        self.graph, self.optimizer_slots = graph, optimizer_slots
        self.bandwidth, self.latency = bandwidth, latency
        self.compute = [n.name for n in graph.compute]
        self.pos = {name: i for i, name in enumerate(self.compute)}
        self.users: dict[str, list[str]] = {n.name: [] for n in graph.nodes}
        for n in graph.nodes:
            for i in n.inputs:
                self.users[i].append(n.name)
        for n in reversed(graph.nodes):  # reversed: a node's users are placed first
            if not n.computes:
                self.pos[n.name] = min((self.pos[u] for u in self.users[n.name] if u in self.pos), default=0)
        self.at: list[list[GraphNode]] = [[] for _ in self.compute]
        for n in graph.nodes:  # graph order: a position's placeholders before its computing node
            if self.compute:
                self.at[self.pos[n.name]].append(n)

    def sweep(self, lo: int) -> Iterator[_Range]:
        """The figures of [lo, hi) for hi = lo + 1, ..., n in turn, each in time linear in
        the nodes it adds: every range of every lo in O(n^2 + edges) all told."""
        compute_s, params, activations, inputs = 0.0, 0, 0, 0
        inside: set[str] = set()
        received: set[str] = set()  # once each, however many nodes inside read it
        held: set[int] = set()  # storages counted: the inputs', the received values', the saved
        waiting: dict[str, int] = {}  # inside, with users at or after hi: sent
        # [messages, bytes] of values received and of values sent, each once, forward and
        # back (a value with a gradient crosses twice).
        recv, sent = [0, 0, 0], [0, 0, 0]  # count, forward bytes, bytes with gradients

        def cross(tally: list[int], node: GraphNode, sign: int) -> None:
            tally[0] += sign * (1 + node.out_grad)
            tally[1] += sign * node.out_bytes
            tally[2] += sign * node.out_bytes * (1 + node.out_grad)

        for hi in range(lo + 1, len(self.compute) + 1):
            for node in self.at[hi - 1]:
                inside.add(node.name)
                compute_s += node.forward_s + node.backward_s + node.step_s
                params += node.param_bytes
                if node.op == "placeholder":
                    inputs += node.out_bytes
                    held.update(node.out_storages)
                for i in node.inputs:
                    if i in received:
                        continue
                    if i not in inside:
                        received.add(i)
                        held.update(self.graph.by_name[i].out_storages)
                        cross(recv, self.graph.by_name[i], 1)
                    else:
                        waiting[i] -= 1
                        if not waiting[i]:
                            del waiting[i]
                            cross(sent, self.graph.by_name[i], -1)
                for storage, nbytes in node.saved:  # after its inputs: a saved input counts as one
                    if storage not in held:
                        held.add(storage)
                        activations += nbytes
                if self.users[node.name]:
                    waiting[node.name] = len(self.users[node.name])
                    cross(sent, node, 1)
            comm = (recv[0] + sent[0]) * self.latency + (recv[2] + sent[2]) / self.bandwidth
            yield _Range(compute_s + comm, params, activations, inputs, recv[1], sent[1])

    def memory(self, r: _Range, holding: Holding = Holding()) -> int:
        """The bytes a stage holding ``r`` needs at once: its parameters, their gradients,
        ``optimizer_slots`` copies of optimizer state and ``holding.weight_copies`` more
        copies, and the activations (what autograd saves), inputs and received values of
        the share of a batch's micro-batches it holds (only inputs and received values
        under recompute, plus one micro-batch's activations)."""
        return (2 + self.optimizer_slots + holding.weight_copies) * r.params + self.held(r, holding)

    def held(self, r: _Range, holding: Holding = Holding()) -> int:
        """The bytes of activations, inputs and received values in ``memory``."""
        share = holding.held / holding.microbatches
        if holding.recompute:
            return math.ceil(share * (r.inputs + r.received) + r.activations / holding.microbatches)
        return math.ceil(share * (r.activations + r.inputs + r.received))

    def range(self, lo: int, hi: int) -> _Range:
        """The figures of [lo, hi)."""
        for i, r in enumerate(self.sweep(lo), lo + 1):
            if i == hi:
                return r
        raise IndexError(f"range [{lo}, {hi}) is outside the {len(self.compute)} computing nodes")

    def measure(self, lo: int, hi: int, holding: Holding = Holding()) -> tuple[float, int, int, int, int]:
        """(seconds, memory bytes, parameter bytes, bytes in, bytes out) of the range
        [lo, hi) under ``holding``: profiled compute plus each crossing value forward and,
        when it has one, its gradient back. A value sent to several later stages is priced
        once here, since the range alone does not say how many stages those are: a lower
        bound on the sender's cost that keeps the dynamic programme exact for this model.
        The plan's transfers and bytes_out count each receiving stage."""
        r = self.range(lo, hi)
        return r.seconds, self.memory(r, holding), r.params, r.received, r.sent


def _min_max_cuts(n: int, k: int, cost: Sequence[list[list[float]]]) -> list[int] | None:
    """Boundaries 0 = b_0 < ... < b_k = n minimising the largest cost[s][lo][hi] of the k
    ranges, s the range's index (math.inf: not allowed); None when no cut is allowed.
    Exact, O(k n^2)."""
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    back = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for hi in range(s, n - (k - s) + 1):
            for lo in range(s - 1, hi):
                value = max(best[s - 1][lo], cost[s - 1][lo][hi])
                if value < best[s][hi]:
                    best[s][hi], back[s][hi] = value, lo
    if best[k][n] == math.inf:
        return None
    cuts = [n]
    for s in range(k, 0, -1):
        cuts.append(back[s][cuts[-1]])
    return cuts[::-1]


def _split_index(graph: ModelGraph, point: str, compute: list[str]) -> int:
    """The computing node a split point names: an fx node name, a module's qualified name,
    or a container module's (its first node)."""
    for i, name in enumerate(compute):
        node = graph.by_name[name]
        if name == point or (node.op == "call_module" and node.target == point):
            return i
    for i, name in enumerate(compute):
        node = graph.by_name[name]
        if node.op == "call_module" and node.target.startswith(point + "."):
            return i
    shown = ", ".join(compute[:8]) + (", ..." if len(compute) > 8 else "")
    raise ConfigError(f"split point {point!r} is neither an fx node nor a module of the model: name one of its "
                      f"nodes ({shown}) or a module's qualified name; --print-partition lists them")


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def plan_partitions(graph: ModelGraph, stages: int, method: Method = "params", *,
                    split_points: Sequence[str] = (), memory_cap: int | None = None, optimizer_slots: int = 1,
                    bandwidth: float | None = None, latency: float = 0.0, chunks: int = 1,
                    holdings: Callable[[int], Sequence[Holding] | None] | None = None) -> PartitionPlan:
    """Cut ``graph`` into ``stages`` contiguous ranges of its topological order.

    uniform: equal numbers of computing nodes. params: the largest stage's parameter
    bytes as small as possible. time: the largest stage's forward + backward seconds
    plus its transfers' seconds (``latency`` per message, ``bandwidth`` bytes/s, forward
    and back) as small as possible; needs a profiled graph. manual: each split point
    starts a new stage, so ``stages`` must be len(split_points) + 1. params and time
    are exact min-max dynamic programmes over every contiguous cut and respect
    ``memory_cap`` (bytes per stage: parameters, gradients, ``optimizer_slots`` copies
    of optimizer state, activations and received values); uniform and manual are
    refused when a stage exceeds it. Bad input raises ConfigError.

    ``holdings(r)``: what each of r ranges keeps at once under a pipeline (``Holding``;
    None where the pipeline cannot run r ranges), since stage k of 1f1b holds K - k
    micro-batches and a pipedream stage copies of its weights; each range's memory, and
    the cap, count that. By default each range holds one batch and no copies.

    ``chunks`` v > 1 (--schedule interleaved): the ``stages`` ranges are model chunks,
    and process s of the ``stages / v`` holds chunks s, K + s, 2K + s, ..., which must
    fit ``memory_cap`` together. Where the cut chosen under the cap per chunk puts more
    on a process, params and time cut again under cap / v per chunk, which always fits.
    """
    if method not in METHODS:
        raise ConfigError(f"partition must be one of {', '.join(METHODS)}, got {method!r}: pass --partition params")
    if chunks < 1 or stages % chunks:
        raise ValueError(f"chunks {chunks} must divide stages {stages}")
    costs = _Costs(graph, optimizer_slots, bandwidth or DEFAULT_BANDWIDTH, latency)
    n = len(costs.compute)
    if stages < 1 or stages > n:
        raise ConfigError(f"stages must lie in [1, {n}] for this model, which has {n} computing nodes, got "
                          f"{stages}: pass --stages {max(1, min(stages, n))} or fewer")
    cap = memory_cap if memory_cap is not None else math.inf
    hold = holdings if holdings is not None else (lambda ranges: [Holding()] * ranges)
    per_range = hold(stages)
    if per_range is None or len(per_range) != stages:
        raise ValueError(f"holdings must give each of the {stages} ranges its Holding, got {per_range}")
    ranges = _Ranges(costs)
    cuts = _cut(graph, ranges, stages, method, split_points, cap, per_range, hold, chunks)
    if chunks > 1 and cap < math.inf:
        process, held = _fullest_process(costs, cuts, stages // chunks, per_range)
        if held > cap and method in ("params", "time"):
            found = _min_max_cuts(n, stages, ranges.tables(method, cap / chunks, per_range))
            if found is not None:  # else no cut fits a v-th of the cap per chunk: the first's excess is the message
                cuts = found
                process, held = _fullest_process(costs, cuts, stages // chunks, per_range)
        if held > cap:
            mine = list(range(process, stages, stages // chunks))
            needed = ranges.fewest(cap, hold, chunks, stages)
            fix = f"--stages {needed // chunks} or a larger --stage-memory" if needed else "a larger --stage-memory"
            raise ConfigError(f"process {process} would hold model chunks {', '.join(map(str, mine))} of "
                              f"--schedule interleaved, {format_bytes(held)} together, more than --stage-memory "
                              f"{format_bytes(cap)}: pass {fix}")
    return _make_plan(graph, costs, method, cuts, cap, per_range)


def _fullest_process(costs: _Costs, cuts: list[int], processes: int,
                     per_range: Sequence[Holding]) -> tuple[int, int]:
    """(process, bytes) of the process whose chunks (s, K + s, ... of ``cuts``' ranges,
    K = ``processes``) need the most memory together."""
    held = [0] * processes
    for s in range(len(cuts) - 1):
        held[s % processes] += costs.measure(cuts[s], cuts[s + 1], per_range[s])[1]
    return max(enumerate(held), key=lambda pair: pair[1])


def _cut(graph: ModelGraph, ranges: _Ranges, stages: int, method: str, split_points: Sequence[str],
         cap: float, per_range: Sequence[Holding], hold: Callable[[int], Sequence[Holding] | None],
         chunks: int = 1) -> list[int]:
    """The positions in ``ranges.costs.compute`` where each of ``stages`` ranges begins, and its end."""
    compute = ranges.costs.compute
    n = len(compute)
    if method == "manual":
        if len(split_points) + 1 != stages:
            raise ConfigError(f"--partition manual makes one stage more than split points: {len(split_points)} "
                              f"split points give {len(split_points) + 1} stages, but stages is {stages}: pass "
                              f"--stages {len(split_points) + 1}")
        cuts_at = [_split_index(graph, p, compute) for p in split_points]
        for p, i in zip(split_points, cuts_at):
            if i == 0:
                raise ConfigError(f"split point {p!r} is the model's first node, so stage 0 would be empty: "
                                  f"name a later node")
        if len(set(cuts_at)) != len(cuts_at):
            raise ConfigError(f"split points {', '.join(split_points)} name the same node twice: each split "
                              f"point must start a different stage")
        cuts = [0, *sorted(cuts_at), n]
    elif method == "uniform":
        cuts = [round(s * n / stages) for s in range(stages + 1)]
    else:
        if method == "time" and not graph.profiled:
            raise ValueError("the time method needs a graph traced with profile=True")
        found = _min_max_cuts(n, stages, ranges.tables(method, cap, per_range))
        if found is None:
            raise _no_legal_cut(ranges, graph, stages, cap, per_range, hold, chunks)
        cuts = found
    return cuts


def _no_legal_cut(ranges: _Ranges, graph: ModelGraph, stages: int, cap: float, per_range: Sequence[Holding],
                  hold: Callable[[int], Sequence[Holding] | None], chunks: int = 1) -> ConfigError:
    costs = ranges.costs
    copies = 2 + costs.optimizer_slots + min(h.weight_copies for h in per_range)
    for name in costs.compute:  # every range that holds a node holds its parameters
        node = graph.by_name[name]
        if copies * node.param_bytes > cap:
            return ConfigError(f"node {name} ({node.target}) alone needs {format_bytes(copies * node.param_bytes)} "
                               f"for its parameters, their gradients and optimizer state, more than --stage-memory "
                               f"{format_bytes(cap)}, so no cut is legal: raise --stage-memory to more than that")
    least = ranges.least_cap(per_range)
    needed = ranges.fewest(cap, hold, chunks, stages)
    if chunks > 1:
        what = (f"{stages} model chunks (--stages {stages // chunks} x --chunks {chunks}) cannot hold the model under "
                f"--stage-memory {format_bytes(cap)}")
        fit = f"{needed} can: pass --stages {needed // chunks} or" if needed else "pass"
        return ConfigError(f"{what}; {fit} a larger --stage-memory (one of these chunks alone needs "
                           f"{format_bytes(least)}, and a process's chunks count together)")
    what = f"{stages} stage{'s' if stages > 1 else ''} cannot hold the model under --stage-memory {format_bytes(cap)}"
    if needed is None:
        most = min(len(costs.compute), MOST_STAGES_SEARCHED)
        return ConfigError(f"{what}, nor does any number of stages up to {most}, with what each stage holds at "
                           f"once: pass --stage-memory {format_bytes(least)} or more")
    fewest = "it needs at least" if needed > stages else "it fits in"
    return ConfigError(f"{what}: {fewest} {needed}; pass --stages {needed}, or --stage-memory {format_bytes(least)} "
                       f"for {stages}")


# Stage counts a refusal's search for one that fits tries (each an exact min-max cut).
MOST_STAGES_SEARCHED = 32


class _Ranges:
    """Every range's figures, swept once on first use, and tables of them by holding and
    cap for the min-max searches: the plan's cut, and a refusal's advice."""

    def __init__(self, costs: _Costs) -> None:
        self.costs, self.n = costs, len(costs.compute)
        self._figures: dict[tuple[int, int], _Range] | None = None
        self._tables: dict[tuple[str, Holding, float], list[list[float]]] = {}

    def table(self, value: str, h: Holding, cap: float) -> list[list[float]]:
        """[lo][hi]: the range's parameter bytes, seconds or memory under ``h``
        (``value``: params, time or memory), math.inf where under ``h`` it needs more
        than ``cap``."""
        if cap == math.inf and value != "memory":
            h = Holding()  # every range is legal, whatever it holds: one table for all
        key = (value, h, cap)
        if key not in self._tables:
            if self._figures is None:
                self._figures = {(lo, hi): r for lo in range(self.n)
                                 for hi, r in enumerate(self.costs.sweep(lo), lo + 1)}
            table = [[math.inf] * (self.n + 1) for _ in range(self.n + 1)]
            for (lo, hi), r in self._figures.items():
                memory = self.costs.memory(r, h)
                if memory <= cap:
                    table[lo][hi] = float(r.params if value == "params" else r.seconds if value == "time" else memory)
            self._tables[key] = table
        return self._tables[key]

    def tables(self, value: str, cap: float, per_range: Sequence[Holding]) -> list[list[list[float]]]:
        """``table`` for each range of a plan, by its holding."""
        return [self.table(value, h, cap) for h in per_range]

    def least_cap(self, per_range: Sequence[Holding]) -> int:
        """The smallest cap under which some cut into len(per_range) ranges fits: the
        fullest range of the cut that minimises it."""
        tables = self.tables("memory", math.inf, per_range)
        cuts = _min_max_cuts(self.n, len(per_range), tables)
        return int(max(tables[s][cuts[s]][cuts[s + 1]] for s in range(len(per_range))))

    def fits(self, cap: float, per_range: Sequence[Holding] | None, chunks: int = 1) -> bool:
        """Whether ranges holding ``per_range`` in turn can cover the model under ``cap``;
        with ``chunks`` v > 1, by a params cut (under the cap per chunk, or a v-th of it)
        that also keeps each process's v chunks under it together, as plan_partitions cuts."""
        if per_range is None or len(per_range) > self.n:
            return False
        for each in ((cap,) if chunks == 1 else (cap, cap / chunks)):
            cuts = _min_max_cuts(self.n, len(per_range), self.tables("params", each, per_range))
            if cuts is not None and (chunks == 1 or _fullest_process(
                    self.costs, cuts, len(per_range) // chunks, per_range)[1] <= cap):
                return True
        return False

    def fewest(self, cap: float, hold: Callable[[int], Sequence[Holding] | None], chunks: int,
               stages: int) -> int | None:
        """The fewest ranges other than ``stages`` (of up to MOST_STAGES_SEARCHED
        processes) that hold the model under ``cap``; None if none does. Under a pipeline
        what a stage holds changes with the number of stages (stage 0 of 1f1b holds K
        micro-batches, and more stages can need more), so each count is tried."""
        counts = range(chunks, min(self.n, MOST_STAGES_SEARCHED * chunks) + 1, chunks)
        return next((r for r in counts if r != stages and self.fits(cap, hold(r), chunks)), None)


def _make_plan(graph: ModelGraph, costs: _Costs, method: str, cuts: list[int], cap: float,
               per_range: Sequence[Holding]) -> PartitionPlan:
    pos, compute = costs.pos, costs.compute
    stage_of_pos = {i: s for s in range(len(cuts) - 1) for i in range(cuts[s], cuts[s + 1])}
    assignment = {n.name: stage_of_pos[pos[n.name]] for n in graph.nodes}
    transfers: list[Transfer] = []
    for n in graph.nodes:
        src = assignment[n.name]
        for dst in sorted({assignment[u] for u in costs.users[n.name]} - {src}):
            if n.out_shape is None or n.out_dtype is None:
                raise ConfigError(f"value {n.name} ({n.target}) would cross from stage {src} to stage {dst}, but it "
                                  f"is not one tensor: move the split points so that it and its readers share a "
                                  f"stage")
            transfers.append(Transfer(producer=n.name, src=src, dst=dst, nbytes=n.out_bytes, grad=n.out_grad,
                                      shape=n.out_shape, dtype=n.out_dtype, batch_dim=n.batch_dim))
    partitions = []
    for s in range(len(cuts) - 1):
        r = costs.range(cuts[s], cuts[s + 1])
        seconds, memory = r.seconds, costs.memory(r, per_range[s])
        if memory > cap:
            raise ConfigError(f"stage {s} of the {method} plan needs {format_bytes(memory)}, more than "
                              f"--stage-memory {format_bytes(cap)}: pass --partition params or time, which keep "
                              f"under the cap, or move the split points")
        nodes = tuple(n.name for n in graph.nodes if assignment[n.name] == s)
        infos = [graph.by_name[x] for x in nodes]
        partitions.append(Partition(
            index=s, nodes=nodes, compute=tuple(compute[cuts[s]:cuts[s + 1]]),
            params=tuple(q for i in infos for q in i.params), param_bytes=sum(i.param_bytes for i in infos),
            param_count=sum(i.param_count for i in infos), time_s=seconds, memory_bytes=memory,
            bytes_in=sum(t.nbytes for t in transfers if t.dst == s),
            bytes_out=sum(t.nbytes for t in transfers if t.src == s),
            compute_s=sum(i.forward_s + i.backward_s + i.step_s for i in infos), holding=per_range[s],
            activation_bytes=costs.held(r, per_range[s])))
    _check_shared_weights(graph, assignment)
    return PartitionPlan(method=method, batch=graph.batch, partitions=tuple(partitions), transfers=tuple(transfers),
                         assignment=assignment, output_stage=assignment[graph.output])


def _check_shared_weights(graph: ModelGraph, assignment: dict[str, int]) -> None:
    """A module, or a parameter (tied weights), used from two stages would be trained as
    two copies in two processes: refused. A get_attr value read in another stage is
    sent like any value (its gradient comes back), so only modules are checked."""
    modules = dict(graph.module.named_modules())
    where: dict[int, tuple[str, int]] = {}
    for n in graph.nodes:
        if n.op != "call_module":
            continue
        stage = assignment[n.name]
        for key, p in [(n.target, modules[n.target]), *modules[n.target].named_parameters(prefix=n.target)]:
            first, s = where.setdefault(id(p), (key, stage))
            if s != stage:
                what = f"module {key}" if key == first else f"parameter {key} (tied to {first})"
                raise ConfigError(f"{what} is used in stages {s} and {stage}; its weights must live in one stage: "
                                  f"move the split points so that every use of it falls in one stage")


def format_plan(plan: PartitionPlan, graph: ModelGraph) -> str:
    """The plan as a table: each stage's nodes, parameters, predicted time and memory
    (with, under a pipeline, what it holds at once), and the bytes it receives and sends
    forward per step (send-once)."""
    piped = any(p.holding != Holding() for p in plan.partitions)
    rows = [("stage", "nodes", "params", "pred ms", "memory", *(("holds",) if piped else ()), "in/step", "out/step")]
    for p in plan.partitions:
        span = p.compute[0] if len(p.compute) == 1 else f"{p.compute[0]}..{p.compute[-1]}"
        h = p.holding
        holds = (f"{h.held} of {h.microbatches} mb" if h.microbatches > 1 else f"{h.held} batch{'es' * (h.held > 1)}")
        holds += f" + {h.weight_copies} w" if h.weight_copies else ""
        rows.append((str(p.index), f"{span} ({len(p.compute)})", f"{p.param_count:,}",
                     f"{p.time_s * 1e3:.3f}" if graph.profiled else "-", format_bytes(p.memory_bytes),
                     *((holds,) if piped else ()), format_bytes(p.bytes_in), format_bytes(p.bytes_out)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    cuts = ", ".join(f"{t.producer} {t.src}->{t.dst} {format_bytes(t.nbytes)}" for t in plan.transfers) or "none"
    lines.append(f"transfers (each value once per receiving stage, per step of batch {plan.batch}): {cuts}")
    if piped:
        lines.append("holds: the micro-batches (mb) or batches whose activations a stage keeps at once, and the "
                     "copies of its weights an asynchronous pipeline keeps (w); memory counts them")
    return "\n".join(lines)
