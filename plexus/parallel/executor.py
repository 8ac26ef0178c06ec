"""The partitioned executor: ONE replica's model cut into K stages, one process each.

``plexus train --stages K`` starts K processes of role ``stage``. Each builds the model
from the seed exactly as a one-process run does, traces it on the same sample and makes
the same plan (``partition.py`` is deterministic for uniform, params and manual), keeps
its own ``StageProgram`` and an optimizer over its own parameters, and loops over steps:

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
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

from plexus.cluster.group import Link, Work
from plexus.cluster.liveness import exited_key
from plexus.cluster.rendezvous import ProcessInfo, store_barrier, store_get_json, store_set_json, wait_keys
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.parallel.partition import ModelGraph, PartitionPlan, plan_partitions, trace_model
from plexus.parallel.stages import StageProgram, StageStep, build_stages, merge_state_dicts

__all__ = ["check_stages", "make_plan", "stage_main", "stage_summary"]

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


def _shared_plan(cfg: JobConfig, k: int, store, model: torch.nn.Module, sample: torch.Tensor
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


def _name(k: int) -> str:
    return f"stage {k}"


def _peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: torch's allocator on CUDA; on CPU the resident set's
    high-water mark (ru_maxrss, KiB on Linux), which includes the interpreter and torch
    and, in a forked child, what the parent held at the fork."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _Stage:
    """This process's stage: its program, links to the stages it exchanges values with,
    its optimizer, and the seconds it spent computing and waiting."""

    def __init__(self, cfg: JobConfig, program: StageProgram, plan: PartitionPlan, store, device, backend: str,
                 traffic: Traffic) -> None:
        from plexus.strategies.base import make_optimizer
        self.cfg, self.program, self.plan, self.device = cfg, program, plan, device
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
            link = Link(store, _name(k), _name(peer), traffic=traffic if edge else self.gather_traffic,
                        timeout=cfg.cluster.timeout, backend=backend, net=cfg.cluster.net if edge else None,
                        tag="" if edge else "gather", transport=cfg.cluster.transport)
            (self.links if edge else self.gather_links)[peer] = link
        params = list(program.module.parameters())
        self.optimizer = make_optimizer(params, cfg.optim) if params else None
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
        value = value.detach().contiguous()
        self._sends.append(self.links[peer].isend(value, self.links[peer].peer_index, tag))

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
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
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

    def edge_counts(self, traffic: Traffic) -> dict[str, Any]:
        """Messages and bytes sent to and received from each peer over this stage's edge
        links, {peer: [messages, bytes]} (snapshot links count apart)."""
        snap = traffic.snapshot()
        sent, recv = {}, {}
        for peer in self.links:
            row = snap.get(_name(peer), {"bytes_sent": 0, "bytes_recv": 0, "msgs_sent": 0, "msgs_recv": 0})
            sent[str(peer)] = [row["msgs_sent"], row["bytes_sent"]]
            recv[str(peer)] = [row["msgs_recv"], row["bytes_recv"]]
        return {"sent": sent, "received": recv}

    def close(self) -> None:
        for link in (*self.links.values(), *self.gather_links.values()):
            link.close()


def _gather(own: _Stage, programs: list[StageProgram]) -> dict[str, torch.Tensor] | None:
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


def stage_main(cfg: JobConfig, info: ProcessInfo, store, run_dir: Path | None, data=None) -> None:
    """Run stage ``info.rank`` of the job's one replica (role ``stage``). The output stage
    computes the loss, watches its health, evaluates snapshots of the whole model (every
    ``--eval-every`` steps, gathered from the stages) and decides when a time limit or
    target accuracy ends the run; it writes the replica's records for the summary."""
    from plexus.train.batches import GlobalBatches
    from plexus.train.data import load_dataset
    from plexus.train.evaluation import Evaluation, SnapshotEvaluator, evaluate
    from plexus.train.health import Health, hint
    from plexus.train.metrics import MetricsLog
    from plexus.train.models import build_model
    from plexus.train.progress import STEPS_KEY
    from plexus.train.runner import NonFiniteLoss, resolve_device, total_steps
    from plexus.config.defaults import is_asynchronous
    if cfg.cluster.threads:
        torch.set_num_threads(cfg.cluster.threads)
    k, stages = info.rank, cfg.parallel.stages
    device, backend = resolve_device(cfg, info.local_rank)
    data = data if data is not None else load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)  # the same initial model as a one-process run
    if cfg.model.dtype == "float64":
        data, model = data.to_dtype(torch.float64), model.double()
    batch = cfg.run.batch_size
    graph, plan = _shared_plan(cfg, k, store, model, data.x_train[:batch])
    programs = build_stages(graph, plan)
    program = programs[k]
    program.module.to(device)
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ConfigError(f"--stages runs models with one input; {cfg.model.model} takes {len(placeholders)}")
    g = plan.output_stage
    traffic = Traffic()
    own = _Stage(cfg, program, plan, store, device, backend, traffic)
    batches = GlobalBatches(len(data.x_train), batch, cfg.run.seed)
    limit = total_steps(cfg, batches.steps_per_epoch)
    holds_input = bool(program.model_inputs)
    log = MetricsLog(run_dir if k == g else None)
    classes = data.num_classes if data.task == "classification" else None
    evaluator = whole = None
    if k == g:
        torch.manual_seed(cfg.run.seed)
        whole = build_model(cfg.model, data).to(device)  # holds the merged snapshots
        if cfg.model.dtype == "float64":
            whole = whole.double()
        on_target = None
        if cfg.run.target_accuracy is not None:
            own_store = store.clone()  # the evaluator's thread must not share this connection
            on_target = lambda seconds: store_set_json(own_store, "stats/target", {"time": seconds})  # noqa: E731
        evaluator = SnapshotEvaluator(whole, data.x_test, data.y_test, device, log, cfg.run.target_accuracy,
                                      on_target=on_target)
    health = Health(total_steps=limit, classes=classes)
    must_agree = cfg.run.time_limit is not None or cfg.run.target_accuracy is not None
    try:
        if k == 0:
            store.set(STEPS_KEY, str(limit))
        store_barrier(store, "stages/ready", stages, cfg.cluster.timeout)
        if k == 0:
            store.set("train/t0", repr(time.time()))
        wait_keys(store, ["train/t0"], cfg.cluster.timeout, "stage 0's start time")
        t0 = float(store.get("train/t0").decode())
        clock = lambda: time.time() - t0  # noqa: E731
        loss = float("nan")
        steps_done = 0
        for step in range(limit):
            idx = batches.indices(step)
            x = data.x_train[idx].to(device) if holds_input else None
            y = data.y_train[idx].to(device) if program.output is not None else None
            out = own.step(x, y, {placeholders[0]: x} if x is not None else {})
            steps_done = step + 1
            if out is not None:
                loss = out
                if not math.isfinite(loss):
                    health.diverged(steps_done)
                    raise NonFiniteLoss(f"stage {k}: the training loss became {loss} at step {step}: "
                                        f"{hint('diverging', cfg.settings(), is_asynchronous(cfg.to_flat()))}")
                changed = health.observe(steps_done, loss)
                if changed is not None:
                    why = None if changed == "ok" else hint(changed, cfg.settings(), False)
                    log.log("health", time=clock(), worker=0, step=steps_done, state=changed, loss=loss, hint=why)
                    logger.warning("stage %d: training is %s at step %d (loss %.4g)%s", k,
                                   "learning again" if why is None else changed, steps_done, loss,
                                   "" if why is None else f": {why}")
                if steps_done % cfg.run.log_every == 0 or steps_done == limit:
                    log.log("train", time=clock(), worker=0, step=steps_done, loss=loss,
                            samples=steps_done * batch, worker_samples=steps_done * batch,
                            bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv)
            if cfg.run.eval_every and steps_done % cfg.run.eval_every == 0 and steps_done < limit:
                now = clock()
                merged = _gather(own, programs)
                if merged is not None:
                    whole.load_state_dict(merged)
                    evaluator.submit(whole, steps_done, now, steps_done * batch)
            if must_agree and steps_done % cfg.run.log_every == 0:
                # The output stage decides, every stage stops after the same step.
                key = f"stages/stop/{steps_done}"
                if k == g:
                    over = cfg.run.time_limit is not None and clock() >= cfg.run.time_limit
                    store.set(key, "1" if over or evaluator.reached.is_set() else "0")
                wait_keys(store, [key], cfg.cluster.timeout, "the output stage's word on stopping")
                if store.get(key) == b"1":
                    break
        wall = clock()
        predicted = {f"{s}->{d}": [m * steps_done, b * steps_done] for (s, d), (m, b) in plan.traffic().items()
                     if k in (s, d)}
        record = {"stage": k, "steps": steps_done, "wall_seconds": wall, "compute_seconds": own.compute_s,
                  "idle_seconds": own.idle_s, "peak_memory_bytes": _peak_bytes(device),
                  "peak_memory_measure": "cuda allocator" if device.type == "cuda" else "ru_maxrss",
                  "params": sum(p.numel() for p in program.module.parameters()),
                  "bytes_sent": traffic.bytes_sent, "bytes_recv": traffic.bytes_recv,
                  **own.edge_counts(traffic), "predicted": predicted}
        merged = _gather(own, programs)
        record["snapshot_bytes_sent"] = own.gather_traffic.bytes_sent
        store_set_json(store, f"stats/stage/{k}", record)
        if merged is not None:
            whole.load_state_dict(merged)
            evaluator.close()
            final_loss, final_acc = evaluate(whole, data.x_test, data.y_test, device)
            if not evaluator.results or evaluator.results[-1].step != steps_done:
                evaluator.record(Evaluation(step=steps_done, time=wall, samples=steps_done * batch,
                                            accuracy=final_acc, loss=final_loss))
            if run_dir is not None and cfg.run.save_model:
                torch.save(whole.state_dict(), run_dir / "model.pt")
            store_set_json(store, "stats/eval", {
                "final_test_accuracy": final_acc, "final_test_loss": final_loss, "steps": steps_done,
                "wall_seconds": wall, "time_to_target": evaluator.time_to_target,
                "evaluations": len(evaluator.results), "skipped": evaluator.skipped,
                "replica_test_accuracy": None, "replica_test_loss": None,
                "chance_accuracy": 1 / classes if classes else None})
            wait_keys(store, [f"stats/stage/{j}" for j in range(stages)], cfg.cluster.timeout,
                      "every stage's final record")
            recs = [store_get_json(store, f"stats/stage/{j}") for j in range(stages)]
            # The replica's record, as a worker's: what summary.py reads for any run.
            store_set_json(store, "stats/worker/0", {
                "steps": steps_done, "wall_seconds": wall, "bytes_sent": sum(r["bytes_sent"] for r in recs),
                "bytes_recv": sum(r["bytes_recv"] for r in recs), "traffic": {}, "loss": loss, "slept": 0.0,
                "diverging": health.state == "diverging", "health": health.state, "health_step": health.step,
                "compute_seconds": sum(r["compute_seconds"] for r in recs), "step_seconds": wall})
        store_barrier(store, "stages/done", stages, cfg.cluster.timeout)
    except BaseException:
        # The time of this failure, so the job names the stage that failed first, not a
        # peer that lost its link to it afterwards (job.py reads the earliest).
        try:
            store.compare_set(exited_key(info.name), "", repr(time.time()))
        except RuntimeError:
            pass
        raise
    finally:
        if evaluator is not None:
            evaluator.close()
        log.close()
        own.close()


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
