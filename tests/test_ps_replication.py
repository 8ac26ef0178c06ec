"""Replicated shards (``--replication k``): a server that dies is taken over by its
successor and training goes on; the ledger (``--ledger``, worker w's push of clock t
carries w * 10^6 + t) shows that no acknowledged push is lost and none is applied twice."""
from __future__ import annotations

import pytest
import torch

import plexus
from plexus.config import JobConfig
from plexus.errors import ConfigError, JobFailed
from plexus.ps.consistency import make_consistency
from plexus.ps.replication import ShardState, WorkerRow, replicated_shards, successors
from plexus.strategies.downpour import DownpourStrategy

BASE = dict(strategy="ps", dataset="digits", model="mlp", hidden=32, lr=0.05, batch_size=48, workers=3,
            servers=2, replication=1, ledger=True, steps=40, eval_every=0, log_every=100, quiet=True, timeout=30,
            peer_timeout=5, seed=1, no_report=True)


def test_ring_of_replicas():
    assert successors(0, 3, 2) == [1, 2]
    assert successors(2, 3, 1) == [0]
    assert replicated_shards(0, 3, 2) == [1, 2]
    assert replicated_shards(1, 4, 1) == [0]


def test_bsp_gate_restored_from_replicated_clocks():
    """A takeover mid-round: workers 0 and 2 pushed round 5 to the dead primary, which never
    applied it; the new gate expects round 5 from everyone and serves round 5's reads."""
    gate = make_consistency("bsp", 3)
    gate.restore({0: 5, 1: 5, 2: 5})
    assert gate.may_serve(1, 5) and not gate.may_serve(1, 6)
    assert gate.push(_push(0, 5)) == [] and gate.push(_push(2, 5)) == []
    assert [[p.worker for p in g] for g in gate.push(_push(1, 5))] == [[0, 1, 2]]


def _push(worker: int, clock: int):
    from plexus.ps.consistency import Push
    return Push(worker, clock, 0, None)


def test_shard_state_is_numbers_only():
    state = ShardState(1, 7, 10, torch.ones(5), [torch.zeros(5)], 7,
                       [WorkerRow(0, "active", 0, 7, 7, 7, 7, 7, 0, 6)], [7, 0], ledger=21, duplicates=0)
    parts = state.encode()
    assert all(isinstance(t, torch.Tensor) for t in parts)
    assert parts[0].tolist()[1:4] == [1, 7, 5]


@pytest.mark.parametrize("flags, words", [
    ({"replication": 2, "servers": 2}, "replication must be less than servers (2)"),
    ({"replication": 1, "servers": 2, "backup_workers": 1, "consistency": "bsp"}, "backup_workers"),
    ({"ledger": True, "workers": 17, "batch_size": 68}, "16 workers or fewer"),
])
def test_bad_replication_settings_are_refused(flags, words):
    cfg = JobConfig.from_flat({**BASE, **flags})
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        DownpourStrategy.check_config(cfg)


def _run(tmp_path, name: str, **flags):
    return plexus.run({**BASE, **flags, "out": str(tmp_path / name)})


def _ledger_ok(summary):
    assert summary["ledger_verdict"].startswith("ledger OK"), summary["ledger_verdict"]
    for shard in summary["ledger"].values():
        assert shard["acked"] <= shard["final"] <= shard["sent"] and shard["duplicates"] == 0


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_killed_server_is_taken_over_with_no_acknowledged_push_lost(tmp_path, consistency):
    summary = _run(tmp_path, consistency, consistency=consistency, kill="server:1@step=30", save_model=True)
    assert summary["status"] == "completed"
    assert summary["lost_servers"] == [1] and summary["lost_workers"] == []
    (recovery,) = summary["recoveries"]
    assert recovery["shard"] == 1 and recovery["server"] == 0 and recovery["first_update_seconds"] is not None
    _ledger_ok(summary)
    # Every push was acknowledged (none lost with the server) and applied once per shard.
    assert summary["pushes_acknowledged"] == summary["updates_applied"] == 3 * 40
    if consistency == "bsp":
        # The replica is a byte copy of the primary: the run equals one with no fault.
        calm = _run(tmp_path, "calm", consistency=consistency, save_model=True)
        assert summary["final_test_accuracy"] == calm["final_test_accuracy"]
        killed = torch.load(tmp_path / consistency / "model.pt")
        for name, value in torch.load(tmp_path / "calm" / "model.pt").items():
            assert torch.equal(value, killed[name]), name
    else:
        assert summary["final_test_accuracy"] > 0.6  # learns (asynchronous runs vary: 0.77 to 0.92 measured)


@pytest.mark.slow
@pytest.mark.parallel
def test_primary_and_replica_killed_together_with_two_replicas(tmp_path):
    summary = _run(tmp_path, "k2", consistency="asp", servers=3, replication=2, workers=4, batch_size=48,
                   kill="server:0@step=40,server:1@step=40")
    assert summary["lost_servers"] == [0, 1]
    assert sorted(r["shard"] for r in summary["recoveries"]) == [0, 1]
    assert {r["server"] for r in summary["recoveries"]} == {2}
    _ledger_ok(summary)
    assert summary["final_test_accuracy"] > 0.6


@pytest.mark.slow
@pytest.mark.parallel
def test_killed_worker_under_replication_keeps_the_ledger(tmp_path):
    summary = _run(tmp_path, "worker", consistency="asp", kill="worker:2@step=15")
    assert summary["lost_workers"] == [2] and summary["lost_servers"] == []
    _ledger_ok(summary)


@pytest.mark.slow
@pytest.mark.parallel
def test_killed_server_without_replicas_ends_the_job_naming_it(tmp_path):
    with pytest.raises(JobFailed):
        _run(tmp_path, "bare", consistency="asp", replication=0, kill="server:1@step=30")
    assert '"status": "failed"' in (tmp_path / "bare" / "summary.json").read_text()


@pytest.mark.parametrize("name, n", [("bsp", 0), ("softsync", 2)])
def test_a_push_the_gate_holds_is_not_counted_as_applied(name, n):
    """A replica started from a state taken while a push waits in the gate must expect that
    push again (it is not in the state), not acknowledge it as a duplicate."""
    gate = make_consistency(name, 3, softsync=n)
    for w in range(3):
        gate.join(w, 0)
    gate.push(_push(0, 0))
    assert gate.clocks[0] == 1 and gate.applied_clock(0) == 0 and gate.applied_clock(1) == 0
