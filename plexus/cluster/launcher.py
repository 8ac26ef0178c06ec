"""The local launcher: every role of a job as its own process on this machine.

It streams each child's output with a role prefix, stops every child when one fails or
when it receives SIGINT/SIGTERM (SIGTERM first, SIGKILL after a grace period, so a hung
child dies too), and returns the first failure's exit status. Children run in their own
process groups and ask the kernel to kill them if the launcher dies (see ``child.py``),
so no orphan survives the launcher.

Start-up: given an ``entry`` function, children are forked from a fork server that has
already imported torch (``forkserver.py``), where that is safe.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TextIO

from plexus.cluster.forkserver import ForkServer, can_fork

__all__ = ["RoleSpec", "launch", "exit_status", "first_failure"]

logger = logging.getLogger(__name__)

# Seconds the launcher keeps hearing exits after the first failure, before it stops the job
# (the fork server reports exits every 20 ms, the loop polls every 50 ms).
_SETTLE = 0.25


@dataclass(frozen=True)
class RoleSpec:
    """One process to start: its role, its rank within the role, and extra environment."""

    role: str
    rank: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"


def exit_status(returncode: int) -> int:
    """A shell-style status: a child killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def first_failure(failed: Sequence[tuple[Any, int]]) -> tuple[Any, int]:
    """The likeliest cause among failures heard together, as (who, status): the first
    killed by a signal (status above 128: the OOM killer, a crash, a kill), since peers
    exit with a status of their own on losing a process; else the first heard."""
    return next((f for f in failed if f[1] > 128), failed[0])


def _pump(stream, prefix: str, sink: TextIO, lock: threading.Lock, muted: threading.Event) -> None:
    for raw in iter(stream.readline, b""):
        if muted.is_set():
            continue  # read on, so the child never blocks on a full pipe
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            sink.write(f"{prefix}{line}\n")
            sink.flush()
    stream.close()


class _Children:
    def __init__(self) -> None:
        self.procs: list[tuple[RoleSpec, subprocess.Popen]] = []

    def signal_all(self, sig: int) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace: float) -> None:
        """SIGTERM every live child, then SIGKILL what is left after ``grace`` seconds."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for _, p in self.procs):
            time.sleep(0.02)
        self.signal_all(signal.SIGKILL)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.error("launcher: pid %d did not die after SIGKILL", proc.pid)


def launch(argv: Sequence[str], roles: Sequence[RoleSpec], *, env: dict[str, str] | None = None,
           may_fail: Callable[[RoleSpec, int], bool] | None = None, poll: Callable[[], None] | None = None,
           grace: float = 2.0, sink: TextIO | None = None, time_limit: float | None = None,
           on_exit: Callable[[RoleSpec, int], None] | None = None,
           entry: Callable[[], int | None] | None = None, threads: int = 1,
           warm: Callable[[], None] | None = None, signals: list[int] | None = None) -> int:
    """Run ``argv`` once per role and wait for all of them.

    With ``entry``, the function that ``argv`` would run, each child is forked from a fork
    server and calls ``entry()`` where ``can_fork(threads)`` allows; else ``argv`` starts a
    fresh interpreter. ``warm()`` runs in this process before the fork server is forked
    (once per process in effect: its imports stay).

    Each child gets ``env`` plus its role's ``env`` plus ``PLEXUS_ROLE``,
    ``PLEXUS_ROLE_RANK`` and ``PLEXUS_PARENT_PID``. A child whose failure ``may_fail``
    accepts (a worker killed on purpose in a fault-tolerant job, say) does not stop the
    others. ``on_exit(spec, status)`` hears of every child that ends on its own, also in
    the ``_SETTLE`` seconds after the first failure, before the rest are stopped. ``poll``
    is called about twenty times a second (progress display).
    ``time_limit`` seconds after start every child is stopped and 124 returned.

    Returns 0 when every child succeeded, else the status of the failure it names
    (``first_failure`` of those heard within ``_SETTLE`` seconds of the first), or 128 +
    signal for the launcher's own SIGINT/SIGTERM, which it also appends to ``signals``, so
    a caller can tell an interrupted job from a failed one. After such a
    signal the children's output is dropped unless logging is at INFO (``--debug``): what
    they say while being stopped (a peer's link closed) is noise to a user who pressed
    Ctrl-C.
    """
    sink = sink or sys.stderr
    base_env = dict(os.environ if env is None else env)
    children = _Children()
    lock = threading.Lock()
    received: list[int] = [] if signals is None else signals
    muted = threading.Event()

    def on_signal(signum, _frame) -> None:
        received.append(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    pumps = []
    status = 0
    started = time.monotonic()
    # Forked now, before any child exists, while this process's threads are idle.
    forks = ForkServer(entry, warm) if entry is not None and can_fork(threads) else None
    try:
        for spec in roles:
            child_env = {**base_env, **spec.env, "PLEXUS_ROLE": spec.role, "PLEXUS_ROLE_RANK": str(spec.rank),
                         "PLEXUS_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
            if forks is not None:
                proc = forks.start(child_env)
            else:
                proc = subprocess.Popen(list(argv), env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            children.procs.append((spec, proc))
        for spec, proc in children.procs:
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{spec.name}] ", sink, lock, muted),
                                    daemon=True)
            pump.start()
            pumps.append(pump)
        pending = {proc.pid for _, proc in children.procs}
        failed: list[tuple[RoleSpec, int]] = []
        settle_until = 0.0
        while pending:
            if received:
                logger.info("launcher: received signal %d, stopping %d processes", received[0], len(pending))
                if not logger.isEnabledFor(logging.INFO):
                    muted.set()
                status = 128 + received[0]
                break
            if time_limit is not None and time.monotonic() - started > time_limit:
                with lock:
                    sink.write(f"plexus: the job ran past its limit of {time_limit:g} s; stopping it\n")
                status = 124
                break
            for spec, proc in children.procs:
                if proc.pid in pending and proc.poll() is not None:
                    pending.discard(proc.pid)
                    code = exit_status(proc.returncode)
                    if on_exit is not None:
                        on_exit(spec, code)
                    if code != 0 and not (may_fail and may_fail(spec, code)):
                        failed.append((spec, code))
            if failed:
                # Peers exit on losing a process, and the fork server reports exits in its
                # own order: the first failure seen need not be the first to happen. Hear
                # the exits of the next moment too before stopping, so that on_exit's
                # caller can order them (by the times a --kill records, say).
                settle_until = settle_until or time.monotonic() + _SETTLE
                if time.monotonic() >= settle_until:
                    break
            if poll is not None:
                poll()
            time.sleep(0.05 if pending else 0)
        if failed:
            spec, code = first_failure(failed)
            with lock:
                sink.write(f"plexus: {spec.name} exited with status {code}; stopping the job\n")
            status = status or code
    finally:
        children.stop(grace)
        for pump in pumps:
            pump.join(timeout=grace)
        if forks is not None:
            forks.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
