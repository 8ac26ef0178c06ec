"""``plexus simulate``: a job's config and a cluster description in, a run directory out.

The run directory has the files of ``plexus train`` (config.json, metrics.jsonl,
summary.json, the plots), times in simulated seconds, and ``"simulated": true`` in the
summary with the cluster that was simulated and the real seconds the simulation took.
The run's health is judged as a real one's (``train/health.py``): worker 0's training
losses, one per ``--log-every`` steps here (the window counts those), and a final
accuracy no better than chance; the summary names the state and the hint.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.sim.cluster import ComputeModel, SimSpec, profile_compute
from plexus.sim.engines import AllReduceSim, Outcome, ParameterServerSim
from plexus.sim.maths import Replica
from plexus.sim.replicas import AdPsgdSim, EasgdSim, GossipSim, LocalSgdSim
from plexus.sim.sandblaster import SandblasterSim
from plexus.sim.tree import TreePsSim
from plexus.train.data import load_dataset
from plexus.train.evaluation import loss_fn
from plexus.train.metrics import MetricsLog
from plexus.train.models import build_model
from plexus.train.feed import total_steps
from plexus.train.health import Health
from plexus.train.summary import judge_health

__all__ = ["simulate", "check", "SIMULATED"]

# The simulated job of each strategy the simulator models today (``engine_for`` picks the
# variant: tree-ps base is the flat PS under the tree's gate, gossip --async is AD-PSGD).
ENGINES = {"allreduce": AllReduceSim, "ps": ParameterServerSim, "tree-ps": TreePsSim, "local-sgd": LocalSgdSim,
           "gossip": GossipSim, "easgd": EasgdSim, "sandblaster": SandblasterSim}
SIMULATED = tuple(ENGINES)


def engine_for(cfg: JobConfig) -> tuple[type, JobConfig]:
    """The simulated job that runs ``cfg``, and the config it runs."""
    s = cfg.strategy
    if s.strategy == "tree-ps" and s.variant == "base":
        from plexus.strategies.tree_ps import TreePSStrategy
        return ParameterServerSim, TreePSStrategy.effective(cfg)
    if s.strategy == "gossip" and s.async_gossip:
        return AdPsgdSim, cfg
    return ENGINES[s.strategy], cfg


def check(cfg: JobConfig, spec: SimSpec) -> None:
    """Bad input, before anything is computed (ConfigError: one line, exit 2)."""
    strategy = cfg.strategy.strategy
    if strategy not in ENGINES:
        raise ConfigError(f"plexus simulate models {', '.join(SIMULATED)} so far, not {strategy!r}: "
                          f"pass --strategy {' or --strategy '.join(SIMULATED)}")
    if spec.timing_only and cfg.run.target_accuracy is not None:
        raise ConfigError("--timing-only skips the maths, so no accuracy is measured: drop --target-accuracy, "
                          "or drop --timing-only to simulate with the real maths")
    if cfg.run.batch_size % spec.workers and strategy != "sandblaster":  # sandblaster hands out units
        raise ConfigError(f"batch_size {cfg.run.batch_size} must be divisible by --sim-workers {spec.workers} "
                          f"(each worker takes an equal share): pass --batch-size {spec.workers * 32} for example")
    s = cfg.strategy
    unmodelled = [flag for flag, used in (
        ("--assignment dynamic", s.assignment != "static"),
        (f"--push-every {s.push_every}", s.push_every != 1),
        (f"--fetch-every {s.fetch_every}", s.fetch_every != 1),
        ("--kill (use --fail ROLE:K@t=SECONDS)", bool(cfg.cluster.kill)),
        ("--dtype float64", cfg.model.dtype == "float64"),
        ("--model logreg under ps (its sparse table)", strategy in ("ps", "tree-ps") and cfg.model.model == "logreg"),
        (f"--replication {s.replication} (a dead simulated server ends the job)", s.replication > 0),
        ("--ledger", s.ledger),
        (f"--drain {s.drain}", bool(s.drain)),
        ("--elastic (a dead simulated worker ends an all-reduce job)", s.elastic),
        *((f"--slow {w.role}:{w.rank}={w.factor:g} (it slows workers only)", True)
          for w in cfg.cluster.slow if w.role != "worker"),
        (f"--threads {cfg.cluster.threads} (its compute is measured with one thread; give it with --compute)",
         cfg.cluster.threads != 1),
    ) if used]
    if unmodelled:
        raise ConfigError(f"plexus simulate does not model {', '.join(unmodelled)} yet: drop it, or train it for real "
                          f"with plexus train")
    if cfg.run.time_limit is not None:
        raise ConfigError("--time-limit is wall-clock time; a simulation's time is virtual: pass --steps")
    if strategy == "tree-ps" and cfg.strategy.variant != "base" and (spec.failures or spec.fail_rate):
        raise ConfigError("plexus simulate does not kill processes in a tree-ps tree yet: drop --fail and "
                          "--fail-rate, or simulate --variant base")


def simulate(cfg: JobConfig, spec: SimSpec, run_dir: Path | None) -> dict[str, Any]:
    """Simulate ``cfg`` on the cluster ``spec``; writes ``run_dir`` (when given) and returns
    the summary."""
    check(cfg, spec)
    started = time.perf_counter()
    data = load_dataset(cfg.data, cfg.run.seed)
    # Timing alone reads no sample; Sandblaster's batch caps at the training set (full batch).
    if cfg.run.batch_size > len(data.x_train) and not spec.timing_only and cfg.strategy.strategy != "sandblaster":
        raise ConfigError(f"batch_size must not exceed the training set ({len(data.x_train)} samples), got "
                          f"{cfg.run.batch_size}: pass a smaller --batch-size")
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    share = cfg.run.batch_size // spec.workers
    if spec.compute.per_sample is None:  # the default: measure this model here
        overhead, per_sample = profile_compute(model, loss_fn, data.x_train, data.y_train, share)
        spec = replace(spec, compute=ComputeModel(per_sample=per_sample, overhead=overhead,
                                                  jitter=spec.compute.jitter, measured=True))
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    spec = replace(spec, extra={"numel": sum(sizes), "param_sizes": sizes})
    torch.manual_seed(cfg.run.seed)
    replica = None if spec.timing_only else Replica(build_model(cfg.model, data))
    steps = total_steps(cfg, max(1, len(data.x_train) // cfg.run.batch_size))
    log = MetricsLog(run_dir)
    evals: list[dict[str, Any]] = []
    target = cfg.run.target_accuracy

    classes = data.num_classes if data.task == "classification" else None
    health = Health(total_steps=max(1, steps // cfg.run.log_every), classes=classes)
    health_at: list[int] = []  # the step of each loss health has seen

    def logged(kind: str, **fields: Any) -> None:
        """Every event goes to metrics.jsonl; worker 0's training losses also to ``health``."""
        log.log(kind, **fields)
        loss = fields.get("loss")
        if kind == "train" and fields.get("worker") == 0 and loss is not None:
            health_at.append(fields["step"])
            if not math.isfinite(loss):
                health.diverged(len(health_at))
            else:
                health.observe(len(health_at), loss)

    def evaluate(now: float, step: int, samples: int) -> bool:
        loss, accuracy = replica.evaluate(data.x_test, data.y_test)
        evals.append({"time": now, "step": step, "accuracy": accuracy})
        log.log("eval", time=now, step=step, samples=samples, test_accuracy=accuracy, test_loss=loss,
                model="global")
        return target is not None and accuracy >= target

    kind, cfg = engine_for(cfg)
    engine = kind(cfg, spec, data, replica, logged, evaluate if replica is not None else (lambda *a: False))
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outcome = engine.run(steps)
        if replica is not None and not outcome.failed:
            evaluate(outcome.virtual_seconds, outcome.steps_per_worker[0] if outcome.steps_per_worker else 0,
                     outcome.samples)
    finally:
        torch.set_num_threads(torch_threads)
        log.close()
    summary = _summary(cfg, spec, outcome, evals, time.perf_counter() - started)
    if replica is not None:
        seen = health.step is not None and 0 < health.step <= len(health_at)
        record = {"health": health.state, "health_step": health_at[health.step - 1] if seen else None}
        summary.update(judge_health(cfg, {0: record}, {"chance_accuracy": 1 / classes if classes else None,
                                                  "final_test_accuracy": summary["final_test_accuracy"]}, summary))
    if run_dir is not None and replica is not None and cfg.run.save_model:
        torch.save(replica.model.state_dict(), run_dir / "model.pt")
    if run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _summary(cfg: JobConfig, spec: SimSpec, out: Outcome, evals: list[dict[str, Any]], real: float
             ) -> dict[str, Any]:
    wall = out.virtual_seconds
    final = evals[-1] if evals else {}
    target = cfg.run.target_accuracy
    reached = next((e["time"] for e in evals if target is not None and e["accuracy"] >= target), None)
    hist = out.staleness
    sent = out.bytes_sent
    return {
        "simulated": True,
        "status": "failed" if out.failed else "completed",
        "error": out.failed,
        "strategy": cfg.strategy.strategy,
        "algorithm": cfg.strategy.algorithm if cfg.strategy.strategy == "allreduce" else None,
        "consistency": cfg.strategy.consistency if cfg.strategy.strategy == "ps" else None,
        "workers": spec.workers,
        "servers": max(1, spec.servers) if cfg.strategy.strategy == "ps" else None,
        "dataset": cfg.data.dataset,
        "model": cfg.model.model,
        "steps": out.steps,
        # As plexus train's summary says it (summary.py): steps taken together, or each worker's own, summed.
        "steps_kind": "global" if out.samples == out.steps * cfg.run.batch_size else "worker",
        "steps_per_worker": out.steps_per_worker if len(out.steps_per_worker) <= 64 else None,
        "samples": out.samples,
        "final_test_accuracy": final.get("accuracy"),
        "wall_seconds": wall,
        "samples_per_second": out.samples / wall if wall else None,
        "time_to_target_seconds": reached,
        "target_accuracy": target,
        "bytes_sent_total": sum(sent) + out.bytes_sent_servers,
        "bytes_sent_workers": sum(sent),
        "updates_applied": out.updates_applied if out.updates_applied is not None else out.steps,
        "staleness_mean": hist.mean if hist is not None and hist.total else 0.0,
        "staleness_max": hist.max if hist is not None and hist.total else 0,
        "lost_workers": sorted(out.lost_workers),
        # The order in which the servers applied gradients, (worker, clock) by (worker, clock):
        # the same seed gives the same order (tested).
        "update_order_sha256": hashlib.sha256(repr(out.order).encode()).hexdigest() if out.order else None,
        "evaluations": len(evals),
        "compute_seconds_mean": out.compute_seconds,
        "wait_seconds_mean": out.wait_seconds,
        "sim": {
            "workers": spec.workers, "servers": spec.servers, "timing_only": spec.timing_only,
            "compute": asdict(spec.compute), "network": asdict(spec.network),
            "server_gamma": spec.server_gamma, "failures": [asdict(f) for f in spec.failures],
            "fail_rate": spec.fail_rate, "events": out.events, "real_seconds": real,
            **out.extra},
        "settings": cfg.settings(),
    }
