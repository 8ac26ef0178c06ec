"""Sandblaster L-BFGS: the coordinator's algorithm against torch.optim.LBFGS, the float64
oracle over shards, replicas and units, exactly-once units under backups and a killed
replica, load balancing, and bad input."""
from __future__ import annotations


import pytest
import torch
from torch import nn

import plexus
from plexus.cli import main
from plexus.config import DataConfig
from plexus.sandblaster.lbfgs import Lbfgs, LocalVectors, Settings, Slot
from plexus.train.data import load_dataset
from userpkg import oracle

ITERATIONS = 8


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _torch_lbfgs(factory, data, iterations: int, history: int, line_search: str | None, lr: float = 1.0
                 ) -> nn.Module:
    """torch.optim.LBFGS on the full batch, float64, from the same seed as plexus."""
    torch.manual_seed(0)
    model = factory(data).double()
    x, y = data.x_train.double(), data.y_train
    opt = torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=iterations, max_eval=10**6, history_size=history,
                            line_search_fn=line_search)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    return model


@pytest.fixture(scope="module")
def digits():
    return load_dataset(DataConfig(dataset="digits"), 0)


@pytest.mark.parametrize("line_search", ["strong_wolfe", "none"])
@pytest.mark.parametrize("recursion", ["two-loop", "vector-free"])
def test_the_coordinators_lbfgs_is_torchs_step_for_step(digits, line_search, recursion):
    """The algorithm over slots, in one process: torch's iterates to 1e-12, and the round
    trips of the direction are 2m + 1 (two-loop) or 1 (vector-free) once m pairs are kept."""
    history, lr = 3, 1.0 if line_search != "none" else 0.5
    want = _torch_lbfgs(oracle.mlp, digits, 12, history, None if line_search == "none" else line_search, lr)
    torch.manual_seed(0)
    model = oracle.mlp(digits).double()
    x, y = digits.x_train.double(), digits.y_train
    params = list(model.parameters())
    v = LocalVectors(_flat(model).numel(), torch.float64)
    v[Slot.X].copy_(_flat(model))

    def objective(t: float) -> tuple[float, float]:
        v.copy(Slot.T, Slot.X)
        v.axpy(Slot.T, t, Slot.D)
        torch.nn.utils.vector_to_parameters(v[Slot.T], params)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        v[Slot.GN].copy_(torch.cat([p.grad.reshape(-1) for p in params]))
        return float(loss.detach()), float(v[Slot.GN].dot(v[Slot.D]))

    lbfgs = Lbfgs(v, objective, Settings(lr=lr, history=history, line_search=line_search, recursion=recursion),
                  round_trips=lambda: v.trips)
    trips = [lbfgs.iterate(fresh_batch=False, last=i == 11).direction_round_trips for i in range(12)]
    got = v[Slot.X]
    assert float((got - _flat(want)).norm() / _flat(want).norm()) < 1e-12
    assert trips[-1] == (2 * history + 1 if recursion == "two-loop" else 1)


def _oracle_job(tmp_path, **over) -> dict:
    job = {"strategy": "sandblaster", "dataset": "digits", "model": "userpkg.oracle:mlp", "dtype": "float64",
           "steps": ITERATIONS, "history": 4, "line_search": "strong_wolfe", "weight_decay": 0.0,
           "batch_size": 8192, "eval_every": 0, "save_model": True, "out": str(tmp_path), "quiet": True, **over}
    return plexus.run(job)


@pytest.mark.slow
@pytest.mark.parametrize("shards, replicas, unit, backup, model, recursion", [
    (1, 1, 0, 0.0, "logreg", "two-loop"),
    (2, 3, 37, 0.5, "mlp", "two-loop"),
    (3, 2, 200, 0.3, "mlp", "vector-free"),
])
def test_full_batch_sandblaster_equals_torch_lbfgs_in_float64(tmp_path, digits, shards, replicas, unit, backup,
                                                              model, recursion):
    """Whatever the shards, replicas, unit size and backup tasks, the parameters after
    ITERATIONS iterations are torch.optim.LBFGS's to 1e-8: each unit counts once. No
    message from a shard to the coordinator comes near a parameter vector."""
    summary = _oracle_job(tmp_path, servers=shards, workers=replicas, unit_size=unit, backup_after=backup,
                          model=f"userpkg.oracle:{model}", lbfgs=recursion)
    want = _flat(_torch_lbfgs(getattr(oracle, model), digits, ITERATIONS, 4, "strong_wolfe"))
    state = torch.load(tmp_path / "model.pt")
    got = torch.cat([t.reshape(-1) for t in state.values()])
    assert got.dtype == torch.float64
    assert float((got - want).norm() / want.norm()) < 1e-8
    assert summary["iterations"] == ITERATIONS and summary["status"] == "completed"
    assert summary["units_accepted_by_shard"] == [summary["units_expected"]] * shards
    assert summary["coordinator_largest_message"] < summary["parameter_vector_bytes"] / 4
    assert summary["coordinator_bytes_recv"] < summary["parameter_vector_bytes"] * summary["round_trips_total"] / 4


@pytest.mark.slow
def test_a_killed_replica_costs_only_its_unit(tmp_path):
    """Replica 1 dies holding a unit it pushed to the first shard only: with backup tasks
    off, only the re-run of a lost replica's unit can finish the evaluation; it does, each
    shard counts every unit once, and the job finishes."""
    summary = plexus.run({"strategy": "sandblaster", "dataset": "digits", "workers": 3, "servers": 2, "steps": 15,
                          "kill": "worker:1@step=6", "backup_after": 0.0, "eval_every": 0, "out": str(tmp_path),
                          "quiet": True})
    assert summary["status"] == "completed" and summary["lost_workers"] == [1]
    assert summary["units_by_worker"].keys() == {"0", "2"}
    assert sum(summary["reruns_by_worker"].values()) == 1
    assert summary["units_accepted_by_shard"] == [summary["units_expected"]] * 2
    assert summary["duplicate_pushes_by_shard"][0] >= 1  # the re-run's push to the shard that had it
    assert summary["final_test_accuracy"] > 0.8


@pytest.mark.slow
def test_a_slow_replica_takes_fewer_units(tmp_path):
    """With replica 0 four times slower, the fast replicas take most of the units."""
    summary = plexus.run({"strategy": "sandblaster", "dataset": "digits", "workers": 3, "steps": 10,
                          "slow": "worker:0=4", "eval_every": 0, "out": str(tmp_path), "quiet": True})
    units = summary["units_by_worker"]
    fast = (units["1"] + units["2"]) / 2
    assert units["0"] < 0.6 * fast, units
    assert summary["units_accepted_by_shard"] == [summary["units_expected"]]


@pytest.mark.parametrize("flags, words", [
    (["--unit-size", "100", "--batch-size", "64"], "unit_size must not exceed batch_size"),
    (["--history", "0"], "history must be at least 1"),
    (["--consistency", "asp"], "consistency"),
    (["--momentum", "0.9"], "momentum"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, flags, words):
    assert main(["train", "--strategy", "sandblaster", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@pytest.mark.slow
def test_a_replica_that_joins_takes_units(tmp_path):
    """``plexus worker --join`` adds a replica to a running job: the shards open a link to
    it and it computes units of the next evaluations; each unit still counts once."""
    import json
    import os

    import warm_cli
    from plexus.cluster.rendezvous import ProcessInfo, connect_store
    from plexus.train.metrics import read_events
    from test_ps_join import _free_port, _wait_for
    port, token, out = _free_port(), "join-sandblaster", tmp_path / "run"
    env = {**os.environ, "PLEXUS_TOKEN": token}
    job = warm_cli.popen(["train", "--strategy", "sandblaster", "--workers", "2", "--dataset", "digits",
                          "--steps", "100000", "--time-limit", "90", "--log-every", "20", "--port", str(port),
                          "--timeout", "30", "--out", str(out), "--quiet", "--json"], env=env)
    try:
        _wait_for(lambda: bool(read_events(out, "train")), 90, "training started", job)
        joiner = warm_cli.popen(["worker", "--join", f"127.0.0.1:{port}", "--timeout", "30"], env=env)
        _wait_for(lambda: any(e["worker"] == 2 and e["step"] >= 40 for e in read_events(out, "train")), 90,
                  "the joined replica's units", job)
        info = ProcessInfo(role="worker", rank=-1, world_size=0, master_addr="127.0.0.1", master_port=port,
                           token=token)
        connect_store(info, 10).set("sb/stop_request", "1")  # what a reached target or time limit sets
        _, join_err = joiner.communicate(timeout=120)
        job_out, job_err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
    assert joiner.returncode == 0, join_err
    assert job.returncode == 0, job_err
    summary = json.loads(job_out.strip().splitlines()[-1])
    assert summary["units_by_worker"]["2"] >= 40
    assert summary["units_accepted_by_shard"] == [summary["units_expected"]]
