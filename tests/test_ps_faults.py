"""Workers that die: the job finishes with the others under every consistency model, the
summary names the lost worker and still has a final accuracy (worker 0 included), and
every push a server acknowledged was applied."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import warm_cli
from procs import role_processes

import plexus
from plexus.train.metrics import read_events
from test_ps_join import _free_port, _stop, _wait_for

BASE = dict(strategy="ps", dataset="digits", model="mlp", hidden=32, lr=0.05, batch_size=48, servers=2,
            eval_every=20, log_every=10, quiet=True, timeout=30, peer_timeout=5, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("consistency, extra, victim, at, steps", [
    ("asp", {}, 0, 15, 60),                       # the evaluating worker itself
    ("bsp", {}, 1, 10, 40),                       # the barrier goes on without it
    ("ssp", {"staleness": 2}, 2, 10, 40),          # the bound goes on without it
    ("softsync", {"softsync": 2}, 1, 10, 40),
])
def test_killed_worker_leaves_the_job_running(tmp_path, consistency, extra, victim, at, steps):
    summary = plexus.run({**BASE, **extra, "consistency": consistency, "workers": 3, "steps": steps,
                          "kill": f"worker:{victim}@step={at}", "out": str(tmp_path / consistency)})
    assert summary["lost_workers"] == [victim]
    assert summary["final_test_accuracy"] is not None and summary["final_test_accuracy"] > 0.3
    # Killed at the start of step `at`, the victim's `at` pushes were all answered: nothing
    # acknowledged is lost, and nothing is applied twice.
    assert summary["updates_applied"] == summary["pushes_acknowledged"] == 2 * steps + at, summary
    assert summary["protocol_errors"] == 0
    if consistency == "bsp":
        assert summary["staleness_max"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "tree-ps"])
def test_evaluation_goes_on_when_worker_0_is_lost(tmp_path, strategy):
    """The lowest-ranked survivor takes over the snapshots, so the job still stops at the
    target accuracy and the summary has the time it took."""
    steps = 3000
    summary = plexus.run({**BASE, "strategy": strategy, "consistency": "asp", "workers": 3, "steps": steps,
                          "momentum": 0.0, "lr": 0.1, "kill": "worker:0@step=5", "eval_every": 10,
                          "target_accuracy": 0.9, "out": str(tmp_path)})
    assert summary["lost_workers"] == [0]
    evals = read_events(tmp_path, "eval")
    # On failure, say which way it failed: evaluations that stopped after the loss, or an
    # asynchronous run that never reached the target (its accuracies, its steps, its health).
    seen = [(e["step"], round(e["test_accuracy"], 3)) for e in evals]
    assert summary["time_to_target_seconds"] is not None, (seen[-12:], len(seen), summary)
    assert summary["final_test_accuracy"] >= 0.85
    assert any(e["step"] > 5 for e in evals)  # snapshots after worker 0 was gone
    assert summary["steps"] < 2 * steps        # it stopped at the target, not at the step limit


def _worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of worker ``rank`` among the processes the launcher ``launcher`` started."""
    return role_processes(launcher).get(f"worker {rank}")


@pytest.mark.slow
def test_silent_worker_is_dropped_after_peer_timeout_under_bsp(tmp_path):
    """A worker that stops (SIGSTOP: alive, but silent) holds the bsp barrier for
    --peer-timeout seconds only; when it wakes up it learns it was dropped and exits, and
    the job finishes with the others."""
    port, token, out = _free_port(), "silent-test-token", tmp_path / "run"
    job = warm_cli.popen(["train", "--strategy", "ps", "--consistency", "bsp", "--workers", "3", "--dataset", "digits",
                          "--hidden", "32", "--lr", "0.05", "--batch-size", "48", "--steps", "1000000",
                          "--time-limit", "120", "--eval-every", "0", "--log-every", "10", "--port", str(port),
                          "--timeout", "20", "--peer-timeout", "2", "--out", str(out), "--quiet", "--json"],
                         env={**os.environ, "PLEXUS_TOKEN": token})
    try:
        progress = lambda: max((e["step"] for e in read_events(out, "train") if e["worker"] == 0), default=0)  # noqa
        _wait_for(lambda: progress() >= 20, 90, "training started", job)
        victim = _worker_pid(job.pid, 2)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = progress()
        # The barrier goes on without it once --peer-timeout has passed.
        _wait_for(lambda: progress() >= stopped_at + 50, 60, "the others to go on", job)
        os.kill(victim, signal.SIGCONT)
        _wait_for(lambda: _gone(victim), 60, "the dropped worker to exit", job)
        _stop(port, token)
        job_out, job_err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, job_err
    summary = json.loads(job_out.strip().splitlines()[-1])
    assert summary["lost_workers"] == [2] and summary["final_test_accuracy"] is not None
    assert "lost worker 2 (no heartbeat" in job_err
    # Its last push may have been applied while its answer said it was dropped, never the reverse.
    assert 0 <= summary["updates_applied"] - summary["pushes_acknowledged"] <= 1
    assert summary["staleness_max"] == 0


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_monitor_drops_silent_and_absent_workers(tmp_path):
    """In one process: a server whose worker 1 beats once and then falls silent drops it
    after --peer-timeout; worker 0 never appears and is dropped after --timeout; then the
    shard drains and the server returns its record."""
    import threading

    import torch.distributed as dist

    from plexus.cluster.rendezvous import host_store
    from plexus.cluster.traffic import Traffic
    from plexus.config import JobConfig
    from plexus.ps.server import KEYS, ParameterServer

    store = dist.PrefixStore("job/", host_store("127.0.0.1", 0, "t", 10))
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 2, "batch_size": 2, "timeout": 3, "peer_timeout": 1})
    server = ParameterServer(store, 0, cfg, Traffic())
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(server.serve()))
    start = time.monotonic()
    thread.start()
    store.add(KEYS.heartbeat("worker", 1), 1)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - start < 15
    assert "no heartbeat" in result["lost"]["1"]
    assert set(result["lost"]) == {"0", "1"} and store.check([KEYS.lost("worker 1")])
    assert json.loads(store.get(KEYS.drained(0)))["evaluator"] == -1
