"""A fork server: children forked from a process that has already imported torch.

``import torch`` costs seconds, and P children started as fresh interpreters pay it P
times at once on the same cores (about 10 s for a 4-worker job on 2 cores, measured
here). A forked child starts in milliseconds.

The launcher cannot fork its children itself: it hosts the job's store, whose server
thread resolves the address of every child that connects, and a child forked while that
thread holds glibc's resolver lock waits on it forever (seen here: a child stuck in
``getnameinfo`` under ``TCPStore``). So the launcher forks one *fork server* before any
child exists, while its own threads are idle, and the fork server, which has one thread,
forks every child on request. It reports each child's pid and exit status back over a
``SOCK_SEQPACKET`` socket; each child's output pipe is created by the launcher and passed
with the request (``SCM_RIGHTS``), so the launcher reads it as it would a ``Popen``'s.

Lifetime: the fork server asks the kernel to kill it when the launcher dies, its
children ask the same of it (``child.prepare_child`` reads ``PLEXUS_PARENT_PID``), and it
exits when the launcher closes the socket.

Forking is used only where it is safe (``can_fork``): on Linux, on a machine without
CUDA or where this process has not imported torch (CUDA does not survive a fork), and
with one torch thread per child (``--threads 1``, the default; an OpenMP pool does not
survive a fork either).
``PLEXUS_START=spawn`` forces fresh interpreters, ``PLEXUS_START=fork`` forking.
"""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Callable

__all__ = ["can_fork", "ForkServer", "ForkedChild"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 20
# Seconds to wait for the fork server to start a child (a fork takes milliseconds; a loaded
# machine here once took 8 s, when the fork server still ran the warm-up imports itself).
_START_TIMEOUT = 120.0
# Seconds the fork server has to exit once the launcher closes its socket.
_CLOSE_TIMEOUT = 10.0
_PR_SET_PDEATHSIG = 1


def can_fork(threads: int = 1) -> bool:
    """Whether children may be forked from this process (see the module docstring)."""
    start = os.environ.get("PLEXUS_START", "")
    if start in ("spawn", "fork"):
        return start == "fork"
    if not sys.platform.startswith("linux") or threads != 1:
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    # Asking torch whether CUDA is available arms its fork guard, after which no child of
    # a fork may use CUDA; there is no asking whether someone asked. So where CUDA is
    # there (initialised or not), children get fresh interpreters. On a CPU build the
    # question costs nothing and arms nothing.
    return not torch.cuda.is_available()


class ForkedChild:
    """A child of the fork server, with the part of ``subprocess.Popen``'s interface the
    launcher uses: ``pid``, ``stdout``, ``poll``, ``wait`` and ``returncode``."""

    def __init__(self, server: "ForkServer", pid: int, stdout) -> None:
        self._server, self.pid, self.stdout = server, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.collect(0.0)
            self.returncode = self._server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            self._server.collect(0.05 if left is None else min(0.05, left))
        return self.returncode


class ForkServer:
    """Forks the fork server at construction; ``start(env)`` forks one child of it, which
    runs ``entry()`` with ``env`` as its environment. ``close()`` ends the fork server.

    ``warm()``, if given, runs in this process before the fork server is forked: imports
    every child would otherwise pay on its own (see ``plexus.train.process.warm``). Run
    here, not in the fork server, they are paid once per process rather than once per job:
    a process that launches several jobs (``plexus compare``, the Python API, the test
    suite) pays them for its first job only (2.5 s of a 4-worker job's 2.9 s on this
    2-core machine, measured in-process, each job after the first)."""

    def __init__(self, entry: Callable[[], int | None], warm: Callable[[], None] | None = None) -> None:
        self.exits: dict[int, int] = {}
        if warm is not None:
            try:
                warm()
            except Exception:  # noqa: BLE001 - only an optimisation: each child imports what it needs
                traceback.print_exc()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _flush_std()
        pid = os.fork()
        if pid == 0:  # the fork server: never returns
            ours.close()
            _serve(theirs, entry, os.getppid())
        theirs.close()
        self.pid, self._sock, self._replies = pid, ours, []

    def start(self, env: dict[str, str]) -> ForkedChild:
        """Fork a child with ``env`` (its ``PLEXUS_PARENT_PID`` is set to the fork server)."""
        read, write = os.pipe()
        try:
            payload = json.dumps({**env, "PLEXUS_PARENT_PID": str(self.pid)}).encode()
            socket.send_fds(self._sock, [payload], [write])
        finally:
            os.close(write)
        while not self._replies:
            if not self.collect(_START_TIMEOUT):
                os.close(read)
                raise OSError(f"the fork server (pid {self.pid}) did not start a child within {_START_TIMEOUT:g} s")
        return ForkedChild(self, self._replies.pop(0), os.fdopen(read, "rb"))

    def collect(self, timeout: float) -> bool:
        """Read what the fork server reported within ``timeout`` seconds: started pids
        and exit statuses. False when nothing came."""
        got = False
        while True:
            ready, _, _ = select.select([self._sock], [], [], timeout if not got else 0.0)
            if not ready:
                return got
            data = self._sock.recv(_MAX_MESSAGE)
            if not data:  # the fork server is gone; its children died with it
                self._server_gone()
                return got
            got = True
            message = json.loads(data)
            if "started" in message:
                self._replies.append(message["started"])
            else:
                self.exits[message["pid"]] = message["status"]

    def _server_gone(self) -> None:
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        raise OSError(f"the fork server (pid {self.pid}) exited")

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """End the fork server: it exits when its socket closes; one that has not within
        ``timeout`` seconds (stuck, say, in a finaliser of something it inherited) is
        killed. Its children die with it."""
        self._sock.close()
        deadline = time.monotonic() + timeout
        try:
            while os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                if time.monotonic() > deadline:
                    logger.warning("plexus: the fork server (pid %d) did not exit within %g s of its socket "
                                   "closing; killed", self.pid, timeout)
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.01)
        except ChildProcessError:
            pass


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # or a child would write the parent's buffered text again
        except (OSError, ValueError, AttributeError):
            pass


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (Linux); exit now if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(1)


def _serve(sock: socket.socket, entry: Callable[[], int | None], parent: int) -> None:
    """The fork server's loop: fork a child per request, report every exit."""
    code = 0
    try:
        # Everything inherited from the launcher stays uncollected here and in the
        # children: its garbage may own threads that did not survive the fork (a gloo
        # process group's destructor waits for them forever: seen when a test left one
        # in a reference cycle and the next job's fork server collected it while warming).
        gc.freeze()
        _die_with(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when to stop
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        live: set[int] = set()
        while True:
            ready, _, _ = select.select([sock], [], [], 0.02)
            for pid in list(live):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    live.discard(pid)
                    sock.send(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}).encode())
            if not ready:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
            if not data:
                break  # the launcher closed the socket: its children are gone or going
            env = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _child(entry, env, fds[0], sock)
            os.close(fds[0])
            live.add(pid)
            sock.send(json.dumps({"started": pid}).encode())
    except BaseException:  # noqa: BLE001 - report and leave; the launcher sees the socket close
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _child(entry: Callable[[], int | None], env: dict[str, str], out: int, sock: socket.socket) -> None:
    """A forked child: a session of its own, stdin from /dev/null, stdout and stderr into
    ``out``, the role's environment, then ``entry()``; it ends with ``os._exit`` so that
    none of the launcher's finalizers or atexit hooks run here."""
    code = 1
    try:
        sock.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        torch = sys.modules.get("torch")
        if torch is not None:
            # The launcher's OpenMP pool did not survive the fork: a parallel region here
            # would wait forever at its barrier (seen: a copy kernel under pytest). With
            # one thread torch never enters one.
            torch.set_num_threads(1)
        result = entry()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a child reports everything, then exits
        traceback.print_exc()
    finally:
        try:
            _flush_std()
        finally:
            os._exit(code)

