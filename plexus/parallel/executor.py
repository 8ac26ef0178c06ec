"""The partitioned executor: ONE replica's model cut into K stages, one process each.

``plexus train --stages K`` starts K processes of role ``stage``, each running
``train/stage_runner.py``. Each builds the model from the seed exactly as a one-process
run does, traces it on the same sample and makes the same plan (``shared_plan``), keeps
its own ``StageProgram`` and, in a ``StageExecutor``, an optimizer over its own
parameters and its links, and loops over steps (``StageExecutor.step``):

- forward as dataflow: a stage posts a receive for every transfer into it at once (on
  the links to each producer, in any order of arrival), waits for them, runs, and sends
  each value it produces once per consuming stage (``Transfer``);
- backward in reverse: the gradients of what it sent come back over the same links, it
  runs backward and sends back the gradients of what it received; then its optimizer
  steps. Synchronous SGD of one replica, so K stages train exactly as one process with
  the same global batch (contract 1), up to float rounding.

One link per pair of stages joined by a cut edge, so each link's counters are one edge's
traffic in each direction: the summary sets them beside ``PartitionPlan.traffic()`` for
the run's steps (``traffic_matches_plan``). Every ``--eval-every`` steps and at the end,
the output stage gathers every stage's state_dict as tensors over links of their own
(counted apart from the edges' traffic), merges them (``merge_state_dicts``) and
evaluates the whole model off the training path, as a worker does its snapshots; it
also decides, every ``--log-every`` steps, whether a time limit or target accuracy ends
the run (the others read its word in the store), and writes the replica's record
(``stats/worker/0``), so the run directory is that of any run.

Replicas (``--stages K --workers R``, R x K processes; ``--replicas`` is another name for
``--workers``): replica r takes worker r's slice of global batch t (contract 1), as in a
plain allreduce run, and is cut into the same K stages. After backward, stage k of every
replica averages its gradients with stage k of the others: one data-parallel group per
stage, over that stage's parameters only (Dean et al. 2012's picture of model replicas
cut into partitions), with the project's all-reduce (``--algorithm``, ``--bucket-mb``,
``collectives/bucketing.py``) on a ``Group`` of its own whose bytes count apart from the
cut edges'. Each replica's mean loss over B/R samples, averaged over R replicas, is the
global batch's mean loss, so training equals ``--strategy allreduce --workers R`` (and
one process) up to float rounding. Replica 0's stages gather, evaluate and save the
model; every replica's output stage writes its replica's record (``stats/worker/r``).

Not yet: other strategies over replicas, checkpoints, torchrun, --kill and --slow of a
stage, micro-batches (pipelines).
"""
from __future__ import annotations

import logging
import resource
import time
from typing import Any, Callable

import torch

from plexus.cluster.group import Group, Link, Work
from plexus.cluster.rendezvous import store_barrier, store_get_json, store_set_json, wait_keys
from plexus.cluster.traffic import Traffic
from plexus.collectives import get_algorithm
from plexus.collectives.base import Handle
from plexus.collectives.bucketing import GradientBuckets
from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.parallel.partition import ModelGraph, PartitionPlan, plan_partitions, trace_model
from plexus.parallel.stages import StageProgram, StageStep, merge_state_dicts

__all__ = ["StageExecutor", "check_stages", "gather_state", "make_plan", "peak_bytes", "shared_plan", "stage_name",
           "stage_summary"]

logger = logging.getLogger(__name__)

# Tags on an edge's link: the forward value of the plan's transfer i is 2i, its gradient
# 2i + 1. Snapshot links carry state_dict entry i with tag GATHER_TAG + i.
GATHER_TAG = 1 << 20


def check_stages(cfg: JobConfig) -> None:
    """Refuse, before anything starts, what the partitioned executor cannot run yet."""
    k = cfg.parallel.stages
    if k <= 1:
        return
    replicas = cfg.cluster.workers
    if cfg.strategy.strategy != "allreduce" or cfg.strategy.elastic:
        what = "one replica" if replicas == 1 else f"{replicas} replicas x {k} stages"
        raise ConfigError(f"--stages {k} runs {what} by synchronous SGD (stage k of every replica all-reduces its "
                          f"gradients); strategy {cfg.strategy.strategy}"
                          f"{' --elastic' if cfg.strategy.elastic else ''} over stages is not supported yet: pass "
                          f"--strategy allreduce (the default), the one supported")
    settings = cfg.settings()
    for key in ("algorithm", "bucket_mb"):  # one replica all-reduces nothing: these would do nothing
        if replicas == 1 and settings[key]["source"] != "default":
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} does not apply to --stages {k}: one replica cut into stages all-reduces "
                              f"nothing; drop {flag}")
    for value, flag in ((cfg.run.checkpoint_every, "--checkpoint-every"), (cfg.run.resume, "--resume")):
        if value:
            raise ConfigError(f"{flag} with --stages {k} is not supported yet (a checkpoint would need every "
                              f"stage's part): drop {flag}")
    if cfg.cluster.kill or cfg.cluster.slow:
        raise ConfigError(f"--kill and --slow name workers, and --stages {k} runs stages: drop them")


def make_plan(cfg: JobConfig, model: torch.nn.Module, sample: torch.Tensor,
              split_points: tuple[str, ...] | None = None,
              optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
              check_only: bool = False) -> tuple[ModelGraph, PartitionPlan]:
    """The traced graph and the configured plan; with ``split_points``, the plan cut at
    those nodes instead (manual), which is how the stages share one profiled plan. A
    profile (--partition time) also times a step of ``optimizer`` when given, since each
    stage's compute includes its optimizer's step. ``check_only`` (the launcher's check
    of bad input) profiles nothing: time is planned as params, whose legal cuts under
    the memory cap are the same (both search every cut under it)."""
    method = cfg.parallel.partition if split_points is None else "manual"
    if check_only and method == "time":
        method = "params"
    graph = trace_model(model, sample, profile=method == "time", optimizer=optimizer)
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ConfigError(f"--stages {cfg.parallel.stages} runs models that take one input (a batch), and "
                          f"{cfg.model.model} takes {len(inputs)} ({', '.join(inputs)}): pass --stages 1")
    optim = cfg.optim
    slots = {"adam": 2, "adagrad": 1}.get(optim.optimizer, 1 if optim.momentum > 0 else 0)
    points = cfg.parallel.split_point_names if split_points is None else split_points
    plan = plan_partitions(graph, cfg.parallel.stages, method, split_points=points,
                           memory_cap=cfg.parallel.stage_memory_bytes, optimizer_slots=slots,
                           bandwidth=cfg.cluster.net.bandwidth, latency=cfg.cluster.net.latency)
    return graph, plan


# Where stage 0 leaves the cut of a profiled plan (--partition time) for the others, and
# its predicted seconds per step for every stage, [[compute, compute + transfers], ...].
SPLIT_KEY = "stages/split_points"
PREDICTED_KEY = "stages/predicted"


def shared_plan(cfg: JobConfig, k: int, store, model: torch.nn.Module, sample: torch.Tensor,
                optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
                ) -> tuple[ModelGraph, PartitionPlan, list[list[float]] | None]:
    """The plan every stage runs, and (time only) the profiled plan's predicted seconds
    per step of each stage, [compute, compute + transfers]. uniform, params and manual
    are deterministic, so each stage makes its own. time depends on seconds measured in
    one process: stage 0 profiles and plans, and publishes the first node of each stage
    after the first; every stage, stage 0 too, then cuts its unprofiled trace at those
    nodes, so all hold one plan. Stage 0 profiles only once every stage has built its
    model: on two cores, a profile taken while the others still import torch and load
    data would time the nodes under that contention, which the training steps do not
    have."""
    if cfg.parallel.partition != "time":
        return (*make_plan(cfg, model, sample), None)
    store_barrier(store, "stages/built", cfg.parallel.stages * cfg.cluster.workers, cfg.cluster.timeout)
    if k == 0:
        _, plan = make_plan(cfg, model, sample, optimizer=optimizer)
        store_set_json(store, PREDICTED_KEY, [[p.compute_s, p.time_s] for p in plan.partitions])
        store_set_json(store, SPLIT_KEY, [p.compute[0] for p in plan.partitions[1:]])
    wait_keys(store, [SPLIT_KEY], cfg.cluster.timeout, "stage 0's profiled plan")
    graph, plan = make_plan(cfg, model, sample, tuple(store_get_json(store, SPLIT_KEY)))
    return graph, plan, store_get_json(store, PREDICTED_KEY)


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


class StageExecutor:
    """This process's stage: its program, links to the stages it exchanges values with,
    its optimizer, and the seconds it spent computing and waiting. With ``replicas`` > 1,
    also its replica group (stage k of every replica) and the gradient buckets it
    all-reduces over that group after each backward pass."""

    def __init__(self, cfg: JobConfig, program: StageProgram, plan: PartitionPlan, store, device: torch.device,
                 backend: str, traffic: Traffic, optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], replica: int = 0,
                 replicas: int = 1) -> None:
        self.cfg, self.program, self.plan, self.device = cfg, program, plan, device
        self.traffic, self.loss_fn = traffic, loss_fn
        self.replica, self.replicas = replica, replicas
        self.batch = cfg.run.batch_size // replicas  # this replica's slice of the global batch
        self.k = k = program.index
        self.step_runner = StageStep(program)
        self.index = {t: i for i, t in enumerate(plan.transfers)}
        # One link per cut edge's pair of stages (its counters are that edge's traffic), and
        # one from every stage to the output stage for snapshots of the model, counted apart.
        g = plan.output_stage
        pairs = {(min(t.src, t.dst), max(t.src, t.dst), "edge") for t in plan.transfers}
        if replica == 0:  # replica 0's stages hold the model that is evaluated and saved
            pairs |= {(min(j, g), max(j, g), "gather") for j in range(plan.stages) if j != g}
        self.links: dict[int, Link] = {}
        self.gather_links: dict[int, Link] = {}
        self.gather_traffic = Traffic()
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
        params = list(program.module.parameters())
        self.sync_traffic = Traffic()
        self.group: Group | None = None
        self.buckets: GradientBuckets | None = None
        if replicas > 1 and params:
            # Stage k's data-parallel group: the same program in every replica, so the same
            # buckets in the same order on every member (what persistent() relies on).
            self.group = Group(store, f"stage-{k}-replicas", replica,
                               [stage_name(r * plan.stages + k) for r in range(replicas)], traffic=self.sync_traffic,
                               timeout=cfg.cluster.timeout, backend=backend, net=cfg.cluster.net)
            algorithm = get_algorithm(cfg.strategy.algorithm, cfg.strategy)
            self.buckets = GradientBuckets(params, int(cfg.strategy.bucket_mb * 2**20), self._launch)
            self.reductions = {id(b.buffer): algorithm.persistent(b.buffer, self.group, "mean")
                               for b in self.buckets.buckets}
        self.optimizer = optimizer(params) if params else None
        self.compute_s = self.idle_s = self.sync_s = 0.0
        self._sends: list[Work] = []

    def name(self, j: int) -> str:
        """The process of stage ``j`` of this replica."""
        return stage_name(self.replica * self.plan.stages + j)

    def _launch(self, buffer: torch.Tensor, last: bool) -> Handle:
        """Start the mean all-reduce of one bucket over the replica group (the last one in
        this thread, as ``strategies/allreduce.py`` does)."""
        reduction = self.reductions[id(buffer)]
        if last:
            reduction()
            return Handle()
        return reduction.start()

    def _recv_all(self, wanted: list[tuple[int, int, torch.Tensor]]) -> None:
        """Post every receive (peer, tag, buffer) at once, then wait for them all: the
        stage runs when its last input arrives, whatever the order."""
        start = time.perf_counter()
        works = [self.links[peer].irecv(buf, self.links[peer].peer_index, tag) for peer, tag, buf in wanted]
        for work in works:
            work.wait()
        self.idle_s += time.perf_counter() - start

    def _send(self, peer: int, tag: int, value: torch.Tensor) -> None:
        """Start sending ``value``. Starting may block (a shared-memory ring with no room
        while the receiver is behind, or --net's delay): those seconds are waiting, not
        compute, so they move from the one to the other."""
        start = time.perf_counter()
        value = value.detach().contiguous()
        self._sends.append(self.links[peer].isend(value, self.links[peer].peer_index, tag))
        waited = time.perf_counter() - start
        self.idle_s += waited
        self.compute_s -= waited

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, inputs: dict[str, torch.Tensor]
             ) -> float | None:
        """One synchronous step of this stage; returns the loss on the output stage."""
        p = self.program
        received: dict[str, torch.Tensor] = {}
        wanted = []
        for t in p.receives:
            buf = torch.empty(t.shape_for(self.batch), dtype=getattr(torch, t.dtype), device=self.device)
            received[t.producer] = buf
            wanted.append((t.src, 2 * self.index[t], buf))
        self._recv_all(wanted)
        start = time.perf_counter()
        if self.buckets is not None:
            self.buckets.zero()  # (the gradients are views into the buckets: never set to None)
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        values = self.step_runner.forward(received, inputs)
        for t in p.sends:
            self._send(t.dst, 2 * self.index[t], values[t.producer])
        loss = None
        if p.output is not None:
            out = values[p.output]
            loss = self.loss_fn(out, y)
        self.compute_s += time.perf_counter() - start
        grads, wanted = [], []
        for t in p.sends:
            if t.grad:
                value = values[t.producer]  # (received contiguous, whatever the value's strides)
                buf = torch.empty(value.shape, dtype=value.dtype, device=value.device)
                grads.append((t.producer, buf))
                wanted.append((t.dst, 2 * self.index[t] + 1, buf))
        self._recv_all(wanted)
        start = time.perf_counter()
        back = self.step_runner.backward(grads, loss)
        for t in p.receives:
            if t.grad:
                self._send(t.src, 2 * self.index[t] + 1, back[t.producer])
        if self.buckets is not None:
            # The mean over the replicas of their mean losses' gradients: the global batch's.
            sync = time.perf_counter()
            self.buckets.finish()
            self.sync_s += time.perf_counter() - sync
            start += time.perf_counter() - sync
        if self.optimizer is not None:
            self.optimizer.step()
        self.compute_s += time.perf_counter() - start
        start = time.perf_counter()
        for work in self._sends:
            work.wait()
        self._sends = []
        self.idle_s += time.perf_counter() - start
        return None if loss is None else loss.item()

    def figures(self, steps: int) -> dict[str, Any]:
        """This stage's record for the summary (``stage_summary``): seconds computing
        (forward, loss, backward, optimizer) and idle (waiting for values, gradients and
        for sends to start or finish), peak memory, and the messages and bytes sent to and received from each
        peer over its edge links, {peer: [messages, bytes]}, beside the plan's prediction
        for ``steps`` steps ({"src->dst": [messages, bytes]}); snapshot links count apart, and
        so does the replica group's all-reduce (bytes and seconds)."""
        snap = self.traffic.snapshot()
        sent, recv = {}, {}
        for peer in self.links:
            row = snap.get(self.name(peer), {"bytes_sent": 0, "bytes_recv": 0, "msgs_sent": 0, "msgs_recv": 0})
            sent[str(peer)] = [row["msgs_sent"], row["bytes_sent"]]
            recv[str(peer)] = [row["msgs_recv"], row["bytes_recv"]]
        predicted = {f"{s}->{d}": [m * steps, b * steps] for (s, d), (m, b) in self.plan.traffic().items()
                     if self.k in (s, d)}
        return {"stage": self.k, "replica": self.replica, "steps": steps,
                "nodes": list(self.plan.partitions[self.k].compute), "compute_seconds": self.compute_s,
                "idle_seconds": self.idle_s,
                "peak_memory_bytes": peak_bytes(self.device),
                "peak_memory_measure": "cuda allocator" if self.device.type == "cuda" else "ru_maxrss",
                "params": sum(p.numel() for p in self.program.module.parameters()),
                "bytes_sent": self.traffic.bytes_sent, "bytes_recv": self.traffic.bytes_recv,
                "snapshot_bytes_sent": self.gather_traffic.bytes_sent,
                "allreduce_bytes_sent": self.sync_traffic.bytes_sent,
                "allreduce_bytes_recv": self.sync_traffic.bytes_recv, "allreduce_seconds": self.sync_s,
                "sent": sent, "received": recv, "predicted": predicted}

    def close(self) -> None:
        for link in (*self.links.values(), *self.gather_links.values()):
            link.close()
        if self.buckets is not None:
            self.buckets.remove()
        if self.group is not None:
            self.group.close()


def gather_state(own: "StageExecutor", programs: list[StageProgram]) -> dict[str, torch.Tensor] | None:
    """Every stage's state_dict, merged, on the output stage (None elsewhere): tensors
    over the snapshot links, in each program's state_dict order, never pickle."""
    g = own.plan.output_stage
    if own.k != g:
        link = own.gather_links[g]
        for i, value in enumerate(own.program.module.state_dict().values()):
            link.send_to_peer(value.detach().contiguous(), GATHER_TAG + i)
        return None
    states = []
    for j, program in enumerate(programs):
        if j == g:
            states.append({key: v.detach().clone() for key, v in own.program.module.state_dict().items()})
            continue
        link, state = own.gather_links[j], {}
        for i, (key, like) in enumerate(program.module.state_dict().items()):
            buf = torch.empty_like(like)
            link.recv_from_peer(buf, GATHER_TAG + i)
            state[key] = buf
        states.append(state)
    return merge_state_dicts(states)


def _replica_edges(records: dict[int, dict[str, Any]]) -> dict[tuple[int, int], dict[str, list[int]]]:
    """One replica's edges {(src, dst): {"sent", "received", "predicted": [messages, bytes]}}
    from its stages' records, keyed by stage."""
    edges: dict[tuple[int, int], dict[str, list[int]]] = {}
    for k, rec in records.items():
        for peer, (m, b) in rec["sent"].items():
            edges.setdefault((k, int(peer)), {})["sent"] = [m, b]
        for peer, (m, b) in rec["received"].items():
            edges.setdefault((int(peer), k), {})["received"] = [m, b]
        for edge, mb in rec["predicted"].items():
            src, dst = (int(v) for v in edge.split("->"))
            edges.setdefault((src, dst), {})["predicted"] = list(mb)
    return edges


def stage_summary(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The summary's per-stage figures (compute and idle seconds, peak memory, bytes over
    the cut edges, bytes of model snapshots sent to the output stage and, with replicas,
    bytes of the replica group's all-reduce, which the edges do not count) and cut-edge
    traffic, measured beside predicted, summed over the replicas. Each stage also names
    its computing nodes and, under --partition time, the profiled plan's prediction for
    the run's steps: ``predicted_compute_seconds`` (forward, backward and optimizer step,
    as ``compute_seconds`` counts) and ``predicted_seconds`` (with its transfers).
    ``traffic_matches_plan`` is true when, in every replica and on every edge (src, dst),
    the messages and bytes src sent, those dst received, and the plan's prediction for the
    steps made are all equal (so the totals are the plan's per-replica traffic times R).
    With replicas, ``stage_allreduce`` gives each stage group's all-reduce bytes."""
    by_replica: dict[int, dict[int, dict[str, Any]]] = {}
    for rec in records.values():
        by_replica.setdefault(rec.get("replica", 0), {})[rec["stage"]] = rec
    totals: dict[tuple[int, int], dict[str, list[int]]] = {}
    ok = bool(records)
    for replica in sorted(by_replica):
        for edge, e in _replica_edges(by_replica[replica]).items():
            sent, recv, pred = e.get("sent", [0, 0]), e.get("received", [0, 0]), e.get("predicted", [0, 0])
            if sent == recv == pred == [0, 0]:
                continue  # the direction of a link that carries no gradient back
            ok = ok and sent == recv == pred
            total = totals.setdefault(edge, {"sent": [0, 0], "received": [0, 0], "predicted": [0, 0]})
            for key, mb in (("sent", sent), ("received", recv), ("predicted", pred)):
                total[key] = [total[key][0] + mb[0], total[key][1] + mb[1]]
    rows = [{"src": src, "dst": dst, "messages_sent": e["sent"][0], "bytes_sent": e["sent"][1],
             "messages_received": e["received"][0], "bytes_received": e["received"][1],
             "predicted_messages": e["predicted"][0], "predicted_bytes": e["predicted"][1]}
            for (src, dst), e in sorted(totals.items())]
    keys = ("stage", "replica", "nodes", "compute_seconds", "predicted_compute_seconds", "predicted_seconds",
            "idle_seconds", "peak_memory_bytes", "peak_memory_measure",
            "params", "bytes_sent", "bytes_recv", "snapshot_bytes_sent", "allreduce_bytes_sent", "allreduce_seconds")
    ordered = sorted(records.values(), key=lambda r: (r.get("replica", 0), r["stage"]))
    stages = [{key: rec[key] for key in keys if key in rec} for rec in ordered]
    out = {"stages": stages, "stage_traffic": rows, "traffic_matches_plan": ok and bool(records)}
    if len(by_replica) > 1:
        groups = sorted({rec["stage"] for rec in records.values()})
        out["replicas"] = len(by_replica)
        out["stage_allreduce"] = [
            {"stage": k, "replicas": sum(1 for rec in records.values() if rec["stage"] == k),
             "params": next(rec["params"] for rec in records.values() if rec["stage"] == k),
             "bytes_sent": sum(rec.get("allreduce_bytes_sent", 0) for rec in records.values() if rec["stage"] == k),
             "bytes_recv": sum(rec.get("allreduce_bytes_recv", 0) for rec in records.values() if rec["stage"] == k),
             "seconds_max": max(rec.get("allreduce_seconds", 0.0) for rec in records.values() if rec["stage"] == k)}
            for k in groups]
    return out
