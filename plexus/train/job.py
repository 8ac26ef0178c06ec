"""A whole training job: validate, prepare the run directory, start every role, collect.

``run(config)`` is the Python API behind ``plexus train``: it starts the processes on this
machine through the local launcher and returns the summary. ``run_torchrun`` is what a
process started by ``torchrun`` runs instead: one worker of a job that spans machines.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from plexus.cluster.launcher import RoleSpec, first_failure, launch
from plexus.cluster.liveness import Pulse, exit_time, exited_key, explain_loss
from plexus.cluster.rendezvous import (ProcessInfo, connect_store, first_line, gloo_interface_towards,
                                       host_store, job_namespace, new_token, store_set_json, wait_keys)
from plexus.collectives import get_algorithm
from plexus.config import JobConfig
from plexus.errors import CommError, CommTimeout, ConfigError, JobFailed, JobInterrupted, PeerLost
from plexus.strategies import strategy_class
from plexus.train.checkpoint import CHECKPOINTS, checkpoint_fields
from plexus.train.data import load_dataset
from plexus.train.models import build_model
from plexus.train.progress import StartupProbe, oversubscription
from plexus.train.runner import role_main, save_dataset, worker_main
from plexus.train.summary import assemble_summary, collect_records, write_summary

__all__ = ["run", "run_local", "run_torchrun", "prepare_run_dir", "validate"]

logger = logging.getLogger(__name__)


def validate(cfg: JobConfig):
    """Check names and the model/dataset fit before any process starts; returns the
    loaded dataset so it is read once. Nothing the user asked for may silently do nothing
    (``preflight.py``): an --out holding an earlier run, a flag the strategy ignores, a
    --kill that cannot fire."""
    from plexus.train import preflight
    preflight.check_run_dir(cfg.run.out, cfg.run.overwrite)
    preflight.check_applies(cfg)
    preflight.check_roles(cfg)
    strategy_class(cfg.strategy.strategy).check_config(cfg)
    from plexus.train.stage_groups import check_stages
    check_stages(cfg)
    get_algorithm(cfg.strategy.algorithm, cfg.strategy)
    data = load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    if cfg.parallel.partitioned:  # a model that does not trace, or a plan that cannot be made
        from plexus.parallel.executor import make_plan
        sample = data.x_train[:cfg.run.batch_size // cfg.cluster.workers]  # one replica's share
        if cfg.model.dtype == "float64":
            model, sample = model.double(), sample.double() if sample.is_floating_point() else sample
        graph, plan = make_plan(cfg, model, sample, check_only=True)
        if cfg.parallel.tensor_parallel > 1:  # every stage must have a layer to split
            from plexus.parallel.executor import stage_examples
            from plexus.parallel.stages import build_stages
            from plexus.parallel.tensor import plan_tensor_split
            programs = build_stages(graph, plan)
            for program, example in zip(programs, stage_examples(programs, sample)):
                try:
                    plan_tensor_split(program.module, cfg.parallel.tensor_parallel, example)
                except ConfigError as exc:
                    part = "model chunk" if cfg.parallel.chunks > 1 else "stage"
                    where = f"{part} {program.index} of {plan.stages}: " if plan.stages > 1 else ""
                    raise ConfigError(f"{where}{exc}") from None
    # (Sandblaster's batch caps at the training set: a larger one is full-batch L-BFGS.)
    if cfg.run.batch_size > len(data.x_train) and cfg.strategy.strategy != "sandblaster":
        raise ConfigError(f"batch_size must not exceed the training set ({len(data.x_train)} samples), "
                          f"got {cfg.run.batch_size}: pass a smaller --batch-size")
    preflight.check_schedule(cfg, len(data.x_train))
    return data


def warn_risks(cfg: JobConfig) -> None:
    """One line on stderr for each value the user set that is risky here (``config.defaults``)."""
    from plexus.config.defaults import risks
    for line in risks(cfg.to_flat(), cfg.sources):
        logger.warning("plexus: warning: %s", line)


# What a run writes into its directory; --overwrite removes these (and the plots, *.png)
# from an earlier run there, and keeps any other file.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "model.pt", "index.html")
# The dataset as the launcher loaded it, for its processes to read; removed when the job
# ends. In the run directory, not the system's temporary folder, so a launcher killed
# with SIGKILL leaves it beside the run it belongs to (the next run there removes it).
DATA_CACHE = ".data"


def prepare_run_dir(cfg: JobConfig) -> Path:
    """Create the run directory and write config.json. An --out that holds files is
    refused unless --overwrite, which removes the earlier run's results (``RUN_FILES``
    and plots). The default, ``runs/<time>-<strategy>``, gets a suffix (-2, -3...) if a
    run of the same second has it."""
    from plexus.train.preflight import check_run_dir
    if cfg.run.out:
        out = Path(cfg.run.out)
        check_run_dir(out, cfg.run.overwrite)
    else:
        base = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy.strategy}"
        out, n = base, 1
        while out.exists():
            n += 1
            out = base.with_name(f"{base.name}-{n}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {out}: {exc.strerror}: pass another --out") from None
    for stale in (*RUN_FILES, *(p.name for p in out.glob("*.png"))):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)  # an earlier run's: --resume must not find them
    shutil.rmtree(out / DATA_CACHE, ignore_errors=True)  # a killed launcher's
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return out


# The store key (in the job's namespace) of the job's strategy, for workers that join.
JOB_KEY = "job/strategy"


def _python_path() -> str:
    """sys.path of this process, so children import the user's modules the parent can."""
    entries = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
    return os.pathsep.join(dict.fromkeys(entries))


def run_local(cfg: JobConfig, poll: Callable[[Path, StartupProbe], None] | None = None, sink=None
              ) -> tuple[Path, dict[str, Any]]:
    """Run the job on this machine; returns (run directory, summary).

    ``poll(run_dir, probe)`` is called about twenty times a second while the job runs (the
    progress display; ``probe`` reads the start-up phase from the job's store).

    Raises ConfigError before anything starts, JobFailed if a process fails, and
    JobInterrupted on SIGINT/SIGTERM (after writing summary.json marked ``interrupted``).
    With ``--debug`` (logging at INFO) it logs the settings that are not dataclass
    defaults and the seconds each phase took.
    """
    phases = _Phases()
    data = validate(cfg)
    from plexus.train import preflight
    from plexus.train.plan import role_plan
    preflight.check_device(cfg, len(role_plan(cfg)))  # every process runs here
    phases.done("validate")
    _log_settings(cfg)
    warn_risks(cfg)
    crowded = oversubscription(cfg)
    if crowded is not None:
        logger.warning("plexus: warning: %s", crowded)
    run_dir = prepare_run_dir(cfg)
    token = os.environ.get("PLEXUS_TOKEN") or new_token()
    store = host_store(cfg.cluster.host, cfg.cluster.port, token, cfg.cluster.timeout)
    # What a `plexus worker --join` asks first: whether this job can take one more worker.
    store_set_json(_job_store(store, token), JOB_KEY, {"strategy": cfg.strategy.strategy,
                                                       "consistency": cfg.strategy.consistency,
                                                       "elastic": cfg.strategy.elastic})
    cache = run_dir / DATA_CACHE
    try:
        save_dataset(data, cache)
        env = {**os.environ, "MASTER_ADDR": cfg.cluster.host, "MASTER_PORT": str(store.port),
               "WORLD_SIZE": str(cfg.cluster.workers), "PLEXUS_TOKEN": token,
               "PLEXUS_CONFIG": str(run_dir / "config.json"), "PLEXUS_RUN_DIR": str(run_dir),
               "PLEXUS_DATA": str(cache), "PYTHONPATH": _python_path(), "PLEXUS_WORKERS": str(cfg.cluster.workers),
               "PLEXUS_DEBUG": "1" if cfg.run.debug else ""}
        cls = strategy_class(cfg.strategy.strategy)
        roles = _roles(cfg)
        probe = StartupProbe(_job_store(store, token), len(roles), cfg.cluster.workers)
        lost: dict[str, list[int]] = {}
        signals: list[int] = []  # the launcher's own SIGINT/SIGTERM: the user stopped the job
        phases.done("prepare")

        # Processes whose failure the job cannot survive, with their exit status, in order.
        failures: list[tuple[str, int]] = []

        def on_exit(spec: RoleSpec, code: int) -> None:
            if code != 0:
                # When, for survivors that re-form without it (strategies/elastic.py).
                # (A --kill records its own time of death there first; that one stands.)
                _job_store(store, token).compare_set(exited_key(f"{spec.role} {spec.rank}"), "", repr(time.time()))
                lost.setdefault(spec.role, []).append(spec.rank)
                if not cls.tolerates_loss(cfg, spec.role, spec.rank):
                    failures.append((f"{spec.role} {spec.rank}", code))

        # The job's own timeouts end it; this outer limit only catches what they cannot.
        limit = None if cfg.run.time_limit is None else cfg.run.time_limit + 10 * cfg.cluster.timeout
        from plexus.train import process
        status = launch([sys.executable, "-m", "plexus.train.process"], roles, env=env, entry=process.main,
                        warm=process.warm,
                        threads=cfg.cluster.threads,
                        may_fail=lambda spec, code: cls.tolerates_loss(cfg, spec.role, spec.rank),
                        poll=(lambda: poll(run_dir, probe)) if poll else None, sink=sink, time_limit=limit,
                        on_exit=on_exit, signals=signals)
        phases.done("processes")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    failed = None
    if signals:
        summary = _summarise_failure(cfg, run_dir, _job_store(store, token), lost, interrupted=signals[0])
        name = signal.Signals(signals[0]).name
        done = f" after {summary['steps']} steps" if summary and summary.get("steps") else ""
        raise JobInterrupted(f"interrupted by {name}{done}; what was measured so far is in "
                             f"{run_dir / 'summary.json'} (status interrupted)", signals[0])
    if status != 0:
        what = f"status {status}"
        if failures:
            # The first to die, by the times in the store (a planned kill records its own
            # time of death; a peer that failed on losing it may be seen exiting first),
            # and one killed by a signal before one that exited on its own.
            job_store = _job_store(store, token)
            first, status = first_failure(sorted(failures, key=lambda f: exit_time(job_store, f[0])))
            what = f"{first} exited with status {status}"
        failed = JobFailed(f"the job failed ({what}); see the messages above", exit_code=status)
    elif len(lost.get("worker", [])) == cfg.cluster.workers:
        # Name the other processes that died first (a shard's primary and its replicas, say).
        job_store = _job_store(store, token)
        others = sorted((f"{role} {r}" for role, ranks in lost.items() if role != "worker" for r in ranks),
                        key=lambda name: exit_time(job_store, name))
        after = f" after {', '.join(others)} died" if others else ""
        failed = JobFailed(f"every worker was lost ({cfg.cluster.workers} of {cfg.cluster.workers}){after}; "
                           f"nothing is left to finish the job", exit_code=1)
    if failed is not None:
        _summarise_failure(cfg, run_dir, _job_store(store, token), lost)
        raise failed
    summary = assemble_summary(cfg, collect_records(cfg, _job_store(store, token), lost), lost)
    summary["status"] = "completed"
    summary.update(checkpoint_fields(cfg, run_dir))
    write_summary(run_dir, summary)
    _write_report(cfg, run_dir)
    phases.done("summary")
    phases.log(summary.get("wall_seconds"))
    return run_dir, summary


class _Phases:
    """Seconds of each phase of run_local, logged at INFO (``--debug``)."""

    def __init__(self) -> None:
        self.last = self.start = time.monotonic()
        self.seconds: dict[str, float] = {}

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name], self.last = now - self.last, now

    def log(self, training: float | None) -> None:
        parts = dict(self.seconds)
        if training is not None and "processes" in parts:
            # The processes' phase is start-up (spawn, rendezvous, first batch) and training.
            processes = parts.pop("processes")
            parts = {**{k: v for k, v in parts.items() if k != "summary"}, "start-up": max(0.0, processes - training),
                     "training": training, "summary": parts.get("summary", 0.0)}
        logger.info("plexus: phases (s): %s; total %.2f", ", ".join(f"{k} {v:.2f}" for k, v in parts.items()),
                    time.monotonic() - self.start)


def _log_settings(cfg: JobConfig) -> None:
    """``--debug``: the effective values that are not dataclass defaults, with their sources."""
    if not logger.isEnabledFor(logging.INFO):
        return
    changed = {k: v for k, v in cfg.settings().items() if v["source"] != "default"}
    logger.info("plexus: settings: %s", ", ".join(f"{k}={json.dumps(v['value'])} ({v['source']})"
                                                  for k, v in changed.items()))


def _summarise_failure(cfg: JobConfig, run_dir: Path, store, lost: dict[str, list[int]],
                       interrupted: int | None = None) -> dict[str, Any] | None:
    """summary.json of a job that did not finish, from the records that reached the store;
    returns it (None when there is none). Best effort: it must never hide the failure itself.

    A failed job's summary is marked ``failed``, and its health hint often says why. A job
    stopped by signal ``interrupted`` (Ctrl-C, SIGTERM) is marked ``interrupted``: its
    workers left no final record, so each one's figures are those of its last ``train``
    event in metrics.jsonl, and the test accuracy that of the last snapshot evaluated
    (``measured_from``). Workers that were stopped are not lost (``lost_workers`` keeps
    only those that died before the signal)."""
    try:
        records = collect_records(cfg, store, lost)
        if interrupted is not None:
            _records_from_events(cfg, run_dir, records)
        summary = assemble_summary(cfg, records, lost)
    except Exception as exc:  # noqa: BLE001 - records of a failed job may be partial
        logger.debug("plexus: no summary of the unfinished job: %s", exc)
        return None
    if interrupted is not None:
        summary["status"] = "interrupted"
        summary["interrupted_by"] = signal.Signals(interrupted).name
        summary["measured_from"] = "the last train event of each worker and the last snapshot evaluated"
        summary["lost_workers"] = sorted(lost.get("worker", []))
    else:
        summary["status"] = "failed"
    write_summary(run_dir, summary)
    if interrupted is None and summary.get("health", "ok") != "ok":
        # The same words as a completed run's closing line (cli._print_summary).
        logger.warning("plexus: warning: training %s (detected at step %s): %s", summary["health"],
                       summary["health_step"], summary["health_hint"])
    return summary


# Fields of a train event that are not a worker's final-record fields of the same name.
_EVENT_ONLY = ("event", "time", "worker", "step", "samples", "worker_samples")


def _records_from_events(cfg: JobConfig, run_dir: Path, records: dict[str, Any]) -> None:
    """Fill in, from metrics.jsonl, the final records an interrupted job's processes never
    wrote: each worker's last train event, and the last evaluation of the global model."""
    from plexus.train.metrics import read_events
    last: dict[int, dict[str, Any]] = {}
    evals: list[dict[str, Any]] = []
    for event in read_events(run_dir):
        if event.get("event") == "train":
            last[int(event["worker"])] = event
        elif event.get("event") == "eval" and event.get("model", "global") == "global":
            evals.append(event)
    for rank, event in last.items():
        if rank not in records["worker"]:
            records["worker"][rank] = {**{k: v for k, v in event.items() if k not in _EVENT_ONLY},
                                       "steps": event["step"], "wall_seconds": event["time"], "slept": None}
    if not records["eval"] and evals:
        records["eval"] = {"final_test_accuracy": evals[-1]["test_accuracy"],
                           "final_test_loss": evals[-1]["test_loss"], "evaluations": len(evals)}
    if not records["target"] and cfg.run.target_accuracy is not None:
        hit = next((e["time"] for e in evals if e["test_accuracy"] >= cfg.run.target_accuracy), None)
        if hit is not None:
            records["target"] = {"time": hit}


def _roles(cfg: JobConfig) -> list[RoleSpec]:
    """Every process of the job, as the role plan orders them (train/plan.py). Global
    ranks (RANK) are unique across roles; PLEXUS_ROLE_RANK is the rank within the role."""
    from plexus.train.plan import role_plan
    slots = role_plan(cfg)
    # Every process runs on this machine: PLEXUS_PROCESSES_HERE tells --backend auto
    # whether each has a GPU of its own (runner.choose_backend).
    return [RoleSpec(slot.role, slot.rank, {"RANK": str(g), "LOCAL_RANK": str(g),
                                            "PLEXUS_PROCESSES_HERE": str(len(slots))})
            for g, slot in enumerate(slots)]


def _job_store(store, token: str):
    import torch.distributed as dist
    return dist.PrefixStore(job_namespace(token), store)


def _write_report(cfg: JobConfig, run_dir: Path) -> None:
    if cfg.run.no_report or os.environ.get("PLEXUS_NO_REPORT", "") not in ("", "0"):
        return
    from plexus.report import write_report
    try:
        write_report([run_dir])
    except Exception as exc:  # a failed plot must not fail a finished run
        logger.warning("plexus: could not write the report of %s: %s", run_dir, exc)


def run(config: JobConfig | dict[str, Any]) -> dict[str, Any]:
    """Train as ``plexus train`` would, on this machine; returns the summary.

    ``config`` is a JobConfig or a flat dict of the CLI's keys, e.g.
    ``plexus.run({"strategy": "allreduce", "workers": 2, "model": "mypkg.nets:make"})``.
    """
    if isinstance(config, JobConfig):
        cfg = config
    elif config.get("resume"):
        from plexus.train.checkpoint import resumed_config
        cfg = resumed_config(config)
    else:
        cfg = JobConfig.from_flat(config)
    run_dir, summary = run_local(cfg)
    return {**summary, "run_dir": str(run_dir)}


# Set by the writer of a torchrun job once it holds every record (run_torchrun).
_SUMMARISED_KEY = "job/summarised"


def run_torchrun(cfg: JobConfig) -> dict[str, Any] | None:
    """One process of a job launched by torchrun: its role and rank within the role come
    from the role plan (train/plan.py) at its global RANK of WORLD_SIZE. Worker 0 (under
    ``--stages``, replica 0's output stage) writes the run directory and returns the
    summary; every other process returns None."""
    import dataclasses
    from plexus.train.plan import plan_for_world, writer_slot
    from plexus.train.preflight import check_applies
    from plexus.train.stage_groups import check_stages
    info = ProcessInfo.from_env()
    gloo_interface_towards(info.master_addr)  # before any link is made
    global_rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg, slots = plan_for_world(cfg, world)
    check_applies(cfg)
    strategy_class(cfg.strategy.strategy).check_config(cfg)
    check_stages(cfg)
    slot, writer = slots[global_rank], writer_slot(cfg)
    info = dataclasses.replace(info, role=slot.role, rank=slot.rank, world_size=cfg.cluster.workers)
    store = connect_store(info, cfg.cluster.timeout)
    pulse = Pulse(store, info.name, info.master_addr, cfg.cluster.timeout)
    run_dir = None
    try:
        if slot == writer:
            warn_risks(cfg)
            run_dir = prepare_run_dir(cfg)
        if slot.role == "stage":
            from plexus.train.stage_runner import stage_main
            stage_main(cfg, info, store, run_dir)
        elif slot.role == "worker":
            worker_main(cfg, info, store, run_dir)
        else:
            role_main(cfg, info, store, None)
        pulse.finish()
    except dist.DistError as exc:
        # The store or a gloo peer went away under this process (its host was cut off, or
        # the job ended without it): one line naming who and where, not c10d's C++ stack.
        raise PeerLost(f"{info.name} on {socket.gethostname()}: lost the job at {info.master_addr}:"
                       f"{info.master_port}: {first_line(exc)}", peer="store") from None
    except CommError as exc:
        # No launcher watches the other hosts: name the processes that went silent.
        raise explain_loss(exc, store, info.name, [s.name for s in slots], info.master_addr) from None
    finally:
        pulse.stop()
    if slot != writer:
        if info.hosts_store:
            # The store lives in this process: stay until the writer has read the records
            # (it waits up to --timeout for them), or it would lose them with the store.
            try:
                wait_keys(store, [_SUMMARISED_KEY], 2 * cfg.cluster.timeout, f"{writer.name}'s summary")
            except CommTimeout as exc:
                logger.warning("plexus: %s: %s", info.name, exc)
        return None
    # Under torchrun no launcher sees a process die: a peer that declared one lost says so in
    # the store, and the records wait only for the others.
    records = collect_records(cfg, store, wait=cfg.cluster.timeout)
    store.set(_SUMMARISED_KEY, "1")
    summary = assemble_summary(cfg, records, records["lost"])
    summary["status"] = "completed"
    if run_dir is not None:
        write_summary(run_dir, summary)
        _write_report(cfg, run_dir)
    return summary
