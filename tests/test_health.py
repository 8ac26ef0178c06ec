"""Run health (train/health.py): diverging and stalled runs are detected while they
happen, named in the summary, and explained with the flag to change."""
from __future__ import annotations

import json
import math

import pytest

from plexus.config import JobConfig
from plexus.train.health import Health, hint, worst
from plexus.train.metrics import read_events

from test_cli import plexus_cli


def feed(health: Health, losses: list[float]) -> list[tuple[int, str]]:
    return [(step, state) for step, loss in enumerate(losses, 1) if (state := health.observe(step, loss))]


def test_a_falling_loss_is_ok():
    losses = [2.3 * math.exp(-step / 40) + 0.05 for step in range(300)]
    assert feed(Health(total_steps=300, classes=10), losses) == []


def test_a_loss_at_chance_is_stalled_after_the_set_fraction():
    health = Health(total_steps=300, classes=10)
    changes = feed(health, [math.log(10) + 0.01 * (-1) ** step for step in range(300)])
    assert changes == [(99, "stalled")] and health.step == 99  # 30 % of 300 steps, then 10 steps in a row


def test_a_slow_start_is_not_a_stall_once_the_loss_falls():
    health = Health(total_steps=100, classes=10)
    changes = feed(health, [2.3] * 40 + [1.0] * 20)
    assert changes == [(39, "stalled"), (41, "ok")] and health.state == "ok"


def test_a_plateau_shorter_than_the_window_is_not_announced():
    # Judged from step 20, no better than chance at steps 20 to 25, falling from 26 on: a
    # short run's early plateau, which used to warn at step 20 and recover at 26.
    assert feed(Health(total_steps=60, classes=10), [2.3] * 25 + [1.0] * 35) == []


def test_a_loss_no_better_than_its_start_is_stalled_even_below_chance():
    # Regression, or a model that starts below ln(classes): only "no better than at start" applies.
    changes = feed(Health(total_steps=100, classes=None), [0.8] * 50)
    assert changes == [(39, "stalled")]


def test_a_rising_loss_is_diverging_and_stays_so():
    health = Health(total_steps=100, classes=10)
    changes = feed(health, [2.3, 2.0, 5.0, 30.0, 40.0, 60.0, 2.0, 500.0])
    assert changes == [(6, "diverging")]  # above 23 at three steps in a row


def test_a_spike_the_loss_leaves_at_once_is_not_divergence():
    # Adagrad at 0.05 under asp over 8 workers (measured, worker 1 of a run that ended at
    # 94 %): its second loss was 18x its first, its third back near chance.
    losses = [2.3, 42.4, 4.7, 3.1, 2.5, 2.3] + [2.3 * math.exp(-step / 20) + 0.05 for step in range(94)]
    assert feed(Health(total_steps=100, classes=10), losses) == []
    assert feed(Health(total_steps=100, classes=10), [2.3, 42.4, 30.0, 4.7] + losses[4:]) == []


def test_short_runs_are_not_judged_before_two_windows():
    assert feed(Health(total_steps=10, classes=10), [math.log(10)] * 10) == []


def test_the_worst_state_wins_with_its_earliest_step():
    assert worst([("ok", None), ("stalled", 50), ("diverging", 70), ("diverging", 40)]) == ("diverging", 40)
    assert worst([]) == ("ok", None)


def test_hints_name_the_cause_from_the_effective_configuration():
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 4, "momentum": 0.99, "lr": 1.0, "optimizer": "sgd"},
                              {"momentum": "flag"})
    assert "pass --momentum 0" in hint("diverging", cfg.settings(), True)
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 4, "lr": 3.0, "optimizer": "sgd"}, {"lr": "flag"})
    text = hint("stalled", cfg.settings(), True, staleness_mean=3.2)
    assert "learning rate 3 (flag)" in text and "mean 3.2" in text and "--staleness-lr" in text
    assert "--optimizer" not in text  # the user chose sgd
    assert "lower --lr (the default here is 0.2)" in text
    # The default Adam: a rate set alone would select Adagrad, so the hint names both flags.
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 4})
    assert "lower --lr with --optimizer adam or" in hint("stalled", cfg.settings(), True)
    cfg = JobConfig.from_flat({"strategy": "ps", "workers": 4, "lr": 0.5}, {"lr": "flag"})
    assert "lower --lr (the default here is 0.05) or" in hint("stalled", cfg.settings(), True)  # Adagrad kept
    cfg = JobConfig.from_flat({"strategy": "allreduce", "lr": 20.0})
    assert "lower --lr" in hint("diverging", cfg.settings(), False)


@pytest.mark.parametrize("flat, said", [
    ({"optimizer": "sgd", "lr": 0.2, "workers": 16}, "lower --lr (the default here is 0.05)"),
    ({"lr": 0.05, "workers": 32}, "lower --lr (the default here is 0.0125)"),  # Adagrad's, which a rate keeps
])
def test_a_stalled_asynchronous_run_at_the_users_rate_is_told_the_default_rate(flat, said):
    """Over many workers the default rate falls with the workers (config/defaults.py); the
    hint names it, for the optimizer the run used."""
    cfg = JobConfig.from_flat({"strategy": "ps", **flat}, {key: "flag" for key in flat})
    assert said in hint("stalled", cfg.settings(), True, staleness_mean=14.0)
    default = JobConfig.from_flat({"strategy": "ps", "workers": 16}, {"workers": "flag"})
    assert "the default here" not in hint("stalled", default.settings(), True)  # at the default already


@pytest.mark.slow
def test_a_bad_asynchronous_configuration_ends_unhealthy_with_a_hint(tmp_path):
    """Issue 12's deliberately bad configuration: explicit momentum 0.99 and lr 1 under asp."""
    result = plexus_cli("train", "--strategy", "ps", "--consistency", "asp", "--servers", "2", "--workers", "4",
                        "--optimizer", "sgd", "--momentum", "0.99", "--lr", "1", "--steps", "100", "--out",
                        str(tmp_path), "--json")
    # The loss may stay finite (the job completes) or become NaN on every worker (the job
    # fails, status 1): either way summary.json says why, and one closing line gives the hint.
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == ("completed" if result.returncode == 0 else "failed"), result.stderr
    assert summary["health"] in ("stalled", "diverging") and summary["health_step"] >= 1
    assert "pass --momentum 0" in summary["health_hint"]
    closing = [line for line in result.stderr.splitlines() if "warning: training" in line
               and not line.startswith("[")]
    assert len(closing) == 1 and "--momentum 0" in closing[0], result.stderr
    assert "plexus: warning: momentum 0.99 (flag) under ps/asp" in result.stderr  # said before training
    assert read_events(tmp_path, "health")


@pytest.mark.slow
def test_a_run_that_does_not_learn_is_stalled(tmp_path, with_report):
    result = plexus_cli("train", "--workers", "2", "--steps", "60", "--lr", "1e-6", "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["health"] == "stalled" and summary["health_step"] == 29  # judged from 20, 10 in a row
    assert "warning: training stalled" in result.stderr
    (event, *_) = read_events(tmp_path, "health")
    assert event["state"] == "stalled"
    html = (tmp_path / "index.html").read_text()
    assert 'class="unhealthy"' in html


@pytest.mark.slow
def test_a_healthy_run_says_ok(tmp_path):
    result = plexus_cli("train", "--strategy", "ps", "--workers", "2", "--steps", "100", "--out", str(tmp_path),
                        "--json", "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["health"] == "ok" and summary["health_hint"] is None
    assert summary["settings"]["optimizer"] == {"value": "adam", "source": "default for ps/asp"}
    assert "warning" not in result.stderr
