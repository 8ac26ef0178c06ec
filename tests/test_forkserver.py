"""The fork server (cluster/forkserver.py): children forked from a process that has
imported torch start in milliseconds, behave as spawned ones do, and leave nothing behind."""
from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest

import warm_cli
import plexus
from plexus.cluster.forkserver import can_fork
from plexus.cluster.launcher import RoleSpec, launch
from procs import descendants, role_processes

PY = sys.executable


def _entry() -> int:
    from plexus.cluster.child import prepare_child
    prepare_child()
    rank = int(os.environ["PLEXUS_ROLE_RANK"])
    name = open(f"/proc/{os.getpid()}/comm").read().strip()
    print(f"forked {rank} as {name!r}, parent {os.getppid()}, torch loaded {'torch' in sys.modules}")
    if os.environ.get("MODE") == "fail" and rank == 1:
        return 7
    if os.environ.get("MODE") == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    return 0


def test_children_are_forked_named_and_report_their_status(monkeypatch):
    monkeypatch.setenv("PLEXUS_START", "fork")
    sink = io.StringIO()
    status = launch([PY, "-c", "raise SystemExit(99)"], [RoleSpec("worker", r) for r in range(3)], sink=sink,
                    entry=_entry, env={**os.environ, "MODE": "ok"})
    assert status == 0, sink.getvalue()
    out = sink.getvalue()
    for r in range(3):
        assert f"[worker {r}] forked {r} as 'worker {r}'" in out and "torch loaded True" in out
    assert f"parent {os.getpid()}" not in out  # grandchildren: the fork server is their parent
    assert set(descendants(os.getpid())) <= warm_cli.helper_pids()  # the tests' idle helper may stay


def test_a_failed_child_stops_the_rest_even_one_that_ignores_sigterm(monkeypatch):
    monkeypatch.setenv("PLEXUS_START", "fork")
    started = time.monotonic()
    sink = io.StringIO()
    status = launch([PY], [RoleSpec("worker", 0), RoleSpec("worker", 1)], sink=sink, entry=_entry, grace=1.0,
                    env={**os.environ, "MODE": "fail"})
    assert status == 7 and "worker 1 exited with status 7" in sink.getvalue()
    status = launch([PY], [RoleSpec("worker", 0)], sink=sink, entry=_entry, grace=1.0, time_limit=1.0,
                    env={**os.environ, "MODE": "hang"})
    assert status == 124
    assert time.monotonic() - started < 15
    assert set(descendants(os.getpid())) <= warm_cli.helper_pids()  # the tests' idle helper may stay


def test_spawn_is_used_where_forking_is_unsafe_or_asked_against(monkeypatch):
    monkeypatch.delenv("PLEXUS_START", raising=False)
    assert can_fork(threads=0) is False  # an OpenMP pool may not survive a fork
    assert can_fork(threads=1) is sys.platform.startswith("linux")
    monkeypatch.setenv("PLEXUS_START", "spawn")
    assert can_fork(threads=1) is False
    sink = io.StringIO()
    code = "import os; print('spawned', os.getppid())"
    assert launch([PY, "-c", code], [RoleSpec("worker", 0)], sink=sink, entry=_entry) == 0
    assert f"spawned {os.getpid()}" in sink.getvalue()


@pytest.mark.slow
def test_a_forked_job_trains_exactly_as_a_spawned_one(monkeypatch, tmp_path):
    results = {}
    for start in ("fork", "spawn"):
        monkeypatch.setenv("PLEXUS_START", start)
        summary = plexus.run({"strategy": "allreduce", "algorithm": "ring", "workers": 2, "steps": 20,
                              "eval_every": 0, "out": str(tmp_path / start), "quiet": True})
        results[start] = (summary["final_test_accuracy"], summary["final_test_loss"])
    assert results["fork"] == results["spawn"]
    assert role_processes(os.getpid()) == {}


_RSS_AFTER_FREE = """
import ctypes, os, torch
from plexus.cluster.child import keep_freed_memory
kept = keep_freed_memory(ctypes.CDLL("libc.so.6"))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
x = torch.ones(4 << 20)  # 16 MiB, every page touched
del x
print(kept, (rss() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("setting, kept", [("1", True), ("0", False)])
def test_a_child_keeps_the_memory_it_frees_for_the_next_step(setting, kept):
    """With ``keep_freed_memory`` (every child calls it) a freed 16 MiB tensor stays in the
    process for the next allocation of its size; with glibc's defaults it goes back to the
    kernel at once, and the next one faults its pages in again."""
    import subprocess
    out = subprocess.run([PY, "-c", _RSS_AFTER_FREE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PLEXUS_KEEP_FREED_MEMORY": setting}, check=True).stdout.split()
    assert out[0] == str(kept)
    assert (int(out[1]) >= 15) == kept, out  # MiB still resident after the free


_INHERITED_GARBAGE = """
import gc, os, sys
from plexus.cluster.forkserver import ForkServer
marks = sys.argv[1]
class Finalised:
    def __del__(self):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\\n")
gc.disable()  # the cycle below stays uncollected until the fork, as a test's leftovers may
a, b = Finalised(), Finalised()
a.other, b.other = b, a
del a, b
def entry():
    gc.collect()
    return 0
forks = ForkServer(entry)
child = forks.start(dict(os.environ))
assert child.wait(60) == 0
forks.close()
gc.enable()
gc.collect()
print(os.getpid())
"""


def test_what_the_launcher_left_uncollected_is_never_finalised_in_the_fork_server(tmp_path):
    """A gloo process group left in a reference cycle by an earlier job once hung the next
    job's fork server: it collected the group while warming (the warm-up imports run in the
    launcher now), and the group's destructor waited forever for threads that had not
    survived the fork. Inherited objects are frozen in the fork server and its children
    (this child collects): only the launcher finalises its garbage."""
    import subprocess
    marks = tmp_path / "finalised"
    out = subprocess.run([PY, "-c", _INHERITED_GARBAGE, str(marks)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PLEXUS_START": "fork"})
    assert out.returncode == 0, out.stderr
    launcher = out.stdout.split()[-1]
    assert marks.read_text().split() == [launcher, launcher]  # both objects, by the launcher alone


def test_a_fork_server_that_does_not_exit_is_killed_by_close():
    from plexus.cluster.forkserver import ForkServer
    forks = ForkServer(lambda: 0)
    os.kill(forks.pid, signal.SIGSTOP)  # alive, but it never reads its socket again
    started = time.monotonic()
    forks.close(timeout=1.0)
    assert time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):
        os.kill(forks.pid, 0)
