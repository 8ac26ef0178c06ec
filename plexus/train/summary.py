"""summary.json, assembled from the final records every process leaves in the store.

Each process writes ``stats/<role>/<rank>`` (JSON) when it finishes; the process that
evaluates the global model writes ``stats/eval``. The summary is assembled by whoever
outlives the others: the local launcher (which hosts the store, so the summary survives
the loss of any worker), or worker 0 under torchrun.

A process started by the local launcher also leaves its CPU time, ``cpu/<role>/<rank>``,
once its role has returned (``process.report_cpu``); it joins that process's record as
``cpu_seconds``. Under torchrun and Ray no process leaves one, and ``cpu_seconds`` is null.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from plexus.cluster.rendezvous import lost_key, store_get_json
from plexus.config import JobConfig
from plexus.config.applies import applies
from plexus.config.defaults import is_asynchronous
from plexus.errors import CommTimeout
from plexus.strategies import strategy_class
from plexus.strategies.base import ONE_MACHINE_SOURCE
from plexus.train.health import CHANCE_MARGIN, hint, worst
from plexus.train.metrics import FIGURES
from plexus.train.plan import other_roles

logger = logging.getLogger(__name__)

__all__ = ["collect_records", "assemble_summary", "write_summary", "judge_health", "cpu_key", "FIGURES"]


# Entries of collect_records' result that are not the records of a role besides the workers.
# (A replica cut into stages leaves its own record as worker 0, which counts the stages'
# bytes: their records are per-stage figures, not more senders.)
_NOT_OTHER_ROLES = ("worker", "eval", "target", "lost", "stage")


def cpu_key(role: str, rank: int) -> str:
    """The store key of a process's CPU seconds (``process.report_cpu``)."""
    return f"cpu/{role}/{rank}"


def _present(store, key: str) -> bool:
    return store.check([key])


def _await_records(store, role: str, ranks: list[int], wait: float) -> list[int]:
    """Wait up to ``wait`` seconds until every rank of ``role`` has left its record or was
    declared lost by a peer (``lost_key``); returns the ranks declared lost."""
    deadline = time.monotonic() + wait
    while True:
        lost = [r for r in ranks if store.check([lost_key(f"{role} {r}")])]
        missing = [r for r in ranks if r not in lost and not store.check([f"stats/{role}/{r}"])]
        if not missing:
            return lost
        if time.monotonic() >= deadline:
            keys = ", ".join(f"stats/{role}/{r}" for r in missing)
            raise CommTimeout(f"timed out after {wait:g} s waiting for the final records of every {role}: "
                              f"missing {keys}", peer=keys)
        time.sleep(0.05)


def collect_records(cfg: JobConfig, store, lost: dict[str, list[int]] | None = None,
                    wait: float | None = None) -> dict[str, Any]:
    """The final records of every process that was not lost: {"worker": {r: ...},
    "server": {...}, ..., "eval": {...}, "lost": {role: [ranks]}}. With ``wait``, wait that
    long for the records of live processes (torchrun, where they may still be finishing, and
    where a lost process is known only by the peer that declared it lost)."""
    lost = {role: list(ranks) for role, ranks in (lost or {}).items()}
    cls = strategy_class(cfg.strategy.strategy)
    counts = {"worker": cfg.cluster.workers + cls.joined_workers(store), **dict(other_roles(cfg))}
    if cfg.parallel.partitioned:
        counts["stage"] = cfg.parallel.per_replica * cfg.cluster.workers  # K stages x T shards per replica
    late: dict[str, list[int]] = {}
    for role, rank in cls.late_records(cfg, store):
        late.setdefault(role, []).append(rank)
    for role, ranks in late.items():  # written by processes the launcher did not start
        try:
            _await_records(store, role, ranks, wait if wait is not None else cfg.cluster.timeout)
        except CommTimeout as exc:
            logger.warning("plexus: %s", exc)
    records: dict[str, Any] = {}
    for role, count in counts.items():
        if wait is not None:
            declared = _await_records(store, role, [r for r in range(count) if r not in lost.get(role, [])], wait)
            if declared:
                lost[role] = sorted(set(lost.get(role, [])) | set(declared))
        # A lost process may have left a record before it ended (a worker whose loss became
        # non-finite says so); a killed one has none.
        keys = {r: f"stats/{role}/{r}" for r in range(count)}
        records[role] = {r: store_get_json(store, k) for r, k in keys.items() if _present(store, k)}
        for r, record in records[role].items():
            if _present(store, cpu_key(role, r)):
                record["cpu_seconds"] = store_get_json(store, cpu_key(role, r))["cpu_seconds"]
    records["eval"] = store_get_json(store, "stats/eval") if _present(store, "stats/eval") else {}
    records["target"] = store_get_json(store, "stats/target") if _present(store, "stats/target") else {}
    records["lost"] = {role: ranks for role, ranks in lost.items() if ranks}
    return records


def assemble_summary(cfg: JobConfig, records: dict[str, Any], lost: dict[str, list[int]] | None = None
                     ) -> dict[str, Any]:
    cls = strategy_class(cfg.strategy.strategy)
    workers = records["worker"]
    ev = records["eval"]
    wall = ev.get("wall_seconds") or max((w["wall_seconds"] for w in workers.values()), default=0.0)
    if cls.synchronous:
        steps = ev.get("steps", max((w["steps"] for w in workers.values()), default=0))
        samples = steps * cfg.run.batch_size
    else:
        steps = sum(w["steps"] for w in workers.values())
        samples = steps * (cfg.run.batch_size // cfg.cluster.workers)
    sent = [workers[r]["bytes_sent"] if r in workers else None for r in range(cfg.cluster.workers)]
    others = sum(rec["bytes_sent"] for role, recs in records.items() if role not in _NOT_OTHER_ROLES
                 for rec in recs.values())
    summary: dict[str, Any] = {
        "strategy": cfg.strategy.strategy,
        # null where the strategy has no all-reduce algorithm or no servers (config/applies.py);
        # strategies with servers give their count (ps: --servers 0 means one).
        "algorithm": cfg.strategy.algorithm if applies("algorithm", cfg.strategy.strategy) else None,
        "workers": cfg.cluster.workers,
        "servers": cfg.cluster.servers if applies("servers", cfg.strategy.strategy) else None,
        "dataset": cfg.data.dataset,
        "model": cfg.model.model,
        # Where the workers computed and what carried their messages (--device, --backend).
        "device": next((w.get("device") for w in workers.values() if w.get("device")), None),
        "backend": next((w.get("backend") for w in workers.values() if w.get("backend")), None),
        "steps": steps,
        "samples": samples,
        "final_test_accuracy": ev.get("final_test_accuracy"),
        "final_test_loss": ev.get("final_test_loss"),
        "wall_seconds": wall,
        "samples_per_second": samples / wall if wall else None,
        # Worker 0's evaluator records the time when it happens, in case worker 0 is lost.
        "time_to_target_seconds": ev.get("time_to_target") if ev.get("time_to_target") is not None
        else records.get("target", {}).get("time"),
        "target_accuracy": cfg.run.target_accuracy,
        "bytes_sent_total": sum(b for b in sent if b is not None) + others,
        "bytes_sent_per_worker": sent,
        # Synchronous updates are computed on the current model: one update per step,
        # staleness 0. Asynchronous strategies override these from their servers' records.
        "updates_applied": steps,
        "staleness_mean": 0.0,
        "staleness_max": 0,
        "lost_workers": sorted((lost or {}).get("worker", [])),
        "evaluations": ev.get("evaluations", 0),
        "snapshots_skipped": ev.get("skipped", 0),
        # Workers whose training loss stayed above 10x its first value (health.py; runner.py warns as it happens).
        "diverging_workers": sorted(r for r, w in workers.items() if w.get("diverging")),
        "emulated_sleep_seconds": [workers[r]["slept"] if r in workers else None
                                   for r in range(cfg.cluster.workers)],
    }
    staged: dict[str, Any] = {}
    if not cfg.parallel.partitioned:
        summary.update(cls.summary_fields(cfg, records))
    else:
        staged, job = _stages(cfg, records)
        summary.update(job)
    summary.update(_figures(cfg, records, summary, sent))
    summary.update(judge_health(cfg, workers, ev, summary))
    summary.update(staged)
    summary["settings"] = cfg.settings()
    if summary["algorithm"] not in (None, cfg.strategy.algorithm):  # the default's choice (strategies/base.py)
        summary["settings"]["algorithm"] = {"value": summary["algorithm"], "source": ONE_MACHINE_SOURCE}
    return summary


def _stages(cfg: JobConfig, records: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job of replicas cut into stages: (the stages' figures (``stage_summary``), each
    stage group's strategy figures (its ``summary_fields`` over the group's records, as
    for a job of its own) and the bytes each stage sent to each server; the job's own
    strategy figures (steps, updates applied, staleness), which are stage group 0's:
    every group trains on the same batches, one update per step of its replicas)."""
    from plexus.parallel.executor import stage_summary
    from plexus.train.stage_groups import group_config, group_records, server_traffic
    out = stage_summary(records.get("stage", {}))
    cls = strategy_class(cfg.strategy.strategy)
    groups = group_records(cfg, records)
    fields = {row["group"]: cls.summary_fields(group_config(cfg, row["group"]), groups[row["group"]])
              for row in out.get("stage_groups", [])}
    for row in out.get("stage_groups", []):
        row.update(fields[row["group"]])
    roles = other_roles(cfg)
    if any(role == "server" for role, _ in roles):
        out["stage_server_traffic"] = server_traffic(cfg, records)
    out["processes"] = cfg.parallel.per_replica * cfg.cluster.workers + sum(n for _, n in roles)
    if cfg.cluster.workers == 1:
        out["algorithm"] = None  # one replica: nothing is all-reduced
    cpu = {role: [rec["cpu_seconds"] for rec in records.get(role, {}).values() if "cpu_seconds" in rec]
           for role in ("stage", *(role for role, _ in roles))}
    cpu = {role: sum(seconds) for role, seconds in cpu.items() if seconds}
    out["cpu_seconds"] = sum(cpu.values()) if cpu else None
    out["cpu_seconds_by_role"] = cpu
    return out, fields.get(0, {})


def _figures(cfg: JobConfig, records: dict[str, Any], summary: dict[str, Any], sent: list[int | None]
             ) -> dict[str, Any]:
    """The figures every report reads (``FIGURES``), named so that no label has to guess."""
    workers = records["worker"]
    count = max([cfg.cluster.workers, *(r + 1 for r in workers)])
    by_role: dict[str, int] = {"worker": sum(b for b in sent if b is not None)}
    for role, recs in records.items():
        if role not in _NOT_OTHER_ROLES and recs:
            by_role[role] = sum(rec["bytes_sent"] for rec in recs.values())
    # Joined workers (ps) count as workers too.
    by_role["worker"] += sum(w["bytes_sent"] for r, w in workers.items() if r >= cfg.cluster.workers)
    # Processes of the job (workers, joined ones too, and the strategy's other roles) and
    # the CPU seconds of those that reported theirs (process.report_cpu).
    roles = {"worker": count, **dict(other_roles(cfg))}
    cpu = {role: sum(rec["cpu_seconds"] for rec in records.get(role, {}).values() if "cpu_seconds" in rec)
           for role in roles if any("cpu_seconds" in rec for rec in records.get(role, {}).values())}
    steps, samples, target = summary["steps"], summary["samples"], cfg.run.target_accuracy
    final, reached = summary.get("final_test_accuracy"), summary.get("time_to_target_seconds") is not None
    return {
        "steps_kind": "global" if samples == steps * cfg.run.batch_size else "worker",
        "steps_per_worker": summary.get("steps_per_worker")
        or [workers[r]["steps"] if r in workers else None for r in range(count)],
        "bytes_sent_workers": by_role["worker"],
        "bytes_sent_by_role": by_role,
        "target_reached": None if target is None else reached,
        # A snapshot reached the target, but the final model fell back below it.
        "target_reached_then_lost": bool(reached and final is not None and target is not None and final < target),
        # Per worker: seconds of forward + backward, and inside Strategy.step (train/timing.py).
        "compute_seconds_per_worker": [workers[r].get("compute_seconds") if r in workers else None
                                       for r in range(count)],
        "step_seconds_per_worker": [workers[r].get("step_seconds") if r in workers else None
                                    for r in range(count)],
        "processes": sum(roles.values()),
        # User + system CPU seconds, every thread, summed over the processes that reported.
        "cpu_seconds": sum(cpu.values()) if cpu else None,
        "cpu_seconds_by_role": cpu,
    }


def judge_health(cfg: JobConfig, workers: dict[int, Any], ev: dict[str, Any], summary: dict[str, Any]
                 ) -> dict[str, Any]:
    """``health`` (ok, stalled, diverging), the step it was detected at, and a hint: the
    worst of the workers' own verdicts (train/health.py), or stalled when the final test
    accuracy is no better than chance."""
    state, step = worst([(w.get("health", "ok"), w.get("health_step")) for w in workers.values()])
    chance, acc = ev.get("chance_accuracy"), ev.get("final_test_accuracy")
    if state == "ok" and chance is not None and acc is not None and acc <= chance + CHANCE_MARGIN:
        state, step = "stalled", summary["steps"]
    why = None if state == "ok" else hint(state, cfg.settings(), is_asynchronous(cfg.to_flat()),
                                          summary.get("staleness_mean"))
    return {"health": state, "health_step": step, "health_hint": why}


def write_summary(run_dir, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
