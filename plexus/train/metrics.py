"""The run directory's event log (``metrics.jsonl``) and summary (``summary.json``).

``metrics.jsonl`` holds one JSON object per line; every object has ``event`` and ``time``
(seconds on the job's training clock, which starts when every worker has joined).
Events:

- ``{"event": "train", "time", "worker", "step", "loss", "samples", "worker_samples",
  "bytes_sent", "bytes_recv", "staleness", "compute_seconds", "step_seconds"}``: a
  worker's progress every ``--log-every`` steps. ``step`` is this worker's own step count;
  ``samples`` counts the samples the whole job has consumed so far as this worker knows
  it (step x global batch for synchronous strategies; for asynchronous ones the sum of
  every worker's count in the store), so the job's throughput is its slope;
  ``worker_samples`` is this worker's own share. ``bytes_sent`` and ``bytes_recv`` are
  this process's cumulative traffic; ``staleness`` is null where the strategy has none;
  ``compute_seconds`` (forward + backward) and ``step_seconds`` (inside the strategy's
  step, compute included) are cumulative (``train/timing.py``).
- ``{"event": "eval", "time", "step", "samples", "test_accuracy", "test_loss", "model"}``:
  the evaluation of a snapshot of the global model taken at ``time`` (training clock at the
  moment of the snapshot, not of the evaluation); ``model`` is ``"global"`` or names a
  worker's own replica (``"worker0"``).
- ``{"event": "strategy", "time", "worker", "step", ...}``: values a strategy reports at
  each snapshot and once after the last step (``Strategy.prepare_snapshot``), e.g.
  gossip's and local SGD's ``consensus_distance``.
- ``{"event": "staleness_histogram", "time", "counts"}``: ``counts[k]`` is the number of
  updates applied with staleness k.

Each process appends whole lines with a single ``write`` to a file opened with
``O_APPEND``, so lines from several processes never interleave.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "read_events", "SUMMARY_KEYS", "FIGURES"]

# Keys every summary.json carries (others may be added).
SUMMARY_KEYS = (
    "strategy", "algorithm", "workers", "servers", "dataset", "model", "steps", "samples",
    "final_test_accuracy", "final_test_loss", "wall_seconds", "samples_per_second",
    "time_to_target_seconds", "bytes_sent_total", "bytes_sent_per_worker", "updates_applied",
    "staleness_mean", "staleness_max", "lost_workers", "health", "health_step", "health_hint", "settings",
    "steps_kind", "steps_per_worker", "bytes_sent_workers", "bytes_sent_by_role",
)

# What every figure of a summary means; the CLI, the plots and the HTML report read them
# the same way (README, "The run directory").
FIGURES = {
    "steps": "steps of the job: a synchronous step (every worker on its slice of one global batch) "
             "counts once; asynchronously, every worker's own step (batch/workers samples of its "
             "partition) counts once, so steps is the sum over workers; steps_kind says which",
    "steps_kind": "'global' (steps taken together) or 'worker' (each worker's own steps, summed)",
    "steps_per_worker": "each worker's own steps (null for a lost worker without a record)",
    "samples": "training samples consumed by all workers together",
    "samples_per_second": "job throughput: samples / wall_seconds, i.e. the sum over workers",
    "wall_seconds": "training clock, from the moment every worker joined to the last worker's end",
    "updates_applied": "optimizer updates the job made to the model it evaluates",
    "bytes_sent_total": "bytes sent by every process (workers, servers, aggregators)",
    "bytes_sent_workers": "bytes sent by the workers alone",
    "bytes_sent_by_role": "bytes sent, by role; reports show them in MiB (2**20 bytes)",
    "device": "where the workers computed: cpu, or cuda:N (worker 0's GPU)",
    "backend": "what carried the messages: gloo (host memory; a GPU tensor travels through a host copy) or nccl",
    "time_to_target_seconds": "training clock when a snapshot first reached target_accuracy; the "
                              "final accuracy may be lower (target_reached_then_lost)",
}


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends events to ``DIR/metrics.jsonl``; a no-op when ``run_dir`` is None."""

    def __init__(self, run_dir: str | os.PathLike | None) -> None:
        self._fd: int | None = None
        if run_dir is not None:
            path = Path(run_dir) / "metrics.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        record = {"event": event, **{k: _clean(v) for k, v in fields.items()}}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(run_dir: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """The events of a run directory, in file order, optionally only those of one kind."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if event is None or record.get("event") == event:
                out.append(record)
    return out
