"""What a running job is doing, for the progress display of ``plexus train``.

Two cheap sources, read by the launching process while it waits:

- the job's store, for start-up: each process adds 1 to ``start/joined`` once it has
  connected (``plexus.train.process``); ``train/ready`` counts the workers whose strategy
  is set up (its links and groups formed: the rendezvous); worker 0 sets ``train/t0`` when
  the training clock starts and ``train/steps_total`` to the run's length in steps;
- ``metrics.jsonl``, read from where the last read stopped, for training: steps, loss,
  samples, test accuracy.

Throughput is the job's (summed over workers), as in ``summary.json``: a ``train`` event's
``samples`` counts what the whole job has consumed (``plexus.train.metrics``), so the
job's rate is the largest count seen over the training clock of its event.

Also here: the warning when the job's processes outnumber the cores by more than 2x.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["JOINED_KEY", "STEPS_KEY", "StartupProbe", "MetricsTail", "Snapshot", "describe",
           "oversubscription", "usable_cores"]

JOINED_KEY = "start/joined"  # processes connected to the store
STEPS_KEY = "train/steps_total"  # steps each worker means to take (worker 0's)
_READY_KEY, _T0_KEY = "train/ready", "train/t0"  # set by plexus.train.runner
# Processes per core above which the job is oversubscribed: start-up and every step then
# wait for the CPU, and timings measure contention more than the strategy.
OVERSUBSCRIBED = 2.0


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription(cfg, cores: int | None = None) -> str | None:
    """One warning line when the job's processes (workers and the strategy's other roles:
    servers, aggregators, coordinator) outnumber the cores by more than ``OVERSUBSCRIBED``
    times; None otherwise."""
    from plexus.train.plan import other_roles
    cores = cores or usable_cores()
    stages = cfg.parallel.per_replica
    counts = {"worker": cfg.cluster.workers} if stages == 1 else {"stage": stages * cfg.cluster.workers}
    for role, count in other_roles(cfg):
        counts[role] = counts.get(role, 0) + count
    total = sum(counts.values())
    if total <= OVERSUBSCRIBED * cores:
        return None
    parts = ", ".join(f"{n} {role}{'s' if n != 1 else ''}" for role, n in counts.items() if n)
    others = total - counts.get("worker", 0) - counts.get("stage", 0)
    fit = max(1, (int(OVERSUBSCRIBED * cores) - others) // stages)  # --workers that would fit
    return (f"{total} processes ({parts}) on {cores} core{'s' if cores != 1 else ''}: more than "
            f"{OVERSUBSCRIBED:g} per core, so start-up and every step wait for the CPU and timings measure "
            f"contention more than the strategy; pass fewer --workers (at most "
            f"{fit} here) or use a bigger machine")


class StartupProbe:
    """Reads the start-up phase of a job from its store (module docstring)."""

    def __init__(self, store, processes: int, workers: int) -> None:
        self.store, self.processes, self.workers = store, processes, workers
        self.started = False  # the training clock has started: nothing more to read here
        self.steps_total: int | None = None
        self._asked = False

    def _count(self, key: str) -> int:
        return self.store.add(key, 0)  # reads the counter (0 if absent) without a wait

    def phase(self) -> str | None:
        """``spawning: 3/5 processes up``, ``rendezvous: 2/4 workers ready``, ``first step``,
        or None once training has started and a step was logged (read from the metrics)."""
        if self.started:
            return "first step"
        try:
            joined = self._count(JOINED_KEY)
            if joined < self.processes:
                return f"spawning: {joined}/{self.processes} processes up"
            ready = self._count(_READY_KEY)
            if ready < self.workers and not self.store.check([_T0_KEY]):
                return f"rendezvous: {ready}/{self.workers} workers ready (links and groups forming)"
            self.started = True
        except Exception:  # noqa: BLE001 - a display must never fail the job; the store may be closing
            return None
        return "first step"

    def total(self) -> int | None:
        """The steps each worker means to take, once worker 0 has said (None before, and
        for a run bounded by --time-limit alone)."""
        if self.steps_total is None and not self._asked:
            try:
                if self.store.check([STEPS_KEY]):
                    self._asked = True
                    total = int(self.store.get(STEPS_KEY).decode())
                    self.steps_total = total if total < 2**40 else None  # 2**62: --time-limit alone
            except Exception:  # noqa: BLE001 - as above
                self._asked = True
        return self.steps_total


@dataclass
class Snapshot:
    """The latest training figures, from metrics.jsonl."""

    step: int = 0  # worker 0's own step (each worker's count under asynchronous strategies)
    loss: float | None = None
    samples: int = 0  # the job's, summed over workers
    time: float = 0.0  # training clock of the event that gave ``samples``, seconds
    accuracy: float | None = None
    seen: bool = False  # a train event was read

    @property
    def rate(self) -> float:
        """The job's samples per second so far."""
        return self.samples / self.time if self.time > 0 else 0.0


@dataclass
class MetricsTail:
    """Reads a run directory's metrics.jsonl from where it last stopped (whole lines only)."""

    run_dir: Path
    offset: int = 0
    state: Snapshot = field(default_factory=Snapshot)

    def read(self) -> Snapshot:
        path = Path(self.run_dir) / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.state
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                self._take(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # a display skips what it cannot read
        return self.state

    def _take(self, event: dict[str, Any]) -> None:
        s = self.state
        if event["event"] == "train":
            s.seen = True
            if event.get("worker") == 0 or s.loss is None:
                s.step = max(s.step, int(event["step"]))
                s.loss = event.get("loss")
            samples = event.get("samples") or 0
            if samples >= s.samples:
                s.samples, s.time = samples, max(s.time, float(event["time"]))
        elif event["event"] == "eval" and event.get("model", "global") == "global":
            s.accuracy = event.get("test_accuracy")


def describe(s: Snapshot, elapsed: float, steps_total: int | None, time_limit: float | None) -> str:
    """One progress line: step, the job's samples/s, loss, test accuracy, elapsed, ETA."""
    step = f"step {s.step}" + (f"/{steps_total}" if steps_total else "")
    loss = "–" if s.loss is None else f"{s.loss:.4f}"
    parts = [step, f"{s.rate:,.0f} samples/s", f"loss {loss}"]
    if s.accuracy is not None:
        parts.append(f"test acc {100 * s.accuracy:.2f}%")
    parts.append(f"elapsed {elapsed:.1f} s")
    eta = None
    if steps_total and 0 < s.step <= steps_total and s.time > 0:
        eta = s.time * (steps_total - s.step) / s.step
    if time_limit is not None:
        left = max(0.0, time_limit - s.time)
        eta = left if eta is None else min(eta, left)
    parts.append("ETA –" if eta is None else f"ETA {eta:.1f} s")
    return "  ".join(parts)
