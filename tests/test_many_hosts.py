"""Every strategy across separate hosts under torchrun, with one role plan from the global
rank (train/plan.py): network namespaces on a bridge (tests/netns.py), each with its own
address, host name and /dev/shm, one torchrun node per namespace. Synchronous jobs must
give the model of the same job on one host, bit for bit."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import netns
from plexus.cli import main

PY = sys.executable
PORT = 29561

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=netns.skip_reason() or "")


def _torchrun(tmp_path, per_node: list[int], flags: list[str], timeout: float = 150) -> dict:
    """Run ``plexus train FLAGS`` with torchrun, node i with per_node[i] processes on host
    i; returns worker 0's summary."""
    out = tmp_path / "multi"
    env = {**os.environ, "PLEXUS_TOKEN": "many-hosts", "MPLCONFIGDIR": "/tmp/plexus-mpl"}
    with netns.hosts(len(per_node)) as found:
        master = found[0].address
        procs = []
        try:
            for node, (host, nproc) in enumerate(zip(found, per_node)):
                argv = [PY, "-m", "torch.distributed.run", "--nnodes", str(len(per_node)), "--node-rank", str(node),
                        "--nproc-per-node", str(nproc), "--master-addr", master, "--master-port", str(PORT),
                        "-m", "plexus.cli", "train", *flags, "--host", master, "--timeout", "40", "--quiet",
                        "--json", "--save-model", "--out", str(out)]
                procs.append(netns.on_host(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True))
            results = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
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


@pytest.mark.slow
def test_allreduce_ring_across_two_hosts_equals_one_host(tmp_path):
    flags = ["--strategy", "allreduce", "--algorithm", "ring", "--steps", "30"]
    multi = _torchrun(tmp_path, [1, 1], flags)
    assert _same(multi["model"], _local(tmp_path, [*flags, "--workers", "2"]))


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
