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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from plexus.cluster.launcher import RoleSpec, launch
from plexus.cluster.rendezvous import ProcessInfo, connect_store, host_store, job_namespace, new_token
from plexus.collectives import get_algorithm
from plexus.config import JobConfig
from plexus.errors import ConfigError, JobFailed
from plexus.strategies import strategy_class
from plexus.train.data import load_dataset
from plexus.train.models import build_model
from plexus.train.runner import save_dataset, worker_main
from plexus.train.summary import assemble_summary, collect_records, write_summary

__all__ = ["run", "run_local", "run_torchrun", "prepare_run_dir", "validate"]

logger = logging.getLogger(__name__)


def validate(cfg: JobConfig):
    """Check names and the model/dataset fit before any process starts; returns the
    loaded dataset so it is read once."""
    strategy_class(cfg.strategy.strategy).check_config(cfg)
    get_algorithm(cfg.strategy.algorithm, cfg.strategy)
    data = load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    build_model(cfg.model, data)
    if cfg.run.batch_size > len(data.x_train):
        raise ConfigError(f"batch_size must not exceed the training set ({len(data.x_train)} samples), "
                          f"got {cfg.run.batch_size}: pass a smaller --batch-size")
    return data


def warn_risks(cfg: JobConfig) -> None:
    """One line on stderr for each value the user set that is risky here (``config.defaults``)."""
    from plexus.config.defaults import risks
    for line in risks(cfg.to_flat(), cfg.sources):
        logger.warning("plexus: warning: %s", line)


def prepare_run_dir(cfg: JobConfig) -> Path:
    """Create the run directory (default ``runs/<time>-<strategy>``) and write config.json;
    results of an earlier run in the same directory are removed."""
    out = Path(cfg.run.out) if cfg.run.out else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy.strategy}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {out}: {exc.strerror}: pass another --out") from None
    for stale in ("metrics.jsonl", "summary.json", "model.pt"):
        (out / stale).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return out


def _python_path() -> str:
    """sys.path of this process, so children import the user's modules the parent can."""
    entries = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
    return os.pathsep.join(dict.fromkeys(entries))


def run_local(cfg: JobConfig, poll: Callable[[Path], None] | None = None, sink=None) -> tuple[Path, dict[str, Any]]:
    """Run the job on this machine; returns (run directory, summary).

    Raises ConfigError before anything starts, JobFailed if a process fails.
    """
    data = validate(cfg)
    warn_risks(cfg)
    run_dir = prepare_run_dir(cfg)
    token = os.environ.get("PLEXUS_TOKEN") or new_token()
    store = host_store(cfg.cluster.host, cfg.cluster.port, token, cfg.cluster.timeout)
    cache = Path(tempfile.mkdtemp(prefix="plexus-data-"))
    try:
        save_dataset(data, cache)
        env = {**os.environ, "MASTER_ADDR": cfg.cluster.host, "MASTER_PORT": str(store.port),
               "WORLD_SIZE": str(cfg.cluster.workers), "PLEXUS_TOKEN": token,
               "PLEXUS_CONFIG": str(run_dir / "config.json"), "PLEXUS_RUN_DIR": str(run_dir),
               "PLEXUS_DATA": str(cache), "PYTHONPATH": _python_path(), "PLEXUS_WORKERS": str(cfg.cluster.workers),
               "PLEXUS_DEBUG": "1" if cfg.run.debug else ""}
        cls = strategy_class(cfg.strategy.strategy)
        roles = _roles(cfg)
        lost: dict[str, list[int]] = {}

        def on_exit(spec: RoleSpec, code: int) -> None:
            if code != 0:
                lost.setdefault(spec.role, []).append(spec.rank)

        # The job's own timeouts end it; this outer limit only catches what they cannot.
        limit = None if cfg.run.time_limit is None else cfg.run.time_limit + 10 * cfg.cluster.timeout
        from plexus.train import process
        status = launch([sys.executable, "-m", "plexus.train.process"], roles, env=env, entry=process.main,
                        threads=cfg.cluster.threads,
                        may_fail=lambda spec, code: cls.tolerates_loss(cfg, spec.role, spec.rank),
                        poll=(lambda: poll(run_dir)) if poll else None, sink=sink, time_limit=limit,
                        on_exit=on_exit)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    failed = None
    if status != 0:
        failed = JobFailed(f"the job failed (status {status}); see the messages above", exit_code=status)
    elif len(lost.get("worker", [])) == cfg.cluster.workers:
        failed = JobFailed(f"every worker was lost ({cfg.cluster.workers} of {cfg.cluster.workers}); "
                           f"nothing is left to finish the job", exit_code=1)
    if failed is not None:
        _summarise_failure(cfg, run_dir, _job_store(store, token), lost)
        raise failed
    summary = assemble_summary(cfg, collect_records(cfg, _job_store(store, token), lost), lost)
    summary["status"] = "completed"
    write_summary(run_dir, summary)
    _write_report(run_dir)
    return run_dir, summary


def _summarise_failure(cfg: JobConfig, run_dir: Path, store, lost: dict[str, list[int]]) -> None:
    """summary.json of a failed job, marked ``failed``, from the records that reached the
    store; and its health hint, which often says why it failed. Best effort: it must never
    hide the failure itself."""
    try:
        summary = assemble_summary(cfg, collect_records(cfg, store, lost), lost)
    except Exception as exc:  # noqa: BLE001 - records of a failed job may be partial
        logger.debug("plexus: no summary of the failed job: %s", exc)
        return
    summary["status"] = "failed"
    write_summary(run_dir, summary)
    if summary.get("health", "ok") != "ok":
        logger.warning("plexus: training %s (detected at step %s): %s", summary["health"], summary["health_step"],
                       summary["health_hint"])


def _roles(cfg: JobConfig) -> list[RoleSpec]:
    """Every process of the job: the workers, then the strategy's other roles. Global
    ranks (RANK) are unique across roles; PLEXUS_ROLE_RANK is the rank within the role."""
    specs = [RoleSpec("worker", r, {"RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(cfg.cluster.workers)]
    for role, count in strategy_class(cfg.strategy.strategy).extra_roles(cfg):
        for r in range(count):
            specs.append(RoleSpec(role, r, {"RANK": str(len(specs)), "LOCAL_RANK": str(len(specs))}))
    return specs


def _job_store(store, token: str):
    import torch.distributed as dist
    return dist.PrefixStore(job_namespace(token), store)


def _write_report(run_dir: Path) -> None:
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
    cfg = config if isinstance(config, JobConfig) else JobConfig.from_flat(config)
    run_dir, summary = run_local(cfg)
    return {**summary, "run_dir": str(run_dir)}


def run_torchrun(cfg: JobConfig) -> dict[str, Any] | None:
    """One worker of a job launched by torchrun (roles and ranks from its environment)."""
    info = ProcessInfo.from_env()
    if info.world_size != cfg.cluster.workers:
        cfg = cfg.replace(workers=info.world_size)
    if strategy_class(cfg.strategy.strategy).extra_roles(cfg):
        raise ConfigError(f"strategy {cfg.strategy.strategy} needs roles besides workers; under torchrun "
                          f"only workers start: use the local launcher (plexus train) on one machine")
    store = connect_store(info, cfg.cluster.timeout)
    if info.rank == 0:
        warn_risks(cfg)
    run_dir = prepare_run_dir(cfg) if info.rank == 0 else None
    worker_main(cfg, info, store, run_dir)
    if info.rank != 0:
        return None
    summary = assemble_summary(cfg, collect_records(cfg, store, wait=cfg.cluster.timeout))
    if run_dir is not None:
        write_summary(run_dir, summary)
        _write_report(run_dir)
    return summary
