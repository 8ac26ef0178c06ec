"""The files of a job's checkpoint and the store keys its processes meet on: below the
training layer, so that servers (``ps/server.py``) write their part of a checkpoint
without knowing what a job is. The checkpoint itself, its manifest and ``--resume``:
``train/checkpoint.py``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CHECKPOINTS", "REQUEST", "write_piece", "load_piece", "request_of", "server_checkpoints"]

CHECKPOINTS = "checkpoints"     # the run directory's folder of checkpoints
REQUEST = "ckpt/request"        # the newest checkpoint number the servers must write


def write_piece(folder: Path, name: str, state: dict[str, Any]) -> None:
    """Write one process's part of a checkpoint and flush it to disk."""
    path = folder / f"{name}.pt"
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def load_piece(folder: Path, name: str) -> dict[str, Any]:
    """One process's part (``weights_only``: tensors, numbers and strings only)."""
    return torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)


def request_of(store: dist.Store) -> int:
    """The newest checkpoint the workers asked the servers for (0: none yet)."""
    return int(store.add(REQUEST, 0))


def server_checkpoints(store: dist.Store, run_dir: Path, index: int, done: int,
                       snapshot: Callable[[], Any]) -> int:
    """On a server, between requests: write the shard for every checkpoint the workers
    asked for since ``done`` (``snapshot()`` gives the ``ShardState`` tensors under the
    server's lock); returns the newest one written."""
    asked = request_of(store)
    for k in range(done + 1, asked + 1):
        write_piece(Path(run_dir) / CHECKPOINTS / f".tmp-{k}", f"server-{index}", {"shard": snapshot()})
        store.set(f"ckpt/{k}/server/{index}", "1")
    return max(done, asked)
