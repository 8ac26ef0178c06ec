"""Deterministic emulation of slow machines and planned deaths (ARCHITECTURE.md section 6).

``--slow worker:K=F`` stretches worker K's compute by sleeping (F - 1) times each measured
compute interval, which frees the CPU for the others on a small machine. ``--kill
worker:K@step=N`` ends process K abruptly (SIGKILL, no clean-up) when it reaches step N.
Network delays (``--net``) are applied per send in ``group.py``.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable
import time
from contextlib import contextmanager
from typing import Iterator

from plexus.config import ClusterConfig

__all__ = ["Emulator"]

logger = logging.getLogger(__name__)


class Emulator:
    """The slow-down and planned death that apply to one process (``role`` ``rank``)."""

    def __init__(self, cluster: ClusterConfig, role: str, rank: int) -> None:
        self.name = f"{role} {rank}"
        self.factor = 1.0
        for spec in cluster.slow:
            if spec.role == role and spec.rank == rank:
                self.factor = spec.factor
        self.kill_step = min((k.step for k in cluster.kill if k.role == role and k.rank == rank), default=None)
        self.slept = 0.0
        # Called just before a planned kill (the runner records the time of death).
        self.before_kill: Callable[[], None] | None = None

    def stretch(self, compute_seconds: float) -> None:
        """Sleep so that a compute interval of ``compute_seconds`` lasts ``factor`` times as long."""
        if self.factor > 1.0 and compute_seconds > 0:
            extra = (self.factor - 1.0) * compute_seconds
            time.sleep(extra)
            self.slept += extra

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the enclosed computation and stretch it by the slow factor."""
        start = time.perf_counter()
        yield
        self.stretch(time.perf_counter() - start)

    def at_step(self, step: int) -> None:
        """Die abruptly if this is the planned step."""
        if self.kill_step is not None and step >= self.kill_step:
            logger.warning("%s: killed on purpose at step %d (--kill)", self.name, step)
            if self.before_kill is not None:
                self.before_kill()
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
