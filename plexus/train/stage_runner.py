"""The training loop of one stage process (role ``stage``), for ``plexus train --stages K``
(and ``--workers R``: R replicas x K stages, stage role rank r*K + k is stage k of replica r).

The counterpart of ``runner.worker_main`` for one replica cut into stages: it loads the
data and builds the model as a one-process run does (contract 2), reads global batch t at
step t (contract 1: the stages holding the model's input read x, the output stage y),
drives its ``StageExecutor`` (``parallel/executor.py``: dataflow forward, backward,
optimizer step), and on the output stage watches health, evaluates snapshots of the
merged model off the training path, decides when a time limit or target accuracy ends
the run, and leaves the replica's records (``stats/worker/0``, ``stats/eval``) for the
summary beside each stage's own (``stats/stage/k``). With replicas, replica r reads
worker r's slice of global batch t, as worker r of a plain allreduce run does; replica 0
evaluates, decides and saves, and each replica's output stage writes ``stats/worker/r``.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from plexus.cluster.liveness import exited_key
from plexus.cluster.rendezvous import ProcessInfo, store_barrier, store_get_json, store_set_json, wait_keys
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.config.defaults import is_asynchronous
from plexus.parallel.executor import StageExecutor, gather_state, shared_plan
from plexus.parallel.stages import build_stages
from plexus.strategies.base import make_optimizer
from plexus.train.batches import GlobalBatches
from plexus.train.data import load_dataset
from plexus.train.evaluation import SnapshotEvaluator
from plexus.train.health import Health, hint
from plexus.train.metrics import MetricsLog
from plexus.train.models import build_model
from plexus.train.progress import STEPS_KEY
from plexus.train.runner import NonFiniteLoss, record_final_evaluation, resolve_device, total_steps

__all__ = ["stage_main"]

logger = logging.getLogger(__name__)


def _loss(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model's output, as ``evaluation.loss_fn`` computes it."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), y.reshape(-1))


def stage_main(cfg: JobConfig, info: ProcessInfo, store, run_dir: Path | None, data=None) -> None:
    """Run stage ``info.rank`` of the job's one replica (role ``stage``). The output stage
    computes the loss, watches its health, evaluates snapshots of the whole model (every
    ``--eval-every`` steps, gathered from the stages) and decides when a time limit or
    target accuracy ends the run; it writes the replica's records for the summary."""
    if cfg.cluster.threads:
        torch.set_num_threads(cfg.cluster.threads)
    stages, replicas = cfg.parallel.stages, cfg.cluster.workers
    i = info.rank  # this process's stage role rank
    r, k = divmod(i, stages)
    device, backend = resolve_device(cfg, info.local_rank)
    data = data if data is not None else load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)  # the same initial model as a one-process run
    if cfg.model.dtype == "float64":
        data, model = data.to_dtype(torch.float64), model.double()
    batch = cfg.run.batch_size
    share = batch // replicas  # this replica's samples per step (config checks B % R == 0)
    graph, plan, predicted = shared_plan(cfg, i, store, model, data.x_train[:share],
                                         optimizer=lambda params: make_optimizer(params, cfg.optim))
    programs = build_stages(graph, plan)
    program = programs[k]
    program.module.to(device)
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]  # one: make_plan checked
    g = plan.output_stage
    traffic = Traffic()
    own = StageExecutor(cfg, program, plan, store, device, backend, traffic,
                        optimizer=lambda params: make_optimizer(params, cfg.optim), loss_fn=_loss,
                        replica=r, replicas=replicas)
    batches = GlobalBatches(len(data.x_train), batch, cfg.run.seed)
    limit = total_steps(cfg, batches.steps_per_epoch)
    holds_input = bool(program.model_inputs)
    lead = r == 0 and k == g  # replica 0's output stage: evaluates, decides and logs
    log = MetricsLog(run_dir if lead else None)
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
        store_barrier(store, "stages/ready", stages * replicas, cfg.cluster.timeout)
        if i == 0:
            store.set("train/t0", repr(time.time()))
        wait_keys(store, ["train/t0"], cfg.cluster.timeout, "stage 0's start time")
        t0 = float(store.get("train/t0").decode())
        clock = lambda: time.time() - t0  # noqa: E731
        loss = float("nan")
        steps_done = 0
        for step in range(limit):
            idx = batches.worker_indices(step, r, replicas)
            x = data.x_train[idx].to(device) if holds_input else None
            y = data.y_train[idx].to(device) if program.output is not None else None
            out = own.step(x, y, {placeholders[0]: x} if x is not None else {})
            steps_done = step + 1
            if out is not None:
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
                    log.log("train", time=clock(), worker=0, step=steps_done, loss=loss,
                            samples=steps_done * batch, worker_samples=steps_done * share,
                            bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv)
            if r == 0 and cfg.run.eval_every and steps_done % cfg.run.eval_every == 0 and steps_done < limit:
                now = clock()
                merged = gather_state(own, programs)
                if merged is not None:
                    whole.load_state_dict(merged)
                    evaluator.submit(whole, steps_done, now, steps_done * batch)
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
        record = {**own.figures(steps_done), "wall_seconds": wall}
        if predicted is not None:  # per step, for the steps made: beside compute_seconds
            record["predicted_compute_seconds"] = predicted[k][0] * steps_done
            record["predicted_seconds"] = predicted[k][1] * steps_done
        merged = gather_state(own, programs) if r == 0 else None
        record["snapshot_bytes_sent"] = own.gather_traffic.bytes_sent  # the final gather's too
        store_set_json(store, f"stats/stage/{i}", record)
        if merged is not None:
            whole.load_state_dict(merged)
            evaluator.close()
            record_final_evaluation(whole, data, device, evaluator, store, cfg, run_dir, steps=steps_done, wall=wall,
                                    samples=lambda: steps_done * batch)
        if k == g:
            mine = [r * stages + j for j in range(stages)]
            wait_keys(store, [f"stats/stage/{j}" for j in mine], cfg.cluster.timeout,
                      f"every stage's final record of replica {r}")
            recs = [store_get_json(store, f"stats/stage/{j}") for j in mine]
            # The replica's record, as a worker's: what summary.py reads for any run. Its
            # bytes are the cut edges' and the replica groups' all-reduce.
            store_set_json(store, f"stats/worker/{r}", {
                "steps": steps_done, "wall_seconds": wall,
                "bytes_sent": sum(x["bytes_sent"] + x.get("allreduce_bytes_sent", 0) for x in recs),
                "bytes_recv": sum(x["bytes_recv"] + x.get("allreduce_bytes_recv", 0) for x in recs),
                "traffic": {}, "loss": loss, "slept": 0.0,
                "diverging": health.state == "diverging", "health": health.state, "health_step": health.step,
                "compute_seconds": sum(x["compute_seconds"] for x in recs), "step_seconds": wall})
        store_barrier(store, "stages/done", stages * replicas, cfg.cluster.timeout)
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
