"""``run(args)``: ``python -m plexus.cli ARGS`` for the tests, as ``subprocess.run`` would
run it (its own process, exit status, stdout and stderr apart), but forked from a helper
interpreter that has already imported torch, ``torch._dynamo`` and plexus.

Those imports are most of a short command's cost: 5.5 to 6 s of CPU here (``import
torch`` 3.0 s, ``torch._dynamo`` 2.6 s, measured 2026-11-27 on this 2-core machine) against
about 0.7 s for the rest of a 40-step job, and the suite runs over a hundred commands. The
helper never runs a torch operation, so no OpenMP pool exists to be lost in the fork, and
it never configures logging: a forked command starts as a fresh interpreter would, with
these modules already loaded. It differs from a fresh interpreter in what was read at
those imports: the helper imports torch with ``TORCH_CPP_LOG_LEVEL=ERROR``, as ``plexus``
does without ``--debug``, so a command with ``--debug`` (which keeps c10d's C++ warnings)
runs as a real subprocess instead, as does one under ``PLEXUS_WARM_CLI=0``.

One helper per test process, started on first use; it dies with that process
(``PR_SET_PDEATHSIG``), and each command dies with the helper. ``helper_pids()`` lets the
conftest's orphan check tell the helper from a process a test left behind.

``python warm_cli.py --listen FD PARENT`` is a helper that runs commands side by side on
the listening Unix socket FD it inherits (``listener``): each connection is one command,
in a session of its own, and
``Command`` is its ``subprocess.Popen``. ``popen`` starts one for the test process (for the
jobs a test signals, or joins while they run), and tests/netns.py one on each host (network
namespace) that several tests share, so that the processes of a job across hosts do not
each import torch.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["run", "popen", "listener", "listening_pid", "helper_pids", "Command"]

_MAX_MESSAGE = 1 << 20
_helper: tuple[subprocess.Popen, socket.socket] | None = None
_listening: tuple[subprocess.Popen, str] | None = None  # popen's helper and its socket


def helper_pids() -> set[int]:
    return {proc.pid for proc in (_helper and _helper[0], _listening and _listening[0])
            if proc is not None and proc.poll() is None}


def listening_pid() -> int | None:
    """The listening helper of ``popen``, if it runs: the commands' waiting processes are its
    children (the conftest's orphan check looks for those left)."""
    return _listening[0].pid if _listening is not None and _listening[0].poll() is None else None


def popen(args, env: dict | None = None, cwd=None) -> "Command | subprocess.Popen":
    """``subprocess.Popen([python, "-m", "plexus.cli", *args], stdout=PIPE, stderr=PIPE,
    text=True, env=env, cwd=cwd, start_new_session=True)`` for a command the test signals,
    reads while it runs or runs beside others: forked from a listening helper of this test
    process (``--listen``), started on first use; a real subprocess where ``run`` makes one."""
    global _listening
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if _fresh(args, env):
        return subprocess.Popen([sys.executable, "-m", "plexus.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)
    if _listening is None or _listening[0].poll() is not None:
        folder = tempfile.mkdtemp(prefix="plexus-warm-")
        path = os.path.join(folder, "helper.sock")
        sock, argv, helper_env = listener(path)
        with sock:  # the helper holds it from here: with the helper gone, a command is refused at once
            proc = subprocess.Popen(argv, env=helper_env, pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL)
        _listening = (proc, path)
        atexit.register(_stop_listening, proc, folder)
    return Command(_listening[1], args, env, cwd)


def listener(path: str) -> tuple[socket.socket, list[str], dict[str, str]]:
    """A listening Unix socket bound at ``path``, and the command line and environment of a
    helper that serves it: start that with the socket's descriptor passed, then close ours.
    A command may connect at once; it waits in the backlog while the helper imports torch."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(path)
    sock.listen(64)
    argv = [sys.executable, os.path.abspath(__file__), "--listen", str(sock.fileno()), str(os.getpid())]
    return sock, argv, {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _fresh(args: list[str], env: dict[str, str]) -> bool:
    """A command that runs as a real subprocess: ``--debug`` keeps c10d's C++ warnings, which
    the helpers' import of torch turned off, and ``PLEXUS_WARM_CLI=0`` asks for one."""
    return "--debug" in args or env.get("PLEXUS_WARM_CLI") == "0"


def _stop_listening(proc: subprocess.Popen, folder: str) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _start() -> tuple[subprocess.Popen, socket.socket]:
    global _helper
    if _helper is not None and _helper[0].poll() is None:
        return _helper
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno()), str(os.getpid())],
                            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    _helper = (proc, ours)
    atexit.register(_stop)
    return _helper


def _stop() -> None:
    global _helper
    if _helper is not None:
        proc, sock = _helper
        sock.close()  # the helper leaves when its socket closes
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _helper = None


def _read(fds: list[int], deadline: float) -> dict[int, bytes]:
    """Everything written to the read ends ``fds`` until each is closed, or until
    ``deadline``; raises TimeoutError then."""
    out = {fd: b"" for fd in fds}
    open_fds = set(fds)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                out[fd] += chunk
            else:
                open_fds.discard(fd)
    return out


def _reply(sock: socket.socket, deadline: float) -> dict:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([sock], [], [], left)[0]:
        raise TimeoutError
    data = sock.recv(_MAX_MESSAGE)
    if not data:
        raise OSError("the tests' plexus helper exited")
    return json.loads(data)


def run(args, timeout: float = 180, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "plexus.cli", *args], capture_output=True,
    text=True, timeout=timeout, env=env, cwd=cwd)``, forked from the warm helper."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-m", "plexus.cli", *args]
    if _fresh(args, env):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    _, sock = _start()
    deadline = time.monotonic() + timeout
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        request = {"args": args, "env": env, "cwd": str(cwd or os.getcwd())}
        socket.send_fds(sock, [json.dumps(request).encode()], [out_w, err_w])
    finally:
        os.close(out_w)
        os.close(err_w)
    pid = None
    try:
        pid = _reply(sock, deadline)["started"]
        got = _read([out_r, err_r], deadline)
        status = _reply(sock, deadline)["status"]
    except TimeoutError:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reply(sock, time.monotonic() + 30)  # its status: the helper is free again
        raise subprocess.TimeoutExpired(argv, timeout) from None
    finally:
        os.close(out_r)
        os.close(err_r)
    return subprocess.CompletedProcess(argv, status, got[out_r].decode(errors="replace"),
                                       got[err_r].decode(errors="replace"))


class Command:
    """``subprocess.Popen([python, "-m", "plexus.cli", *args], stdout=PIPE, stderr=PIPE,
    text=True, env=env, cwd=cwd, start_new_session=True)``, forked from the listening
    helper at ``path``: ``pid``, ``returncode``, ``poll``, ``wait`` and ``communicate``."""

    def __init__(self, path: str, args, env: dict[str, str], cwd=None) -> None:
        self.args = [str(a) for a in args]
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(path)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            request = {"args": self.args, "env": env, "cwd": str(cwd or os.getcwd())}
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self._pipes = [out_r, err_r]
        self._got = {out_r: b"", err_r: b""}
        self.pid = _reply(self._sock, time.monotonic() + 30)["started"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None and select.select([self._sock], [], [], 0)[0] else \
            self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = time.monotonic() + (1e9 if timeout is None else timeout)
            try:
                self.returncode = _reply(self._sock, deadline)["status"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._sock.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr once both are closed, and then its exit status."""
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        if self._pipes:
            try:
                got = _read(self._pipes, deadline)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            for fd in self._pipes:
                self._got[fd] += got[fd]
                os.close(fd)
            self._pipes = []
        self.wait(max(0.0, deadline - time.monotonic()))
        out, err = self._got.values()
        return out.decode(errors="replace"), err.decode(errors="replace")


# --- the helper ---------------------------------------------------------------------------------

def _warm_up(parent: int) -> list[str]:
    """A helper's start: die with the test process ``parent``, import what every command
    would, and return the import path a command starts from (less PYTHONPATH)."""
    from plexus.cluster.forkserver import _die_with  # here: the package imports torch
    _die_with(parent)  # SIGKILL when the test process dies
    for name in ("torch", "plexus.cli", "plexus.train.job"):  # the point of the helper
        importlib.import_module(name)
    from plexus.train.process import warm
    warm()
    return [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def _serve(sock: socket.socket, parent: int) -> None:
    base_path = _warm_up(parent)
    while True:
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        if not data:
            return
        request = json.loads(data)
        me, pid = os.getpid(), os.fork()
        if pid == 0:
            _command(request, fds, sock, base_path, me)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"started": pid}).encode())
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())


def _serve_many(listening: socket.socket, parent: int) -> None:
    """The listening helper: a process per connection, which forks its command, reports
    the pid, waits for it and reports its exit status."""
    base_path = _warm_up(parent)
    from plexus.cluster.forkserver import _die_with
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the connections' processes reap themselves
    me = os.getpid()
    while True:
        conn, _ = listening.accept()
        if os.fork() == 0:
            listening.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _die_with(me)
            data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
            handler, pid = os.getpid(), os.fork()
            if pid == 0:
                os.setsid()  # the test kills the command's process group
                _command(json.loads(data), fds, conn, base_path, handler)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"started": pid}).encode())
            _, status = os.waitpid(pid, 0)
            conn.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            os._exit(0)
        conn.close()


def _command(request: dict, fds: list[int], sock: socket.socket, base_path: list[str], helper: int) -> None:
    """A forked command: the request's directory, environment and import path (as
    ``python -m`` sets it: the directory first, then PYTHONPATH), stdout and stderr into
    the test's pipes, then ``plexus.cli.main``; atexit hooks run as at an interpreter's
    exit, then ``os._exit``."""
    code = 1
    try:
        sock.close()
        from plexus.cluster.forkserver import _die_with  # imported by the helper already
        _die_with(helper)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # read from TMPDIR again, as a fresh interpreter would
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *[p for p in base_path if p not in extra]]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import plexus.cli
        sys.argv = [plexus.cli.__file__, *request["args"]]
        code = plexus.cli.main(request["args"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, status 1
        import traceback
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    if sys.argv[1] == "--listen":
        _serve_many(socket.socket(fileno=int(sys.argv[2])), int(sys.argv[3]))
    else:
        _serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
