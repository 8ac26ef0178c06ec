"""Checkpoints of a whole job (``--checkpoint-every``) and resuming from one (``--resume``).

What a checkpoint holds, one file per process, in ``RUN_DIR/checkpoints/step-<N>/``:

- ``worker-<r>.pt``: the worker's completed steps (its data position: batches are a pure
  function of the seed and the step, ``batches.py``), its torch random state, and what
  its strategy keeps (allreduce: worker 0's model and optimizer state, which every
  replica shares);
- ``server-<s>.pt``: a ps server's shard, as a takeover would receive it
  (``ps/replication.py``'s ``ShardState``): the weights, the server optimizer's state,
  and every worker's consistency clock and counters;
- ``config.json``, the job's configuration, and ``manifest.json``, written last, with
  each file's size and sha256.

Consistency. A checkpoint is a cut at a step boundary: every worker stops there (a store
barrier), and only then do the servers snapshot their shards, so every push a worker made
before its boundary is in them and none after. Synchronous workers checkpoint at the same
step; asynchronous ones each at their own, recorded in their files.

Half-written checkpoints. Files go into ``.tmp-<k>/``, are flushed and fsynced, the
manifest last, and the folder is then renamed ``step-<N>`` in one step. ``--resume``
takes the newest ``step-*`` whose manifest is there and whose files match their sha256,
with one line of warning for each newer one it skips. A process killed while writing
leaves a ``.tmp-*`` folder behind, which nothing reads. The last ``KEEP`` checkpoints
stay.

Files are ``torch.save`` of tensors, numbers and strings, loaded with
``weights_only=True``: no arbitrary pickle is ever read back.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plexus.cluster.liveness import exited_key
from plexus.cluster.rendezvous import store_get_json, store_set_json, wait_keys
from plexus.cluster.checkpoint_files import CHECKPOINTS, REQUEST, load_piece, write_piece
from plexus.errors import CommTimeout, ConfigError

__all__ = ["Checkpointer", "CheckpointPlan", "CHECKPOINTS", "checkpoint_fields", "latest", "load_piece",
           "parse_every", "resumed_config", "write_piece", "SUPPORTED"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
KEEP = 3
# The strategies whose whole state a checkpoint holds.
SUPPORTED = ("allreduce", "ps")

_PLAN = "ckpt/plan"           # worker 0's plan: {"k": number, "at": step, or -1 for the next boundary}
_LEFT = "ckpt/left"           # workers that made their last step


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--checkpoint-every``: ``100`` (steps) or ``30s`` (seconds)."""
    value = str(text).strip()
    try:
        if value.endswith("s"):
            seconds = float(value[:-1])
            if seconds > 0:
                return None, seconds
        else:
            steps = int(value)
            if steps > 0:
                return steps, None
    except ValueError:
        pass
    raise ConfigError(f"--checkpoint-every must be a number of steps or of seconds (100, 30s), got {text!r}: "
                      f"pass --checkpoint-every 100")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _seal(tmp: Path, final: Path, step: int, cfg_dict: dict[str, Any], strategy: str) -> None:
    """Write config and manifest into ``tmp`` (fsynced, manifest last) and rename it ``final``."""
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())
             if p.name != MANIFEST}
    manifest = {"step": step, "strategy": strategy, "time": time.time(), "files": files}
    with open(tmp / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=2))
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _problem(folder: Path) -> str | None:
    """Why checkpoint ``folder`` cannot be read back, or None when it is whole."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (its writer stopped before the end)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return "manifest.json is not a checkpoint manifest"
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"] or _sha256(path) != meta["sha256"]:
            return f"{name} does not match its sha256 in manifest.json"
        if path.suffix == ".pt":
            try:
                with warnings.catch_warnings():  # torch's note on a foreign pickle protocol
                    warnings.simplefilter("ignore")
                    torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - whatever refused it, the file is not ours
                return f"{name} is not plain tensors (a weights_only load refused it: {str(exc).splitlines()[0]})"
    return None


def latest(run_dir: Path) -> Path:
    """The newest whole checkpoint of ``run_dir``; ConfigError when there is none."""
    root = Path(run_dir) / CHECKPOINTS
    if not Path(run_dir).is_dir():
        raise ConfigError(f"--resume {run_dir}: no such run directory: pass the folder of a run that was trained "
                          f"with --checkpoint-every")
    found = sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []
    problems = []
    for folder in found:
        why = _problem(folder)
        if why is None:
            for skipped, reason in problems:
                logger.warning("plexus: skipping checkpoint %s: %s", skipped, reason)
            return folder
        problems.append((folder, why))
    if problems:
        detail = "; ".join(f"{p.name}: {why}" for p, why in problems)
        raise ConfigError(f"--resume {run_dir}: no whole checkpoint to resume from ({detail})")
    raise ConfigError(f"--resume {run_dir}: it holds no checkpoint: train with --checkpoint-every N to write them")


class CheckpointPlan:
    """When a worker checkpoints: every N steps, or every S seconds as worker 0 decides."""

    def __init__(self, cfg, store: dist.Store, rank: int, synchronous: bool) -> None:
        self.steps, self.seconds = parse_every(cfg.run.checkpoint_every)
        self.store, self.rank, self.synchronous = store, rank, synchronous
        self.last = time.monotonic()
        self.taken = 0  # checkpoints this worker took part in

    def due(self, steps_done: int) -> bool:
        """Whether to checkpoint now, after ``steps_done`` steps (after the last one too,
        so that a finished run can be trained on with ``--resume RUN_DIR --steps N``)."""
        if self.steps is not None and self.synchronous:
            return steps_done % self.steps == 0
        # Worker 0 plans checkpoint k (every N of its steps, or S seconds): synchronous
        # workers take it at the step after the one worker 0 is about to make (which every
        # worker reaches: none can finish that step without worker 0), asynchronous ones at
        # their next boundary, each at its own step.
        k = self.taken + 1
        now_due = steps_done % self.steps == 0 if self.steps is not None \
            else time.monotonic() - self.last >= self.seconds
        if self.rank == 0 and now_due and not self._planned(k):
            store_set_json(self.store, _PLAN, {"k": k, "at": steps_done + 1 if self.synchronous else -1})
        if not self._planned(k):
            return False
        at = store_get_json(self.store, _PLAN)["at"]
        return at < 0 or steps_done >= at

    def _planned(self, k: int) -> bool:
        return self.store.check([_PLAN]) and store_get_json(self.store, _PLAN)["k"] >= k


class Checkpointer:
    """One worker's part in writing the job's checkpoints."""

    def __init__(self, cfg, store: dist.Store, run_dir: Path, rank: int, workers: int, servers: int,
                 synchronous: bool) -> None:
        self.cfg, self.store, self.rank, self.workers, self.servers = cfg, store, rank, workers, servers
        self.root = Path(run_dir) / CHECKPOINTS
        self.plan = CheckpointPlan(cfg, store, rank, synchronous)
        self.written: list[int] = []

    def write(self, steps_done: int, state: dict[str, Any]) -> None:
        """Write this worker's ``state`` as part of the next checkpoint, with the others."""
        k = self.plan.taken = self.plan.taken + 1
        self.plan.last = time.monotonic()
        tmp = self.root / f".tmp-{k}"
        tmp.mkdir(parents=True, exist_ok=True)
        write_piece(tmp, f"worker-{self.rank}", {"steps": steps_done, "rng": torch.get_rng_state(), **state})
        timeout = self.cfg.cluster.timeout
        if self.rank == 0:
            store_set_json(self.store, f"ckpt/{k}/step", steps_done)
        self.store.add(f"ckpt/{k}/workers", 1)
        if self.rank == 0:
            self._cut(k, timeout)
            # Every worker stands at its boundary: now the servers snapshot their shards.
            if self.servers:
                self.store.add(REQUEST, 1)
                wait_keys(self.store, [f"ckpt/{k}/server/{s}" for s in range(self.servers)], timeout,
                          f"the servers' shards for checkpoint {k}")
            step = store_get_json(self.store, f"ckpt/{k}/step")
            _seal(tmp, self.root / f"step-{step:08d}", step, self.cfg.to_dict(), self.cfg.strategy.strategy)
            for old in sorted(self.root.glob("step-*"))[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
            self.store.set(f"ckpt/{k}/done", "1")
        wait_keys(self.store, [f"ckpt/{k}/done"], timeout, f"checkpoint {k} to be sealed")
        self.written.append(steps_done)

    def _cut(self, k: int, timeout: float) -> None:
        """On worker 0: wait until every worker stands at its boundary, has left the
        training loop, or was lost (the launcher records its exit)."""
        deadline = time.monotonic() + timeout
        names = [f"worker {r}" for r in range(self.workers)]
        while True:
            arrived = int(self.store.add(f"ckpt/{k}/workers", 0))
            left = int(self.store.add(_LEFT, 0))
            lost = sum(self.store.check([exited_key(n)]) for n in names)
            if arrived + left + lost >= self.workers:
                return
            if time.monotonic() > deadline:
                raise CommTimeout(f"worker 0: checkpoint {k}: {self.workers - arrived - left - lost} worker(s) did "
                                  f"not reach a step boundary within {timeout:g} s", peer="a worker")
            time.sleep(0.005)

    def leave(self) -> None:
        """This worker made its last step: checkpoints no longer wait for it."""
        self.store.add(_LEFT, 1)


# What --resume lets a user change: the run's length, its output, and its waits.
_RESUME_MAY_SET = ("resume", "steps", "epochs", "time_limit", "target_accuracy", "out", "overwrite", "quiet", "json",
                   "debug", "no_report", "save_model", "eval_every", "log_every", "checkpoint_every", "timeout",
                   "host", "port")


def resumed_config(flat: dict[str, Any]):
    """The configuration of a run that continues ``flat["resume"]`` (a run directory)
    from its newest whole checkpoint: the saved job's, with only the keys of
    ``_RESUME_MAY_SET`` taken from ``flat``, no planned kill, and a new run directory."""
    from plexus.config import JobConfig
    given = {k.replace("-", "_"): v for k, v in flat.items() if v is not None}
    folder = latest(Path(given["resume"]))
    try:
        saved = JobConfig.from_dict(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume {given['resume']}: {folder.name}/config.json is not a plexus job's "
                          f"configuration ({type(exc).__name__}: {exc})") from None
    before = saved.to_flat()
    changed = sorted(k for k in given if k not in _RESUME_MAY_SET and k != "kill" and given[k] != before.get(k))
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise ConfigError(f"--resume continues the saved job as it was configured: {flags} cannot change; only "
                          f"its length (--steps, --epochs, --time-limit) and output (--out, --save-model...) may")
    step = json.loads((folder / MANIFEST).read_text())["step"]
    if saved.strategy.strategy not in SUPPORTED:
        raise ConfigError(f"--resume {given['resume']}: its checkpoint is of strategy {saved.strategy.strategy}, "
                          f"which cannot resume (checkpoints: {', '.join(SUPPORTED)})")
    length = saved.run.steps if saved.run.steps is not None else None
    if "steps" not in given and "epochs" not in given and "time_limit" not in given and length is not None \
            and length <= step:
        raise ConfigError(f"--resume {given['resume']}: its newest checkpoint is at step {step}, the end of its "
                          f"--steps {length}: pass --steps N with N > {step} to train on")
    overrides = {k: v for k, v in given.items() if k in _RESUME_MAY_SET and k != "resume" or k == "kill"}
    overrides.setdefault("out", None)  # never the saved run's own directory
    overrides.setdefault("overwrite", False)
    overrides.setdefault("kill", ())   # the saved run's planned kills fired already
    return saved.replace(**overrides, resume=str(folder))


def checkpoint_fields(cfg, run_dir: Path) -> dict[str, Any]:
    """Summary keys: the checkpoints this run left (their steps) and where it resumed from."""
    fields: dict[str, Any] = {}
    if cfg.run.checkpoint_every:
        fields["checkpoints"] = [int(p.name.split("-")[1]) for p in sorted((Path(run_dir) / CHECKPOINTS).glob("step-*"))]
    if cfg.run.resume:
        manifest = json.loads((Path(cfg.run.resume) / MANIFEST).read_text())
        fields["resumed_from"] = {"checkpoint": cfg.run.resume, "step": manifest["step"]}
    return fields
