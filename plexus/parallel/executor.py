"""The partitioned executor: how ONE replica computes a step with its model cut into K
stages, one process each (ARCHITECTURE.md section 9: an executor, apart from the
synchroniser that makes replicas agree).

``plexus train --stages K`` starts K processes of role ``stage`` per replica, each running
``train/stage_runner.py``. Each builds the model from the seed exactly as a one-process
run does, traces it on the same sample and makes the same plan (``shared_plan``), keeps
its own ``StageProgram`` and, in a ``StageExecutor``, its links. The executor gives the
synchroniser a loss function (``StageExecutor.loss_fn``) that is the stage's part of the
replica's step, so any strategy trains a stage's parameters as it trains a whole model's:

- forward as dataflow: a stage posts a receive for every transfer into it at once (on
  the links to each producer, in any order of arrival), waits for them, runs, and sends
  each value it produces once per consuming stage (``Transfer``);
- backward in reverse, from the strategy's ``loss.backward()``: the gradients of what the
  stage sent come back over the same links (``_Exchange``), autograd runs the stage's
  backward, and the gradients of what it received go back. Then the strategy
  synchronises and steps. With one replica (allreduce over a group of one, the
  default), K stages train exactly as one process with the same global batch (contract
  1), up to float rounding.

Under --partition time stage 0 profiles the nodes, cuts by that profile and then prices
the chosen cut by running its stage programs in one process as a step runs them
(``price_plan``: each stage's zero_grad and forward in dataflow order, then from the
output stage back each one's backward and optimizer step, medians of 40 steps), so each
stage is timed with the whole model's memory touched between its steps, as in the run.
Those seconds are the prediction the summary sets beside each stage's compute_seconds.

One link per pair of stages joined by a cut edge, so each link's counters are one edge's
traffic in each direction: the summary sets them beside ``PartitionPlan.traffic()`` for
the run's steps (``traffic_matches_plan``). Snapshots of the model for evaluation travel
to the output stage on links of their own (``gather_state``), counted apart.

Replicas (``--stages K --workers R``; ``--replicas`` is another name for ``--workers``)
are synchronised stage by stage: ``train/stage_groups.py``.

Pipelines (--microbatches M, --schedule): a synchronous schedule (gpipe, 1f1b,
interleaved, zb-h1) runs a step's M micro-batches in its order and leaves the whole
batch's gradient for the synchroniser (``_pipelined_loss``); under interleaved the plan
has K x v partitions, virtual stage u running on process u mod K as one of its model
chunks (``stages.join_chunks``), and every link, tag and count is between processes; pipedream and pipedream-2bw are asynchronous
(``_asynchronous_loss``): the op list covers the whole run, each synchroniser step runs
the ops up to the next optimizer step (pipedream: one input's backward; 2bw: a batch's M
micro-batches' last), inputs stay in flight across steps, and each forward and its
backward use one stashed weight version (``stash.WeightStash``).

Not yet: checkpoints, --kill and --slow of a stage.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.func import functional_call

from plexus.cluster.group import Endpoint, Link, Work
from plexus.cluster.rendezvous import store_barrier, store_get_json, store_set_json, wait_keys
from plexus.cluster.traffic import Traffic
from plexus.config import ASYNCHRONOUS_SCHEDULES, JobConfig
from plexus.errors import ConfigError
from plexus.parallel.partition import Holding, ModelGraph, PartitionPlan, Transfer, plan_partitions, trace_model
from plexus.parallel.schedules import Op, compensated_delay, make_schedule, replay, simulate
from plexus.parallel.stages import StageProgram, StageStep, build_stages, join_chunks, merge_state_dicts
from plexus.parallel.split_backward import SplitBackward, Template
from plexus.parallel.stash import WeightStash, delay_lr_scale
from plexus.parallel.tensor import TensorPlan, merge_tensor_states, predict_traffic
from plexus.train.evaluation import logits_loss

__all__ = ["StageExecutor", "gather_state", "stage_examples", "make_plan", "peak_bytes", "price_plan", "shared_plan",
           "stage_holdings", "stage_name", "stage_summary"]

logger = logging.getLogger(__name__)

# Tags on an edge's link: the forward value of the plan's transfer i is 2i, its gradient
# 2i + 1. Snapshot links carry state_dict entry i with tag GATHER_TAG + i.
GATHER_TAG = 1 << 20


def make_plan(cfg: JobConfig, model: torch.nn.Module, sample: torch.Tensor,
              split_points: tuple[str, ...] | None = None,
              optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
              check_only: bool = False) -> tuple[ModelGraph, PartitionPlan]:
    """The traced graph and the configured plan; with ``split_points``, the plan cut at
    those nodes instead (manual), which is how the stages share one profiled plan. A
    profile (--partition time) also times a step of ``optimizer`` when given, since each
    stage's compute includes its optimizer's step, and the cut it chooses is then priced
    by running its stage programs (``price_plan``): the plan's ``compute_s`` and
    ``time_s`` are those measured figures. ``check_only`` (the launcher's check of bad
    input) profiles nothing: time is planned as params, whose legal cuts under the
    memory cap are the same (both search every cut under it)."""
    method = cfg.parallel.partition if split_points is None else "manual"
    if check_only and method == "time":
        method = "params"
    # The output stage's loss: its saved log-softmax and targets (class indices) count too.
    graph = trace_model(model, sample, profile=method == "time", optimizer=optimizer,
                        loss=lambda out: logits_loss(out, torch.zeros(out.shape[:-1], dtype=torch.long,
                                                                      device=out.device)))
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ConfigError(f"--stages {cfg.parallel.stages} runs models that take one input (a batch), and "
                          f"{cfg.model.model} takes {len(inputs)} ({', '.join(inputs)}): pass --stages 1")
    optim = cfg.optim
    slots = {"adam": 2, "adagrad": 1}.get(optim.optimizer, 1 if optim.momentum > 0 else 0)
    points = cfg.parallel.split_point_names if split_points is None else split_points
    # --schedule interleaved: K x v partitions, process s running virtual stages s, K + s, ...
    plan = plan_partitions(graph, cfg.parallel.stages * cfg.parallel.chunks, method, split_points=points,
                           memory_cap=cfg.parallel.stage_memory_bytes, optimizer_slots=slots,
                           bandwidth=cfg.cluster.net.bandwidth, latency=cfg.cluster.net.latency,
                           chunks=cfg.parallel.chunks, holdings=stage_holdings(cfg))
    if cfg.parallel.chunks > 1:  # a cut interleaved cannot run (a value between one process's chunks) is
        join_chunks(build_stages(graph, plan, share=True), cfg.parallel.stages)  # refused before processes start
    if method == "time":
        plan = price_plan(graph, plan, sample, optimizer, microbatches=cfg.parallel.microbatches)
    return graph, plan


def stage_holdings(cfg: JobConfig) -> Callable[[int], list[Holding] | None] | None:
    """What each of a pipeline's model chunks keeps at once (``Holding``), for plans of
    any number of them (the plan's memory, which --stage-memory caps): the micro-batches
    the schedule holds on its process (of that chunk, under interleaved), and under an
    asynchronous schedule the copies of its weights ``WeightStash`` makes, one per weight
    version it keeps and one for the weights a prediction starts from. None: no pipeline,
    one batch a step."""
    par = cfg.parallel
    asynchronous = par.schedule in ASYNCHRONOUS_SCHEDULES
    if par.microbatches == 1 and cfg.source("schedule") == "default" and not asynchronous:
        return None

    def holdings(ranges: int) -> list[Holding] | None:
        stages, odd = divmod(ranges, par.chunks)
        if odd or stages < 2:  # a pipeline has two stages or more (config.ParallelConfig), v chunks each
            return None
        try:  # an asynchronous schedule's lists long enough for its steady state
            schedule = make_schedule(par.schedule, stages, par.microbatches, chunks=par.chunks,
                                     vertical_sync=par.vertical_sync,
                                     minibatches=2 * stages + 1 if asynchronous else None)
        except ConfigError:  # not a number of stages the schedule runs
            return None
        out = []
        for r in range(ranges):
            chunk, stage = divmod(r, stages)
            copies = 0
            if asynchronous:  # a stage that predicts (compensation, a delay) keeps the prediction's base too
                copies = schedule.max_versions(stage) + (par.delay_compensation and schedule.delay(stage) > 0)
            out.append(Holding(held=schedule.max_in_flight(stage, chunk if par.chunks > 1 else None),
                               microbatches=par.microbatches, weight_copies=copies, recompute=par.recompute))
        return out
    return holdings


# Steps price_plan times (after PRICE_WARMUP untimed ones): deep-mlp --hidden 1024 at
# batch 64 takes about 30 ms a step on one thread, so pricing adds about 1.4 s to the
# profile (2.7 s in all). The slowest stage's price moved by under 1 % between two
# back-to-back pricings, by up to 17 % between runs minutes apart (docs/results/partition.md).
PRICE_STEPS = 40
PRICE_WARMUP = 3


def price_plan(graph: ModelGraph, plan: PartitionPlan, sample: torch.Tensor,
               optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None, *,
               steps: int = PRICE_STEPS, clock: Callable[[], float] = time.perf_counter,
               microbatches: int = 1) -> PartitionPlan:
    """``plan`` with each stage's compute seconds measured on its own stage program.

    The node profile that chose the cut times each node alone, back to back, with its
    weights hot in cache; inside a training step a stage's weights, gradients and
    optimizer state were last touched a whole step earlier, after the rest of the model,
    and the memory-bound optimizer step suffers most (the stages measured 1.04 to 1.25
    times the calibrated node profile, docs/results/partition.md). So this runs the
    plan's stage programs (copies of ``graph``'s module) in this process as a step of K
    stage processes runs them: each stage zeroes its gradients to None and runs its
    forward, in dataflow order; then, from the output stage back, each runs its backward
    (the output seeded as the gradient of its mean, the loss's cost left out) and at once
    its optimizer's step, as each stage process steps as soon as its backward ends. A
    stage's price is the median over ``steps`` steps of the seconds of those phases, read
    on ``clock`` (the steps before them warm up and create the optimizer's state); its
    transfers keep the plan's price. With ``microbatches`` M > 1 (a pipeline), a step is
    M forwards and backwards of 1/M of ``sample`` each, then one optimizer step, as a
    pipelined step computes: a stage of small micro-batches costs more than one pass of
    the whole batch (about twice, deep-mlp --hidden 512 at 16 rows on one core). The cut,
    the memory and the traffic are ``plan``'s, and ``graph``'s model and the random
    generator are left as they were.
    """
    programs = build_stages(graph, plan)  # stage k receives only from stages before it
    runs = [StageStep(program) for program in programs]
    optimizers = [optimizer(params) if optimizer is not None and (params := list(program.module.parameters()))
                  else None for program in programs]
    seconds: list[list[float]] = [[] for _ in programs]
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        for step in range(PRICE_WARMUP + steps):
            spent = [0.0] * len(programs)
            for program in programs:
                start = clock()
                program.module.zero_grad(set_to_none=True)
                spent[program.index] += clock() - start
            parts = sample.split(-(-len(sample) // microbatches))
            for m, part in enumerate(parts):
                inbox: list[dict[str, torch.Tensor]] = [{} for _ in programs]
                back: list[list[tuple[str, torch.Tensor]]] = [[] for _ in programs]
                loss = None
                for program, run in zip(programs, runs):
                    start = clock()
                    values = run.forward(inbox[program.index], {name: part for name in program.model_inputs})
                    if program.output is not None:
                        loss = values[program.output].mean()
                    spent[program.index] += clock() - start
                    for t in program.sends:
                        inbox[t.dst][t.producer] = values[t.producer].detach()
                for program, run, opt in reversed(list(zip(programs, runs, optimizers))):
                    start = clock()
                    grads = run.backward(back[program.index], loss if program.output is not None else None)
                    if opt is not None and m == len(parts) - 1:  # after the stage's last backward
                        opt.step()
                    spent[program.index] += clock() - start
                    for t in program.receives:
                        if t.grad:
                            back[t.src].append((t.producer, grads[t.producer]))
            if step >= PRICE_WARMUP:
                for k, s in enumerate(spent):
                    seconds[k].append(s)
    priced = [statistics.median(s) for s in seconds]
    partitions = tuple(dataclasses.replace(p, compute_s=c, time_s=c + (p.time_s - p.compute_s))
                       for p, c in zip(plan.partitions, priced))
    return dataclasses.replace(plan, partitions=partitions, priced=True)


# Where stage 0 leaves the cut of a profiled plan (--partition time) for the others, and
# its predicted seconds per step for every stage, [[compute, compute + transfers], ...].
SPLIT_KEY = "stages/split_points"
PREDICTED_KEY = "stages/predicted"


def shared_plan(cfg: JobConfig, k: int, store, model: torch.nn.Module, sample: torch.Tensor,
                optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
                ) -> tuple[ModelGraph, PartitionPlan, list[list[float]] | None]:
    """The plan every stage runs, and (time only) the profiled plan's predicted seconds
    per step of each stage's process, [compute, compute + transfers]. uniform, params and manual
    are deterministic, so each stage makes its own. time depends on seconds measured in
    one process: stage 0 profiles and plans, prices the chosen cut on its stage programs
    (``price_plan``: those seconds are the prediction published), and publishes the
    first node of each stage after the first; every stage, stage 0 too, then cuts its
    unprofiled trace at those nodes, so all hold one plan. Stage 0 profiles only once every stage has built its
    model: on two cores, a profile taken while the others still import torch and load
    data would time the nodes under that contention, which the training steps do not
    have."""
    if cfg.parallel.partition != "time":
        return (*make_plan(cfg, model, sample), None)
    store_barrier(store, "stages/built", cfg.parallel.per_replica * cfg.cluster.workers, cfg.cluster.timeout)
    if k == 0:
        _, plan = make_plan(cfg, model, sample, optimizer=optimizer)
        processes = cfg.parallel.stages  # under interleaved each holds chunks s, K + s, ...: their sum
        store_set_json(store, PREDICTED_KEY, [[sum(p.compute_s for p in plan.partitions[s::processes]),
                                               sum(p.time_s for p in plan.partitions[s::processes])]
                                              for s in range(processes)])
        store_set_json(store, SPLIT_KEY, [p.compute[0] for p in plan.partitions[1:]])
    wait_keys(store, [SPLIT_KEY], cfg.cluster.timeout, "stage 0's profiled plan")
    graph, plan = make_plan(cfg, model, sample, tuple(store_get_json(store, SPLIT_KEY)))
    return graph, plan, store_get_json(store, PREDICTED_KEY)


def stage_examples(programs: list[StageProgram], x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each stage's inputs on the sample ``x``, in its program's input order, received
    values requiring a gradient where their transfer carries one back, as the stages get
    them in training (what ``tensor.plan_tensor_split`` traces a stage with)."""
    values: dict[str, torch.Tensor] = {}
    examples = []
    with torch.no_grad():
        for program in programs:
            grad = {t.producer: t.grad for t in program.receives}
            args = tuple((x if name in program.model_inputs else values[name]).detach().requires_grad_(
                grad.get(name, False)) for name in program.inputs)
            examples.append(args)
            values.update(zip(program.outputs, program.module(*args)))
    return examples


def op_padding(raw: str) -> dict[str, float]:
    """``PLEXUS_PIPELINE_OP_MS=F,B,W``, an instrument (``benchmarks/pipeline_bubble.py
    --op-ms``): each op of a pipeline lasts at least F ms for a forward, B for
    an input gradient and W for a weight gradient (a backward that computes both before its
    sends, B + W), its core asleep for the rest. Ops of equal, known cost on any machine,
    on cores that need not be free: what the executor and its hand-offs add to a schedule's
    closed form. The computation is unchanged. Seconds by op kind; {} when unset."""
    if not raw:
        return {}
    try:
        values = [float(v) for v in raw.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or not all(0 <= v < 1e4 for v in values):
        raise ConfigError(f"PLEXUS_PIPELINE_OP_MS must be three milliseconds F,B,W such as 4,4,4, got {raw!r}")
    return {kind: v / 1000 for kind, v in zip("FBW", values)}


def stage_name(k: int) -> str:
    """The process of stage role rank ``k``: stage k mod K of replica k div K."""
    return f"stage {k}"


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: torch's allocator on CUDA; on CPU the resident set's
    high-water mark (ru_maxrss, KiB on Linux), which includes the interpreter and torch
    and, in a forked child, what the parent held at the fork."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _Exchange(torch.autograd.Function):
    """The seam between a stage and the rest of its replica in autograd: a zero that
    depends on every value the stage sent. Its backward receives the gradients of those
    values from the stages they went to, and queues, for the end of the backward pass,
    the sending back of the gradients of what the stage received. So a synchroniser that
    calls ``loss.backward()`` on the stage's loss runs the stage's part of the replica's
    backward, exchanges included, as it would on a whole model."""

    @staticmethod
    def forward(ctx, executor: "StageExecutor", anchor: torch.Tensor, *sent: torch.Tensor) -> torch.Tensor:
        ctx.executor = executor
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        executor: StageExecutor = ctx.executor
        grads = executor._receive_gradients()
        torch.autograd.Variable._execution_engine.queue_callback(executor._after_backward)
        return (None, None, *grads)


def _add_gradients(grads: list[torch.Tensor | None], got, seeds: list[torch.Tensor] = ()) -> None:
    """Add one micro-batch's parameter gradients ``got`` into the step's ``grads``. The
    first micro-batch's gradients become the accumulators themselves (autograd made them
    for this call alone), which saves a pass of zeros and an addition over every
    parameter per step; unless one is a seed passed in (autograd may hand a seed back as
    a gradient), which later additions must not change."""
    kept = {seed.data_ptr() for seed in seeds}
    for i, g in enumerate(got):
        if g is None:
            continue
        if grads[i] is not None:
            grads[i].add_(g)
        elif g.data_ptr() in kept or g._base is not None:
            grads[i] = g.clone()
        else:
            grads[i] = g


def _counting_saved(params: set[int], saved: dict[int, int]) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that record in ``saved`` the bytes of each tensor autograd saves, by data
    pointer, apart from the parameters (``params``, data pointers): a micro-batch's
    activations held until its backward. A saved tensor is kept detached: one kept with
    its grad_fn (a saved output) points back at the node that saved it, and once W read
    it (``SplitBackward``, ``node._saved_mat1``) every micro-batch's graph stayed alive,
    8 MB a step on a two-stage deep-mlp."""
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in params:
            saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _split_backward(mb: "_Microbatch", tensors: list[torch.Tensor], seeds: list[torch.Tensor],
                    leaves: list[tuple[Transfer, torch.Tensor]], params: list[torch.Tensor],
                    template: Template | None = None) -> SplitBackward:
    """A micro-batch's backward split into B and W: B differentiates the received values
    and, on a stage that reads the model's input, that input (made a leaf by
    ``_forward``), whose gradient comes after the received values' and is dropped."""
    inputs = [mb.x] if mb.x is not None and mb.x.requires_grad else []
    return SplitBackward(tensors, seeds, [leaf for _, leaf in leaves] + inputs, params, template)


class _Deposit(torch.autograd.Function):
    """A pipelined step's result for its synchroniser: the loss, whose backward leaves in
    each parameter the gradient the micro-batches accumulated (``grads``), once, as one
    backward of the whole batch would (so gradient hooks, all-reduce buckets among them,
    fire once per step)."""

    @staticmethod
    def forward(ctx, grads: list[torch.Tensor], loss: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None, None, *ctx.grads)


def _chunk_weights(model: torch.nn.Module, program: StageProgram) -> dict[str, torch.Tensor]:
    """``model``'s parameters (the synchroniser's model of a process, holding every chunk's
    layers at their qualified names) that model chunk ``program`` computes with."""
    params = dict(model.named_parameters())
    return {name: params[name] for name, _ in program.module.named_parameters()}


@dataclass
class _Microbatch:
    """A micro-batch between its forward and its backward on one stage."""

    runner: StageStep
    values: dict[str, torch.Tensor]
    loss: torch.Tensor | None
    received: dict[str, torch.Tensor]
    x: torch.Tensor | None
    y: torch.Tensor | None
    held: int  # bytes of activations kept for its backward
    # zb-h1: the backward B ran, its graph and the gradients W restarts from kept.
    split: SplitBackward | None = None


class StageExecutor:
    """This process's stage of one replica: its program, its links to the stages it
    exchanges values with, and ``loss_fn``, the stage's part of a step over them, which
    any synchroniser (a strategy over the stage group, ``train/stage_groups.py``) calls
    as it calls the loss of a whole model: forward (receive, run, send), then, from the
    ``backward()`` of what it returns, the gradients back over the same links.

    It keeps the seconds the stage spent computing, waiting for values and gradients
    (idle), and in the synchroniser (between its step's start and the forward, and after
    the backward: communication across replicas and the optimizer step; counted as
    computing when there is one replica, where only the optimizer runs there), and the
    intervals of the last ``TIMELINE_STEPS`` steps for the report's time line."""

    TIMELINE_STEPS = 3
    REPLAY_STEPS = 8

    def __init__(self, cfg: JobConfig, program: StageProgram, plan: PartitionPlan, store, device: torch.device,
                 backend: str, traffic: Traffic, criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 replica: int = 0, replicas: int = 1, shard: int = 0, shards: int = 1,
                 tensor: tuple[TensorPlan, Endpoint] | None = None) -> None:
        self.cfg, self.program, self.plan, self.device = cfg, program, plan, device
        self.traffic, self.criterion = traffic, criterion
        self.replica, self.replicas = replica, replicas
        # --tensor-parallel T: this process is shard ``shard`` of its stage, whose layers
        # ``tensor`` (plan, group of the stage's T shards) split; its cut edges join it to
        # the same shard of the other stages, each of which holds every value whole.
        self.shard, self.shards = shard, shards
        self.tensor_plan, self.tensor_group = tensor if tensor is not None else (None, None)
        # --microbatches M > 1 (or --schedule): a pipeline, each step the M micro-batches'
        # forwards and backwards in the order ``schedule.ops(stage)`` gives (parallel/schedules.py).
        self.microbatches = cfg.parallel.microbatches
        # An asynchronous schedule (pipedream) lists the whole run, so it is made once the
        # run's steps are known (``feed``); a synchronous one lists one step.
        self.asynchronous = cfg.parallel.schedule in ASYNCHRONOUS_SCHEDULES
        # Stage processes of the replica; under --schedule interleaved the plan's partitions
        # are K x v virtual stages, virtual stage u running on process u mod K.
        self.stages = cfg.parallel.stages
        self.chunks = program.chunks or (program,)
        # One micro-batch pipelines too when a schedule is asked for (--schedule S with M = 1:
        # the naive model-parallel step, bubble (K-1)/K, through the schedule's op lists).
        piped = self.microbatches > 1 or cfg.source("schedule") != "default"
        self.schedule = make_schedule(cfg.parallel.schedule, self.stages, self.microbatches,
                                      chunks=cfg.parallel.chunks) if piped and not self.asynchronous else None
        self.weight_stashing, self.vertical_sync = cfg.parallel.weight_stashing, cfg.parallel.vertical_sync
        # Delay compensation: the steps this stage's forwards predict its weights ahead
        # (its optimizer's lr is scaled by the synchroniser's config, stage_groups.py).
        self.delay = compensated_delay(cfg.parallel.schedule, self.stages, program.index, self.vertical_sync,
                                       cfg.parallel.delay_compensation)
        self._batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._coming: Iterator[Op] = iter(())  # the run's ops not yet made (Schedule.iter_ops)
        self._ahead: deque[Op] = deque()  # ops made but not yet run: a look ahead for the next forward
        self._stash: WeightStash | None = None
        self._live: dict[int, _Microbatch] = {}  # an asynchronous pipeline's inputs in flight, across steps
        self._versions: dict[int, int] = {}  # their weight versions
        self._fetched: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # the last mini-batch read
        self.steps_done = 0  # optimizer steps this stage's synchroniser applied: the weights' version
        # An asynchronous step's sends of forward values, which the next stage receives in
        # its next step: waited for at the end of that step, not this one.
        self._carried: list[Work] = []
        self.in_flight = 0  # the most micro-batches whose activations this stage held at once
        self.peak_activation_bytes = 0  # the most bytes of them, at once
        # --recompute: a micro-batch's forward keeps only its inputs; its backward runs it again.
        self.recompute = cfg.parallel.recompute
        self.pipeline_s = self.pipeline_idle_s = 0.0
        # [sum, count] of micro-batch ops; weight: zb-h1's W, apart from its B (backward).
        self.op_seconds = {"forward": [0.0, 0], "backward": [0.0, 0], "weight": [0.0, 0]}
        self.after_send_s = 0.0  # the backwards' seconds after their sends (adding into the accumulators)
        self.send_s = 0.0  # seconds starting sends (the transport's copy of each message): part of idle
        self._pad = op_padding(os.environ.get("PLEXUS_PIPELINE_OP_MS", ""))
        self.batch = cfg.run.batch_size // replicas  # this replica's slice of the global batch
        self.k = k = program.index
        self.step_runner = StageStep(program)
        self.index = {t: i for i, t in enumerate(plan.transfers)}
        # One link per cut edge's pair of stages (its counters are that edge's traffic), and
        # one from every stage to the output stage for snapshots of the model, counted apart.
        g, K = plan.output_stage % self.stages, self.stages
        pairs = {(min(t.src % K, t.dst % K), max(t.src % K, t.dst % K), "edge") for t in plan.transfers}
        if replica == 0 and shard == 0:  # replica 0's stages hold the model that is evaluated and saved
            pairs |= {(min(j, g), max(j, g), "gather") for j in range(K) if j != g}
        self.links: dict[int, Link] = {}
        self.gather_links: dict[int, Link] = {}
        self.gather_traffic = Traffic()
        # Replica 0's shards of a stage send theirs to shard 0, which merges the stage's state.
        self.shard_links: dict[int, Link] = {}
        if replica == 0 and shards > 1:
            for u in range(1, shards) if shard == 0 else [0]:
                self.shard_links[u] = Link(store, self.name(k), self.name(k, u), traffic=self.gather_traffic,
                                           timeout=cfg.cluster.timeout, backend=backend, tag="gather",
                                           transport=cfg.cluster.transport)
        # Every stage opens its links in one global order of pairs, from this thread: no
        # two stages wait on each other (ARCHITECTURE.md section 8).
        for lo, hi, kind in sorted(pairs):
            if k not in (lo, hi):
                continue
            peer = hi if k == lo else lo
            edge = kind == "edge"
            link = Link(store, self.name(k), self.name(peer), traffic=traffic if edge else self.gather_traffic,
                        timeout=cfg.cluster.timeout, backend=backend, net=cfg.cluster.net if edge else None,
                        tag="" if edge else "gather", transport=cfg.cluster.transport)
            (self.links if edge else self.gather_links)[peer] = link
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        # Per chunk: the shape of its split plan where it is Linears alone, which the next
        # micro-batches' plans follow (SplitBackward.template); None where it is not, and
        # then W cannot be matrix products alone (``_linear_backward``).
        self._templates: dict[int, Template | None] = {}
        self._sends: list[Work] = []
        self._sent: list[str] = []  # producers whose gradients come back, in _Exchange's order
        self.compute_s = self.idle_s = self.sync_s = 0.0
        self.t0 = time.time()  # the training clock's origin, for the time line (``start_clock``)
        self._marks: dict[str, float] = {}
        self._waits: list[tuple[float, float]] = []
        self._ops: list[tuple[str, float, float]] = []
        self.timeline: deque[list[list[Any]]] = deque(maxlen=self.TIMELINE_STEPS)
        # A synchronous pipeline's last steps: [seconds, of them after its sends] per op of
        # the schedule's list, for the summary's replay (``bubble_replayed``).
        self.step_ops: deque[list[list[float]]] = deque(maxlen=self.REPLAY_STEPS)

    def name(self, j: int, shard: int | None = None) -> str:
        """The process of stage ``j`` of this replica, this shard (or ``shard``)."""
        return stage_name((self.replica * self.stages + j) * self.shards + (self.shard if shard is None else shard))

    def stage_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """This stage's whole state_dict from ``module`` (its model, or its shard of it) on
        shard 0; None on the other shards, which send theirs there (replica 0 only)."""
        state = module.state_dict()
        if self.shards == 1:
            return {key: v.detach().clone() for key, v in state.items()}
        if self.shard != 0:
            _send_state(self.shard_links[0], state)
            return None
        states = [{key: v.detach().clone() for key, v in state.items()}]
        # (the same shapes on every shard)
        states += [_recv_state(self.shard_links[u], state) for u in range(1, self.shards)]
        return merge_tensor_states(states, self.tensor_plan)

    def start_clock(self, t0: float) -> None:
        """Times in the time line count from ``t0`` (the job's training start, wall clock)."""
        self.t0 = t0

    # --- one step: the synchroniser's step, with this stage's loss inside ---------------

    def begin_step(self) -> None:
        self._marks = {"start": time.time()}
        self._waits = []
        self._ops: list[tuple[str, float, float]] = []  # a pipeline's (forward | backward, start, end)

    def end_step(self) -> None:
        """Close the step's accounts: waiting, computing, and the synchroniser's share."""
        end = time.time()
        m = self._marks
        forward, backward = m.get("forward", end), m.get("backward", end)
        waits = sorted(self._waits)
        idle = sum(b - a for a, b in waits)
        outside = (forward - m["start"]) + (end - backward)  # in the synchroniser
        kind = "sync" if self.replicas > 1 else "compute"
        if kind == "sync":
            self.sync_s += outside
            self.compute_s += (end - m["start"]) - idle - outside
        else:
            self.compute_s += (end - m["start"]) - idle
        self.idle_s += idle
        spans = [["sync" if kind == "sync" else "compute", m["start"], forward]]
        at = forward
        # Inside the stage's part: waits, a pipeline's micro-batch forwards and backwards,
        # and computing in between.
        # W and the accumulation of a micro-batch's gradients: parts of a backward
        ops = [("backward" if what in ("weight", "accumulate") else what, a, b) for what, a, b in self._ops]
        for what, a, b in sorted([("wait", a, b) for a, b in waits] + ops, key=lambda span: span[1]):
            a = max(a, at)
            spans += [["compute", at, a], [what, a, b]]
            at = max(at, b)
        spans += [["compute", at, backward], [kind, backward, end]]
        self.timeline.append([[what, a - self.t0, b - self.t0] for what, a, b in spans if b > a])

    def loss_fn(self, model: torch.nn.Module, x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor:
        """This stage's part of the replica's loss on batch (x, y), with ``model`` as its
        module (the stage's own, or a synchroniser's copy of it): the model's loss on the
        output stage, plus a zero whose backward exchanges the gradients (``_Exchange``)."""
        p = self.program
        self._marks.setdefault("start", time.time())
        self._marks["forward"] = time.time()
        if self.asynchronous:
            return self._asynchronous_loss(model)
        if self.schedule is not None:
            return self._pipelined_loss(model, x, y)
        received = self._receive_values(self.batch, 0)
        inputs = {name: x for name in p.model_inputs}
        values = self.step_runner.forward(received, inputs, module=model)
        for t in p.sends:
            self._send(t.dst, self._tag(t, 0, False), values[t.producer])
        self._sent = list(dict.fromkeys(t.producer for t in p.sends if t.grad))
        zero = _Exchange.apply(self, self._anchor, *(values[name] for name in self._sent))
        if p.output is None:
            return zero
        return self.criterion(values[p.output], y) + zero.to(values[p.output].dtype)

    def _tag(self, transfer: Transfer, microbatch: int, grad: bool) -> int:
        """The tag of a transfer's value (or gradient) for one micro-batch of the step (0
        without a pipeline)."""
        return 2 * (self.index[transfer] + len(self.index) * microbatch) + int(grad)

    def _receive_values(self, batch: int, microbatch: int, program: StageProgram | None = None
                        ) -> dict[str, torch.Tensor]:
        """Every value that crosses into this stage (or its chunk ``program``) for one
        (micro-)batch of ``batch`` samples, by producer."""
        received, wanted = {}, []
        for t in (program or self.program).receives:
            buf = torch.empty(t.shape_for(batch), dtype=getattr(torch, t.dtype), device=self.device)
            received[t.producer] = buf
            wanted.append((t.src % self.stages, self._tag(t, microbatch, False), buf))
        self._recv_all(wanted)
        return received

    def _receive_value_gradients(self, values: dict[str, torch.Tensor], microbatch: int,
                                 program: StageProgram | None = None) -> list[tuple[Transfer, torch.Tensor]]:
        """The gradient of each value this stage (or its chunk ``program``) sent
        (``values``, by producer), one per transfer that carries one back, received
        contiguous whatever the value's strides."""
        wanted = [(t, torch.empty(values[t.producer].shape, dtype=values[t.producer].dtype,
                                  device=values[t.producer].device)) for t in (program or self.program).sends if t.grad]
        self._recv_all([(t.dst % self.stages, self._tag(t, microbatch, True), buf) for t, buf in wanted])
        return wanted

    def _finish_sends(self) -> None:
        """Wait until every send of the step has left; the end of its backward part."""
        start = time.time()
        for work in self._sends:
            work.wait()
        self._sends = []
        self._marks["backward"] = time.time()
        self._waits.append((start, self._marks["backward"]))

    def _forward(self, model: torch.nn.Module, received: dict[str, torch.Tensor], x: torch.Tensor | None,
                 y: torch.Tensor | None, grad: bool, weights: dict[str, torch.Tensor] | None = None,
                 program: StageProgram | None = None) -> "_Microbatch":
        """One micro-batch's forward (and loss, weighted 1/M, on the output stage), and
        the bytes of activations it leaves for its backward: what autograd saved, apart
        from the parameters (``grad``), or, recomputing, nothing, with the values it
        received and the model's input it read, which it holds until its backward too. ``weights``:
        parameters to run ``model`` with instead of its own (a stashed version).
        ``program``: the model chunk to run (interleaved), with ``model``'s parameters."""
        p = program or self.program
        runner = StageStep(p)
        if program is not None and program is not self.program:
            target = program.module
            weights = weights if weights is not None else _chunk_weights(model, program)
        else:
            target = model
        if grad and p.model_inputs and x is not None and x.is_floating_point() and self.schedule is not None \
                and not self.asynchronous and self.shards == 1:
            # A synchronous pipeline's stage that reads the model's input: B differentiates
            # that input too, which is what lets W take only the weight products
            # (SplitBackward, zb-h1's W and ``_linear_backward``) where a stage that receives
            # nothing would have an empty B and a whole backward as W. The input's gradient
            # is dropped, and autograd computes it only where B asks for it. Not with
            # --tensor-parallel: a split layer that reads the input all-reduces its
            # gradient across the shards, a message per micro-batch for a dropped value.
            x = x.detach().requires_grad_(True)
        params = {q.data_ptr() for q in (model.parameters() if weights is None else weights.values())}
        module = target if weights is None else (lambda *args: functional_call(target, weights, args))
        saved: dict[int, int] = {}
        with _counting_saved(params, saved), torch.set_grad_enabled(grad):
            values = runner.forward(received, {name: x for name in p.model_inputs}, module=module)
            loss = self.criterion(values[p.output], y) / self.microbatches if p.output is not None else None
        kept = saved if grad else {}  # and, each once, the received values and input it holds until its backward
        for v in (*received.values(), *([x] if p.model_inputs and x is not None else [])):
            kept.setdefault(v.data_ptr(), v.numel() * v.element_size())
        return _Microbatch(runner, values, loss, received, x, y, sum(kept.values()))

    def _pipelined_loss(self, model: torch.nn.Module, x: torch.Tensor | None, y: torch.Tensor | None
                        ) -> torch.Tensor:
        """The stage's part of a pipelined step: its micro-batches' forwards and backwards
        in the schedule's order, each exchanging its values and gradients with the
        neighbouring stages as a step of one batch does; the gradients accumulate apart
        from the parameters and are deposited by the returned loss's backward (``_Deposit``),
        each micro-batch's loss weighted 1/M, so that the step's gradient is the whole
        batch's mean loss's, as in one process.

        Under zb-h1 (``splits_backward``) B differentiates only the received values and
        sends their gradients back at once; W, later, takes the parameters' gradients from
        where B left them (``SplitBackward``: only the weight products, unless the graph
        cannot be split, where W is a whole backward again). Under interleaved each op
        names its model chunk, a program of its own with its own transfers."""
        m_count = self.microbatches
        split = self.schedule.splits_backward
        batch = self.batch // m_count
        xs = x.split(batch) if x is not None else [None] * m_count
        ys = y.split(batch) if y is not None else [None] * m_count
        params = [q for q in model.parameters() if q.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(params)  # the first micro-batch's become them
        # (micro-batch, chunk) -> its forward's values and graph, until its backward (W under zb-h1)
        live: dict[tuple[int, int], _Microbatch] = {}
        total = torch.zeros((), device=self.device)
        start, waited = time.time(), len(self._waits)
        for op in self.schedule.ops(self.k):
            m, key, chunk = op.microbatch, (op.microbatch, op.chunk), self.chunks[op.chunk]
            if op.kind == "F":
                received = self._receive_values(batch, m, chunk)
                began = time.time()
                mb = self._forward(model, received, xs[m], ys[m], grad=not self.recompute, program=chunk)
                self._ops.append(("forward", began, self._pad_op(began, "F")))
                for t in chunk.sends:
                    self._send(t.dst % self.stages, self._tag(t, m, False), mb.values[t.producer])
                live[key] = mb
                self.in_flight = max(self.in_flight, len(live))
                self.peak_activation_bytes = max(self.peak_activation_bytes, sum(b.held for b in live.values()))
                continue
            if op.kind == "W":
                mb = live.pop(key)
                began = time.time()
                _add_gradients(grads, mb.split.weight_gradients(into=grads), mb.split.seeds)
                del mb  # its graph, kept for W, goes now, before the next op allocates its own
                self._ops.append(("weight", began, self._pad_op(began, "W")))
                continue
            mb = live[key] if split else live.pop(key)
            loss = mb.loss  # the forward's, added to the step's after the sends below
            wanted = self._receive_value_gradients(mb.values, m, chunk)
            began = time.time()
            if self.recompute:  # the forward again, now keeping what backward needs
                mb = self._forward(model, mb.received, mb.x, mb.y, grad=True, program=chunk)
                if split:
                    live[key] = mb
            tensors, seeds, leaves = self._backward_targets(mb, wanted)
            weights = None  # a W run right after the sends (a stage of Linears)
            if split:  # the input gradient only; the parameters' wait for W
                mb.split = self._split_backward(op.chunk, mb, tensors, seeds, leaves, params)
                got, mine = mb.split.input_gradients()[:len(leaves)], []
            else:
                weights = self._linear_backward(op.chunk, mb, tensors, seeds, leaves, params)
                if weights is not None:  # B now, W by matrix products into the accumulators after the sends
                    got, mine = weights.input_gradients()[:len(leaves)], []
                else:
                    mine, got = self._gradients(params, tensors, seeds, [leaf for _, leaf in leaves])
            self._send_back(began, leaves, got, m, grads, mine, seeds, weights)
            if loss is not None:
                # Here, not between the output stage's forward and its backward: the first
                # torch call after an op costs about 26 us there (under 2 warm), on the path
                # of the gradient the previous stage waits for.
                total = total + loss.detach()
            # A graph B kept for a W that has run goes now, not after the next forward
            # (zb-h1's stays in ``live`` until its W op).
            del mb, weights, tensors, seeds, loss
        return self._end_pipeline(start, waited, grads, total, params)

    def _pad_op(self, began: float, *kinds: str) -> float:
        """The end of an op that began at ``began``: now, or under PLEXUS_PIPELINE_OP_MS
        (``op_padding``) no sooner than ``began`` plus the padding of ``kinds``."""
        if not self._pad:  # every op of every run but the instrument's
            return time.time()
        pad = sum(self._pad.get(kind, 0.0) for kind in kinds)
        now = time.time()
        if pad - (now - began) > 0.0005:
            time.sleep(pad - (now - began) - 0.0003)
        # The last fraction of a millisecond spun (a sleep overshoots it), on the difference
        # the op's record keeps: ``now >= began + pad`` can leave ``now - began`` a rounding
        # (about 0.2 us at today's time.time()) short of ``pad``.
        while now - began < pad:
            now = time.time()
        return now

    def _linear_backward(self, chunk: int, mb: "_Microbatch", tensors: list[torch.Tensor],
                         seeds: list[torch.Tensor], leaves: list[tuple[Transfer, torch.Tensor]],
                         params: list[torch.Tensor]) -> SplitBackward | None:
        """A micro-batch's backward as B then W where every parameter of the stage (its
        chunk) is a Linear's: W adds each weight gradient into the step's accumulator in
        its matrix product (``SplitBackward.weight_gradients(into=...)``) instead of
        autograd writing a new gradient that is then added, about a third of a 1024-wide
        layer's weight gradient on a CPU core. None where the graph has other parameters
        or cannot be split; the answer is kept per chunk, whose graph is the same at
        every micro-batch: a chunk whose first plan left no template is not Linears alone."""
        if chunk in self._templates and self._templates[chunk] is None:
            return None
        backward = self._split_backward(chunk, mb, tensors, seeds, leaves, params)
        return backward if backward.split and not backward.groups and backward.linears else None

    def _split_backward(self, chunk: int, mb: "_Microbatch", tensors: list[torch.Tensor],
                        seeds: list[torch.Tensor], leaves: list[tuple[Transfer, torch.Tensor]],
                        params: list[torch.Tensor]) -> SplitBackward:
        """``_split_backward`` for model chunk ``chunk``, planned once per chunk where
        its plan is Linears alone: each later micro-batch's graph has the same shape, and
        its plan follows the first's (``SplitBackward.template``: 118 against 181
        us a plan on a stage of four 1024-wide Linears here, paid before the sends)."""
        backward = _split_backward(mb, tensors, seeds, leaves, params, self._templates.get(chunk))
        if chunk not in self._templates:
            self._templates[chunk] = backward.template
        return backward

    def _end_pipeline(self, start: float, waited: int, grads: list[torch.Tensor | None], total: torch.Tensor,
                      params: list[torch.Tensor]) -> torch.Tensor:
        """The end of a pipelined step that began at ``start`` with ``waited`` waits on
        record: wait for its sends, count its seconds, op times and idle time, and return
        its loss (``_deposit``)."""
        self._finish_sends()
        self.pipeline_s += self._marks["backward"] - start
        ops: list[list[float]] = []
        for kind, a, b in self._ops:  # an accumulation is the end of the backward before it
            tally = self.op_seconds["backward" if kind == "accumulate" else kind]
            tally[0] += b - a
            tally[1] += kind != "accumulate"
            if kind == "accumulate":
                self.after_send_s += b - a
                ops[-1] = [ops[-1][0] + b - a, b - a]
            else:
                ops.append([b - a, 0.0])
        # (an asynchronous schedule's lists cover the run, not a step: no replay of those)
        if self.schedule.synchronous and len(ops) == len(self.schedule.ops(self.k)):
            self.step_ops.append(ops)
        self.pipeline_idle_s += sum(b - a for a, b in self._waits[waited:])
        return self._deposit(grads, total, params)

    @staticmethod
    def _backward_targets(mb: _Microbatch, wanted: list[tuple[Transfer, torch.Tensor]]
                          ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[Transfer, torch.Tensor]]]:
        """What a micro-batch's backward differentiates: its loss (seeded with 1) and the
        values it sent (seeded with the gradients ``wanted`` received for them), and the
        received values, as leaves, whose gradients go back."""
        tensors, seeds = ([mb.loss], [torch.ones_like(mb.loss)]) if mb.loss is not None else ([], [])
        for t, buf in wanted:
            tensors.append(mb.values[t.producer])
            seeds.append(buf)
        return tensors, seeds, [(t, leaf) for t, leaf in mb.runner.leaves if t.grad]

    def _deposit(self, grads: list[torch.Tensor | None], total: torch.Tensor, params: list[torch.Tensor]
                 ) -> torch.Tensor:
        """The step's loss, whose backward leaves ``grads`` in ``params`` (``_Deposit``). A
        stage without parameters (an interleaved chunk of a flatten alone, say) still
        returns a loss that ``backward()`` accepts: tied to the anchor, gradient zero."""
        if not params:
            return total + 0 * self._anchor
        grads = [g if g is not None else torch.zeros_like(q) for g, q in zip(grads, params)]
        return _Deposit.apply(grads, total, *params)

    @staticmethod
    def _gradients(params: list[torch.Tensor], tensors: list[torch.Tensor], seeds: list[torch.Tensor],
                   leaves: list[torch.Tensor] = ()) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The gradients of ``params`` and of ``leaves`` from the backward of ``tensors``
        seeded with ``seeds`` (freeing the graph)."""
        inputs = [*params, *leaves]
        got = torch.autograd.grad(tensors, inputs, seeds, allow_unused=True) if tensors and inputs else \
            [None] * len(inputs)
        return list(got[:len(params)]), list(got[len(params):])

    def _send_back(self, began: float, leaves: list[tuple[Transfer, torch.Tensor]], got: list[torch.Tensor | None],
                   tag: int, grads: list[torch.Tensor | None], mine: list[torch.Tensor | None],
                   seeds: list[torch.Tensor], weights: SplitBackward | None = None) -> None:
        """The end of a micro-batch's backward that began at ``began``: send the received
        values' gradients ``got`` back, then add its parameters' gradients ``mine`` into
        the step's ``grads`` (or, with ``weights``, run that split backward's W into them).
        In that order, since the previous stage waits for the first
        and nobody for the second: adding a stage's worth of parameters took 1.8 ms
        against 3.8 ms for the backward itself (deep-mlp, hidden 1024, 32 samples), which
        the previous stage would otherwise spend idle at every micro-batch. The op's time
        counts both parts, not the sends between them."""
        self._ops.append(("backward", began, self._pad_op(began, "B", "W" if mine else "")))
        for (t, leaf), g in zip(leaves, got):
            self._send(t.src % self.stages, self._tag(t, tag, True), g if g is not None else torch.zeros_like(leaf))
        if mine or weights is not None:
            added = time.time()
            if weights is not None:  # W of a stage of Linears, into the accumulators
                _add_gradients(grads, weights.weight_gradients(into=grads), seeds)
            else:
                _add_gradients(grads, mine, seeds)
                mine.clear()  # no reference outlives the op: the next backward reuses its memory
            self._ops.append(("accumulate", added, self._pad_op(added, "W" if weights is not None else "")))

    def feed(self, batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]], steps: int) -> None:
        """Where an asynchronous pipeline reads its inputs, and how long the run is:
        ``batch_at(t)`` is this replica's batch (x, y) of step t, and the run makes
        ``steps`` steps. Step t's ``loss_fn`` runs the stage's ops up to its t-th optimizer
        step (the op with ``step``), which includes forwards of inputs of later steps:
        hence the batches by step, not the batch the synchroniser passes. The schedule
        lists the whole run, so the pipeline fills once and drains once, at the run's end.
        Nothing to do under a synchronous schedule, whose step holds its micro-batches."""
        if not self.asynchronous:
            return
        cfg = self.cfg.parallel
        self._batch_at = batch_at
        self.schedule = make_schedule(cfg.schedule, self.stages, self.microbatches,
                                      vertical_sync=self.vertical_sync, minibatches=steps)
        self._coming, self._ahead = self.schedule.iter_ops(self.k), deque()

    def _next_op(self) -> Op | None:
        """The next op of an asynchronous pipeline's run; None once the run is done."""
        return self._ahead.popleft() if self._ahead else next(self._coming, None)

    def _next_forward_version(self) -> int | None:
        """The weight version the next forward asks for; None when no forward is left."""
        for op in self._ahead:
            if op.kind == "F":
                return op.version
        for op in self._coming:
            self._ahead.append(op)
            if op.kind == "F":
                return op.version
        return None

    def _input(self, m: int, batch: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Input ``m`` of an asynchronous pipeline, micro-batch m mod M of mini-batch m div
        M (each step's batch is one mini-batch), on the stages that read the data."""
        p = self.program
        if not p.model_inputs and p.output is None:
            return None, None
        g, j = divmod(m, self.microbatches)
        if self._fetched is None or self._fetched[0] != g:
            self._fetched = (g, self._batch_at(g))
        x, y = self._fetched[1]
        return x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch]

    def _asynchronous_loss(self, model: torch.nn.Module) -> torch.Tensor:
        """One step of an asynchronous pipeline (pipedream): the stage's ops from where
        the last step stopped up to the next that steps the optimizer, each forward with
        the weight version its op names and each backward differentiating that same
        version (``WeightStash``; the newest weights under --no-weight-stashing). Inputs
        stay in flight across steps, the pipeline never flushes. The gradients are
        deposited into the live parameters by the returned loss's backward
        (``_Deposit``), as in a synchronous step, and the synchroniser steps: this
        stage's version ``steps_done`` + 1. The loss is that of the inputs whose backward
        ran (the output stage runs an input's forward and backward in one step)."""
        if self._batch_at is None:
            raise RuntimeError(f"stage {self.k}: --schedule {self.cfg.parallel.schedule} reads future batches; "
                               f"call feed(batch_at, steps) before the first step")
        p = self.program
        batch = self.batch // self.microbatches
        # Tags repeat every few inputs: fewer than 2K are ever in flight on a link.
        window = 4 * self.stages
        if self._stash is None or self._stash.module is not model:
            self._stash = WeightStash(model, ahead=self.delay)
        stash = self._stash
        coming = self._next_forward_version()
        if coming is not None and coming <= self.steps_done:  # a forward will run on these weights
            stash.keep(self.steps_done)
        params = stash.live
        grads: list[torch.Tensor | None] = [None] * len(params)  # the first micro-batch's become them
        total = torch.zeros((), device=self.device)
        start, waited = time.time(), len(self._waits)
        fresh: list[Work] = []  # this step's sends of forward values
        while (op := self._next_op()) is not None:
            m, tag = op.microbatch, op.microbatch % window
            if op.kind == "F":
                x, y = self._input(m, batch)
                received = self._receive_values(batch, tag)
                began = time.time()
                mb = self._forward(model, received, x, y, grad=True, weights=stash.weights(op.version))
                self._ops.append(("forward", began, self._pad_op(began, "F")))
                sent = len(self._sends)
                for t in p.sends:
                    self._send(t.dst, self._tag(t, tag, False), mb.values[t.producer])
                fresh += self._sends[sent:]
                del self._sends[sent:]
                self._live[m], self._versions[m] = mb, op.version
                self.in_flight = max(self.in_flight, len(self._live))
                self.peak_activation_bytes = max(self.peak_activation_bytes,
                                                 sum(b.held for b in self._live.values()))
            else:
                mb = self._live.pop(m)
                del self._versions[m]
                wanted = self._receive_value_gradients(mb.values, tag)
                began = time.time()
                tensors, seeds, leaves = self._backward_targets(mb, wanted)
                got, back = stash.gradients(op.version, tensors, seeds, [leaf for _, leaf in leaves],
                                            stashing=self.weight_stashing)
                if mb.loss is not None:
                    total = total + mb.loss.detach()
                self._send_back(began, leaves, back, tag, grads, got, seeds)
            stash.drop(set(self._versions.values()), self._next_forward_version())
            if op.step:
                break
        self.steps_done += 1
        # The last step's forward values have been received by now: the next stage asked
        # for them before it sent this step's gradients. This step's may not have been, and
        # on a transport whose send completes only once received (gloo over sockets),
        # waiting for them would hang a run that stops here (--time-limit).
        self._sends += self._carried
        self._carried = fresh
        return self._end_pipeline(start, waited, grads, total, params)

    def _receive_gradients(self) -> list[torch.Tensor]:
        """The gradients of the values this stage sent, summed over the stages each went to."""
        summed: dict[str, torch.Tensor] = {}
        for t, buf in self._receive_value_gradients(self.step_runner.outputs, 0):
            summed[t.producer] = summed[t.producer] + buf if t.producer in summed else buf
        return [summed[name] for name in self._sent]

    def _after_backward(self) -> None:
        """At the end of the backward pass: send back the gradients of what this stage
        received (zeros where it did not depend on a value, so every message the plan
        counts is sent), and wait until every send of the step has left."""
        for t, grad in self.step_runner.input_gradients():
            self._send(t.src, self._tag(t, 0, True), grad)
        self._finish_sends()

    def _recv_all(self, wanted: list[tuple[int, int, torch.Tensor]]) -> None:
        """Post every receive (peer, tag, buffer) at once, then wait for them all: the
        stage runs when its last input arrives, whatever the order."""
        if not wanted:
            return
        start = time.time()
        works = [self.links[peer].irecv(buf, self.links[peer].peer_index, tag) for peer, tag, buf in wanted]
        for work in works:
            work.wait()
        self._waits.append((start, time.time()))

    def _send(self, peer: int, tag: int, value: torch.Tensor) -> None:
        """Start sending ``value``. Starting may block (a shared-memory ring with no room
        while the receiver is behind, or --net's delay): those seconds are waiting. Each
        torch call here costs 5-10 us right after a stage's matrix products have filled
        the caches (against 1 warm), and a micro-batch makes several sends: only what
        needs one gets a detach or a copy."""
        start = time.time()
        if value.requires_grad:
            value = value.detach()
        if not value.is_contiguous():
            value = value.contiguous()
        self._sends.append(self.links[peer].isend(value, self.links[peer].peer_index, tag))
        end = time.time()
        self._waits.append((start, end))
        self.send_s += end - start

    def figures(self, steps: int) -> dict[str, Any]:
        """This stage's record for the summary (``stage_summary``): seconds computing
        (forward, loss, backward, and with one replica the optimizer), idle (waiting for
        values, gradients and for sends to start or finish) and, with replicas, in the
        synchroniser; the time line of its last steps; peak memory; and the messages and
        bytes sent to and received from each peer over its edge links, {peer: [messages,
        bytes]}, beside the plan's prediction for ``steps`` steps ({"src->dst": [messages,
        bytes]}). Snapshot links count apart, as does the synchroniser's traffic."""
        snap = self.traffic.snapshot()
        sent, recv = {}, {}
        for peer in self.links:
            row = snap.get(self.name(peer), {"bytes_sent": 0, "bytes_recv": 0, "msgs_sent": 0, "msgs_recv": 0})
            sent[str(peer)] = [row["msgs_sent"], row["bytes_sent"]]
            recv[str(peer)] = [row["msgs_recv"], row["bytes_recv"]]
        m_count = self.microbatches
        predicted, in_flight = self._asynchronous_traffic(steps) if self.asynchronous else \
            (self._planned_traffic(steps), {})
        tensor = {}
        if self.tensor_plan is not None:
            # Per micro-batch; --recompute runs each forward, and its collectives, twice.
            once = predict_traffic(self.tensor_plan, self.batch // m_count, self.shards)
            passes = 2 if self.recompute else 1
            plan = {key: m_count * (passes * once[f"forward_{key}"] + once[f"backward_{key}"])
                    for key in ("messages", "bytes")}
            rows = self.tensor_group.traffic.snapshot().values()
            tensor = {**{f"tensor_{what}_{way}": sum(row[f"{key}_{way}"] for row in rows)
                         for what, key in (("messages", "msgs"), ("bytes", "bytes")) for way in ("sent", "recv")},
                      "predicted_tensor_messages": plan["messages"] * steps,
                      "predicted_tensor_bytes": plan["bytes"] * steps,
                      "tensor_layers": [[split.name, split.kind] for split in self.tensor_plan.layers]}
        pipeline = {}
        if self.schedule is not None:
            pipeline = {"microbatches": self.microbatches, "schedule": self.schedule.name, "chunks": len(self.chunks),
                        "max_in_flight": self.in_flight, "peak_activation_bytes": self.peak_activation_bytes,
                        "recompute": self.recompute, "pipeline_seconds": self.pipeline_s,
                        "pipeline_idle_seconds": self.pipeline_idle_s, "send_seconds": self.send_s,
                        "bubble": self.pipeline_idle_s / self.pipeline_s if self.pipeline_s else None,
                        "predicted_bubble": self.schedule.predicted_bubble(),
                        **{f"{kind}_op_seconds": total / count if count else None
                           for kind, (total, count) in self.op_seconds.items()},
                        "backward_after_send_seconds": self.after_send_s / self.op_seconds["backward"][1]
                        if self.op_seconds["backward"][1] else None, "step_ops": list(self.step_ops)}
            if self.asynchronous:  # the run's mini-batches (--time-limit: those made) and the versions kept
                made = make_schedule(self.cfg.parallel.schedule, self.stages, self.microbatches,
                                     vertical_sync=self.vertical_sync, minibatches=max(1, steps))
                pipeline.update(minibatches=max(1, steps), predicted_bubble=made.predicted_bubble(),
                                weight_stashing=self.weight_stashing, vertical_sync=self.vertical_sync,
                                weight_versions=self._stash.peak if self._stash is not None else 0,
                                weight_copies=self._stash.peak_copies if self._stash is not None else 0,
                                delay_compensation=self.cfg.parallel.delay_compensation, delay=self.delay)
        mine = [self.plan.partitions[c.index] for c in self.chunks]
        if pipeline:  # what the plan counted this process's chunks to hold, against the measured
            pipeline["planned_in_flight"] = sum(p.holding.held for p in mine)
            pipeline["planned_activation_bytes"] = sum(p.activation_bytes for p in mine)
            if self.asynchronous:
                pipeline["planned_weight_copies"] = sum(p.holding.weight_copies for p in mine)
        return {"stage": self.k, "replica": self.replica, "shard": self.shard, "steps": steps, **tensor, **pipeline,
                "nodes": [n for p in mine for n in p.compute],
                "planned_memory_bytes": sum(p.memory_bytes for p in mine),
                "compute_seconds": self.compute_s,
                "idle_seconds": self.idle_s, "sync_seconds": self.sync_s,
                "timeline": [span for step in self.timeline for span in step],
                "peak_memory_bytes": peak_bytes(self.device),
                "peak_memory_measure": "cuda allocator" if self.device.type == "cuda" else "ru_maxrss",
                "params": sum(p.numel() for p in self.program.module.parameters()),
                "bytes_sent": self.traffic.bytes_sent, "bytes_recv": self.traffic.bytes_recv,
                "snapshot_bytes_sent": self.gather_traffic.bytes_sent,
                "sent": sent, "received": recv, "predicted": predicted, "in_flight": in_flight}

    def _planned_traffic(self, steps: int) -> dict[str, list[int]]:
        """The plan's traffic on this stage's edges over ``steps`` synchronous steps,
        {"src->dst": [messages, bytes]}: each transfer once per micro-batch, a 1/M share of
        the batch each; under interleaved, the edges between virtual stages that join the
        same two processes summed."""
        per_step: dict[tuple[int, int], list[int]] = {}
        for (s, d), (m, b) in self.plan.traffic().items():
            pair = per_step.setdefault((s % self.stages, d % self.stages), [0, 0])
            pair[0], pair[1] = pair[0] + m, pair[1] + b
        return {f"{s}->{d}": [m * steps * self.microbatches, b * steps] for (s, d), (m, b) in per_step.items()
                if self.k in (s, d)}

    def _asynchronous_traffic(self, steps: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """An asynchronous pipeline's traffic on this stage's edges over its first
        ``steps`` steps, from the schedule's ops: what the sender sends (each forward sends
        every value once, each backward every gradient), {"src->dst": [messages, bytes]},
        and what of it the receiver has not taken by then, in flight at the stop. A run
        cut short (--time-limit) leaves forwards in flight: stage k runs K - k forwards
        ahead of its backwards, one more than stage k + 1, so each forward edge carries
        the values of one more input than its receiver used. A run of its whole schedule
        drains, and nothing is left in flight."""
        done: dict[int, tuple[int, int]] = {}

        def ops(j: int) -> tuple[int, int]:  # stage j's forwards and backwards in its first ``steps`` steps
            if j not in done:
                forwards = backwards = stepped = 0
                for op in (self.schedule.iter_ops(j) if steps else ()):
                    forwards, backwards = forwards + (op.kind == "F"), backwards + (op.kind == "B")
                    stepped += op.step
                    if stepped == steps:
                        break
                done[j] = (forwards, backwards)
            return done[j]

        sent: dict[str, list[int]] = {}
        kept: dict[str, list[int]] = {}
        for t in self.plan.transfers:
            src, dst = t.src % self.stages, t.dst % self.stages
            if self.k not in (src, dst):
                continue
            ways = [(src, dst, ops(src)[0], ops(dst)[0])]  # values: src's forwards, dst's
            if t.grad:
                ways.append((dst, src, ops(dst)[1], ops(src)[1]))  # gradients: dst's backwards, src's
            for a, b, made, used in ways:
                for table, count in ((sent, made), (kept, made - used)):
                    row = table.setdefault(f"{a}->{b}", [0, 0])
                    row[0], row[1] = row[0] + count, row[1] + t.nbytes * count // self.microbatches
        return sent, {edge: row for edge, row in kept.items() if row != [0, 0]}

    def close(self) -> None:
        for link in (*self.links.values(), *self.gather_links.values(), *self.shard_links.values()):
            link.close()
        if self.tensor_group is not None:
            self.tensor_group.close()


def gather_state(own: "StageExecutor", programs: list[StageProgram], module: torch.nn.Module
                 ) -> dict[str, torch.Tensor] | None:
    """Every stage's state_dict, merged, on the output stage's shard 0 (None elsewhere):
    this stage's from ``module`` (its synchroniser's model to evaluate: the stage module
    or a copy with its keys; under --tensor-parallel its shard, merged on the stage's
    shard 0 first), as tensors over the snapshot links, in each program's state_dict
    order, never pickle."""
    state = own.stage_state(module)
    if state is None:
        return None
    g = own.plan.output_stage % own.stages
    if own.k != g:
        _send_state(own.gather_links[g], state)
        return None
    return merge_state_dicts([state if j == g else _recv_state(own.gather_links[j], program.module.state_dict())
                              for j, program in enumerate(programs)])


def _send_state(link: Link, state: dict[str, torch.Tensor]) -> None:
    """A state_dict's tensors over a snapshot link, in its order, never pickle."""
    for i, value in enumerate(state.values()):
        link.send_to_peer(value.detach().contiguous(), GATHER_TAG + i)


def _recv_state(link: Link, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state_dict ``_send_state`` sent, into buffers shaped as ``like``'s."""
    state = {}
    for i, (key, value) in enumerate(like.items()):
        state[key] = torch.empty_like(value)
        link.recv_from_peer(state[key], GATHER_TAG + i)
    return state


def _replica_edges(records: dict[int, dict[str, Any]]) -> dict[tuple[int, int], dict[str, list[int]]]:
    """One replica's edges {(src, dst): {"sent", "received", "predicted", "in_flight":
    [messages, bytes]}} from its stages' records, keyed by stage."""
    edges: dict[tuple[int, int], dict[str, list[int]]] = {}
    for k, rec in records.items():
        for peer, (m, b) in rec["sent"].items():
            edges.setdefault((k, int(peer)), {})["sent"] = [m, b]
        for peer, (m, b) in rec["received"].items():
            edges.setdefault((int(peer), k), {})["received"] = [m, b]
        for key in ("predicted", "in_flight"):
            for edge, mb in rec.get(key, {}).items():
                src, dst = (int(v) for v in edge.split("->"))
                edges.setdefault((src, dst), {})[key] = list(mb)
    return edges


def stage_summary(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The summary's per-stage figures (compute, idle and sync seconds, peak memory, bytes
    over the cut edges, bytes of model snapshots sent to the output stage, and bytes of the
    stage group's synchronisation, which the edges do not count) and cut-edge
    traffic, measured beside predicted, summed over the replicas. Each stage also names
    its computing nodes and, under --partition time, the profiled plan's prediction for
    the run's steps: ``predicted_compute_seconds`` (forward, backward and optimizer step,
    as ``compute_seconds`` counts) and ``predicted_seconds`` (with its transfers).
    ``traffic_matches_plan`` is true when, in every replica (and, under
    --tensor-parallel T, for every shard, whose processes form a lane of the replica's
    stages) and on every edge (src, dst), the messages and bytes src sent, those dst
    received, and the plan's prediction for the steps made are all equal (so the totals
    are the plan's per-replica traffic times R x T); an asynchronous pipeline stopped
    before its schedule's end (--time-limit) predicts from the schedule's ops and leaves
    the values of inputs no stage will use in flight (``messages_in_flight_at_stop``):
    then dst received what src sent less those. ``tensor_traffic_matches_plan``:
    likewise for each shard's collectives against ``tensor.predict_traffic``.
    ``stage_groups`` gives each group's synchronisation bytes and seconds (the job's
    strategy over one stage's shard in every replica; the summary adds its figures).
    Each stage's ``timeline`` is its last steps as [kind, start, end] spans (compute,
    wait, sync), in seconds of the training clock."""
    lanes: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for rec in records.values():
        lanes.setdefault((rec.get("replica", 0), rec.get("shard", 0)), {})[rec["stage"]] = rec
    totals: dict[tuple[int, int], dict[str, list[int]]] = {}
    ok = bool(records)
    for lane in sorted(lanes):
        for edge, e in _replica_edges(lanes[lane]).items():
            sent, recv, pred = e.get("sent", [0, 0]), e.get("received", [0, 0]), e.get("predicted", [0, 0])
            flying = e.get("in_flight", [0, 0])
            if sent == recv == pred == [0, 0]:
                continue  # the direction of a link that carries no gradient back
            ok = ok and sent == pred and [recv[0] + flying[0], recv[1] + flying[1]] == pred
            total = totals.setdefault(edge, {key: [0, 0] for key in ("sent", "received", "predicted", "in_flight")})
            for key, mb in (("sent", sent), ("received", recv), ("predicted", pred), ("in_flight", flying)):
                total[key] = [total[key][0] + mb[0], total[key][1] + mb[1]]
    rows = [{"src": src, "dst": dst, "messages_sent": e["sent"][0], "bytes_sent": e["sent"][1],
             "messages_received": e["received"][0], "bytes_received": e["received"][1],
             "predicted_messages": e["predicted"][0], "predicted_bytes": e["predicted"][1],
             "messages_in_flight_at_stop": e["in_flight"][0], "bytes_in_flight_at_stop": e["in_flight"][1]}
            for (src, dst), e in sorted(totals.items())]
    keys = ("stage", "replica", "shard", "group", "nodes", "compute_seconds", "predicted_compute_seconds", "predicted_seconds",
            "idle_seconds", "sync_seconds", "timeline", "peak_memory_bytes", "peak_memory_measure",
            "params", "bytes_sent", "bytes_recv", "snapshot_bytes_sent", "sync_bytes_sent", "sync_bytes_recv",
            "tensor_layers", "tensor_messages_sent", "tensor_bytes_sent", "tensor_messages_recv", "tensor_bytes_recv",
            "predicted_tensor_messages", "predicted_tensor_bytes", "max_in_flight", "peak_activation_bytes",
            "pipeline_seconds", "pipeline_idle_seconds", "bubble", "forward_op_seconds", "backward_op_seconds",
            "weight_op_seconds", "backward_after_send_seconds", "send_seconds", "weight_versions", "weight_copies",
            "planned_memory_bytes", "planned_in_flight", "planned_activation_bytes", "planned_weight_copies")
    ordered = sorted(records.values(), key=lambda r: (r.get("replica", 0), r["stage"], r.get("shard", 0)))
    stages = [{key: rec[key] for key in keys if key in rec} for rec in ordered]
    out = {"stages": stages, "stage_traffic": rows, "traffic_matches_plan": ok and bool(records)}
    if any("tensor_bytes_sent" in rec for rec in records.values()):
        out["tensor_traffic_matches_plan"] = all(
            rec["tensor_bytes_sent"] == rec["tensor_bytes_recv"] == rec["predicted_tensor_bytes"]
            and rec["tensor_messages_sent"] == rec["tensor_messages_recv"] == rec["predicted_tensor_messages"]
            for rec in records.values())
    piped = [rec for rec in records.values() if rec.get("bubble") is not None]
    if piped:
        # The schedule run in virtual time with each stage's measured micro-batch forward
        # and backward (replica 0, shard 0): the bubble the stages' unequal costs leave,
        # with transfers and the time between ops left out.
        lane = sorted((rec for rec in piped if rec.get("replica", 0) == 0 and rec.get("shard", 0) == 0),
                      key=lambda rec: rec["stage"])
        v = lane[0].get("chunks", 1)
        schedule = make_schedule(lane[0]["schedule"], len(lane), lane[0]["microbatches"], chunks=v,
                                 vertical_sync=lane[0].get("vertical_sync", False),
                                 minibatches=lane[0].get("minibatches"))
        # Under zb-h1 backward_op_seconds is B's and weight_op_seconds W's. simulate takes a
        # stage's cost of a micro-batch, which interleaved runs as v chunk ops, each measured.
        # A backward's dependents wait only for its sends, not for the addition of its
        # gradients after them (backward_after_send_seconds, part of backward_op_seconds).
        weights = [rec["weight_op_seconds"] for rec in lane] if schedule.splits_backward else None
        simulated = simulate(schedule, [v * rec["forward_op_seconds"] for rec in lane],
                             [v * rec["backward_op_seconds"] for rec in lane], weights,
                             after_send=[v * (rec.get("backward_after_send_seconds") or 0.0) for rec in lane]).bubble
        # The same schedule replayed with each op's own duration in each of the last steps
        # all stages recorded: what a measured bubble adds to it is the time from an op's
        # end to its dependent's start (transfers, waking up), not the ops' costs.
        steps = min(len(rec.get("step_ops") or []) for rec in lane)
        replayed = None
        if steps:
            played = [replay(schedule, [[d for d, _ in rec["step_ops"][-n]] for rec in lane],
                             [[t for _, t in rec["step_ops"][-n]] for rec in lane]).bubble
                      for n in range(1, steps + 1)]
            replayed = sum(played) / len(played)
        # The bubble: the share of the pipelined part of its steps each stage spent waiting,
        # averaged over the stage processes, beside the schedule's closed form.
        out["pipeline"] = {"schedule": piped[0]["schedule"], "microbatches": piped[0]["microbatches"],
                           "bubble_measured": sum(rec["bubble"] for rec in piped) / len(piped),
                           "bubble_predicted": piped[0]["predicted_bubble"],
                           "bubble_simulated": simulated, "bubble_replayed": replayed,
                           "max_in_flight": max(rec["max_in_flight"] for rec in piped),
                           "peak_activation_bytes": max(rec["peak_activation_bytes"] for rec in piped),
                           "recompute": piped[0]["recompute"]}
        if "weight_stashing" in piped[0]:
            out["pipeline"].update({key: piped[0][key] for key in ("weight_stashing", "vertical_sync", "minibatches",
                                                                   "delay_compensation")},
                                   weight_versions=max(rec["weight_versions"] for rec in piped),
                                   predicted_ahead=[rec["delay"] for rec in lane],
                                   lr_scale=[delay_lr_scale(rec["delay"]) for rec in lane])
    replicas = {rec.get("replica", 0) for rec in records.values()}
    if len(replicas) > 1:
        out["replicas"] = len(replicas)
    by_group: dict[int, list[dict[str, Any]]] = {}
    for rec in records.values():
        by_group.setdefault(rec.get("group", rec["stage"]), []).append(rec)
    out["stage_groups"] = [
        {"group": g, "stage": recs[0]["stage"], "shard": recs[0].get("shard", 0), "replicas": len(recs),
         "params": recs[0]["params"],
         "bytes_sent": sum(rec.get("sync_bytes_sent", 0) for rec in recs),
         "bytes_recv": sum(rec.get("sync_bytes_recv", 0) for rec in recs),
         "sync_seconds_max": max(rec.get("sync_seconds", 0.0) for rec in recs)}
        for g, recs in sorted(by_group.items())]
    return out
