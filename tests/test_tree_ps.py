"""tree-ps: the tree's shape, softsync by gradients, every gradient reaching the root once,
synchronous trees equal to one process (contract 1), and losses under async variants."""
from __future__ import annotations

import json

import pytest
import torch

import plexus
from plexus.cluster.spawn import spawn
from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.ps.consistency import Push, SoftSync
from plexus.ps.tree import ROOT, Node, Tree
from plexus.strategies.tree_ps import TreePSStrategy, group_size
from test_contract import assert_same_model
from test_ps_contract import one_process

# --- the shape ---------------------------------------------------------------------------


@pytest.mark.parametrize("fanout", [2, 3, 4])
@pytest.mark.parametrize("workers", range(1, 21))
def test_tree_covers_every_worker_once_and_the_root_sees_at_most_fanout(workers, fanout):
    tree = Tree(workers, fanout)
    assert tree.leaves(ROOT) == tuple(range(workers))
    assert 1 <= len(tree.children(ROOT)) <= fanout
    for a in range(tree.aggregators):
        node = Node("aggregator", a)
        assert 2 <= len(tree.children(node)) <= fanout  # no aggregator with a single child
        assert tree.depth(node) == tree.depth(tree.children(node)[0]) - 1
    for node in tree.nodes():
        assert tree.children(tree.parent(node))[tree.position(node)] == node
    assert tree.height == max(tree.depth(Node("worker", r)) for r in range(workers))


def test_tree_shapes_by_hand():
    eight = Tree(8, 2)
    assert eight.aggregators == 6 and eight.height == 3
    assert eight.children(ROOT) == (Node("aggregator", 4), Node("aggregator", 5))
    assert eight.children(Node("aggregator", 0)) == (Node("worker", 0), Node("worker", 1))
    five = Tree(5, 2)  # the odd worker moves up a level instead of getting an aggregator of its own
    assert five.children(ROOT) == (Node("aggregator", 2), Node("worker", 4))
    assert five.depth(Node("worker", 4)) == 1 and five.depth(Node("worker", 0)) == 3
    seven = Tree(7, 3)
    assert seven.children(ROOT) == (Node("aggregator", 0), Node("aggregator", 1), Node("worker", 6))
    assert Tree(3, 4).aggregators == 0 and Tree(3, 4).children(ROOT) == tuple(Node("worker", r) for r in range(3))
    with pytest.raises(ValueError):
        Tree(4, 1)


# --- softsync counts gradients ---------------------------------------------------------------


def test_softsync_counts_the_gradients_a_tree_push_holds():
    gate = SoftSync(4)
    for w in range(2):
        gate.join(w)
    assert gate.push(Push(0, 0, 0, "a", weight=2)) == []          # 2 of 4 gradients
    groups = gate.push(Push(1, 0, 0, "b", weight=3))               # 5 >= 4: one update
    assert [[p.payload for p in g] for g in groups] == [["a", "b"]]
    assert gate.divisor(groups[0]) == 4                             # every gradient weighs lr / n
    assert SoftSync(1).divisor([Push(0, 0, 0, "c", weight=3)]) == 1
    partial = SoftSync(4)
    partial.join(0)
    assert partial.push(Push(0, 0, 0, "d", weight=2)) != []        # the only live child waits: apply
    assert partial.divisor([Push(0, 0, 0, "d", weight=2)]) == 2


def test_softsync_flush_applies_what_waits():
    gate = SoftSync(2)
    for w in range(3):
        gate.join(w)
    assert gate.push(Push(2, 0, 0, "x")) == []
    assert [[p.payload for p in g] for g in gate.flush()] == [["x"]]
    assert gate.pending() == 0 and gate.flush() == []


def _cfg(**flat) -> JobConfig:
    return JobConfig.from_flat({"strategy": "tree-ps", "workers": 4, "batch_size": 8, **flat})


def test_group_size_maps_consistency_and_softsync():
    assert group_size(_cfg()) == 1                                  # asp, the default
    assert group_size(_cfg(consistency="bsp")) == 4
    assert group_size(_cfg(consistency="softsync")) == 4
    assert group_size(_cfg(softsync=2)) == 2
    assert TreePSStrategy.effective(_cfg(softsync=2)).strategy.consistency == "softsync"


@pytest.mark.parametrize("flat, words", [
    (dict(consistency="ssp", staleness=2), "n-softsync protocol, not ssp"),
    (dict(consistency="bsp", softsync=2), "--consistency bsp means --softsync 4"),
    (dict(fetch_every=2), "--fetch-every and --push-every must be 1"),
    (dict(kill="aggregator:2@step=3"), "this tree has 2 aggregators"),
    (dict(kill="aggregator:0@step=3", variant="base"), "this tree has 0 aggregators"),
    (dict(softsync=5), "softsync must not exceed workers"),
])
def test_tree_ps_config_errors(flat, words):
    with pytest.raises(ConfigError, match=words):
        TreePSStrategy.check_config(_cfg(**flat))


# --- every gradient reaches the root exactly once ------------------------------------------


@pytest.mark.slow
def test_every_gradient_reaches_the_root_exactly_once():
    cases = []
    for fanout in (2, 3):
        for workers in range(2, 9):
            cases.append({"workers": workers, "fanout": fanout, "softsync": 1,
                          "pushes": [2 + r % 3 for r in range(workers)]})
    cases += [{"workers": 7, "fanout": 2, "softsync": 7, "pushes": [3] * 7},
              {"workers": 5, "fanout": 3, "softsync": 5, "servers": 2, "pushes": [2] * 5},
              {"workers": 6, "fanout": 2, "softsync": 1, "servers": 2, "pushes": [1, 2, 3, 1, 2, 3]}]
    procs = max(c["workers"] + Tree(c["workers"], c["fanout"]).aggregators + c.get("servers", 1) for c in cases)
    results = spawn("tree_fns:tree_counts", procs, {"cases": cases}, timeout=400, comm_timeout=60)
    for i, case in enumerate(cases):
        P, pushes = case["workers"], case["pushes"]
        out = [r for proc in results for r in proc if r["case"] == i]
        weights = [r["weights"] for r in out if r["role"] == "worker" and r["weights"] is not None]
        assert len(weights) == 1, (case, out)
        got = torch.tensor(weights[0])
        if case["softsync"] == 1:  # the sum of every gradient: each count exactly
            want = -torch.tensor([*pushes, sum(pushes)], dtype=torch.float32)
        else:                      # the mean of one gradient per worker, per round
            want = -torch.tensor([pushes[0] / P] * P + [pushes[0]], dtype=torch.float32)
        assert torch.allclose(got, want, atol=1e-5), (case, got, want)
        for server in (r["record"] for r in out if r["role"] == "server"):
            assert server["gradients"] == {str(r): n for r, n in enumerate(pushes)}, (case, server)
            assert max(int(k) for k in server["fan_in_counts"]) <= case["fanout"]
            if case["softsync"] == P:
                assert server["staleness_counts"] == [sum(pushes)]  # synchronous: never stale


# --- contract 1: a synchronous tree is one process ------------------------------------------

BASE = dict(strategy="tree-ps", dataset="digits", model="mlp", hidden=32, lr=0.05, momentum=0.9, batch_size=48,
            steps=20, eval_every=0, log_every=20, save_model=True, seed=3, timeout=30, peer_timeout=10,
            consistency="bsp")


@pytest.mark.slow
def test_synchronous_tree_equals_one_process(tmp_path):
    cases = [
        {**BASE, "optimizer": "sgd", "workers": 4, "fanout": 2, "servers": 1},
        {**BASE, "optimizer": "sgd", "workers": 3, "fanout": 2, "servers": 2},
        {**BASE, "optimizer": "sgd", "workers": 4, "fanout": 3, "servers": 2, "consistency": "softsync",
         "softsync": 4},
        {**BASE, "optimizer": "adagrad", "workers": 4, "fanout": 2, "servers": 2},
        {**BASE, "optimizer": "sgd", "workers": 4, "fanout": 2, "servers": 1, "variant": "base"},
    ]
    for i, case in enumerate(cases):
        case["out"] = str(tmp_path / f"{i}-{case['optimizer']}-p{case['workers']}-k{case['fanout']}")
    spawn("ps_fns:ps_cases", 8, {"workers": 4, "servers": 2, "aggregators": 2, "cases": cases}, timeout=400,
          comm_timeout=60)
    oracles = {opt: one_process({**BASE, "strategy": "ps", "optimizer": opt}) for opt in ("sgd", "adagrad")}
    for case in cases:
        summary = json.loads(open(f"{case['out']}/summary.json").read())
        try:
            assert_same_model(torch.load(f"{case['out']}/model.pt"), oracles[case["optimizer"]])
        except AssertionError as exc:
            raise AssertionError(f"{case['out']}: {exc}") from None
        assert summary["updates_applied"] == summary["pushes_acknowledged"] == case["steps"] * case["workers"]
        assert summary["root_updates"] == case["steps"] and summary["staleness_max"] == 0
        fan_in = case["workers"] if case.get("variant") == "base" else len(Tree(case["workers"], case["fanout"])
                                                                             .children(ROOT))
        assert summary["root_max_fan_in"] == fan_in, (case["out"], summary)


# --- losses under the async variants ---------------------------------------------------------

JOB = dict(strategy="tree-ps", dataset="digits", model="mlp", workers=4, fanout=2, steps=40, lr=0.05, momentum=0.0,
           eval_every=0, log_every=20, timeout=30, peer_timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("variant, victim, lost, transport", [
    ("adv", "aggregator:0", {"aggregator 0": []}, "auto"),   # workers 0 and 1 re-attach to the root
    ("adv", "worker:3", {"worker 3": [3]}, "auto"),
    ("adv-star", "aggregator:1", {"aggregator 1": []}, "auto"),
    ("adv-star", "worker:0", {"worker 0": [0]}, "auto"),     # worker 1 evaluates instead
    ("adv-star", "worker:2", {"worker 2": [2]}, "socket"),   # its read links break as sockets do
])
def test_a_lost_worker_or_aggregator_leaves_the_others_running(tmp_path, variant, victim, lost, transport):
    summary = plexus.run({**JOB, "variant": variant, "kill": f"{victim}@step=8", "transport": transport,
                          "out": str(tmp_path)})
    assert summary["lost_with"] == lost and summary["lost_workers"] == sorted(w for ws in lost.values() for w in ws)
    assert summary["final_test_accuracy"] is not None and summary["protocol_errors"] == 0
    applied = summary["updates_applied_by_worker"]
    for w in range(4):
        if w in summary["lost_workers"]:
            assert applied[str(w)] <= 9   # what it pushed before the kill, at most
        else:
            assert applied[str(w)] == JOB["steps"]  # every gradient of a survivor, exactly once
    assert summary["pushes_acknowledged"] == JOB["steps"] * (4 - len(summary["lost_workers"]))
    if victim.startswith("aggregator"):  # its children re-attached: nobody was lost with it
        assert len(summary["reattached"]) == 2 and summary["lost_aggregators"] == [int(victim[-1])]


@pytest.mark.slow
@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("victim, moved", [("aggregator:0", {("worker 0", "aggregator 2"), ("worker 1", "aggregator 2")}),
                                           ("aggregator:2", {("aggregator 0", "root"), ("aggregator 1", "root")})])
def test_children_of_a_dead_aggregator_re_attach_to_the_grandparent(tmp_path, consistency, victim, moved):
    """Five workers, fanout 2: aggregators 0 (workers 0, 1) and 1 (workers 2, 3) under
    aggregator 2, which shares the root with worker 4. A bottom aggregator's workers
    re-attach to aggregator 2; a middle one's aggregators re-attach to the root."""
    summary = plexus.run({**JOB, "workers": 5, "batch_size": 60, "consistency": consistency, "ledger": True,
                          "kill": f"{victim}@step=20", "out": str(tmp_path)})
    assert {(e["node"], e["to"]) for e in summary["reattached"]} == moved
    assert summary["lost_workers"] == [] and summary["ledger_verdict"].startswith("ledger OK")
    assert summary["updates_applied_by_worker"] == {str(w): JOB["steps"] for w in range(5)}


@pytest.mark.slow
def test_root_fan_in_and_bytes_base_against_adv(tmp_path):
    """The root hears from P senders per update in base, from fanout in adv."""
    got = {}
    for variant in ("base", "adv"):
        got[variant] = plexus.run({**JOB, "variant": variant, "consistency": "bsp", "steps": 10,
                                   "out": str(tmp_path / variant)})
    assert got["base"]["root_max_fan_in"] == 4 and got["adv"]["root_max_fan_in"] == 2
    ratio = got["base"]["root_bytes_per_update"] / got["adv"]["root_bytes_per_update"]
    assert 1.8 < ratio < 2.2, ratio


# --- Rudra-adv*: learners read the weights straight from the servers -----------------------


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_a_read_waits_for_a_newer_version_and_is_no_push(transport):
    """A learner's read (ps/readers.py) is answered once the shard is newer than what the
    learner holds, or after READ_WAIT; reads are outside the gate and the fan-in."""
    results = spawn("tree_fns:reads", 4, {"transport": transport}, timeout=120, comm_timeout=60)
    reader = next(r for r in results if r["role"] == "reader")
    assert reader["first"] == {"versions": [1, 1], "weights": [-1.0] * 4}  # it waited for the push
    assert reader["second"]["versions"] == [1, 1] and reader["second"]["waited"] >= 0.8 * reader["second"]["least"]
    for server in (r["record"] for r in results if r["role"] == "server"):
        assert server["reads"] == {"worker 1": 2} and server["protocol_errors"] == 0
        assert server["gradients"] == {"0": 1} and server["fan_in_counts"] == {"1": 1}  # reads push nothing
        assert server["version"] == 1 and server["staleness_counts"] == [1]


@pytest.mark.slow
def test_adv_star_learners_read_the_root_whose_fan_in_stays_at_the_fanout(tmp_path):
    """adv and adv-star on the same job: in adv-star the weights cross one link (root to
    learner) instead of the tree's height, every learner reads the servers, the root still
    hears pushes from its K children only, and the staleness stays near adv's (the weight
    tree this replaced measured 19 against 2.7). The bound is loose: on a loaded 2-core CI
    machine adv-star measured 7.5 against adv's 2.8, since the learners' reads compete for
    the same cores as the pushes; the bound still tells the weight tree apart."""
    job = {**JOB, "workers": 4, "fanout": 2, "steps": 150, "log_every": 50}
    got = {v: plexus.run({**job, "variant": v, "out": str(tmp_path / v)}) for v in ("adv", "adv-star")}
    adv, star = got["adv"], got["adv-star"]
    assert adv["weight_hops"] == Tree(4, 2).height == 2 and star["weight_hops"] == 1
    assert adv["weight_reads_by_worker"] == {}
    assert all(n > 0 for n in star["weight_reads_by_worker"].values()) and len(star["weight_reads_by_worker"]) == 4
    for summary in (adv, star):
        assert summary["root_max_fan_in"] <= 2 and max(map(int, summary["root_fan_in_counts"])) <= 2
        assert summary["updates_applied"] == summary["pushes_acknowledged"] == 4 * job["steps"]
        assert summary["protocol_errors"] == 0 and summary["lost_workers"] == []
    assert star["staleness_mean"] <= 3 * adv["staleness_mean"] + 3, (star["staleness_mean"], adv["staleness_mean"])
