"""Every strategy across separate hosts under torchrun, with one role plan from the global
rank (train/plan.py): network namespaces on a bridge (tests/netns.py), each with its own
address, host name and /dev/shm, one torchrun node per namespace. Synchronous jobs must
give the model of the same job on one host, bit for bit."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time

import pytest
import torch

import netns
from plexus.cli import main

PORT = 29561

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=netns.skip_reason() or "")


@pytest.fixture(scope="module")
def warm_hosts():
    """Two hosts that the jobs without an agent share, each with a helper that has
    imported torch (netns.start_helper): their processes are forked from it, which saves
    6 s of CPU per process. The tests that kill a host or cut its link make their own."""
    folder = tempfile.mkdtemp(prefix="plexus-hosts-")
    try:
        with netns.hosts(2) as found:
            paths, helpers = [os.path.join(folder, f"{host.name}.sock") for host in found], []
            try:
                for host, path in zip(found, paths):
                    helpers.append(netns.start_helper(host, path))
                yield found, paths
            finally:
                netns.kill_all(helpers)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_ports = itertools.count(PORT + 1)


def _torchrun(tmp_path, per_node: list[int], flags: list[str], timeout: float = 150, agent: bool = True,
              warm: tuple | None = None) -> dict:
    """Run ``plexus train FLAGS`` with torchrun, node i with per_node[i] processes on host
    i; returns worker 0's summary. ``agent=False``: the processes with torchrun's
    environment but no agent, which saves an interpreter and torch's import per host (the
    tests that check the agent itself keep it); ``warm`` (the ``warm_hosts`` fixture): on
    those shared hosts, forked from their helpers, each job on a port of its own."""
    out = tmp_path / "multi"
    with (contextlib.nullcontext(warm[0]) if warm else netns.hosts(len(per_node))) as found:
        procs = netns.start_train(found, per_node, [*flags, "--save-model", "--timeout", "40"], out,
                                  next(_ports) if warm else PORT, agent, helpers=warm[1] if warm else None)
        try:
            results = [p.communicate(timeout=timeout) for p in procs]
        finally:
            netns.kill_all(procs)
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    line = next(r[0].strip().splitlines()[-1] for r in results if r[0].strip())
    return {**json.loads(line), "model": torch.load(out / "model.pt")}


def _local(tmp_path, flags: list[str]) -> dict:
    out = tmp_path / "one"
    assert main(["train", *flags, "--quiet", "--save-model", "--out", str(out)]) == 0
    return torch.load(out / "model.pt")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _close(a: dict, b: dict, tol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=tol) for k in a)


# Synchronous jobs across 2 hosts against the same job on one host: bit for bit where the
# sums run in a fixed order; gloo's own all-reduce (native), hier's leaders (whose inner
# reduction groups differ with the hosts) and local-sgd's default algorithm (native across
# hosts, ring on one: strategies/base.py) within float32 rounding. per_node: processes on
# host 1, host 2; 3 workers (not a power of two, so a batch of 48) where the algorithm cares.
SYNCHRONOUS = {
    "ring": ([1, 2], ["--strategy", "allreduce", "--algorithm", "ring", "--batch-size", "48"], 0.0),
    "rhd": ([1, 2], ["--strategy", "allreduce", "--algorithm", "rhd", "--batch-size", "48"], 0.0),
    "dbtree": ([1, 2], ["--strategy", "allreduce", "--algorithm", "dbtree", "--batch-size", "48"], 0.0),
    "master": ([1, 2], ["--strategy", "allreduce", "--algorithm", "master", "--batch-size", "48"], 0.0),
    "ps-algorithm": ([1, 2], ["--strategy", "allreduce", "--algorithm", "ps", "--batch-size", "48"], 0.0),
    "native": ([1, 2], ["--strategy", "allreduce", "--algorithm", "native", "--batch-size", "48"], 1e-6),
    "hier-hosts-as-groups": ([2, 2], ["--strategy", "allreduce", "--algorithm", "hier"], 1e-6),
    "gossip": ([2, 2], ["--strategy", "gossip"], 0.0),
    "local-sgd": ([1, 2], ["--strategy", "local-sgd", "--batch-size", "48"], 1e-6),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SYNCHRONOUS))
def test_a_synchronous_job_across_two_hosts_gives_the_model_of_one_host(tmp_path, case, warm_hosts):
    per_node, flags, tol = SYNCHRONOUS[case]
    flags = [*flags, "--steps", "20"]
    agent = case == "ring"  # the agent's own path, once
    multi = _torchrun(tmp_path, per_node, flags, agent=agent, warm=None if agent else warm_hosts)
    assert multi["status"] == "completed" and multi["workers"] == sum(per_node)
    one = _local(tmp_path, [*flags, "--workers", str(sum(per_node))])
    assert (_same if tol == 0 else lambda a, b: _close(a, b, tol))(multi["model"], one)
    if case == "local-sgd":  # the default --algorithm: gloo's own across machines, ring on one
        assert multi["algorithm"] == "native"
        assert json.loads((tmp_path / "one" / "summary.json").read_text())["algorithm"] == "ring"


# Pipelines across hosts (per_node, flags, replicas): the stages of a replica exchange
# activations and gradients between hosts over gloo's sockets and within one over shared
# memory. "zb-h1-two-replicas-ps": host 1 holds replica 0 and replica 1's first stage,
# host 2 replica 1's last stage and both stage groups' servers.
PIPELINES = {
    "1f1b-a-stage-per-host": ([1, 1], ["--stages", "2", "--microbatches", "4"], 1),
    "zb-h1-two-replicas-ps": ([3, 3], ["--stages", "2", "--microbatches", "2", "--schedule", "zb-h1",
                                       "--strategy", "ps", "--consistency", "bsp"], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PIPELINES))
def test_a_pipeline_across_two_hosts_gives_the_model_of_one_host(tmp_path, case, warm_hosts):
    """The writer (replica 0's last stage) is not global rank 0, which hosts the store
    without an agent: rank 0 must outlast the writer's reading of the records."""
    per_node, flags, replicas = PIPELINES[case]
    flags = [*flags, "--steps", "20"]
    multi = _torchrun(tmp_path, per_node, flags, agent=False, warm=warm_hosts)
    assert multi["status"] == "completed" and multi["workers"] == replicas
    assert multi["processes"] == sum(per_node) and multi["traffic_matches_plan"] is True
    assert _same(multi["model"], _local(tmp_path, [*flags, "--workers", str(replicas)]))


# Jobs whose result depends on timing: across 2 hosts they must learn as well as on one,
# at least 0.9x its accuracy. per_node is (host 1, host 2); workers-first puts the other
# roles on host 2, beside workers: servers and workers mixed on one host.
ASYNCHRONOUS = {
    "ps-asp-mixed": ([2, 2], ["--strategy", "ps", "--consistency", "asp", "--batch-size", "48"], 3),
    "tree-ps-aggregators-on-host-2": ([3, 4], ["--strategy", "tree-ps", "--variant", "adv"], 4),
    "gossip-async": ([2, 2], ["--strategy", "gossip", "--async"], 4),
    "easgd": ([2, 1], ["--strategy", "easgd"], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ASYNCHRONOUS))
def test_an_asynchronous_job_across_two_hosts_learns_as_on_one_host(tmp_path, case, warm_hosts):
    per_node, flags, workers = ASYNCHRONOUS[case]
    flags = [*flags, "--steps", "150"]
    multi = _torchrun(tmp_path, per_node, flags, agent=False, warm=warm_hosts)
    assert multi["status"] == "completed" and multi["workers"] == workers and not multi["lost_workers"]
    out = tmp_path / "one"
    assert main(["train", *flags, "--workers", str(workers), "--quiet", "--out", str(out)]) == 0
    one = json.loads((out / "summary.json").read_text())["final_test_accuracy"]
    assert multi["final_test_accuracy"] >= 0.9 * one, (multi["final_test_accuracy"], one)


@pytest.mark.slow
def test_ps_servers_on_their_own_host_equal_one_host(tmp_path):
    """--place roles-first: the server is rank 0, alone on host 1; both workers on host 2.
    Synchronous ps (bsp) gives one host's model, bit for bit."""
    flags = ["--strategy", "ps", "--consistency", "bsp", "--steps", "30"]
    multi = _torchrun(tmp_path, [1, 2], [*flags, "--place", "roles-first"])
    assert multi["workers"] == 2 and multi["servers"] == 1 and multi["status"] == "completed"
    assert _same(multi["model"], _local(tmp_path, [*flags, "--workers", "2"]))


@pytest.mark.slow
def test_sandblaster_spans_two_hosts(tmp_path):
    """Replicas on host 1, the shard and the coordinator on host 2 (workers-first)."""
    multi = _torchrun(tmp_path, [2, 2], ["--strategy", "sandblaster", "--steps", "15"])
    assert multi["status"] == "completed" and multi["final_test_accuracy"] > 0.7  # 15 iterations: it learns
    assert multi["units_accepted_by_shard"] == [multi["units_expected"]]


def test_print_plan_and_a_world_size_that_does_not_fit(capsys):
    assert main(["train", "--strategy", "tree-ps", "--place", "roles-first", "--print-plan", "7"]) == 0
    out = capsys.readouterr().out
    assert "rank   0  server 0" in out and "rank   3  worker 0" in out and "rank   6  worker 3" in out
    assert main(["train", "--strategy", "ps", "--servers", "2", "--print-plan", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world size 2 does not fit strategy ps" in err[0] and "3, 4, 6" in err[0]


def _await_training(out, procs, lines: int = 2, limit: float = 90) -> None:
    """Until worker 0 has logged ``lines`` lines of metrics: the job is training."""
    deadline = time.monotonic() + limit
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"a process ended before training: {ended[0].communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.1)


def _plexus_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("plexus:")]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "link down"])
def test_a_lost_host_ends_a_synchronous_job_naming_its_ranks_and_leaves_no_process(tmp_path, fault):
    """Host 2 (worker 1) killed, or cut off, mid-run. Host 1's worker fails within the
    peer timeout (8 s, plus the 2 s it watches the pulses) with one line naming worker 1
    and host 2; a cut-off host 2 says it is cut off, and its processes exit too."""
    out = tmp_path / "run"
    flags = ["--strategy", "allreduce", "--algorithm", "ring", "--steps", "100000", "--log-every", "5",
             "--timeout", "8"]
    with netns.hosts(2) as (one, two):
        procs = netns.start_train([one, two], [1, 1], flags, out, PORT)
        try:
            _await_training(out, procs)
            began = time.monotonic()
            (netns.kill_host if fault == "killed" else netns.link_down)(two)
            _, err = procs[0].communicate(timeout=60)
            detected = time.monotonic() - began
            _, cut_off = procs[1].communicate(timeout=60)
        finally:
            netns.kill_all(procs)
        left = netns.pids(one) + netns.pids(two)
    assert procs[0].returncode != 0 and detected < 15, detected
    lines = _plexus_lines(err)
    assert len(lines) == 1 and "worker 1 on host2" in lines[0] and two.address in lines[0], err[-2000:]
    if fault == "link down":
        assert procs[1].returncode != 0 and any("this host is cut off" in line for line in _plexus_lines(cut_off))
    assert left == []


@pytest.mark.slow
def test_a_pipeline_that_loses_the_stores_host_ends_in_one_line_and_leaves_no_process(tmp_path):
    """A stage per host, no agent: host 1 (stage 0, and the store in global rank 0) killed
    mid-run. Stage 1 on host 2 fails at once with one line, and only that line (no c10d
    warning with its C++ stack): it lost stage 0, and the store cannot be reached either.
    (Under an agent, torchrun adds its own report of the failed child.)"""
    out = tmp_path / "run"
    flags = ["--stages", "2", "--microbatches", "4", "--steps", "100000", "--log-every", "5", "--timeout", "8"]
    with netns.hosts(2) as (one, two):
        procs = netns.start_train([one, two], [1, 1], flags, out, PORT, agent=False)
        try:
            _await_training(out, procs)
            began = time.monotonic()
            netns.kill_host(one)
            _, err = procs[1].communicate(timeout=60)
            detected = time.monotonic() - began
        finally:
            netns.kill_all(procs)
        left = netns.pids(one) + netns.pids(two)
    assert procs[1].returncode != 0 and detected < 15, detected
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plexus: stage 1: ") and "lost stage 0" in lines[0], err[-2000:]
    assert f"the job's store at {one.address} cannot be reached" in lines[0]
    assert left == []


@pytest.mark.slow
def test_ad_psgd_outlives_a_lost_host_and_its_summary_names_the_lost_workers(tmp_path):
    """AD-PSGD (gossip --async) tolerates lost workers: host 2 (workers 2 and 3) killed
    mid-run; host 1's workers finish the budget, exit 0, and the summary names 2 and 3."""
    out = tmp_path / "run"
    flags = ["--strategy", "gossip", "--async", "--steps", "600", "--log-every", "5", "--timeout", "8"]
    with netns.hosts(2) as (one, two):
        procs = netns.start_train([one, two], [2, 2], flags, out, PORT, agent=False)
        try:
            _await_training(out, procs)
            netns.kill_host(two)
            (stdout, err), (_, err1) = procs[0].communicate(timeout=90), procs[1].communicate(timeout=90)
        finally:
            netns.kill_all(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err[-2000:] + err1[-2000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["lost_workers"] == [2, 3]
    assert json.loads((out / "summary.json").read_text())["lost_workers"] == [2, 3]
