"""The training loop of one stage process (role ``stage``), for ``plexus train --stages K``
(and ``--workers R``: R replicas x K stages, stage role rank r*K + k is stage k of replica r).

The counterpart of ``runner.worker_main`` for one replica cut into stages: it loads the
data and builds the model as a one-process run does (contract 2), reads its replica's
batch at step t (contract 1 under a synchronous strategy: worker r's slice of global
batch t; under an asynchronous one, worker r's own partition), and drives two things
apart (ARCHITECTURE.md section 9):

- the executor (``parallel/executor.py``), how its replica computes a step: the stage's
  dataflow forward and backward over the cut edges, offered as a loss function;
- the synchroniser, the job's strategy, unchanged, over stage k's group (stage k of
  every replica, ``train/stage_groups.py``), with the stage module as its model, driven
  by the verbs a worker's runner uses (``strategies/base.py``: setup, feed, step,
  snapshot, finish, close): it calls the loss, runs ``backward()``, agrees with the other
  replicas and steps, as it does for a whole model in a worker. A stage with no
  parameters gets ``Alone``, which agrees on nothing.

The output stage of replica 0 watches health, evaluates snapshots of the merged model
(every stage's part of the strategy's global model) off the training path, decides when
a time limit or target accuracy ends the run, and, with every replica's output stage,
leaves the replica's records (``stats/worker/r``, ``stats/eval``) for the summary beside
each stage's own (``stats/stage/i``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import torch

from plexus.cluster.emulation import Emulator
from plexus.cluster.liveness import exited_key
from plexus.cluster.rendezvous import ProcessInfo, store_barrier, store_get_json, store_set_json, wait_keys
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.config.defaults import is_asynchronous
from plexus.errors import ProtocolError
from plexus.cluster.group import Group
from plexus.parallel.executor import StageExecutor, gather_state, shared_plan, stage_examples, stage_name
from plexus.parallel.stages import build_stages, join_chunks
from plexus.parallel.tensor import join_tensor_plans, plan_tensor_split, shard_module
from plexus.strategies import create_strategy
from plexus.strategies.base import Context, LossFn, StepStats, Strategy, make_optimizer
from plexus.train.data import load_dataset
from plexus.train.evaluation import SnapshotEvaluator, logits_loss
from plexus.train.health import Health, hint
from plexus.train.metrics import MetricsLog
from plexus.train.models import build_model
from plexus.train.progress import STEPS_KEY
from plexus.train.runner import NonFiniteLoss, record_final_evaluation, start_process
from plexus.train.plan import stage_position
from plexus.train.stage_groups import group_config, group_of, group_store

__all__ = ["stage_main", "Alone"]

logger = logging.getLogger(__name__)


class Alone(Strategy):
    """The synchroniser of a stage with no parameters, which has nothing to agree on: its
    step runs the stage's loss and backward (which exchange values and gradients with the
    replica's other stages), and its feed is of the job strategy's kind (slices of global
    batches, or the replica's own partition), so that it reads its replica's batches."""

    name = "alone"

    def __init__(self, cfg: JobConfig) -> None:
        self.synchronous = not is_asynchronous(cfg.to_flat())

    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.model, self.loss_fn = model, loss_fn

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        loss = self.loss_fn(self.model, x, y)
        loss.backward()
        return StepStats(loss=loss.item())

    def global_model(self) -> torch.nn.Module:
        return self.model


def stage_main(cfg: JobConfig, info: ProcessInfo, store, run_dir: Path | None, data=None) -> None:
    """Run stage process ``info.rank``: stage k of replica r. The output stage computes
    the loss and, on replica 0, watches its health, evaluates snapshots of the whole
    model (every ``--eval-every`` steps, gathered from the stages) and decides when a time
    limit or target accuracy ends the run; it writes the replica's records."""
    stages, shards, replicas = cfg.parallel.stages, cfg.parallel.tensor_parallel, cfg.cluster.workers
    per_replica = cfg.parallel.per_replica
    i = info.rank  # this process's stage role rank
    r, k, t = stage_position(i, stages, shards)
    device, backend = start_process(cfg, info.local_rank)
    data = data if data is not None else load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)  # the same initial model as a one-process run
    if cfg.model.dtype == "float64":
        data, model = data.to_dtype(torch.float64), model.double()
    batch = cfg.run.batch_size
    share = batch // replicas  # this replica's samples per step (config checks B % R == 0)
    graph, plan, predicted = shared_plan(cfg, i, store, model, data.x_train[:share],
                                         optimizer=lambda params: make_optimizer(params, cfg.optim))
    virtual = build_stages(graph, plan)  # interleaved: K x v model chunks, process s running s, K + s, ...
    programs = join_chunks(virtual, stages)  # a process's chunks as one program
    program = programs[k]
    tensor = None
    if shards > 1:  # this process holds shard t of its chunks' split layers (parallel/tensor.py)
        tp_group = Group(store, f"tensor-{r}-{k}", t, [stage_name(i - t + u) for u in range(shards)],
                         traffic=Traffic(), timeout=cfg.cluster.timeout, backend=backend, net=cfg.cluster.net)
        examples = stage_examples(virtual, data.x_train[:share])
        splits = {}
        for chunk in program.chunks or (program,):
            splits[chunk.index] = plan_tensor_split(chunk.module, shards, examples[chunk.index])
            virtual[chunk.index] = dataclasses.replace(
                chunk, module=shard_module(chunk.module, splits[chunk.index], t, shards, tp_group))
        program = join_chunks(virtual, stages)[k]
        tensor = (join_tensor_plans(list(splits.values())), tp_group)
    program.module.to(device)
    g = plan.output_stage % stages  # the process of the output's (virtual) stage
    if g != stages - 1:  # plan.writer_slot gives the run directory to the last stage's process
        raise ProtocolError(f"stage {i}: the model's output lies in stage {g} of {stages}, not the last")
    traffic = Traffic()
    own = StageExecutor(cfg, program, plan, store, device, backend, traffic, criterion=logits_loss, replica=r,
                        replicas=replicas, shard=t, shards=shards, tensor=tensor)
    lead = r == 0 and k == g and t == 0  # replica 0's output stage: evaluates, decides and logs
    log = MetricsLog(run_dir if lead else None)
    # The synchroniser: the job's strategy as worker r of stage k's group, whose model is
    # this stage's module, driven by the same verbs as a worker's (strategies/base.py).
    gi = group_of(k, t, shards)
    group = group_config(cfg, gi)
    sync_traffic = Traffic()
    ctx = Context(info=dataclasses.replace(info, role="worker", rank=r, world_size=replicas),
                  store=group_store(store, gi), cfg=group, traffic=sync_traffic,
                  emulator=Emulator(group.cluster, "worker", r), device=device, backend=backend, log=log)
    has_parameters = any(True for _ in program.module.parameters())
    strategy = create_strategy(cfg.strategy.strategy) if has_parameters else Alone(cfg)
    strategy.setup(program.module, own.loss_fn, ctx)
    # The stages of a replica must make the same steps: no budget shared with other replicas.
    feed = strategy.feed(ctx, len(data.x_train), shared_budget=False)
    limit = feed.limit

    def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = feed.indices(step)
        return data.x_train[idx].to(device), data.y_train[idx].to(device)

    own.feed(batch_at, limit)  # an asynchronous pipeline (pipedream) reads batches ahead of its steps
    classes = data.num_classes if data.task == "classification" else None
    evaluator = whole = None
    if lead:
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
        if i == 0:
            store.set(STEPS_KEY, str(limit))
        store_barrier(store, "stages/ready", per_replica * replicas, cfg.cluster.timeout)
        if i == 0:
            store.set("train/t0", repr(time.time()))
        wait_keys(store, ["train/t0"], cfg.cluster.timeout, "stage 0's start time")
        t0 = float(store.get("train/t0").decode())
        own.start_clock(t0)
        clock = lambda: time.time() - t0  # noqa: E731
        loss = float("nan")
        steps_done = 0
        for step in range(feed.start(0), limit):
            x, y = batch_at(step)
            own.begin_step()
            out = strategy.step(x, y).loss
            own.end_step()
            feed.stepped(step + 1)
            steps_done = step + 1
            if k == g and t == 0:
                loss = out
                if not math.isfinite(loss):
                    health.diverged(steps_done)
                    raise NonFiniteLoss(f"stage {i}: the training loss became {loss} at step {step}: "
                                        f"{hint('diverging', cfg.settings(), is_asynchronous(cfg.to_flat()))}")
                changed = health.observe(steps_done, loss)
                if changed is not None:
                    why = None if changed == "ok" else hint(changed, cfg.settings(), False)
                    log.log("health", time=clock(), worker=r, step=steps_done, state=changed, loss=loss, hint=why)
                    logger.warning("stage %d: training is %s at step %d (loss %.4g)%s", i,
                                   "learning again" if why is None else changed, steps_done, loss,
                                   "" if why is None else f": {why}")
                if steps_done % cfg.run.log_every == 0 or steps_done == limit:
                    log.log("train", time=clock(), worker=r, step=steps_done, loss=loss,
                            samples=feed.publish(steps_done), worker_samples=steps_done * share,
                            bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv)
            if cfg.run.eval_every and steps_done % cfg.run.eval_every == 0 and steps_done < limit:
                now = clock()
                snapshot = strategy.snapshot(r)  # in every replica: it may be a collective of the group
                if lead and snapshot.fields:
                    log.log("strategy", time=now, worker=r, step=steps_done, **snapshot.fields)
                if r == 0:  # replica 0's stages merge the stage's global model on the output stage
                    held = snapshot.model if snapshot.model is not None else program.module
                    merged = gather_state(own, programs, held)
                    if merged is not None:
                        whole.load_state_dict(merged)
                        evaluator.submit(whole, steps_done, now, feed.seen(steps_done))
            if must_agree and steps_done % cfg.run.log_every == 0:
                # The output stage decides, every stage stops after the same step.
                key = f"stages/stop/{steps_done}"
                if lead:
                    over = cfg.run.time_limit is not None and clock() >= cfg.run.time_limit
                    store.set(key, "1" if over or evaluator.reached.is_set() else "0")
                wait_keys(store, [key], cfg.cluster.timeout, "the output stage's word on stopping")
                if store.get(key) == b"1":
                    break
        wall = clock()
        final = strategy.snapshot(r, final=True)
        done = strategy.finish(group, r)  # every stage waits for the others below (stages/done)
        record = {**own.figures(steps_done), "group": group_of(k, t, shards), "wall_seconds": wall,
                  # As a worker's record of the group's job, for its strategy's summary_fields.
                  "sync": {"steps": steps_done, "wall_seconds": wall, "bytes_sent": sync_traffic.bytes_sent,
                           "bytes_recv": sync_traffic.bytes_recv, "traffic": sync_traffic.snapshot(),
                           "update_budget": None, **done.record},
                  "sync_traffic": sync_traffic.snapshot(), "sync_bytes_sent": sync_traffic.bytes_sent,
                  "sync_bytes_recv": sync_traffic.bytes_recv}
        if predicted is not None:  # per step, for the steps made: beside compute_seconds
            record["predicted_compute_seconds"] = predicted[k][0] * steps_done
            record["predicted_seconds"] = predicted[k][1] * steps_done
        held = final.model if final.model is not None else program.module
        merged = gather_state(own, programs, held) if r == 0 else None
        record["snapshot_bytes_sent"] = own.gather_traffic.bytes_sent  # the final gather's too
        store_set_json(store, f"stats/stage/{i}", record)
        if merged is not None:
            whole.load_state_dict(merged)
            evaluator.close()
            record_final_evaluation(whole, data, device, evaluator, store, cfg, run_dir, steps=steps_done, wall=wall,
                                    samples=lambda: feed.seen(steps_done))
        if k == g and t == 0:
            mine = [r * per_replica + j for j in range(per_replica)]
            wait_keys(store, [f"stats/stage/{j}" for j in mine], cfg.cluster.timeout,
                      f"every stage's final record of replica {r}")
            recs = [store_get_json(store, f"stats/stage/{j}") for j in mine]
            # The replica's record, as a worker's: what summary.py reads for any run. Its
            # bytes are the cut edges' and the stage groups' synchronisation.
            store_set_json(store, f"stats/worker/{r}", {
                "steps": steps_done, "wall_seconds": wall,
                "bytes_sent": sum(x["bytes_sent"] + x["sync_bytes_sent"] for x in recs),
                "bytes_recv": sum(x["bytes_recv"] + x["sync_bytes_recv"] for x in recs),
                "traffic": {}, "loss": loss, "slept": 0.0, "device": str(device), "backend": backend,
                "diverging": health.state == "diverging", "health": health.state, "health_step": health.step,
                "compute_seconds": sum(x["compute_seconds"] for x in recs), "step_seconds": wall})
        store_barrier(store, "stages/done", per_replica * replicas, cfg.cluster.timeout)
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
        strategy.close()
        own.close()
