"""The training loop of one worker process, the same for every strategy.

The local executor of ARCHITECTURE.md section 9: the whole model in each worker. It loads
data and builds the model deterministically (contract 2), takes this worker's samples
from the strategy's feed (contract 1), drives the strategy by its verbs alone
(``strategies/base.py``), logs metrics, evaluates the snapshots the strategy hands it off
the clock, stops on steps, epochs, time or target accuracy, and leaves its final record
in the store for the summary (``summary.py``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from plexus.cluster.emulation import Emulator
from plexus.cluster.liveness import exited_key
from plexus.cluster.rendezvous import ProcessInfo, store_barrier, store_get_json, store_set_json, wait_keys
from plexus.cluster.shm_channel import set_spin
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.config.defaults import is_asynchronous
from plexus.errors import ConfigError, PlexusError
from plexus.strategies import Context, RoleContext, create_strategy, strategy_class
from plexus.strategies.base import Regrouped, Snapshot, StepStats
from plexus.train.checkpoint import Checkpointer, load_piece
from plexus.train.data import Dataset, load_dataset
from plexus.train.health import Health, hint
from plexus.train.evaluation import Evaluation, SnapshotEvaluator, evaluate, loss_fn
from plexus.train.feed import Feed
from plexus.train.metrics import MetricsLog
from plexus.train.models import build_model
from plexus.train.progress import STEPS_KEY, usable_cores
from plexus.train.timing import StepTimer

__all__ = ["worker_main", "role_main", "NonFiniteLoss", "save_dataset", "load_saved_dataset", "resolve_device",
           "choose_backend", "spin_seconds", "start_process"]

# How long a shared-memory receive polls before it sleeps under --spin on (spin_seconds):
# longer than the waits of a pipeline's hand-offs and of most messages on one machine, short
# enough that a process waiting for a slow peer soon stops taking a core.
SPIN_SECONDS = 0.01

logger = logging.getLogger(__name__)

_DATA_TENSORS = ("x_train", "y_train", "x_test", "y_test")


class NonFiniteLoss(PlexusError):
    exit_code = 3


def save_dataset(data: Dataset, folder: Path) -> None:
    """Write a loaded dataset as .npy files and JSON (no pickle), for workers to map."""
    folder.mkdir(parents=True, exist_ok=True)
    for key in _DATA_TENSORS:
        np.save(folder / f"{key}.npy", getattr(data, key).numpy(), allow_pickle=False)
    meta = {"name": data.name, "task": data.task, "num_classes": data.num_classes,
            "input_shape": list(data.input_shape), "num_features": data.num_features}
    (folder / "meta.json").write_text(json.dumps(meta))


def load_saved_dataset(folder: Path) -> Dataset:
    meta = json.loads((folder / "meta.json").read_text())
    tensors = {key: torch.from_numpy(np.load(folder / f"{key}.npy", allow_pickle=False)) for key in _DATA_TENSORS}
    return Dataset(name=meta["name"], task=meta["task"], num_classes=meta["num_classes"],
                   input_shape=tuple(meta["input_shape"]), num_features=meta["num_features"], **tensors)


def choose_backend(backend: str, cuda: bool, gpus: int, processes_here: int | None) -> str:
    """The backend ``--backend auto`` stands for: NCCL where every process of this machine
    has a GPU of its own (``processes_here``: how many the job runs here, None when not
    known), else gloo. NCCL refuses two ranks on one GPU, and gloo moves GPU tensors
    through host memory (``cluster/group.py``), so a job of more processes than GPUs runs,
    on gloo, rather than failing at its first message."""
    if backend != "auto":
        return backend
    return "nccl" if cuda and processes_here is not None and processes_here <= gpus else "gloo"


def spin_seconds(spin: str, processes_here: int | None, threads: int, cores: int) -> float:
    """How long a receive over shared memory polls before it sleeps (``shm_channel.set_spin``):
    --spin on, 10 ms; off, 0; auto, 10 ms where the ``cores`` this process may run on are at
    least twice the torch threads of the job on this machine (``processes_here`` x
    ``threads``), so that a core that polls is one nobody computes on, even where two cores
    share one's speed (hyper-threads, or the two vCPUs of the machine in README's Measured
    results), and 0 where they are fewer, or the count of processes here or their threads
    (``threads`` 0: torch's own) is not known."""
    if spin != "auto":
        return SPIN_SECONDS if spin == "on" else 0.0
    known = processes_here is not None and threads > 0
    return SPIN_SECONDS if known and cores >= 2 * processes_here * threads else 0.0


def start_process(cfg: JobConfig, local_rank: int) -> tuple[torch.device, str]:
    """A job process's set-up before it builds anything: its torch threads (--threads), how
    its shared-memory receives wait (--spin, ``spin_seconds``), and its (device, backend)
    (``resolve_device``)."""
    if cfg.cluster.threads:
        torch.set_num_threads(cfg.cluster.threads)
    set_spin(spin_seconds(cfg.cluster.spin, _processes_here(), cfg.cluster.threads, usable_cores()))
    return resolve_device(cfg, local_rank)


def _processes_here() -> int | None:
    """How many processes the job runs on this machine: our launcher's count, or torchrun's
    ``LOCAL_WORLD_SIZE``; None when neither says."""
    here = os.environ.get("PLEXUS_PROCESSES_HERE") or os.environ.get("LOCAL_WORLD_SIZE")
    return int(here) if here else None


def resolve_device(cfg: JobConfig, local_rank: int) -> tuple[torch.device, str]:
    """(device, backend): CUDA where asked for or present, else CPU; the backend as
    ``choose_backend`` says, from the processes on this machine (``_processes_here``)."""
    want = cfg.cluster.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    gpus = 0
    if use_cuda:
        if not torch.cuda.is_available():
            from plexus.errors import ConfigError
            raise ConfigError("device cuda was asked for but CUDA is not available: pass --device cpu")
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device, choose_backend(cfg.cluster.backend, use_cuda, gpus, _processes_here())


def worker_main(cfg: JobConfig, info: ProcessInfo, store, run_dir: Path | None,
                data: Dataset | None = None) -> None:
    """Train as worker ``info.rank``; leaves its final record (and, on the process that
    evaluates, ``stats/eval``) in the store for the summary. The strategy is driven by its
    verbs alone (``strategies/base.py``): setup, feed, step, snapshot, agree, finish, close."""
    device, backend = start_process(cfg, info.local_rank)
    data = data if data is not None else load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data).to(device)
    if cfg.model.dtype == "float64":
        data, model = data.to_dtype(torch.float64), model.double()
    traffic = Traffic()
    emulator = Emulator(cfg.cluster, "worker", info.rank)
    # A planned kill's time of death, for survivors that measure their recovery from it.
    emulator.before_kill = lambda: store.set(exited_key(info.name), repr(time.time()))
    strategy = create_strategy(cfg.strategy.strategy)
    log = MetricsLog(run_dir)
    ctx = Context(info=info, store=store, cfg=cfg, traffic=traffic, emulator=emulator, device=device,
                  backend=backend, log=log)
    timer = StepTimer()  # compute vs communication and waiting, for the report's time line
    strategy.setup(model, timer.wrap(loss_fn), ctx)
    workers, rank = info.world_size, info.rank
    feed = strategy.feed(ctx, len(data.x_train))
    if rank == 0:
        store.set(STEPS_KEY, str(feed.limit))  # for the progress display (train/progress.py)
    resumed = _resume(cfg, strategy, feed, store, rank) if cfg.run.resume else 0
    checkpointer = None
    if cfg.run.checkpoint_every:
        if run_dir is None:
            raise ConfigError("--checkpoint-every writes into the run directory, which this process does not have "
                              "(under torchrun only worker 0 does): use the local launcher")
        checkpointer = Checkpointer(cfg, store, run_dir, rank, workers, strategy.checkpoint_servers(cfg),
                                    feed.lockstep)
    # The training clock starts when every worker is ready; worker 0's start is everyone's.
    store_barrier(store, "train/ready", workers, cfg.cluster.timeout)
    if rank == 0:
        store.set("train/t0", repr(time.time()))
    wait_keys(store, ["train/t0"], cfg.cluster.timeout, "worker 0's start time")
    t0 = float(store.get("train/t0").decode())
    clock = lambda: time.time() - t0  # noqa: E731

    # The evaluators of the global model's snapshots, and of worker 0's own replica where
    # the strategy keeps one (decentralized strategies): made on the worker the strategy
    # hands its snapshots to, at the first one.
    evaluator: SnapshotEvaluator | None = None
    replica_eval: SnapshotEvaluator | None = None
    evaluates_replica = rank == 0

    def evaluate_snapshot(snapshot: Snapshot, step: int, now: float) -> None:
        nonlocal evaluator, replica_eval
        if snapshot.fields:
            log.log("strategy", time=now, worker=rank, step=step, **snapshot.fields)
        if snapshot.model is None:
            return
        if evaluator is None:
            if rank != 0:
                logger.warning("worker %d: the workers below it are lost; it evaluates from step %d on", rank, step)
            evaluator = SnapshotEvaluator(snapshot.model, data.x_test, data.y_test, device, log,
                                          cfg.run.target_accuracy, on_target=_target_recorder(store, cfg))
        evaluator.submit(snapshot.model, step, now, feed.seen(step))
        if snapshot.replica is not None and evaluates_replica:
            if replica_eval is None:
                replica_eval = SnapshotEvaluator(snapshot.replica, data.x_test, data.y_test, device, log, None,
                                                 model_label=f"worker{rank}")
            replica_eval.submit(snapshot.replica, step, now, feed.samples(step))

    must_agree = cfg.run.time_limit is not None or cfg.run.target_accuracy is not None
    steps_done, loss = 0, float("nan")
    classes = data.num_classes if data.task == "classification" else None
    health = Health(total_steps=feed.limit, classes=classes)
    settings, asynchronous = cfg.settings(), is_asynchronous(cfg.to_flat())

    def health_event(state: str, loss: float) -> str | None:
        """Log a change of health in metrics.jsonl; returns its hint (None for ok)."""
        why = None if state == "ok" else hint(state, settings, asynchronous)
        log.log("health", time=clock(), worker=rank, step=steps_done, state=state, loss=loss, hint=why)
        return why

    def record(wall: float, loss: float | None) -> dict:
        """This worker's final record, as the summary reads it (summary.py)."""
        return {"steps": steps_done, "wall_seconds": wall, "bytes_sent": traffic.bytes_sent,
                "bytes_recv": traffic.bytes_recv, "traffic": traffic.snapshot(), "loss": loss,
                "slept": emulator.slept, "diverging": health.state == "diverging", "health": health.state,
                "health_step": health.step, "device": str(device), "backend": backend, **timer.fields()}

    try:
        step = steps_done = feed.start(resumed)
        if step and health.chance_loss is not None:
            health.baseline(health.chance_loss)  # joined midway: the job started at chance
        while step < feed.limit:
            emulator.at_step(step)
            idx = feed.indices(step)
            if idx is None:
                break  # the job has no more work for this worker
            while True:
                x, y = data.x_train[idx].to(device, non_blocking=True), data.y_train[idx].to(device, non_blocking=True)
                try:
                    with timer.stepping():
                        stats = strategy.step(x, y)
                    break
                except Regrouped as again:  # the group re-formed during the step
                    if again.completed:
                        stats = StepStats(loss=again.loss)
                        break
                    idx = feed.retry(step)
            loss = stats.loss
            step = steps_done = step + 1
            more = feed.stepped(steps_done)
            if not math.isfinite(loss):
                # The end of training on this worker; it still leaves a record saying so,
                # so the summary written after the job fails has its health and step.
                health.diverged(steps_done)
                why = health_event("diverging", loss)
                store_set_json(store, f"stats/worker/{rank}", {**record(clock(), None), "non_finite_loss": True})
                raise NonFiniteLoss(f"worker {rank}: the training loss became {loss} at step {steps_done - 1}: "
                                    f"{why}")
            changed = health.observe(steps_done, loss)
            if changed is not None:
                # Async training diverges without NaNs, or stalls at chance; say so while it
                # happens, not after.
                why = health_event(changed, loss)
                if why is None:
                    logger.warning("worker %d: training is learning again at step %d (loss %.4g)", rank, steps_done,
                                   loss)
                else:
                    logger.warning("worker %d: training is %s at step %d (loss %.4g): %s", rank, changed,
                                   steps_done, loss, why)
            if steps_done % cfg.run.log_every == 0 or steps_done == feed.limit:
                # samples: the job's total (metrics.py), so that job throughput is its slope
                # whatever the strategy; worker_samples: this worker's own count of it.
                log.log("train", time=clock(), worker=rank, step=steps_done, loss=loss,
                        samples=feed.publish(steps_done), worker_samples=feed.samples(steps_done),
                        bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv, staleness=stats.staleness,
                        **timer.fields())
            if cfg.run.eval_every and steps_done % cfg.run.eval_every == 0:
                now = clock()
                evaluate_snapshot(strategy.snapshot(rank), steps_done, now)  # on every worker: it may be a collective
            if checkpointer is not None and checkpointer.plan.due(steps_done):
                checkpointer.write(steps_done, strategy.checkpoint_state())
            if must_agree and steps_done % cfg.run.log_every == 0:
                over = cfg.run.time_limit is not None and clock() >= cfg.run.time_limit
                reached = evaluator is not None and evaluator.reached.is_set()
                if strategy.agree(over or reached):
                    break
            if not more:
                break
        if checkpointer is not None:
            checkpointer.leave()
        wall = clock()
        # The strategy hands the finished model to the worker that evaluates it (worker 0
        # unless it may be lost); it may wait here for the other workers to finish.
        final = strategy.snapshot(rank, final=True)
        if final.fields:
            log.log("strategy", time=wall, worker=rank, step=steps_done, **final.fields)
        replica_acc = replica_loss = None
        if final.replica is not None and evaluates_replica:
            if replica_eval is None:
                replica_eval = SnapshotEvaluator(final.replica, data.x_test, data.y_test, device, log, None,
                                                 model_label=f"worker{rank}")
            replica_eval.close()
            replica_loss, replica_acc = evaluate(final.replica, data.x_test, data.y_test, device)
            if not replica_eval.results or replica_eval.results[-1].step != steps_done:
                replica_eval.record(Evaluation(step=steps_done, time=wall, samples=feed.samples(steps_done),
                                               accuracy=replica_acc, loss=replica_loss))
        if final.model is not None and evaluator is None:
            evaluator = SnapshotEvaluator(final.model, data.x_test, data.y_test, device, log, cfg.run.target_accuracy)
        if evaluator is not None:
            evaluator.close()
        if final.model is not None:
            record_final_evaluation(final.model, data, device, evaluator, store, cfg, run_dir, steps=steps_done,
                                    wall=wall, samples=lambda: feed.seen(steps_done),
                                    replica=(replica_acc, replica_loss))
        done = strategy.finish(cfg, rank)
        store_set_json(store, f"stats/worker/{rank}", {
            **record(wall, loss), "update_budget": feed.budget.total if feed.budget is not None else None,
            "checkpoints": checkpointer.written if checkpointer is not None else [], **done.record})
        if done.wait:
            store_barrier(store, "train/done", workers, cfg.cluster.timeout)
    finally:
        for open_evaluator in (evaluator, replica_eval):
            if open_evaluator is not None:
                open_evaluator.close()
        log.close()
        strategy.close()


def _resume(cfg: JobConfig, strategy, feed: Feed, store, rank: int) -> int:
    """Load this worker's part of the checkpoint ``cfg.run.resume`` (its steps, random
    state and strategy state); returns the steps it had made. Worker 0 gives the feed the
    updates the whole job had made (a budget the workers share counts on from there)."""
    folder = Path(cfg.run.resume)
    steps = 0
    if (folder / f"worker-{rank}.pt").is_file():
        mine = load_piece(folder, f"worker-{rank}")
        steps = int(mine["steps"])
        torch.set_rng_state(mine["rng"])
        strategy.restore_checkpoint(mine, lambda name: load_piece(folder, name))
    if rank == 0:
        feed.restore(lambda: sum(int(load_piece(folder, p.stem)["steps"]) for p in folder.glob("worker-*.pt")))
    return steps


def _target_recorder(store, cfg: JobConfig):
    """Records when the target accuracy was first reached in the store (``stats/target``),
    so the summary has it even if this worker is lost before the end."""
    if cfg.run.target_accuracy is None:
        return None
    own = store.clone()  # the evaluator thread must not share the training thread's connection
    return lambda seconds: store_set_json(own, "stats/target", {"time": seconds})


def record_final_evaluation(model: nn.Module, data: Dataset, device: torch.device, evaluator: SnapshotEvaluator,
                            store, cfg: JobConfig, run_dir: Path | None, *, steps: int, wall: float,
                            samples: Callable[[], int],
                            replica: tuple[float | None, float | None] = (None, None)) -> None:
    """The job's final evaluation, by the process that holds the whole final model: test
    ``model``, record it as the last snapshot unless one is at ``steps`` already
    (``samples()`` trained on by then), save it under ``--save-model``, and leave the
    ``stats/eval`` record the summary reads (``replica``: one replica's own accuracy and
    loss, where the strategy's global model is not a replica's)."""
    loss, accuracy = evaluate(model, data.x_test, data.y_test, device)
    if not evaluator.results or evaluator.results[-1].step != steps:
        evaluator.record(Evaluation(step=steps, time=wall, samples=samples(), accuracy=accuracy, loss=loss))
    if run_dir is not None and cfg.run.save_model:
        # Host tensors wherever it trained: the file loads on a machine without a GPU.
        torch.save({key: value.detach().cpu() for key, value in model.state_dict().items()}, run_dir / "model.pt")
    classes = data.num_classes if data.task == "classification" else None
    store_set_json(store, "stats/eval", {
        "final_test_accuracy": accuracy, "final_test_loss": loss, "steps": steps,
        "wall_seconds": wall, "time_to_target": evaluator.time_to_target,
        "evaluations": len(evaluator.results), "skipped": evaluator.skipped,
        "replica_test_accuracy": replica[0], "replica_test_loss": replica[1],
        "chance_accuracy": 1 / classes if classes else None})


def role_main(cfg: JobConfig, info: ProcessInfo, store, run_dir: Path | None) -> None:
    """Run a non-worker process (server, aggregator) of the job's strategy."""
    device, backend = start_process(cfg, info.local_rank)
    log = MetricsLog(run_dir)
    ctx = RoleContext(info=info, store=store, cfg=cfg, traffic=Traffic(),
                      emulator=Emulator(cfg.cluster, info.role, info.rank), device=device, backend=backend,
                      run_dir=run_dir, log=log)
    try:
        if cfg.parallel.partitioned:
            _run_group_role(cfg, ctx)
        else:
            strategy_class(cfg.strategy.strategy).run_role(info.role, info.rank, ctx)
    finally:
        log.close()


def _run_group_role(cfg: JobConfig, ctx: RoleContext) -> None:
    """A server (aggregator, centre) of one stage group (``stage_groups.py``): the
    strategy's own role, in the group's namespace of the store, as process ``local`` of a
    job of its own; its final record is then copied under its job-wide name."""
    from plexus.train.stage_groups import group_config, group_store, locate
    info = ctx.info
    slot = locate(cfg, info.role, info.rank)
    store = group_store(ctx.store, slot.group)
    group = group_config(cfg, slot.group)
    mine = dataclasses.replace(ctx, info=dataclasses.replace(info, rank=slot.local, world_size=group.cluster.workers),
                               store=store, cfg=group, emulator=Emulator(group.cluster, info.role, slot.local))
    strategy_class(cfg.strategy.strategy).run_role(info.role, slot.local, mine)
    key = f"stats/{info.role}/{slot.local}"
    if store.check([key]):
        store_set_json(ctx.store, f"stats/{info.role}/{info.rank}", {**store_get_json(store, key), "group": slot.group})
