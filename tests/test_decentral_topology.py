"""Pure objects of decentralized training: graphs, mixing weights, spectral gaps, AD-PSGD's
pairing, local SGD's schedule and AdaComm, and the averaging arithmetic."""
from __future__ import annotations

import math

import pytest
import torch

from plexus.decentral import (AdaComm, AveragingSchedule, FlatParameters, Pairing, Topology, consensus_distance,
                              elastic_difference, make_topology, mix, optimizer_buffers, torus_shape)
from plexus.errors import ConfigError

SIZES = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16]
NAMES = ["ring", "torus", "exp", "complete"]


def _check_doubly_stochastic(t: Topology) -> None:
    w = t.matrix()
    ones = torch.ones(t.size, dtype=torch.float64)
    assert torch.allclose(w, w.T), "W must be symmetric"
    assert torch.allclose(w @ ones, ones) and torch.allclose(ones @ w, ones), "rows and columns must sum to 1"
    assert (w >= 0).all(), "weights must be non-negative"
    for r in range(t.size):
        nonzero = {j for j in range(t.size) if w[r, j] > 0} - {r}
        assert nonzero == set(t.peers(r, step=7)), f"rank {r}: weights off the graph"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mixing", ["uniform", "metropolis"])
def test_builtin_graphs_have_symmetric_doubly_stochastic_weights(name, size, mixing):
    t = make_topology(name, size, mixing)
    _check_doubly_stochastic(t)
    gap = t.spectral_gap()
    assert 0 < gap <= 1 + 1e-12


def test_neighbours_of_each_graph():
    assert make_topology("ring", 6).peers(0) == (1, 5)
    assert make_topology("ring", 2).peers(0) == (1,)
    assert make_topology("ring", 1).peers(0) == ()
    assert make_topology("exp", 8).peers(0) == (1, 2, 4, 6, 7)
    assert make_topology("exp", 16).degree(3) == 7  # +-1, +-2, +-4, 8
    assert torus_shape(12) == (3, 4) and torus_shape(7) == (1, 7)
    torus = make_topology("torus", 12)  # 3 x 4 grid, rank 5 at (1, 1)
    assert torus.peers(5) == (1, 4, 6, 9)
    assert make_topology("torus", 7).peers(0) == make_topology("ring", 7).peers(0)
    assert make_topology("complete", 5).peers(2) == (0, 1, 3, 4)
    # Uniform weights: 1 / (degree + 1) each, self included.
    assert make_topology("ring", 6).weights(0) == pytest.approx({0: 1 / 3, 1: 1 / 3, 5: 1 / 3})


def test_spectral_gap_matches_the_closed_form():
    # Ring with uniform weights: eigenvalues (1 + 2 cos(2 pi k / P)) / 3.
    for size in (4, 5, 8, 16):
        eig = [(1 + 2 * math.cos(2 * math.pi * k / size)) / 3 for k in range(1, size)]
        assert make_topology("ring", size).spectral_gap() == pytest.approx(1 - max(abs(e) for e in eig))
    assert make_topology("complete", 7).spectral_gap() == pytest.approx(1.0)
    # Longer rings mix more slowly; exp and complete mix faster than the ring.
    gaps = [make_topology("ring", n).spectral_gap() for n in (4, 8, 16)]
    assert gaps[0] > gaps[1] > gaps[2]
    assert make_topology("exp", 16).spectral_gap() > 3 * make_topology("ring", 16).spectral_gap()


def test_metropolis_weights_on_an_irregular_graph():
    # A star with a tail: 0-1, 0-2, 0-3, 3-4 (degrees 3, 1, 1, 2, 1).
    star = [[1, 2, 3], [0], [0], [0, 4], [3]]
    t = Topology("star", star, "metropolis")
    _check_doubly_stochastic(t)
    assert t.weights(1) == pytest.approx({0: 0.25, 1: 0.75})
    assert t.weights(3) == pytest.approx({0: 0.25, 3: 5 / 12, 4: 1 / 3})
    with pytest.raises(ConfigError, match="metropolis"):
        Topology("star", star, "uniform")
    with pytest.raises(ValueError, match="symmetric"):
        Topology("bad", [[1], []], "metropolis")
    with pytest.raises(ConfigError, match="topology must be"):
        make_topology("hypercube", 4)


def test_pairing_orientation_is_acyclic_and_covers_every_edge():
    for name in NAMES:
        for size in SIZES:
            t = make_topology(name, size)
            pairing = Pairing(t, seed=1)
            edges = {frozenset((r, j)) for r in range(size) for j in t.peers(r)}
            oriented = [(r, j) for r in range(size) for j in pairing.targets(r)]
            assert {frozenset(e) for e in oriented} == edges, (name, size)
            assert len(oriented) == len(edges), "each edge has one initiator"
            for r in range(size):
                assert set(pairing.sources(r)) == {i for i, j in oriented if j == r}
            colour = t.colouring()
            if colour is not None and size > 1:
                # The paper's bipartite split: actives only start, passives only answer.
                assert all(not pairing.targets(r) or not pairing.sources(r) for r in range(size))
            else:
                assert all(i < j for i, j in oriented), "waits must climb in rank"
    assert Pairing(make_topology("ring", 6)).bipartite
    assert not Pairing(make_topology("ring", 5)).bipartite


def test_pairing_picks_live_targets_reproducibly():
    t = make_topology("ring", 4)
    a, b = Pairing(t, seed=3), Pairing(t, seed=3)
    picks = [a.pick(0) for _ in range(200)]
    assert picks == [b.pick(0) for _ in range(200)]
    assert set(picks) == {1, 3}
    assert {a.pick(0, live={3}) for _ in range(20)} == {3}
    assert a.pick(0, live=set()) is None
    assert a.pick(1) is None  # passive


def test_adacomm_period_rule():
    rule = AdaComm(16)
    assert rule.update(2.0) == 16            # the first round sets F_start
    assert rule.update(0.5) == 8             # sqrt(1/4) * 16
    assert rule.update(0.02) == math.ceil(math.sqrt(0.01) * 16)
    assert rule.update(0.0) == 1             # never below 1
    assert rule.update(8.0) == 16            # never above H0
    assert rule.update(float("nan")) == 16
    with pytest.raises(ConfigError):
        AdaComm(0)


def test_averaging_schedule_warmup_then_rounds():
    s = AveragingSchedule(period=3, warmup_steps=2)
    assert [s.warmup(t) for t in range(4)] == [True, True, False, False]
    assert [s.local_step_done() for _ in range(3)] == [False, False, True]
    s.averaged(1.0)
    assert [s.local_step_done() for _ in range(3)] == [False, False, True]
    ada = AveragingSchedule(period=8, adaptive=True)
    assert ada.averaged(4.0) == 8 and ada.averaged(1.0) == 4 and ada.averaged(0.25) == 2
    assert ada.rounds == {8: 2, 4: 1}
    fixed = AveragingSchedule(period=8)
    assert fixed.averaged(0.01) == 8


def test_mix_sums_in_rank_order_and_is_exact_on_complete():
    gen = torch.Generator().manual_seed(0)
    xs = {r: torch.randn(1000, generator=gen) for r in range(4)}
    w = make_topology("complete", 4).weights(2)
    out = xs[2].clone()
    mix(w, {**xs, 2: out}, out=out)
    assert torch.allclose(out, torch.stack(list(xs.values())).mean(0), atol=1e-6)
    # Every rank of a complete graph computes the very same bits.
    results = []
    for r in range(4):
        own = xs[r].clone()
        results.append(mix(make_topology("complete", 4).weights(r), {**xs, r: own}, out=own))
    assert all(torch.equal(results[0], x) for x in results[1:])


def test_consensus_distance_and_elastic_force():
    a, b = torch.zeros(3), torch.tensor([3.0, 4.0, 0.0])
    assert consensus_distance([a, b]) == pytest.approx(2.5)  # each is 2.5 from the mean
    assert consensus_distance([b, b, b]) == 0.0
    x, centre = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    e = elastic_difference(x, centre, 0.25)
    assert torch.allclose(e, torch.tensor([-0.5, 1.0]))
    assert torch.allclose((x - e) + (centre + e), x + centre)  # worker + centre is conserved


def test_flat_parameters_and_optimizer_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParameters(model)
    assert flat.numel == 3 * 4 + 4 + 4 * 2 + 2 and flat.nbytes == 4 * flat.numel
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p, old)
    flat.flat.add_(1.0)  # the parameters are views of the flat buffer
    assert torch.equal(next(model.parameters()), before[0] + 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    bufs = optimizer_buffers(opt, flat.params)
    assert len(bufs) == 2 * len(flat.params)  # exp_avg and exp_avg_sq, not step
    assert all(b.shape == p.shape for b, p in zip(bufs[::2], flat.params))
