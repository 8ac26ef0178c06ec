"""Pure parts of the collectives: plans (schedule.py), cost model (cost.py), step
measurement (trace.py) and the argument check's messages (check.py). No processes."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.collectives.check import MESSAGE_BYTES, _mismatch, check_bytes, signature
from plexus.collectives.cost import AUTO_CANDIDATES, Network, best, cost
from plexus.collectives.schedule import (Fold, ceil_log2, chunk_bounds, dbtree_chunks, double_tree, hier_groups,
                                         rhd_rounds)
from plexus.collectives.trace import steps
from plexus.errors import ConfigError

NET = Network(alpha=1e-4, beta=1e-9, gamma=2e-10)
N = 1 << 20  # bytes: divisible by every P used below times 4-byte elements


# --- schedule.py -------------------------------------------------------------------------

@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunk_bounds_cover_evenly(length, parts):
    bounds = chunk_bounds(length, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("procs", range(1, 70))
def test_fold_pairs_extra_ranks_and_numbers_the_core(procs):
    fold = Fold(procs)
    assert fold.pof2 <= procs < 2 * fold.pof2
    cores = [fold.core_rank(r) for r in range(procs)]
    assert sorted(c for c in cores if c is not None) == list(range(fold.pof2))
    for r, c in enumerate(cores):
        if c is not None:
            assert fold.rank_of(c) == r
        partner = fold.partner(r)
        if partner is not None:
            assert fold.partner(partner) == r and (cores[r] is None) != (cores[partner] is None)


@pytest.mark.parametrize("pof2", [1, 2, 4, 8, 16, 64])
def test_rhd_rounds_halve_to_own_block_with_symmetric_partners(pof2):
    for core in range(pof2):
        rounds = rhd_rounds(pof2, core)
        assert len(rounds) == ceil_log2(pof2)
        if rounds:
            assert rounds[-1][1] == (core, core + 1)
        for k, (partner, keep, give) in enumerate(rounds):
            other = rhd_rounds(pof2, partner)[k]
            assert other[0] == core and other[1] == give and other[2] == keep


@pytest.mark.parametrize("procs", range(1, 130))
def test_double_tree_is_two_binary_trees_of_log_height(procs):
    a, b = double_tree(procs)
    for tree in (a, b):
        assert tree.parent.count(-1) == 1
        assert all(len(kids) <= 2 for kids in tree.children)
        assert all(tree.parent[k] == r for r, kids in enumerate(tree.children) for k in kids)
        assert tree.height <= ceil_log2(procs)
        if procs > 1:
            assert len(tree.children[tree.root]) == 1
    inner_in_both = sum(1 for r in range(procs) if a.children[r] and b.children[r])
    assert inner_in_both == (0 if procs % 2 == 0 else min(1, procs - 1))


def test_hier_groups_are_consecutive_with_first_rank_leading():
    assert hier_groups(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert hier_groups(4, 4) == [[0, 1, 2, 3]]


# --- cost.py: the textbook formulas --------------------------------------------------------

@pytest.mark.parametrize("procs", [2, 3, 4, 5, 8, 16])
def test_ring_formula(procs):
    c = cost("ring", procs, N * procs, network=NET)
    assert c.steps == 2 * (procs - 1) and c.fan_in == 1
    assert c.sent == (2 * (procs - 1) * N,) * procs  # 2(P-1)/P of the vector
    nb = N * procs
    assert c.time == pytest.approx(2 * (procs - 1) * NET.alpha + 2 * (procs - 1) / procs * nb * NET.beta
                                   + (procs - 1) / procs * nb * NET.gamma)


@pytest.mark.parametrize("procs", [2, 4, 8, 16, 32])
def test_rhd_formula_power_of_two(procs):
    c = cost("rhd", procs, N, network=NET)
    assert c.steps == 2 * int(math.log2(procs)) and c.fan_in == 1
    assert c.sent == (2 * (procs - 1) * N // procs,) * procs
    assert c.time == pytest.approx(2 * math.log2(procs) * NET.alpha + 2 * (procs - 1) / procs * N * NET.beta
                                   + (procs - 1) / procs * N * NET.gamma)


def test_rhd_fold_for_six_ranks():
    c = cost("rhd", 6, N, network=NET)
    assert c.steps == 2 * 2 + 2
    # Ranks 0 and 2 hand their vector to 1 and 3, which also hand the result back.
    core = 2 * 3 * N // 4
    assert c.sent == (N, core + N, N, core + N, core, core)


def test_master_and_ps_formulas():
    m = cost("master", 5, N, network=NET)
    assert (m.steps, m.fan_in, m.sent) == (2, 4, (4 * N, N, N, N, N))
    assert m.time == pytest.approx(2 * 4 * (NET.alpha + N * NET.beta) + 4 * N * NET.gamma)
    p = cost("ps", 4, N, network=NET)
    assert (p.steps, p.fan_in, p.sent) == (2, 3, (3 * N // 2,) * 4)


def test_dbtree_pipeline_steps_and_bytes():
    c = cost("dbtree", 4, 16 << 20, chunk_bytes=1 << 20)
    # Height 2 trees, 8 chunks of 1 MiB per tree (each tree carries 8 MiB).
    assert dbtree_chunks(16 << 20, 1 << 20) == 8
    assert c.steps == 2 * 2 + 8 - 1
    # Rank 2 is inner in tree 0 (up to 0, down to 1 and 3) and a leaf in tree 1 (up to 1);
    # rank 0 is tree 0's root (down to 2) and a leaf in tree 1 (up to 1).
    half = 8 << 20
    assert c.sent == (2 * half, 4 * half, 4 * half, 2 * half)
    assert c.fan_in == 4


def test_hier_is_local_plus_inner():
    c = cost("hier", 8, N, local_size=2, inner="rhd")
    assert c.steps == 2 + cost("rhd", 4, N).steps
    inner = cost("rhd", 4, N).sent
    assert c.sent == (N + inner[0], N, N + inner[1], N, N + inner[2], N, N + inner[3], N)
    assert c.fan_in == 1
    assert cost("hier", 4, N, local_size=4).steps == 2


def test_native_counts_the_backend_ring_nominally():
    assert cost("native", 4, N).sent == cost("ring", 4, N).sent


def test_trivial_cases_cost_nothing_but_the_check():
    for name in ("ring", "rhd", "master", "ps", "dbtree", "hier", "native", "auto"):
        assert cost(name, 1, N).sent == (0,) and cost(name, 1, N).check_bytes == 0
        zero = cost(name, 4, 0)
        assert (zero.steps, zero.sent_max, zero.time) == (0, 0, 0.0)
        assert zero.check_steps == 2 and zero.check_bytes == 2 * MESSAGE_BYTES == check_bytes(4)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["ring", "rhd", "ps", "master", "dbtree", "hier"]), st.integers(2, 40), st.integers(0, 3000),
       st.integers(1, 5))
def test_every_algorithm_sends_2_p_minus_1_vectors_in_all(name, procs, n, local_size):
    """Every rank's data must leave it and the result reach every rank: each algorithm of
    this family sends exactly 2(P-1) N bytes in total, whatever N and the layout."""
    c = cost(name, procs, 4 * n, local_size=local_size, chunk_bytes=64)
    assert sum(c.sent) == 2 * (procs - 1) * 4 * n


def test_auto_follows_the_model():
    assert best(8, 4 << 10, NET) == "rhd"
    assert best(8, 64 << 20, NET) == "rhd"
    assert best(6, 4 << 10, NET) == "rhd"     # the fold's extra bytes are cheap at 4 KB
    assert best(6, 64 << 20, NET) == "ring"   # ... and dear at 64 MB
    assert cost("auto", 6, 64 << 20, network=NET).choice == "ring"
    assert best(4, 4 << 10, NET, candidates=("ps", "master")) == "ps"
    with pytest.raises(ConfigError):
        best(4, 4, NET, candidates=("native",))


def test_bad_arguments_raise_config_error():
    with pytest.raises(ConfigError, match="no cost model"):
        cost("nope", 4, 16)
    with pytest.raises(ConfigError, match="multiple of itemsize"):
        cost("ring", 4, 10)
    with pytest.raises(ConfigError, match="beta"):
        Network(beta=-1.0)
    assert set(AUTO_CANDIDATES) <= {"rhd", "ring", "ps", "dbtree", "master"}


# --- trace.py ------------------------------------------------------------------------------

def _ring_logs(procs: int, rounds: int) -> list[dict]:
    """What a ring of ``rounds`` pass-it-on steps records (tag 5), plus one check message."""
    logs = []
    for r in range(procs):
        sends, recvs = [[(r - 1) % procs, 9, 0, 0]], [[(r + 1) % procs, 9, 0]]
        for s in range(rounds):
            sends.append([(r + 1) % procs, 5, s, len(recvs)])
            recvs.append([(r - 1) % procs, 5, s])
        logs.append({"sends": sends, "recvs": recvs})
    return logs


def test_steps_is_the_longest_chain():
    logs = _ring_logs(4, 6)
    assert steps(logs, ignore_tags=[9]) == 6
    # The check's message (tag 9) is waited for first, so it adds one step when counted.
    assert steps(logs) == 7
    assert steps([{"sends": [], "recvs": [], "opaque": True}]) is None
    # Messages of one stream follow each other even without receives in between.
    burst = [{"sends": [[1, 5, k, 0] for k in range(4)], "recvs": []}, {"sends": [], "recvs": []}]
    assert steps(burst) == 4


# --- check.py ------------------------------------------------------------------------------

def test_mismatch_message_names_ranks_and_values():
    group = SimpleNamespace(names=[f"worker {r}" for r in range(3)], me="worker 1")
    rows = [signature(torch.zeros(10), "rhd", "sum"), signature(torch.zeros(10), "rhd", "sum"),
            signature(torch.zeros(11, dtype=torch.float16), "rhd", "sum")]
    err = _mismatch(group, rows)
    assert "worker 0, worker 1: 10 float32 elements, algorithm rhd, op sum" in str(err)
    assert "worker 2: 11 float16 elements" in str(err)
    assert err.peer == "worker 2"
    assert check_bytes(1) == 0 and check_bytes(5) == 3 * MESSAGE_BYTES
