"""Hygiene for a process started by the launcher: die with the launcher, stop on SIGTERM."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

__all__ = ["prepare_child"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def prepare_child() -> None:
    """Call first thing in a child process.

    Asks the kernel to SIGKILL this process when its parent dies (Linux), and exits at
    once if the launcher is already gone, closing the race between fork and this call.
    SIGTERM raises SystemExit so ``finally`` blocks run; a process stuck inside a C++ wait
    ignores it until it returns, which is why the launcher follows with SIGKILL.
    """
    parent = os.environ.get("PLEXUS_PARENT_PID")
    if parent is not None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:  # no libc by that name: rely on the launcher's SIGKILL
            logger.debug("prctl unavailable; relying on the launcher to stop this process")
        if os.getppid() != int(parent):
            os._exit(1)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
