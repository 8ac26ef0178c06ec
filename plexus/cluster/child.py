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
_PR_SET_NAME = 15


def prepare_child() -> None:
    """Call first thing in a child process.

    Asks the kernel to SIGKILL this process when its parent dies (Linux), and exits at
    once if the launcher is already gone, closing the race between fork and this call.
    SIGTERM raises SystemExit so ``finally`` blocks run; a process stuck inside a C++ wait
    ignores it until it returns, which is why the launcher follows with SIGKILL.

    The process is named after its role (``worker 3``, as ``ps`` and ``top`` show it, and
    ``/proc/PID/comm``): a forked child's ``/proc/PID/environ`` still shows the launcher's
    environment, so the name is how tools and tests tell the processes of a job apart.
    """
    parent = os.environ.get("PLEXUS_PARENT_PID")
    if parent is not None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            role, rank = os.environ.get("PLEXUS_ROLE"), os.environ.get("PLEXUS_ROLE_RANK")
            if role and rank:
                libc.prctl(_PR_SET_NAME, ctypes.c_char_p(f"{role} {rank}"[:15].encode()), 0, 0, 0)
        except OSError:  # no libc by that name: rely on the launcher's SIGKILL
            logger.debug("prctl unavailable; relying on the launcher to stop this process")
        if os.getppid() != int(parent):
            os._exit(1)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
