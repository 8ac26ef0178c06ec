"""``plexus train --launcher ray`` on a Ray cluster that this module starts on the machine
(``ray start --head``, 4 CPUs, and the custom resource ``plexus_server`` that servers ask
for), driven as a user drives an existing cluster: ``--ray-address`` or ``RAY_ADDRESS``.
Synchronous jobs must give the local launcher's model bit for bit; a lost process must end
the job in one line that names it, and leave no actor behind."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from plexus.cli import main

RESOURCE = "plexus_server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _actor_pids() -> list[int]:
    """Processes of plexus's Ray actors (Ray titles them ``ray::RoleActor...``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::RoleActor"):
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def head():
    """A Ray head on a free port for this module, with token authentication (its own
    token, in the environment of the head and of this process, the driver); `ray start
    --block` stops every Ray process it started on SIGTERM. Yields its address."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    # Before Ray is imported here: it reads the authentication mode once, on import.
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    pytest.importorskip("ray")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="plexus-ray-")  # short: Ray's socket paths must fit 107 bytes
    log = open(Path(temp) / "head.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             "--port", str(port), "--num-cpus", "4", "--include-dashboard", "false",
                             "--disable-usage-stats", "--temp-dir", temp, "--resources", f'{{"{RESOURCE}": 100}}'],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, \
                    (Path(temp) / "head.log").read_text()[-3000:]
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _model(out: Path) -> dict:
    return torch.load(out / "model.pt")


@pytest.mark.slow
def test_ps_bsp_on_ray_equals_the_local_launcher(head, tmp_path, capsys):
    """1 server (on a node labelled plexus_server) and 2 workers as Ray actors: the
    synchronous job gives the local launcher's model, every tensor equal."""
    flags = ["train", "--strategy", "ps", "--consistency", "bsp", "--steps", "30", "--workers", "2", "--quiet",
             "--save-model", "--json"]
    assert main([*flags, "--launcher", "ray", "--ray-address", head, "--ray-server-resource", RESOURCE,
                 "--out", str(tmp_path / "ray")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == f"run directory: {tmp_path / 'ray'}"
    assert '"status": "completed"' in out[-1] and '"servers": 1' in out[-1]
    assert main([*flags, "--out", str(tmp_path / "local")]) == 0
    ours, local = _model(tmp_path / "ray"), _model(tmp_path / "local")
    assert ours.keys() == local.keys() and all(torch.equal(ours[k], local[k]) for k in ours)


@pytest.mark.slow
def test_a_killed_worker_ends_a_synchronous_job_in_one_line(head, tmp_path, capsys, monkeypatch):
    """allreduce cannot lose a worker: worker 1's actor dies at step 20 (--kill), and the
    driver names it, stops the other actor and exits 1; no actor process is left."""
    monkeypatch.setenv("RAY_ADDRESS", head)
    started = time.monotonic()
    code = main(["train", "--launcher", "ray", "--strategy", "allreduce", "--workers", "2", "--steps", "5000",
                 "--kill", "worker:1@step=20", "--quiet", "--out", str(tmp_path / "run")])
    took = time.monotonic() - started
    assert code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plexus: ")]
    named = [line for line in lines if "worker 1 (global rank 1 of 2)" in line]
    assert len(named) == 1 and "died" in named[0] and "stopped the other process" in named[0], lines
    assert took < 45, f"{took:.1f} s to end the job"
    deadline = time.monotonic() + 10
    while _actor_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _actor_pids() == []


@pytest.mark.slow
def test_a_lost_worker_under_asp_is_reported_and_the_job_goes_on(head, tmp_path, capsys, caplog):
    """ps asp tolerates a lost worker: worker 1's actor dies at step 20, the driver says so
    in one line, worker 0 finishes, and the summary lists worker 1 as lost."""
    assert main(["train", "--launcher", "ray", "--ray-address", head, "--strategy", "ps", "--consistency", "asp",
                 "--workers", "2", "--steps", "150", "--kill", "worker:1@step=20", "--quiet", "--json",
                 "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["lost_workers"] == [1]
    # The driver's line is a warning of plexus's logger (stderr under `plexus train`).
    lines = captured.err.splitlines() + [r.getMessage() for r in caplog.records]
    named = [line for line in lines if "worker 1 (global rank 1 of 3)" in line]
    assert len(named) == 1 and "died" in named[0] and "goes on without it" in named[0], lines


def test_bad_ray_input_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    """A Ray flag without --launcher ray, Ray missing, and a head that is not there: one
    line each, status 2."""
    assert main(["train", "--ray-address", "127.0.0.1:1", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ray-address applies to --launcher ray only" in err[0]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
        assert main(["train", "--launcher", "ray", "--steps", "1", "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'plexus[ray]'" in err[0]
    pytest.importorskip("ray")
    assert main(["train", "--launcher", "ray", "--ray-address", f"127.0.0.1:{_free_port()}", "--timeout", "1",
                 "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing listens at 127.0.0.1" in err[0] and "ray start --head" in err[0]
