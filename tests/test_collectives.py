"""Every all-reduce algorithm against the exact sum, its counters against cost.py, and its
behaviour with mismatched arguments; one spawn of P processes per P (tests/collective_fns)."""
from __future__ import annotations

import pytest

from plexus.cluster.group import group_pair
from plexus.cluster.spawn import spawn
from plexus.collectives import ALGORITHMS
from plexus.collectives.check import TAG_CHECK
from plexus.collectives.cost import cost
from plexus.collectives.trace import steps

PROCS = [1, 2, 3, 4, 5, 7, 8]
BIG = 1_000_000
COUNTER_LENGTH = 840  # divisible by every P tested: every message non-empty

_RUNS: dict[int, list[dict]] = {}


def run(procs: int) -> list[dict]:
    """The suite's results on every rank, spawned once per P."""
    if procs not in _RUNS:
        lengths = sorted({1, max(procs - 1, 1), procs + 1, 0})
        big_dtypes = ["float32", "float64", "float16", "bfloat16"] if procs in (1, 2, 4, 8) else ["float32"]
        _RUNS[procs] = spawn("collective_fns:suite", procs,
                             {"lengths": lengths, "big": BIG, "big_dtypes": big_dtypes,
                              "counter_length": COUNTER_LENGTH},
                             timeout=240, comm_timeout=60, env={"PYTHONPATH": "tests"})
    return _RUNS[procs]


def test_every_algorithm_is_registered():
    assert set(ALGORITHMS) == {"master", "ps", "rhd", "ring", "dbtree", "hier", "native", "auto"}


@pytest.mark.slow
@pytest.mark.parametrize("procs", PROCS)
def test_exact_sum_every_algorithm_dtype_and_length(procs):
    results = run(procs)
    rows = results[0]["sums"]
    names = {row["algorithm"] for row in rows}
    assert set(ALGORITHMS) <= names
    for rank, result in enumerate(results):
        bad = [row for row in result["sums"] if row["excess"] > 0 or not row["same_dtype"]]
        assert not bad, f"rank {rank}: {bad[:3]}"
    # Every rank ends with the very same bits (replicas stay identical).
    for i, row in enumerate(rows):
        digests = {result["sums"][i]["digest"] for result in results}
        assert len(digests) == 1, f"ranks differ: {row}"
    covered = {(row["algorithm"], row["dtype"]) for row in rows if row["n"] == BIG}
    assert {(name, "float32") for name in ALGORITHMS} <= covered
    assert {row["op"] for row in rows} == {"sum", "mean"}


@pytest.mark.slow
@pytest.mark.parametrize("procs", PROCS)
def test_async_handles(procs):
    for rank, result in enumerate(run(procs)):
        assert all(result["handles"].values()), f"rank {rank}: {result['handles']}"


@pytest.mark.slow
@pytest.mark.parametrize("procs", [p for p in PROCS if p > 1])
def test_mismatch_raises_protocol_error_everywhere(procs):
    last = procs - 1
    for rank, result in enumerate(run(procs)):
        for name, row in result["mismatches"].items():
            assert f"worker {last}: 11 float32 elements" in row["length"], (rank, name, row["length"])
            assert "10 float32 elements" in row["length"], (rank, name)
            assert "worker 0: 10 float64 elements" in row["dtype"], (rank, name, row["dtype"])
            assert row["length_peer"] == f"worker {last}" and row["dtype_peer"] == "worker 1"
            assert row["length_seconds"] < 10 and row["dtype_seconds"] < 10, (name, row)
            assert row["after"] == [float(procs)] * 5, (name, row["after"])  # the group still works


def _model(name: str, row: dict, procs: int, n: int):
    base = name.split(":")[0]
    kwargs = {}
    if base == "hier":
        kwargs = {"local_size": row["local_size"], "inner": row["inner"]}
    if base == "dbtree":
        kwargs = {"chunk_bytes": row["chunk_bytes"]}
    if base == "auto":
        return cost(row["choice"], procs, 4 * n)
    return cost(base, procs, 4 * n, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("procs", PROCS)
def test_counters_equal_cost_model(procs):
    """Traffic counters equal cost.py's bytes per rank (plus the check's), exactly."""
    results = run(procs)
    for name in results[0]["counters"]:
        model = _model(name, results[0]["counters"][name], procs, COUNTER_LENGTH)
        measured = [result["counters"][name]["bytes"] for result in results]
        assert measured == [b + model.check_bytes for b in model.sent], (name, measured, model)


@pytest.mark.slow
@pytest.mark.parametrize("procs", PROCS)
def test_measured_steps_equal_cost_model(procs):
    """The longest chain of messages equals cost.py's steps; the check's own steps apart."""
    results = run(procs)
    for name in results[0]["counters"]:
        model = _model(name, results[0]["counters"][name], procs, COUNTER_LENGTH)
        logs = [result["counters"][name]["log"] for result in results]
        if name == "native" and procs > 1:
            assert steps(logs) is None  # the backend's messages are not visible
            continue
        assert steps(logs, ignore_tags=[TAG_CHECK]) == model.steps, name
        check_only = [{"sends": [s for s in log["sends"] if s[1] == TAG_CHECK],
                       "recvs": [r for r in log["recvs"] if r[1] == TAG_CHECK]} for log in logs]
        assert steps(check_only) == model.check_steps, name


def test_bench_sizes_parse():
    from plexus.bench.collectives import parse_size
    from plexus.errors import ConfigError

    assert [parse_size(s) for s in ("4096", "4KB", "1MB", "1.5MiB", "64M")] == [4096, 4096, 1 << 20, 3 << 19, 64 << 20]
    with pytest.raises(ConfigError, match="--sizes"):
        parse_size("4XB")


@pytest.mark.slow
def test_bench_json_rows(capsys):
    import argparse
    import json

    from plexus.bench import collectives

    parser = argparse.ArgumentParser()
    collectives.add_arguments(parser)
    args = parser.parse_args(["--procs", "2", "--sizes", "4KB,64KB", "--reps", "2", "--warmup", "1", "--json"])
    assert collectives.main(args) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = {"algorithm", "procs", "bytes", "seconds", "algbw_gbps", "busbw_gbps", "sent_bytes_max",
            "model_sent_bytes_max", "steps", "model_steps", "vs_native"}
    assert len(rows) == 2 * (len(ALGORITHMS) + 1)  # every algorithm and the raw backend, per size
    for row in rows:
        assert keys <= set(row), row
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(P-1)/P = 1 at P = 2
        if row["algorithm"] not in ("backend",):
            assert row["sent_bytes_max"] == row["model_sent_bytes_max"], row
        if row["algorithm"] not in ("backend", "native"):
            assert row["steps"] == row["model_steps"], row
    assert {row["vs_native"] for row in rows if row["algorithm"] == "native"} == {1.0}


@pytest.mark.slow
def test_auto_records_its_choice_and_the_modelled_times_behind_it(tmp_path):
    """The summary says what auto chose per message size, on which measured network, and
    each candidate's modelled time: the choice is the fastest of them."""
    import plexus
    summary = plexus.run({"algorithm": "auto", "workers": 2, "steps": 5, "eval_every": 0, "quiet": True,
                          "out": str(tmp_path)})
    (decision,) = summary["auto_decisions"]  # one bucket
    times = decision["modelled_seconds"]
    assert decision["chose"] == min(times, key=times.get) and summary["auto_chose"] == [decision["chose"]]
    assert decision["calls"] == 5 and decision["network"]["alpha"] > 0


# --- over shared memory: a group's messages between members on one machine -------------

LINKED_PROCS = [2, 3, 5]


@pytest.mark.slow
@pytest.mark.parametrize("procs", LINKED_PROCS)
def test_every_algorithm_over_shared_memory(procs):
    """With every member connected (``Group.connect``, as allreduce and local-sgd connect
    their peers) each algorithm gives the exact sum, the same bits as over gloo's sockets,
    the bytes cost.py predicts, and ProtocolError on mismatched arguments."""
    lengths = sorted({1, max(procs - 1, 1), procs + 1, 0})
    linked = spawn("collective_fns:linked", procs,
                   {"lengths": lengths, "big": BIG, "counter_length": COUNTER_LENGTH},
                   timeout=240, comm_timeout=60, env={"PYTHONPATH": "tests"})
    for rank, result in enumerate(linked):
        assert result["linked"] == [m for m in range(procs) if m != rank] and result["links_open"]
        bad = [row for row in result["sums"] if row["excess"] > 0]
        assert not bad, f"rank {rank}: {bad[:3]}"
        assert all(row["after"] == [procs] * 5 and "no error" not in (row["length"], row["dtype"])
                   for row in result["mismatches"].values()), result["mismatches"]
    # The same algorithm gives the same bits over either transport. auto measures the link
    # it runs on and may choose differently over the two: compare what it ran.
    sockets = {(row["algorithm"], row["n"], row["dtype"], row["op"]): row["digest"] for row in run(procs)[0]["sums"]}
    for row in linked[0]["sums"]:
        assert row["digest"] == sockets[(row["chose"], row["n"], row["dtype"], row["op"])], row
    for name in linked[0]["counters"]:
        model = _model(name, linked[0]["counters"][name], procs, COUNTER_LENGTH)
        assert [r["counters"][name]["bytes"] for r in linked] == [b + model.check_bytes for b in model.sent], name


def test_a_connected_pair_moves_and_counts_messages_over_shared_memory():
    import torch

    a, b = group_pair("shm")
    try:
        assert sorted(a.links) == [1] and sorted(b.links) == [0] and a.links[1].transport == "shm"
        got = torch.empty(1000)
        recv = b.irecv(got, 0, tag=3)
        a.isend(torch.arange(1000.0), 1, tag=3).wait()
        recv.wait()
        assert torch.equal(got, torch.arange(1000.0))
        assert a.traffic.snapshot()["worker 1"]["bytes_sent"] == 4000
        assert b.traffic.snapshot()["worker 0"]["bytes_recv"] == 4000
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("machines", [1, 2])
def test_members_agree_whether_they_run_on_one_machine(monkeypatch, machines):
    """``Group.on_one_machine``, which decides what the default --algorithm runs
    (``strategies/base.py``): two machines are two host ids (here, one per thread)."""
    import threading

    from plexus.cluster import group as group_module
    from plexus.cluster.traffic import Traffic
    if machines == 2:
        monkeypatch.setattr(group_module, "host_id", threading.get_ident)

    def make(store, rank):
        group = group_module.Group(store, "pair", rank, ["worker 0", "worker 1"], traffic=Traffic(), timeout=10)
        return group, group.on_one_machine()

    (a, at_a), (b, at_b) = group_module._both_ends(make, 10)
    try:
        assert at_a is at_b is (machines == 1)
    finally:
        a.close()
        b.close()


def test_socket_transport_connects_nothing():
    a, b = group_pair("socket")
    try:
        assert not a.links and not b.links
    finally:
        a.close()
        b.close()


def test_sends_on_a_connected_group_never_wait_for_the_receiver():
    """Six 512 KiB messages (3 MiB, more than the first 1 MiB ring) are all sent before the
    receiver takes any, as over gloo: in a ring or tree all-reduce two members may each
    send the other several messages first. The ring moves to larger regions instead."""
    import torch

    a, b = group_pair("shm")
    try:
        out = [torch.full((128 * 1024,), float(i)) for i in range(6)]
        sends = [a.isend(t, 1, tag=5) for t in out]  # would wait for room, then time out, without eager
        assert all(work.is_completed() for work in sends)
        got = [torch.empty(128 * 1024) for _ in out]
        for t in got:
            b.irecv(t, 0, tag=5).wait(10)
        assert all(torch.equal(g, o) for g, o in zip(got, out))
        assert len(a.links[1].shm.outbox.regions) > 1
    finally:
        a.close()
        b.close()


def test_a_member_that_leaves_ends_the_others_receive_with_peer_lost():
    import time

    import torch

    from plexus.errors import PeerLost

    a, b = group_pair("shm")
    try:
        b.close()
        start = time.monotonic()
        with pytest.raises(PeerLost, match="worker 1"):
            a.irecv(torch.empty(10), 1, tag=5).wait(10)
        assert time.monotonic() - start < 5
    finally:
        a.close()


def test_algorithms_name_the_peers_they_exchange_messages_with():
    from types import SimpleNamespace

    from plexus.collectives import get_algorithm

    def at(rank: int, size: int):
        return SimpleNamespace(rank=rank, size=size)

    assert get_algorithm("ring").peers(at(0, 5)) == {1, 4} and get_algorithm("ring").peers(at(1, 2)) == {0}
    assert get_algorithm("native").peers(at(0, 4)) == set()
    assert get_algorithm("master").peers(at(0, 4)) == {1, 2, 3} and get_algorithm("master").peers(at(2, 4)) == {0}
    assert get_algorithm("rhd").peers(at(1, 4)) == {0, 2, 3}  # every other member unless an algorithm says
    for name in ("ring", "master", "rhd", "dbtree", "ps", "hier"):  # symmetric: i names j iff j names i
        algo = get_algorithm(name)
        for size in (2, 3, 5, 8):
            assert all((j in algo.peers(at(i, size))) == (i in algo.peers(at(j, size)))
                       for i in range(size) for j in range(size) if i != j), (name, size)
