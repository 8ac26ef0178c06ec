"""``plexus simulate`` (plexus/sim/): the real rules and maths under virtual time.

- a simulated synchronous run equals the real run's model bit for bit (allreduce ring and
  master, ps bsp with two servers, local SGD with AdaComm over ring, D-PSGD on a ring, a
  synchronous tree-ps with two aggregators),
  because it drives the same bucket layout, reduction order, gate, server optimizer,
  averaging schedule and mixing;
- the same seed gives the same run, update order included; another seed does not;
- virtual time follows the cluster description (compute, alpha-beta network, failures);
- bad input is one line and exit 2.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from plexus.cli import main
from plexus.collectives.cost import Network, cost
from plexus.config import JobConfig
from plexus.sim.cluster import ComputeModel, SimSpec, network_of, parse_fail, take_in
from plexus.sim.engines import master_round
from plexus.sim.events import EventQueue
from plexus.sim.run import simulate


def _cfg(out=None, **flat) -> JobConfig:
    flat = {"workers": 4, "steps": 30, "seed": 0, "quiet": True, **flat}
    if out is not None:
        flat.update(out=str(out), save_model=True)
    return JobConfig.from_flat(flat, {k: "flag" for k in flat})


def _spec(cfg: JobConfig, **kw) -> SimSpec:
    kw.setdefault("compute", ComputeModel(per_sample=1e-4))
    return SimSpec(workers=cfg.cluster.workers, servers=cfg.cluster.servers, network=network_of(cfg.cluster.net),
                   **kw)


def _sim(tmp_path, name: str, cfg: JobConfig, **kw) -> dict:
    run_dir = tmp_path / name
    run_dir.mkdir()
    return simulate(cfg, _spec(cfg, **kw), run_dir)


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    queue, seen = EventQueue(), []
    queue.at(2.0, seen.append, "late")
    queue.at(1.0, seen.append, "first")
    queue.at(1.0, seen.append, "second")
    queue.at(1.0, lambda: queue.after(0.5, seen.append, "chained"))
    queue.run()
    assert seen == ["first", "second", "chained", "late"] and queue.now == 2.0
    with pytest.raises(ValueError, match="past"):
        queue.at(1.0, seen.append, "x")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{"strategy": "allreduce", "algorithm": "ring"},
                                   {"strategy": "allreduce", "algorithm": "master"},
                                   {"strategy": "ps", "consistency": "bsp", "servers": 2},
                                   {"strategy": "local-sgd", "algorithm": "ring", "period": 4, "adaptive": True,
                                    "average_optimizer_state": True},
                                   {"strategy": "gossip", "topology": "ring"},
                                   {"strategy": "tree-ps", "variant": "adv", "fanout": 2, "softsync": 4}],
                         ids=["ring", "master", "ps-bsp", "local-sgd-adacomm", "gossip", "tree-ps-sync"])
def test_a_simulated_synchronous_run_equals_the_real_one_bit_for_bit(tmp_path, flags):
    from plexus.train.job import run_local
    run_local(_cfg(tmp_path / "real", **flags))
    summary = _sim(tmp_path, "sim", _cfg(tmp_path / "sim", **flags))
    real, sim = torch.load(tmp_path / "real" / "model.pt"), torch.load(tmp_path / "sim" / "model.pt")
    assert real.keys() == sim.keys()
    assert all(torch.equal(real[k], sim[k]) for k in real), {k: (real[k] - sim[k]).abs().max() for k in real}
    assert summary["simulated"] and summary["status"] == "completed" and summary["steps"] == 30


@pytest.mark.parametrize("variant, real_staleness", [("adv", 6.0), ("adv-star", 6.9)])
def test_an_asynchronous_tree_learns_with_staleness_like_the_real_one(tmp_path, variant, real_staleness):
    """tree-ps at 8 workers under its defaults (asp through 6 aggregators): the real runs
    reached 0.933 (adv) and 0.953 (adv-star, 2 servers) with mean staleness 6.0 and 6.9 at
    150 steps (measured); the simulation must learn and show a staleness within 50 %."""
    summary = _sim(tmp_path, "tree", _cfg(strategy="tree-ps", variant=variant, workers=8, servers=2, steps=150))
    assert summary["status"] == "completed" and summary["final_test_accuracy"] > 0.85
    assert abs(summary["staleness_mean"] / real_staleness - 1) <= 0.5 and summary["sim"]["aggregators"] == 6


def test_an_adv_star_learner_under_bsp_computes_on_the_weights_it_has_when_its_push_is_acknowledged(tmp_path):
    """The servers acknowledge a plain push on arrival, before the gate applies it, so under
    bsp a learner often computes its next gradient before the new weights reach it: real
    runs at 8 workers (mnist1d, 200 steps) measured a mean staleness of 0.615, at 4 workers
    0.65-0.68. The simulation once waited for the update before acknowledging (0.0)."""
    summary = _sim(tmp_path, "star", _cfg(strategy="tree-ps", variant="adv-star", consistency="bsp", workers=8,
                                         dataset="mnist1d", steps=200))
    assert abs(summary["staleness_mean"] / 0.615 - 1) <= 0.5, summary["staleness_mean"]


def test_backup_workers_make_each_step_of_the_first_pushes_and_drop_the_late(tmp_path):
    """ps bsp --backup-workers 1 with a 4x straggler (the README's scheduling example):
    each of the job's steps averages the first 2 of 3 pushes, as BackupBSP does for real."""
    cfg = _cfg(strategy="ps", consistency="bsp", backup_workers=1, workers=3, batch_size=63, steps=50,
               slow="worker:0=4")
    summary = _sim(tmp_path, "b", cfg, compute=ComputeModel(per_sample=1e-4, overhead=1e-3), timing_only=True)
    assert summary["steps"] == 50 and summary["samples"] == 50 * 2 * 21
    assert summary["sim"]["late_pushes"] > 0 and summary["sim"]["backup_workers"] == 1
    plain = _sim(tmp_path, "p", _cfg(strategy="ps", consistency="bsp", workers=3, batch_size=63, steps=50,
                                     slow="worker:0=4"),
                 compute=ComputeModel(per_sample=1e-4, overhead=1e-3), timing_only=True)
    assert summary["wall_seconds"] < 0.6 * plain["wall_seconds"]  # no step waits for the straggler


def test_a_synchronous_ps_run_stopped_at_its_target_counts_global_steps(tmp_path):
    """ps bsp stops at its target with some workers one push ahead: still the job's steps of a
    whole batch, as the real summary counts them (plexus simulate --validate divided a
    "worker" count by P and showed 4x the time per step)."""
    cfg = _cfg(strategy="ps", consistency="bsp", workers=4, batch_size=64, steps=150, target_accuracy=0.5,
               eval_every=10, net="bandwidth=100mbit,latency=2ms")
    summary = _sim(tmp_path, "bsp", cfg, compute=ComputeModel(per_sample=35e-6))
    assert summary["time_to_target_seconds"] is not None and summary["steps"] < 150
    assert summary["steps_kind"] == "global" and summary["samples"] == summary["steps"] * 64


def test_a_worker_with_backup_workers_pushes_at_most_once_per_step(tmp_path):
    """16 workers, 2 backups, two 4x stragglers and jittered compute (the
    chen2016-backup-workers recipe): a worker pushes once per reply, each time on newer
    weights, so at most once per step of the job. A late push that arrived while the server
    applied an update was answered by that update and by its own reply; answered twice, a
    worker ran two chains of steps at once (thousands of pushes in 131 steps, which made the
    recipe's backups slower than sync)."""
    cfg = _cfg(strategy="ps", consistency="bsp", backup_workers=2, workers=16, batch_size=64, steps=100,
               slow="worker:3=4,worker:11=4", net="bandwidth=100gbit,latency=10us")
    summary = _sim(tmp_path, "b", cfg, compute=ComputeModel(per_sample=5e-6, overhead=2e-4, jitter="lognormal:0.3"),
                   timing_only=True)
    assert summary["steps"] == 100 and summary["sim"]["late_pushes"] > 0
    assert max(summary["steps_per_worker"]) <= 101, summary["steps_per_worker"]
    plain = _sim(tmp_path, "p", _cfg(strategy="ps", consistency="bsp", workers=16, batch_size=64, steps=100,
                                     slow="worker:3=4,worker:11=4", net="bandwidth=100gbit,latency=10us"),
                 compute=ComputeModel(per_sample=5e-6, overhead=2e-4, jitter="lognormal:0.3"), timing_only=True)
    assert summary["wall_seconds"] < 0.6 * plain["wall_seconds"]  # no step waits for the stragglers


def test_sandblaster_runs_the_real_lbfgs_over_simulated_work_units(tmp_path):
    """Full-batch L-BFGS on digits with 3 replicas and 2 shards, 30 iterations: the real run
    ended at 0.9359 test accuracy after 986 units (measured); the simulation drives the same
    Lbfgs over the same units."""
    cfg = _cfg(strategy="sandblaster", workers=3, servers=2, steps=30)
    summary = _sim(tmp_path, "sb", cfg)
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["final_test_accuracy"] == pytest.approx(0.9359, abs=0.01)
    sim = summary["sim"]
    assert sim["units_per_evaluation"] == 25 and sim["round_trips"] > sim["evaluations"]


def test_the_same_seed_gives_the_same_update_order_and_another_seed_another(tmp_path):
    flags = {"strategy": "ps", "consistency": "asp", "servers": 2, "steps": 20}
    jitter = ComputeModel(per_sample=1e-4, overhead=1e-3, jitter="lognormal:0.5")
    a = _sim(tmp_path, "a", _cfg(**flags), compute=jitter)
    b = _sim(tmp_path, "b", _cfg(**flags), compute=jitter)
    c = _sim(tmp_path, "c", _cfg(seed=1, **flags), compute=jitter)
    assert a["update_order_sha256"] == b["update_order_sha256"] != c["update_order_sha256"]
    assert a["final_test_accuracy"] == b["final_test_accuracy"] and a["wall_seconds"] == b["wall_seconds"]
    assert a["updates_applied"] == 80 and a["steps"] == 80  # asynchronous: steps x workers updates, shared
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_allreduce_time_is_the_slowest_compute_plus_the_modelled_all_reduce(tmp_path):
    cfg = _cfg(algorithm="ring", steps=10, net="latency=1ms,bandwidth=100mbit", slow="worker:2=3")
    summary = _sim(tmp_path, "t", cfg, compute=ComputeModel(per_sample=1e-4, overhead=2e-3), timing_only=True)
    share = cfg.run.batch_size // 4
    comm = summary["sim"]["algorithm_seconds_per_step"]
    assert comm == pytest.approx(cost("ring", 4, 26122 * 4, network=network_of(cfg.cluster.net)).time)
    assert summary["wall_seconds"] == pytest.approx(10 * (3 * (2e-3 + share * 1e-4) + comm))
    assert summary["final_test_accuracy"] is None  # --timing-only: no maths


def test_a_rounds_work_is_paid_at_each_round_of_communication(tmp_path):
    """``per_round``: all-reduce pays it at every step, local SGD only at its averagings;
    a step's own work (``outside``) both pay at every step."""
    net = "latency=1ms,bandwidth=100mbit"
    c, own, rnd = 2e-3, 5e-4, 3e-3
    compute = ComputeModel(per_sample=0.0, overhead=c, outside=own, per_round=rnd)
    ring = cost("ring", 4, 26122 * 4, network=network_of(JobConfig.from_flat({"net": net}).cluster.net)).time
    every = _sim(tmp_path, "a", _cfg(algorithm="ring", steps=10, net=net), compute=compute, timing_only=True)
    assert every["wall_seconds"] == pytest.approx(10 * (c + own + rnd + ring))
    local = _sim(tmp_path, "l", _cfg(strategy="local-sgd", algorithm="ring", period=5, steps=10, net=net),
                 compute=compute, timing_only=True)
    assert local["wall_seconds"] == pytest.approx(10 * (c + own) + 2 * (rnd + ring))


def test_easgd_centre_answers_each_worker_when_its_replica_is_in(tmp_path):
    """Two workers exchange with the centre at every step: the centre's card takes their
    replicas in one after the other and sends each reply as soon as that one is in, so
    worker 1 trails worker 0 by one wire and neither waits for the other's reply (the
    reply used to leave when the last reply queued so far had)."""
    net = "latency=2ms,bandwidth=100mbit"
    c, own, rnd = 1e-3, 5e-4, 1e-3
    cfg = _cfg(strategy="easgd", workers=2, steps=6, period=1, net=net)
    n = network_of(cfg.cluster.net)
    wire = 26122 * 4 * n.beta
    summary = _sim(tmp_path, "e", cfg, compute=ComputeModel(per_sample=0.0, overhead=c, outside=own, per_round=rnd),
                   timing_only=True)
    assert summary["wall_seconds"] == pytest.approx(6 * (c + own + rnd + 2 * n.alpha + 2 * wire) + wire)


def test_a_card_takes_messages_in_one_at_a_time_in_the_order_they_come():
    assert take_in([3.0, 1.0, 1.0], 2.0) == 7.0   # two at once queue: 1-3, 3-5; the third waits until 5
    assert take_in([0.0, 5.0], 2.0) == 7.0        # spaced wider than a wire: no queue
    assert take_in([4.0, 0.0, 1.0], 0.5) == 4.5   # the card is idle when the last comes


def test_master_staggers_its_workers_as_the_emulated_cards_do(tmp_path):
    """Rank 0 takes the gradients in one at a time and sends the sum out one worker after
    another, latency overlapping: the first step costs 2 alpha + 2 (P - 1) N beta, and then
    worker 1 computes while the sum is still on its way to worker 3, so a step costs
    P N beta + 2 alpha plus the compute (the closed form's 2 (P - 1)(alpha + N beta) is
    what it would cost if every worker started together and each latency came in turn)."""
    net = Network(alpha=1e-3, beta=1e-8, gamma=0.0)
    nbytes, wire = 100_000, 1e-3
    held = master_round(np.zeros(4), nbytes, net)
    start = 1e-3 + 3 * wire
    assert held.tolist() == pytest.approx([start + 2 * wire, start + wire + 1e-3, start + 2 * wire + 1e-3,
                                           start + 3 * wire + 1e-3])
    # Two ranks: one message each way, the closed form exactly.
    assert master_round(np.zeros(2), nbytes, net)[1] == pytest.approx(cost("master", 2, nbytes, network=net).time)
    # A whole run: 4 workers, compute c per step, the digits MLP's 26,122 float32s.
    cfg = _cfg(algorithm="master", steps=10, net="latency=1ms,bandwidth=100mbit")
    c, n = 2e-3, 26122 * 4
    summary = _sim(tmp_path, "m", cfg, compute=ComputeModel(per_sample=0.0, overhead=c), timing_only=True)
    net = network_of(cfg.cluster.net)
    alpha, wire, reduce = net.alpha, n * net.beta, 3 * n * net.gamma
    first = c + 2 * alpha + 6 * wire + reduce
    assert summary["wall_seconds"] == pytest.approx(first + 9 * (4 * wire + 2 * alpha + c + reduce))


def test_gossip_exchanges_overlap_the_gradient_not_the_work_after_it(tmp_path):
    """D-PSGD, combine-first: a replica reaches a neighbour alpha + N beta after the step
    starts; the gradient overlaps that, the mixing and optimizer after it (``outside``) do
    not. On a ring of 4 each worker sends to its lower neighbour first, so workers 0 and 1
    get both replicas at alpha + 2 N beta (their card takes them one at a time) and workers
    2 and 3 a wire later, a lag that the job carries to its end."""
    for workers, gradients in ((2, (0.5, 2.0)), (4, (0.5,))):
        cfg = _cfg(strategy="gossip", topology="ring", workers=workers, steps=10,
                   net="latency=1ms,bandwidth=100mbit")
        net = network_of(cfg.cluster.net)
        wire = 26122 * 4 * net.beta
        exchange = net.alpha + (workers // 2) * wire
        for share in gradients:
            summary = _sim(tmp_path, f"g{workers}-{share}", cfg, timing_only=True,
                           compute=ComputeModel(per_sample=0.0, overhead=share * exchange, outside=1e-3))
            lag = wire if workers == 4 else 0.0
            assert summary["wall_seconds"] == pytest.approx(10 * (max(share * exchange, exchange) + 1e-3) + lag)


def test_staleness_under_asp_grows_with_the_workers(tmp_path):
    """Homogeneous workers under asp: each gradient misses about the other P - 1 workers'
    updates (Zhang et al. 2016's <sigma> ~ n for n-softsync, here n = P)."""
    means = {}
    for p in (4, 16):
        cfg = _cfg(strategy="ps", consistency="asp", workers=p, batch_size=64, steps=20)
        means[p] = _sim(tmp_path, f"p{p}", cfg, timing_only=True)["staleness_mean"]
    assert 2 <= means[4] <= 4 and 12 <= means[16] <= 16, means


def test_a_failed_worker_ends_allreduce_and_is_dropped_under_asp(tmp_path):
    cfg = _cfg(strategy="allreduce", steps=200)
    ended = _sim(tmp_path, "ar", cfg, failures=parse_fail("worker:1@t=0.05"))
    assert ended["status"] == "failed" and "worker 1" in ended["error"] and ended["steps"] < 200
    cfg = _cfg(strategy="ps", consistency="asp", steps=100, peer_timeout=0.5)
    survived = _sim(tmp_path, "asp", cfg, failures=parse_fail("worker:1@t=0.05"))
    assert survived["status"] == "completed" and survived["lost_workers"] == [1]
    assert survived["final_test_accuracy"] > 0.8


@pytest.mark.parametrize("flags", [{"strategy": "easgd"}, {"strategy": "gossip", "async": True},
                                   {"strategy": "tree-ps", "variant": "base", "softsync": 2}],
                         ids=["easgd", "ad-psgd", "tree-ps-base"])
def test_asynchronous_replicas_learn_and_outlive_a_worker(tmp_path, flags):
    """EASGD, AD-PSGD and the flat tree-ps, event by event: they learn as the real runs do
    (0.97 and 0.98 at 300 steps on 4 workers, measured), and go on without a worker that
    dies."""
    learned = _sim(tmp_path, "ok", _cfg(steps=150, **flags))
    assert learned["status"] == "completed" and learned["final_test_accuracy"] > 0.9
    survived = _sim(tmp_path, "lost", _cfg(steps=150, **flags), failures=parse_fail("worker:2@t=0.01"))
    assert survived["status"] == "completed" and survived["lost_workers"] == [2]
    assert survived["final_test_accuracy"] > 0.85


@pytest.mark.slow
def test_the_cli_writes_a_run_directory_marked_simulated_and_stops_at_a_target(tmp_path, capsys):
    code = main(["simulate", "--sim-workers", "8", "--batch-size", "64", "--target-accuracy", "0.9",
                 "--eval-every", "10", "--steps", "1000", "--out", str(tmp_path / "run"), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["simulated"] and summary["workers"] == 8 and summary["sim"]["compute"]["measured"]
    assert summary["time_to_target_seconds"] is not None and summary["steps"] < 1000
    assert {"summary.json", "metrics.jsonl", "config.json"} <= {p.name for p in (tmp_path / "run").iterdir()}
    assert "simulated 8 workers" in out


def test_a_simulated_run_that_does_not_learn_is_judged_stalled_with_its_hint(tmp_path, capsys):
    """As a real run is (train/health.py): the training losses, here one per --log-every
    steps, and a final accuracy no better than chance. A rate of 1e-6 leaves the loss where
    it starts: at --log-every 1 the loss rule fires at step 29 as in the real test
    (test_health.py), and the summary, compare's judging and the CLI's warning say so."""
    code = main(["simulate", "--workers", "2", "--steps", "60", "--lr", "1e-6", "--log-every", "1",
                 "--out", str(tmp_path / "run"), "--json"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and summary["health"] == "stalled" and summary["health_step"] == 29
    assert "change --lr" in summary["health_hint"] and "warning: training stalled" in captured.err
    healthy = _sim(tmp_path, "ok", _cfg(workers=2, steps=60))
    assert healthy["health"] == "ok" and healthy["health_hint"] is None
    timing = _sim(tmp_path, "t", _cfg(workers=2, steps=20), timing_only=True)
    assert "health" not in timing  # no maths, no losses: nothing to judge


@pytest.mark.parametrize("args, needle", [
    (["--sim-workers", "0"], "--sim-workers must be at least 1"),
    (["--compute", "-0.001"], "--compute must be a finite time >= 0"),
    (["--compute-jitter", "pareto:0.5"], "--compute-jitter must be"),
    (["--timing-only", "--target-accuracy", "0.9"], "--timing-only skips the maths"),
    (["--strategy", "sandblaster", "--timing-only", "--target-accuracy", "0.9"], "--timing-only skips the maths"),
    (["--strategy", "tree-ps", "--workers", "4", "--fail", "worker:1@t=1"], "does not kill processes in a tree"),
    (["--fail", "worker:9@t=1"], "--fail worker:9"),
    (["--sim-workers", "3"], "batch_size must be divisible by workers (3)"),
    (["--strategy", "ps", "--consistency", "asp", "--assignment", "dynamic"], "does not model --assignment dynamic"),
    (["--workers", "2", "--kill", "worker:1@step=3"], "--kill (use --fail ROLE:K@t=SECONDS)"),
    # A real --elastic job goes on without a dead worker; the simulated one used to end.
    (["--workers", "4", "--elastic", "--fail", "worker:1@t=0.01"], "does not model --elastic"),
    (["--threads", "4"], "does not model --threads 4"),
    (["--strategy", "ps", "--consistency", "asp", "--slow", "server:0=8"], "does not model --slow server:0=8"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, needle):
    code = main(["simulate", "--steps", "5", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_reproduce_lists_its_recipes_and_refuses_an_unknown_one(capsys):
    from plexus.sim.reproduce import RECIPES
    assert main(["reproduce", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in RECIPES) and len(RECIPES) >= 5
    assert main(["reproduce", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no recipe 'nope'" in err[0] and "lian2017-dpsgd" in err[0]


@pytest.mark.slow
def test_a_quick_recipe_writes_its_table_plot_and_a_measured_verdict(tmp_path, capsys):
    assert main(["reproduce", "lian2017-dpsgd", "--quick", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("lian2017-dpsgd: ") and "(quick: 75 steps, not a reproduction)" in line
    assert any(v in line for v in ("holds", "partly", "does not hold")) and "simulated time allreduce" in line
    folder = tmp_path / "lian2017-dpsgd"
    assert {"table.md", "verdict.txt", "accuracy_time.png"} <= {p.name for p in folder.iterdir()}
    table = (folder / "table.md").read_text()
    assert "| allreduce ring |" in table and "| D-PSGD ring |" in table and "**Verdict:" in table
    for run in ("allreduce_ring", "D-PSGD_ring"):
        summary = json.loads((folder / run / "summary.json").read_text())
        assert summary["simulated"] and summary["workers"] == 16 and summary["steps"] == 75


def test_the_validation_table_counts_errors_and_compares_rankings():
    from plexus.sim.validate import Row, table
    rows = [Row(2, "allreduce ring", 0.010, 0.011, 1.0, 1.1), Row(2, "ps asp", 0.020, 0.030, None, 2.0),
            Row(2, "gossip ring", 0.005, 0.004, 0.5, 0.5)]
    text = table(rows, {"alpha": 2e-3, "beta": 8e-8, "per_sample_P2": 3e-5, "outside_P2": 1.5e-3,
                        "per_round_P2": 1e-3})
    assert "| 2 | allreduce ring (calibration) | 0.0100 | 0.0110 | +10% |" in text
    assert "Time per step within 15%: 1 of 3; time to target within 15%: 2 of 2" in text
    assert "P=2: ranking by time per step the same: real gossip ring < allreduce ring < ps asp" in text
    assert "compute per sample P2 30.0 us; a step's own work P2 1.50 ms; a round's work P2 1.00 ms." in text


def test_validate_refuses_flags_it_would_ignore_and_passes_the_device(capsys, monkeypatch):
    from plexus.sim import validate as validation
    code = main(["simulate", "--validate", "--workers", "16", "--dataset", "mnist1d"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("plexus: error: --workers, --dataset do not apply to --validate") and \
        "--steps, --net, --device, --out, --quiet" in err[0], err[0]
    seen = {}

    def fake(out, **kw):
        seen.update(kw)
        return [validation.Row(2, "allreduce ring", 0.01, 0.01, 1.0, 1.0)], \
            {"alpha": 1e-3, "beta": 1e-8, "per_sample_P2": 1e-5, "outside_P2": 1e-3, "per_round_P2": 1e-3}
    monkeypatch.setattr(validation, "validate", fake)
    assert main(["simulate", "--validate", "--device", "cpu", "--steps", "20", "--net", "none", "--quiet"]) == 0
    out = capsys.readouterr()
    assert seen["device"] == "cpu" and seen["steps"] == 20 and seen["net"] is None, seen
    seen["echo"]("a progress line")  # --quiet: nothing on stderr
    assert "| 2 | allreduce ring (calibration) |" in out.out and capsys.readouterr().err == ""


def test_bench_simulate_prints_its_table(capsys):
    assert main(["bench", "simulate", "--steps", "10", "--rows", "0", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| configuration | workers | steps | real s |")
    assert out[2].startswith("| allreduce ring, real maths | 1,000 | 10 |")
    assert out[3].startswith("| allreduce ring, timing only | 10,000 | 10 |")
    assert "not judged: --steps < 1000" in out[-1]


@pytest.mark.slow
def test_compare_simulate_judges_specs_over_seeds_on_the_simulated_cluster(tmp_path, capsys):
    code = main(["compare", "allreduce", "gossip", "--simulate", "--sim-workers", "16", "--batch-size", "64",
                 "--steps", "40", "--seeds", "2", "--eval-every", "10", "--out", str(tmp_path), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    judged = json.loads(out.strip().splitlines()[-1])
    assert len(judged["configurations"]) == 2 and len(judged["runs"]) == 4
    assert all(run["simulated"] and run["workers"] == 16 for run in judged["runs"])
    assert (tmp_path / "index.html").exists()


def test_compare_refuses_cluster_flags_without_simulate(tmp_path, capsys):
    code = main(["compare", "allreduce", "--sim-workers", "64", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--sim-workers describe a simulated cluster: add --simulate" in err[0]


def test_a_report_labels_simulated_runs(tmp_path):
    from plexus.report import write_report
    _sim(tmp_path, "sim", _cfg(steps=20))
    page = write_report([tmp_path / "sim"], tmp_path / "report").read_text()
    assert "(simulated)" in page


@pytest.mark.slow
def test_validation_calibrates_a_steps_own_work_and_a_rounds(tmp_path, monkeypatch):
    """A step's own work is the local steps' real time per step that the model leaves
    out; a round's work is what the reference's leaves out beyond that. So the reference's
    simulated time per step comes out at its real one, and the other configurations are
    simulated with the same two."""
    from plexus.sim import validate as validation
    monkeypatch.setattr(validation, "CONFIGS", {name: validation.CONFIGS[name] for name in
                                                ("allreduce ring", "local-sgd H=8")})
    rows, calibration = validation.validate(tmp_path, workers=(2,), steps=30, target=0.99, echo=lambda line: None)
    reference = next(r for r in rows if r.config == "allreduce ring")
    assert calibration["outside_P2"] > 0 and calibration["per_round_P2"] > 0, calibration
    assert abs(reference.step_error) < 0.03, reference
    local = json.loads((tmp_path / "real-2-local_steps" / "summary.json").read_text())
    assert local["averagings"] == 1  # its period is the run's steps
    fit = json.loads((tmp_path / "fit-2-local_steps" / "summary.json").read_text())
    assert fit["wall_seconds"] / fit["steps"] < local["wall_seconds"] / local["steps"]
    fit = json.loads((tmp_path / "fit-2-allreduce_ring" / "summary.json").read_text())
    assert fit["wall_seconds"] / fit["steps"] < reference.real_step  # the model alone explains less
