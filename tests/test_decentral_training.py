"""gossip (D-PSGD, AD-PSGD), local-sgd and easgd in real processes.

One spawn of 4 workers runs every synchronous case (tests/decentral_fns.py) and the
tests below read its results: contract 1 against one-process SGD, bytes sent against
degree x model bytes and against ``collectives/cost.py``, the consensus distance as the
learning rate shrinks, and the logged events. AD-PSGD with a killed and a slow worker,
and EASGD with its server role, run through the local launcher. AD-PSGD's workers stop on
one budget of updates shared through the store (``train/budget.py``; unit tests first).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plexus
from plexus.cluster.spawn import spawn
from plexus.collectives.check import check_bytes
from plexus.collectives.cost import cost
from plexus.config import JobConfig
from plexus.strategies.gossip import GossipStrategy
from plexus.strategies.local_sgd import LocalSgdStrategy
from plexus.train.budget import UpdateBudget
from plexus.train.metrics import read_events
from plexus.train.summary import assemble_summary
from test_contract import BASE, assert_same_model, one_process_sgd

PROCS = 4
CONTRACT = {**BASE, "steps": 40}
ADPSGD_SLOW_STEPS = 200
# The digits MLP with hidden 32: 64*32+32 + 32*32+32 + 32*10+10 parameters.
NUMEL = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
MODEL_BYTES = 4 * NUMEL
CONVEX = dict(strategy="gossip", topology="ring", dataset="digits", model="decentral_fns:linear_model",
              optimizer="sgd", momentum=0.0, batch_size=64, steps=60, eval_every=0, seed=5)
LRS = [0.1, 0.01, 0.001]


def _cases(root: Path) -> dict[str, dict]:
    c = {
        # Contract 1: these equal synchronous SGD.
        "adapt_complete": {**CONTRACT, "strategy": "gossip", "topology": "complete", "gossip_order": "adapt-first"},
        "local_h1_ring": {**CONTRACT, "strategy": "local-sgd", "period": 1, "algorithm": "ring"},
        "local_h1_master_state": {**CONTRACT, "strategy": "local-sgd", "period": 1, "algorithm": "master",
                                  "average_optimizer_state": True},
        "local_h1_warmup": {**CONTRACT, "strategy": "local-sgd", "period": 1, "warmup_steps": 5},
        "combine_complete_1": {**CONTRACT, "strategy": "gossip", "topology": "complete", "steps": 1},
        # These must not (the comparison is sensitive to the strategy).
        "combine_complete": {**CONTRACT, "strategy": "gossip", "topology": "complete"},
        "local_h4": {**CONTRACT, "strategy": "local-sgd", "period": 4, "algorithm": "ring"},
        # Counters; snapshots every 5 steps must not add to them.
        "bytes_ring": {**CONTRACT, "strategy": "gossip", "topology": "ring", "steps": 12, "eval_every": 5},
        "bytes_exp": {**CONTRACT, "strategy": "gossip", "topology": "exp", "gossip_order": "adapt-first",
                      "steps": 12, "eval_every": 5},
        "bytes_local_ring": {**CONTRACT, "strategy": "local-sgd", "period": 4, "algorithm": "ring", "steps": 12,
                             "eval_every": 5},
        "bytes_local_master_state": {**CONTRACT, "strategy": "local-sgd", "period": 3, "algorithm": "master",
                                     "average_optimizer_state": True, "steps": 12},
        "bytes_local_adaptive": {**CONTRACT, "strategy": "local-sgd", "period": 4, "adaptive": True,
                                 "algorithm": "rhd", "steps": 60, "lr": 0.1},
    }
    for lr in LRS:
        c[f"convex_{lr}"] = {**CONVEX, "lr": lr}
    # AD-PSGD on a graph that is not bipartite (edges oriented by rank); last, since its
    # workers leave at their own pace.
    c["adpsgd_complete"] = {**CONTRACT, "strategy": "gossip", "async_gossip": True, "topology": "complete",
                            "steps": 30, "eval_every": 10}
    # A worker 10x slower than the others spends less of the shared budget. 200 updates a
    # worker, about half a second here: the workers leave the start barrier up to 0.3 s
    # apart on two shared cores, and with 60 (0.15 s) worker 0 often spent the whole budget
    # before the others made their first claim, and they ended 0.2 s after it.
    c["adpsgd_slow"] = {**CONTRACT, "strategy": "gossip", "async_gossip": True, "topology": "ring",
                        "steps": ADPSGD_SLOW_STEPS, "slow": "worker:1=10"}
    return {name: {**case, "out": str(root / name)} for name, case in c.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """{case: {"out": folder, "records": [per-worker final record]}} from one spawn."""
    root = tmp_path_factory.mktemp("decentral")
    cases = _cases(root)
    names = list(cases)
    results = spawn("decentral_fns:train_cases", PROCS, {"cases": [cases[n] for n in names]}, timeout=240,
                    comm_timeout=60)
    return {n: {"out": Path(cases[n]["out"]), "case": cases[n], "records": [results[r][i] for r in range(PROCS)]}
            for i, n in enumerate(names)}


def _model(run: dict) -> dict[str, torch.Tensor]:
    return torch.load(run["out"] / "model.pt")


def test_update_budget_grants_exactly_its_total_across_threads():
    store = dist.HashStore()
    budgets = [UpdateBudget(store, 1000) for _ in range(4)]
    granted = [0] * 4

    def spend(i: int) -> None:
        while budgets[i].take():
            granted[i] += 1

    threads = [threading.Thread(target=spend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sum(granted) == 1000 and budgets[0].claimed() == 1000
    assert all(b.spent and not b.take() for b in budgets)
    # A spent budget never asks the store again: the counter overshoots once per worker.
    assert int(store.add("train/budget", 0)) == 1000 + 4


def test_update_budget_only_for_strategies_that_share_one():
    assert UpdateBudget.open(dist.HashStore(), 2**62, 4) is None  # bounded by --time-limit alone
    assert UpdateBudget.open(dist.HashStore(), 50, 4).total == 200
    flat = {"strategy": "gossip", "workers": 4, "topology": "ring"}
    assert GossipStrategy.shares_budget(JobConfig.from_flat({**flat, "async_gossip": True}))
    assert not GossipStrategy.shares_budget(JobConfig.from_flat(flat))
    assert not LocalSgdStrategy.shares_budget(JobConfig.from_flat({**flat, "strategy": "local-sgd"}))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adapt_complete", "local_h1_ring", "local_h1_master_state", "local_h1_warmup"])
def test_equals_synchronous_sgd(runs, name):
    assert_same_model(_model(runs[name]), one_process_sgd(runs[name]["case"]))


@pytest.mark.slow
def test_combine_first_on_complete_matches_after_one_step_only(runs):
    assert_same_model(_model(runs["combine_complete_1"]), one_process_sgd(runs["combine_complete_1"]["case"]))
    # After many steps the gradients were taken at different replicas: not synchronous SGD.
    with pytest.raises(AssertionError):
        assert_same_model(_model(runs["combine_complete"]), one_process_sgd(runs["combine_complete"]["case"]))
    with pytest.raises(AssertionError):
        assert_same_model(_model(runs["local_h4"]), one_process_sgd(runs["local_h4"]["case"]))
    # adapt-first on complete keeps the replicas equal; combine-first does not.
    assert runs["adapt_complete"]["records"][0]["consensus_distance"] == 0.0
    assert runs["combine_complete"]["records"][0]["consensus_distance"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name,degree", [("bytes_ring", 2), ("bytes_exp", 3)])
def test_gossip_sends_degree_times_model_bytes_per_step(runs, name, degree):
    steps = runs[name]["case"]["steps"]
    for rank, record in enumerate(runs[name]["records"]):
        assert record["bytes_sent"] == steps * degree * MODEL_BYTES, f"worker {rank}"
        assert record["bytes_recv"] == steps * degree * MODEL_BYTES, f"worker {rank}"
        assert len(record["traffic"]) == degree  # only neighbours


@pytest.mark.slow
@pytest.mark.parametrize("name,algorithm,period,vectors", [
    ("bytes_local_ring", "ring", 4, 1),
    ("bytes_local_master_state", "master", 3, 2),  # momentum buffers ride along: twice the bytes
])
def test_local_sgd_sends_one_all_reduce_every_period(runs, name, algorithm, period, vectors):
    steps = runs[name]["case"]["steps"]
    model = cost(algorithm, PROCS, vectors * MODEL_BYTES)
    for rank, record in enumerate(runs[name]["records"]):
        assert record["averagings"] == steps // period
        # The arguments are checked once, at the first averaging (AllReduce.persistent).
        assert record["bytes_sent"] == steps // period * model.sent[rank] + check_bytes(PROCS), f"worker {rank}"


@pytest.mark.slow
def test_adacomm_shrinks_the_period_and_the_counters_follow(runs):
    records = runs["bytes_local_adaptive"]["records"]
    rounds = {int(h): n for h, n in records[0]["rounds_per_period"].items()}
    assert rounds[4] >= 1 and min(rounds) < 4, rounds  # the loss fell, so the period shrank
    assert sum(rounds.values()) == records[0]["averagings"]
    assert all(r["rounds_per_period"] == records[0]["rounds_per_period"] for r in records), \
        "every worker must pick the same period"
    per_call = cost("rhd", PROCS, MODEL_BYTES + 4)  # the round's loss rides as one element
    for rank, record in enumerate(records):
        assert record["bytes_sent"] == record["averagings"] * per_call.sent[rank] + check_bytes(PROCS)
    assert records[0]["averagings"] > 60 // 4


@pytest.mark.slow
def test_consensus_distance_vanishes_as_the_learning_rate_does(runs):
    dist = [runs[f"convex_{lr}"]["records"][0]["consensus_distance"] for lr in LRS]
    rel = [runs[f"convex_{lr}"]["records"][0]["consensus_distance_relative"] for lr in LRS]
    assert dist[0] > dist[1] > dist[2] > 0, dist
    # D-PSGD keeps the replicas within O(lr / spectral gap) of their average.
    assert dist[2] < dist[0] / 30, dist
    assert rel[2] < 1e-3, rel


@pytest.mark.slow
def test_final_consensus_distance_reaches_the_summary(runs):
    def summary(name: str) -> dict:
        run = runs[name]
        cfg = JobConfig.from_flat({**run["case"], "workers": PROCS})
        return assemble_summary(cfg, {"worker": dict(enumerate(run["records"])), "eval": {}})

    # adapt-first on complete keeps the replicas bit-identical (contract 1); a ring does not.
    assert summary("adapt_complete")["consensus_distance"] == 0.0
    ring = summary("bytes_ring")
    assert ring["consensus_distance"] > 0 and 0 < ring["consensus_distance_relative"] < 0.1
    # Local SGD that averages after every step ends at (float-rounding) consensus too.
    assert summary("local_h1_ring")["consensus_distance"] < 1e-6
    # AD-PSGD: worker 0 averaged every final replica.
    adpsgd = summary("adpsgd_complete")
    assert adpsgd["consensus_distance"] > 0 and adpsgd["replicas_averaged"] == [0, 1, 2, 3]
    assert adpsgd["steps"] == adpsgd["update_budget"] == 30 * PROCS


@pytest.mark.slow
def test_snapshots_log_consensus_and_both_models(runs):
    out = runs["bytes_ring"]["out"]
    events = read_events(out, "strategy")
    assert [e["step"] for e in events] == [5, 10, 12]  # every snapshot, and the end
    assert all(e["consensus_distance"] > 0 and e["worker"] == 0 for e in events)
    models = {(e["model"], e["step"]) for e in read_events(out, "eval")}
    assert {("global", 5), ("worker0", 5), ("global", 12), ("worker0", 12)} <= models


@pytest.mark.slow
def test_adpsgd_pairwise_averaging_on_a_complete_graph(runs):
    records = runs["adpsgd_complete"]["records"]
    # One budget of 30 x 4 updates, spent exactly (nobody lost), whoever made them.
    assert sum(r["steps"] for r in records) == 30 * PROCS
    assert all(r["update_budget"] == 30 * PROCS for r in records)
    # Orientation by rank: worker r starts averagings with the workers above it only.
    assert records[PROCS - 1]["averagings"] == 0 and records[0]["served"] == 0
    assert all(r["averagings"] == r["steps"] for r in records[:-1])  # one per step, nobody lost
    assert sum(r["averagings"] for r in records) == sum(r["served"] for r in records)
    message = MODEL_BYTES + 4
    for rank, r in enumerate(records):
        goodbyes = PROCS - 1 - rank  # one per target at the end
        assert r["bytes_sent"] == (r["averagings"] + goodbyes) * message + r["served"] * MODEL_BYTES, rank
        assert r["lost_peers"] == []
    assert records[0]["replicas_averaged"] == [0, 1, 2, 3]
    assert records[0]["consensus_distance"] > 0


@pytest.mark.slow
def test_adpsgd_workers_share_one_budget_and_end_together(runs):
    records = runs["adpsgd_slow"]["records"]
    steps = [r["steps"] for r in records]
    assert sum(steps) == ADPSGD_SLOW_STEPS * PROCS, steps  # exactly the budget: nobody lost
    # The slow worker makes fewer updates than its share; the others spend the rest. (Not
    # "fewer than each other worker": on two shared cores one of them may be starved.)
    assert steps[1] < ADPSGD_SLOW_STEPS < max(steps), steps
    # Everyone stops when the budget is spent: within about one slow step of each other,
    # not after the others as with 200 updates each.
    walls = [r["wall_seconds"] for r in records]
    assert max(walls) - min(walls) < 0.25 * max(walls) + 0.05, walls


@pytest.mark.slow
def test_adpsgd_survives_a_killed_worker_and_a_slow_one_and_ends_together(tmp_path):
    steps = 300
    job = {"strategy": "gossip", "async_gossip": True, "topology": "ring", "workers": 4, "dataset": "digits",
           "hidden": 32, "batch_size": 32, "steps": steps, "eval_every": 100, "timeout": 20,
           "kill": "worker:1@step=40", "slow": "worker:0=4"}
    summary = plexus.run({**job, "out": str(tmp_path / "adpsgd")})
    assert summary["lost_workers"] == [1]
    walls, done = summary["wall_seconds_per_worker"], summary["steps_per_worker"]
    assert walls[1] is None and done[1] is None
    survivors = (0, 2, 3)
    # One budget of 300 x 4 updates: worker 1 made 40 and held the 41st when it died; the
    # survivors spent all the rest.
    assert summary["update_budget"] == 4 * steps
    assert summary["steps"] == sum(done[r] for r in survivors) == 4 * steps - 41
    # Worker 0 sleeps 3x its compute: the others do not wait for it, they make more updates...
    assert done[0] < steps < max(done[2], done[3]), done
    # ...and nobody trains alone at the end: all stop within about one slow step.
    assert max(walls[r] for r in survivors) - min(walls[r] for r in survivors) < \
        0.25 * max(walls[r] for r in survivors) + 0.05, walls
    # So the final replicas stay close (a slow worker training on alone after the others had
    # left used to drift to 7-17% of the model's norm) and their average is a good model.
    assert summary["replicas_averaged"] == [0, 2, 3]
    assert summary["consensus_distance_relative"] < 0.05, summary["consensus_distance_relative"]
    averaged, worker0 = summary["averaged_test_accuracy"], summary["worker0_test_accuracy"]
    if averaged <= 0.85 or worker0 <= 0.8:
        # One asynchronous run is a sample (0.93-0.97 averaged on an idle machine, 0.84 once
        # under CI's load): judge the mean of seeds 0 and 1, as the defaults matrix does.
        again = plexus.run({**job, "seed": 1, "out": str(tmp_path / "adpsgd-seed1")})
        averaged = (averaged + again["averaged_test_accuracy"]) / 2
        worker0 = (worker0 + again["worker0_test_accuracy"]) / 2
    assert averaged > 0.85 and worker0 > 0.8, (averaged, worker0)
    assert summary["pairwise_averagings"] > 0 and summary["spectral_gap"] == pytest.approx(2 / 3)
    written = json.loads((tmp_path / "adpsgd" / "summary.json").read_text())
    assert written["consensus_distance"] == summary["consensus_distance"]
    assert written["steps_per_worker"] == done and written["lost_workers"] == [1]


@pytest.mark.slow
def test_easgd_trains_against_a_centre_server(tmp_path):
    steps, period = 120, 4
    summary = plexus.run({"strategy": "easgd", "period": period, "elastic_alpha": 0.2, "workers": 3,
                          "dataset": "digits", "hidden": 32, "batch_size": 48, "steps": steps, "eval_every": 40,
                          "out": str(tmp_path / "easgd")})
    assert summary["exchanges"] == 3 * steps // period
    assert summary["lost_workers"] == [] and summary["lost_by_server"] == []
    # The final replicas, averaged on worker 0: apart (each walks its own partition), but tied.
    assert summary["replicas_averaged"] == [0, 1, 2]
    assert 0 < summary["consensus_distance_relative"] < 0.5, summary["consensus_distance_relative"]
    # The centre is the model EASGD evaluates; a replica, tied to it only every 4 steps
    # and trained on a third of the data, lags behind it.
    assert summary["averaged_test_accuracy"] > 0.85 and summary["worker0_test_accuracy"] > 0.6
    # Per worker: a 16-byte header and one message per hello, exchange and goodbye, and
    # worker 0's final fetch; each message is the model plus the op code.
    message = MODEL_BYTES + 4
    sent = summary["bytes_sent_per_worker"]
    assert sent[1] == sent[2] == 16 + (1 + steps // period + 1) * message
    assert sent[0] == sent[1] + message
    # The server answers each exchange and fetch with the centre.
    assert summary["bytes_sent_total"] - sum(sent) == (3 * steps // period + 1) * MODEL_BYTES
