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

Not yet: replicas (``--workers`` > 1), other strategies, checkpoints, torchrun, --kill
and --slow of a stage, micro-batches (pipelines).
"""
from __future__ import annotations

import logging
import resource
import time
from typing import Any, Callable

import torch

from plexus.cluster.group import Link, Work
from plexus.cluster.rendezvous import store_get_json, store_set_json, wait_keys
from plexus.cluster.traffic import Traffic
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
    if cfg.cluster.workers != 1:
        raise ConfigError(f"--stages {k} with --workers {cfg.cluster.workers}: replicas x stages is not supported "
                          f"yet; pass --workers 1 to train one replica cut into {k} stages")
    if cfg.strategy.strategy != "allreduce" or cfg.strategy.elastic:
        raise ConfigError(f"--stages {k} runs one replica by synchronous SGD; strategy "
                          f"{cfg.strategy.strategy}{' --elastic' if cfg.strategy.elastic else ''} over stages is not "
                          f"supported yet: pass --strategy allreduce (the default)")
    settings = cfg.settings()
    for key in ("algorithm", "bucket_mb"):  # nothing is all-reduced: these would do nothing
        if settings[key]["source"] != "default":
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
              split_points: tuple[str, ...] | None = None) -> tuple[ModelGraph, PartitionPlan]:
    """The traced graph and the configured plan; with ``split_points``, the plan cut at
    those nodes instead (manual), which is how the stages share one profiled plan."""
    profile = split_points is None and cfg.parallel.partition == "time"
    graph = trace_model(model, sample, profile=profile)
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ConfigError(f"--stages {cfg.parallel.stages} runs models that take one input (a batch), and "
                          f"{cfg.model.model} takes {len(inputs)} ({', '.join(inputs)}): pass --stages 1")
    optim = cfg.optim
    slots = {"adam": 2, "adagrad": 1}.get(optim.optimizer, 1 if optim.momentum > 0 else 0)
    method = cfg.parallel.partition if split_points is None else "manual"
    points = cfg.parallel.split_point_names if split_points is None else split_points
    plan = plan_partitions(graph, cfg.parallel.stages, method, split_points=points,
                           memory_cap=cfg.parallel.stage_memory_bytes, optimizer_slots=slots,
                           bandwidth=cfg.cluster.net.bandwidth, latency=cfg.cluster.net.latency)
    return graph, plan


# Where stage 0 leaves the cut of a profiled plan (--partition time) for the others.
SPLIT_KEY = "stages/split_points"


def shared_plan(cfg: JobConfig, k: int, store, model: torch.nn.Module, sample: torch.Tensor
                 ) -> tuple[ModelGraph, PartitionPlan]:
    """The plan every stage runs. uniform, params and manual are deterministic, so each
    stage makes its own. time depends on seconds measured in one process: stage 0 profiles
    and plans, and publishes the first node of each stage after the first; every stage,
    stage 0 too, then cuts its unprofiled trace at those nodes, so all hold one plan."""
    if cfg.parallel.partition != "time":
        return make_plan(cfg, model, sample)
    if k == 0:
        _, plan = make_plan(cfg, model, sample)
        store_set_json(store, SPLIT_KEY, [p.compute[0] for p in plan.partitions[1:]])
    wait_keys(store, [SPLIT_KEY], cfg.cluster.timeout, "stage 0's profiled plan")
    return make_plan(cfg, model, sample, tuple(store_get_json(store, SPLIT_KEY)))


def stage_name(k: int) -> str:
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
    its optimizer, and the seconds it spent computing and waiting."""

    def __init__(self, cfg: JobConfig, program: StageProgram, plan: PartitionPlan, store, device: torch.device,
                 backend: str, traffic: Traffic, optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.cfg, self.program, self.plan, self.device = cfg, program, plan, device
        self.traffic, self.loss_fn = traffic, loss_fn
        self.batch = cfg.run.batch_size
        self.k = k = program.index
        self.step_runner = StageStep(program)
        self.index = {t: i for i, t in enumerate(plan.transfers)}
        # One link per cut edge's pair of stages (its counters are that edge's traffic), and
        # one from every stage to the output stage for snapshots of the model, counted apart.
        g = plan.output_stage
        pairs = {(min(t.src, t.dst), max(t.src, t.dst), "edge") for t in plan.transfers}
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
            link = Link(store, stage_name(k), stage_name(peer), traffic=traffic if edge else self.gather_traffic,
                        timeout=cfg.cluster.timeout, backend=backend, net=cfg.cluster.net if edge else None,
                        tag="" if edge else "gather", transport=cfg.cluster.transport)
            (self.links if edge else self.gather_links)[peer] = link
        params = list(program.module.parameters())
        self.optimizer = optimizer(params) if params else None
        self.compute_s = self.idle_s = 0.0
        self._sends: list[Work] = []

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
        if self.optimizer is not None:
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
        for ``steps`` steps ({"src->dst": [messages, bytes]}); snapshot links count apart."""
        snap = self.traffic.snapshot()
        sent, recv = {}, {}
        for peer in self.links:
            row = snap.get(stage_name(peer), {"bytes_sent": 0, "bytes_recv": 0, "msgs_sent": 0, "msgs_recv": 0})
            sent[str(peer)] = [row["msgs_sent"], row["bytes_sent"]]
            recv[str(peer)] = [row["msgs_recv"], row["bytes_recv"]]
        predicted = {f"{s}->{d}": [m * steps, b * steps] for (s, d), (m, b) in self.plan.traffic().items()
                     if self.k in (s, d)}
        return {"stage": self.k, "steps": steps, "compute_seconds": self.compute_s, "idle_seconds": self.idle_s,
                "peak_memory_bytes": peak_bytes(self.device),
                "peak_memory_measure": "cuda allocator" if self.device.type == "cuda" else "ru_maxrss",
                "params": sum(p.numel() for p in self.program.module.parameters()),
                "bytes_sent": self.traffic.bytes_sent, "bytes_recv": self.traffic.bytes_recv,
                "snapshot_bytes_sent": self.gather_traffic.bytes_sent,
                "sent": sent, "received": recv, "predicted": predicted}

    def close(self) -> None:
        for link in (*self.links.values(), *self.gather_links.values()):
            link.close()


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


def stage_summary(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The summary's per-stage figures (compute and idle seconds, peak memory, bytes over
    the cut edges, and bytes of model snapshots sent to the output stage, which the edges
    do not count) and cut-edge traffic, measured beside predicted:
    ``traffic_matches_plan`` is true when, on every edge (src, dst), the messages and
    bytes src sent, those dst received, and the plan's prediction for the steps made are
    all equal."""
    edges: dict[str, dict[str, Any]] = {}
    for k, rec in records.items():
        for peer, (m, b) in rec["sent"].items():
            edges.setdefault(f"{k}->{peer}", {})["sent"] = [m, b]
        for peer, (m, b) in rec["received"].items():
            edges.setdefault(f"{peer}->{k}", {})["received"] = [m, b]
        for edge, mb in rec["predicted"].items():
            edges.setdefault(edge, {})["predicted"] = mb
    rows, ok = [], True
    for edge in sorted(edges, key=lambda e: tuple(int(v) for v in e.split("->"))):
        e = edges[edge]
        src, dst = (int(v) for v in edge.split("->"))
        sent, recv, pred = e.get("sent", [0, 0]), e.get("received", [0, 0]), e.get("predicted", [0, 0])
        if sent == recv == pred == [0, 0]:
            continue  # the direction of a link that carries no gradient back
        ok = ok and sent == recv == pred
        rows.append({"src": src, "dst": dst, "messages_sent": sent[0], "bytes_sent": sent[1],
                     "messages_received": recv[0], "bytes_received": recv[1],
                     "predicted_messages": pred[0], "predicted_bytes": pred[1]})
    stages = [{key: records[k][key] for key in ("stage", "compute_seconds", "idle_seconds", "peak_memory_bytes",
                                                "peak_memory_measure", "params", "bytes_sent", "bytes_recv",
                                                "snapshot_bytes_sent")}
              for k in sorted(records)]
    return {"stages": stages, "stage_traffic": rows, "traffic_matches_plan": ok and bool(records)}
