"""Shared fixtures: a temporary matplotlib config, a check that no test leaves a child
process behind, and one that the whole session leaves no shared-memory file behind."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from filelock import FileLock

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import warm_cli  # noqa: E402 - from HERE
os.environ.setdefault("MPLCONFIGDIR", "/tmp/plexus-mpl")
# Children started by spawn() import the test helpers from here.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
# A run's plots cost about 1.3 s of CPU; the tests that read them ask for `with_report`.
os.environ["PLEXUS_NO_REPORT"] = "1"
# Every store connection makes c10d's client look up the name of ::ffff:127.0.0.1 in DNS
# (benchmarks/store_connect.py). This machine's DNS drops some of the lookups that several
# processes send at once, and each dropped one held its job up for the resolver's 5 s
# timeout (tests/test_tree_ps.py's every-gradient test: 18.6 s, 5.5 s with this). glibc
# reads RES_OPTIONS at a process's first lookup; the test processes and their children
# wait 1 s before they ask again.
os.environ.setdefault("RES_OPTIONS", "timeout:1")


@pytest.fixture
def with_report(monkeypatch):
    """Runs started in this test write their plots and index.html, as they do by default."""
    monkeypatch.delenv("PLEXUS_NO_REPORT", raising=False)


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], Any], float], Any]:
    """``once(name, compute, timeout)``: the JSON value ``compute(folder)`` returns, computed
    by the first test of the session that asks for ``name`` and read back by the others;
    under pytest-xdist the workers take turns through a file lock (waiting at most
    ``timeout`` seconds). It is kept in a folder of this session's that all its workers see
    (the parent of their own base folders), or without xdist in the session's own base
    folder: the parent of that one is every session's, where a result would outlive the
    code that made it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, compute: Callable[[Path], Any], timeout: float) -> Any:
        done = shared / f"{name}.json"
        with FileLock(str(done) + ".lock", timeout=timeout):
            if not done.exists():
                done.write_text(json.dumps(compute(shared / name)))
        return json.loads(done.read_text())
    return get


def _children(parent: int | None = None) -> set[int]:
    """PIDs of live processes whose parent is ``parent`` (by default this test process)."""
    me, found = parent or os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) == me and fields[0] != "Z":
                found.add(int(entry))
    return found


@pytest.fixture(autouse=True)
def no_orphans():
    """Every test must reap what it starts."""
    before = _children()
    helper = warm_cli.listening_pid()
    running = _children(helper) if helper is not None else set()
    yield
    left = _children() - before - warm_cli.helper_pids()
    assert not left, f"test left child processes behind: {sorted(left)}"
    # A command of warm_cli.popen waits in a child of the listening helper, not of ours
    # (which leaves it a moment after it has reported the command's exit).
    helper, deadline = warm_cli.listening_pid(), time.monotonic() + 2
    while helper is not None and _children(helper) - running and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _children(helper) - running if helper is not None else set()
    assert not left, f"test left commands of the warm helper running: {sorted(left)}"


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """Links' shared-memory files go to a folder of this session's (children inherit the
    variable); every one must have been unlinked by the end."""
    folder = tempfile.mkdtemp(prefix="plexus-tests-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ["PLEXUS_SHM_DIR"] = folder
    yield
    left = sorted(os.listdir(folder))
    shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"shared-memory files left behind: {left}"
