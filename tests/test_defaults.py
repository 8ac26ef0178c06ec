"""Per-strategy defaults (config/defaults.py): values the user did not set come from the
strategy and its consistency model, a value the user set is never overridden, and every
value names its source."""
from __future__ import annotations

import json

import pytest

from plexus.cli import main
from plexus.config import JobConfig
from plexus.config.defaults import is_asynchronous, resolve, risks
from plexus.errors import ConfigError


def build(flat: dict, source: str = "flag") -> JobConfig:
    return JobConfig.from_flat(flat, {k: source for k in flat})


@pytest.mark.parametrize("flat", [
    {"strategy": "ps", "workers": 4},
    {"strategy": "ps", "consistency": "ssp", "staleness": 1, "workers": 4},
    {"strategy": "tree-ps", "workers": 4},
    {"strategy": "tree-ps", "variant": "adv-star", "workers": 4},
])
def test_asynchronous_parameter_servers_default_to_adam_without_momentum(flat):
    cfg = build(flat)
    label = f"default for {flat['strategy']}/{cfg.strategy.consistency}"
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == ("adam", 0.003, 0.0)
    assert cfg.source("optimizer") == label and cfg.source("momentum") == label
    assert cfg.source("lr") == "default for adam" and cfg.source("workers") == "flag"


@pytest.mark.parametrize("flat, n", [
    ({"strategy": "ps", "consistency": "softsync", "softsync": 2, "workers": 4}, 2),
    ({"strategy": "tree-ps", "variant": "adv-star", "consistency": "softsync", "softsync": 2, "workers": 4}, 2),
    ({"strategy": "tree-ps", "variant": "adv-star", "consistency": "softsync", "workers": 4}, 4),
    ({"strategy": "tree-ps", "variant": "adv-star", "consistency": "bsp", "workers": 8}, 8),
])
@pytest.mark.parametrize("optimizer", [None, "adam"])
def test_asynchronous_updates_of_several_gradients_scale_adams_rate_by_their_root(flat, n, optimizer):
    """An update that averages n gradients is one step on a batch n times larger: Adam's
    rate grows as sqrt(n) (Malladi et al. 2022), unless the user set the rate."""
    cfg = build({**flat, **({"optimizer": optimizer} if optimizer else {})})
    label = f"default for {flat['strategy']}/{cfg.strategy.consistency}, {n} gradients per update"
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == ("adam", round(0.003 * n ** 0.5, 4), 0.0)
    assert cfg.source("lr") == label and cfg.source("momentum") == label
    assert cfg.source("optimizer") == ("flag" if optimizer else label)
    assert build({**flat, "lr": 0.001, "optimizer": "adam"}).optim.lr == 0.001
    sgd = build({**flat, "optimizer": "sgd"})
    assert (sgd.optim.lr, sgd.optim.momentum) == (0.2, 0.0)


@pytest.mark.parametrize("flat, lr, label", [
    ({"strategy": "ps", "consistency": "asp", "workers": 16}, 0.003, "default for adam"),  # 16 behind: as before
    ({"strategy": "ps", "consistency": "asp", "workers": 32}, 0.0015, "default for ps/asp over 32 workers"),
    ({"strategy": "ps", "consistency": "ssp", "workers": 64}, 0.00075, "default for ps/ssp over 64 workers"),
    ({"strategy": "tree-ps", "consistency": "asp", "workers": 64}, 0.00075, "default for tree-ps/asp over 64 workers"),
    # 2 gradients an update: 32 updates behind, sqrt(2) x 0.003 x 16 / 32
    ({"strategy": "ps", "consistency": "softsync", "softsync": 2, "workers": 64}, 0.0021,
     "default for ps/softsync over 64 workers"),
    # every worker's gradient in each update: one update behind, only the sqrt(n) rule
    ({"strategy": "tree-ps", "variant": "adv-star", "consistency": "bsp", "workers": 64}, 0.024,
     "default for tree-ps/bsp, 64 gradients per update"),
])
def test_adams_asynchronous_rate_falls_with_how_many_updates_behind_a_gradient_lands(flat, lr, label):
    """A gradient lands about P / n updates after the weights it was taken on; beyond 16,
    Adam's default rate falls in proportion. The user's rate, and --staleness-lr (which
    divides the rate by the measured staleness itself), keep theirs."""
    cfg = build(flat)
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == ("adam", lr, 0.0)
    assert cfg.source("lr") == label
    assert build({**flat, "lr": 0.003, "optimizer": "adam"}).optim.lr == 0.003
    assert " over " not in build({**flat, "staleness_lr": True}).source("lr")


@pytest.mark.parametrize("optimizer, workers, lr", [
    ("sgd", 4, 0.2), ("sgd", 8, 0.1), ("sgd", 16, 0.05), ("sgd", 64, 0.0125),
    ("adagrad", 8, 0.05), ("adagrad", 16, 0.025), ("adagrad", 64, 0.0063),
])
def test_sgds_and_adagrads_asynchronous_rates_fall_beyond_4_and_8_updates_behind(optimizer, workers, lr):
    """SGD's step grows with the gradient, so it bears 4 updates of lateness, Adagrad 8,
    before its default rate falls in proportion; the user's rate and --staleness-lr keep
    theirs."""
    flat = {"strategy": "ps", "consistency": "asp", "workers": workers, "optimizer": optimizer}
    cfg = build(flat)
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == (optimizer, lr, 0.0)
    far = workers > {"sgd": 4, "adagrad": 8}[optimizer]
    assert (cfg.source("lr") == f"default for ps/asp over {workers} workers") == far, cfg.source("lr")
    # The user set no rate: no value says "with lr set" (a later rule sees the rate this one decided).
    assert "with lr set" not in cfg.source("momentum"), cfg.source("momentum")
    assert build({**flat, "lr": 0.2}).optim.lr == 0.2
    assert build({**flat, "staleness_lr": True}).optim.lr == {"sgd": 0.2, "adagrad": 0.05}[optimizer]


def test_adams_rate_set_at_twice_the_many_workers_default_or_more_is_named_as_a_risk():
    cfg = build({"strategy": "ps", "workers": 64, "optimizer": "adam", "lr": 0.003})
    (line,) = risks(cfg.to_flat(), cfg.sources)
    assert "lr 0.003 (flag) for adam under ps/asp over 64 workers" in line and "default here (0.00075)" in line
    for quiet in ({"strategy": "ps", "workers": 64, "optimizer": "adam", "lr": 0.001},  # under twice the default
                  {"strategy": "ps", "workers": 16, "optimizer": "adam", "lr": 0.003},  # 16 updates late: fine
                  {"strategy": "ps", "workers": 64, "optimizer": "adam", "lr": 0.003, "staleness_lr": True}):
        cfg = build(quiet)
        assert risks(cfg.to_flat(), cfg.sources) == [], quiet


@pytest.mark.parametrize("flat, said", [
    ({"optimizer": "sgd", "lr": 0.2, "workers": 16}, "lr 0.2 (flag) for sgd under ps/asp over 16 workers"),
    ({"lr": 0.05, "workers": 16}, "lr 0.05 (flag) for adagrad under ps/asp over 16 workers"),  # Downpour's rate
])
def test_sgds_and_adagrads_rates_at_twice_the_many_workers_default_or_more_are_named_as_risks(flat, said):
    cfg = build({"strategy": "ps", **flat})
    (line,) = risks(cfg.to_flat(), cfg.sources)
    assert said in line and "real workers" in line
    for quiet in ({**flat, "workers": 4}, {**flat, "lr": flat["lr"] / 4}, {**flat, "staleness_lr": True}):
        cfg = build({"strategy": "ps", **quiet})
        assert risks(cfg.to_flat(), cfg.sources) == [], quiet


@pytest.mark.slow
def test_the_asynchronous_default_learns_at_64_simulated_workers(tmp_path, caplog):
    """ps asp over 64 workers (the simulator's real maths, digits, 150 steps): the default,
    Adam at 0.00075, learns; Adam at 0.003, the rate of 16 workers and fewer, is named as a
    risk before the run and lags far behind. Where it ends depends on the compute times
    measured here, which order the pushes: from 10.0 % (stalled) to 28 % in five runs."""
    summaries = []
    for name, extra in (("default", []), ("fixed", ["--optimizer", "adam", "--lr", "0.003"])):
        assert main(["simulate", "--strategy", "ps", "--consistency", "asp", "--sim-workers", "64", "--steps", "150",
                     "--out", str(tmp_path / name), *extra]) == 0
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    default, fixed = summaries
    assert "plexus: warning: lr 0.003 (flag) for adam under ps/asp over 64 workers" in caplog.text
    assert default["final_test_accuracy"] > 0.9 and default["health"] == "ok", default["final_test_accuracy"]
    assert fixed["final_test_accuracy"] < 0.5, fixed["final_test_accuracy"]


@pytest.mark.slow
def test_sgds_asynchronous_default_learns_over_16_workers(tmp_path, caplog):
    """ps asp under --optimizer sgd over 16 workers (digits, 300 steps): the default, 0.05,
    learns in a real run (97.5 and 98.9 % at seeds 0 and 1, measured); 0.2, the rate up to 4
    workers, is named as a risk before the run, and on the simulator sits at chance (as it
    did in real runs at both seeds)."""
    flags = ["--strategy", "ps", "--consistency", "asp", "--workers", "16", "--optimizer", "sgd", "--steps", "300"]
    assert main(["train", *flags, "--quiet", "--out", str(tmp_path / "real")]) == 0
    real = json.loads((tmp_path / "real" / "summary.json").read_text())
    assert real["final_test_accuracy"] > 0.9 and real["health"] == "ok", real["final_test_accuracy"]
    assert main(["simulate", *flags, "--lr", "0.2", "--out", str(tmp_path / "sim")]) == 0
    assert "plexus: warning: lr 0.2 (flag) for sgd under ps/asp over 16 workers" in caplog.text
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert sim["final_test_accuracy"] < 0.5, sim["final_test_accuracy"]


@pytest.mark.parametrize("source", ["flag", "file", "spec", "api"])
def test_a_rate_set_without_an_optimizer_under_asynchrony_keeps_adagrad(source):
    """Rates for the asynchronous default were chosen at Adagrad's scale (0.05), which
    would make Adam overshoot; an optimizer set beside the rate is the user's."""
    cfg = build({"strategy": "ps", "workers": 4, "lr": 0.05}, source)
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == ("adagrad", 0.05, 0.0)
    assert cfg.source("optimizer") == "default for ps/asp with lr set" and cfg.source("lr") == source
    cfg = build({"strategy": "ps", "workers": 4, "lr": 0.001, "optimizer": "adam"}, source)
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == ("adam", 0.001, 0.0)
    # Synchronous configurations keep the global default optimizer whatever the rate.
    assert build({"strategy": "ps", "consistency": "bsp", "workers": 4, "lr": 0.05}, source).optim.optimizer == "sgd"


def test_plain_sgd_chosen_under_asynchrony_gets_no_momentum_and_a_larger_rate():
    cfg = build({"strategy": "ps", "workers": 4, "optimizer": "sgd"})
    assert (cfg.optim.lr, cfg.optim.momentum) == (0.2, 0.0)
    assert cfg.source("lr") == "default for ps/asp"


@pytest.mark.parametrize("optimizer, lr", [("adam", 0.003), ("adagrad", 0.05), ("sgd", 0.1)])
def test_each_optimizer_has_its_own_learning_rate(optimizer, lr):
    cfg = build({"strategy": "allreduce", "optimizer": optimizer})
    assert cfg.optim.lr == lr and cfg.optim.momentum == 0.9


@pytest.mark.parametrize("flat", [
    {"strategy": "allreduce", "workers": 4},
    {"strategy": "ps", "consistency": "bsp", "workers": 4},
    {"strategy": "ps", "consistency": "softsync", "workers": 4},  # softsync over every worker
    {"strategy": "ps", "workers": 1},
    {"strategy": "tree-ps", "consistency": "bsp", "workers": 4},
    {"strategy": "gossip", "async_gossip": True, "workers": 4},
])
def test_synchronous_configurations_keep_the_global_defaults(flat):
    cfg = build(flat)
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum) == ("sgd", 0.1, 0.9)
    assert cfg.source("momentum") == "default"
    assert not is_asynchronous(cfg.to_flat())


@pytest.mark.parametrize("schedule, microbatches", [("pipedream", 1), ("pipedream-2bw", 4)])
def test_asynchronous_pipelines_keep_momentum_unless_their_delay_goes_uncompensated(schedule, microbatches):
    """Delay compensation (the default) scales each stage's rate for its delay, so momentum
    stays 0.9; PipeDream's plain rule (--no-delay-compensation) takes 0.5, and 0.9 set by
    the user there is named as a risk, but not under compensation."""
    flat = {"stages": 3, "schedule": schedule, "microbatches": microbatches}
    cfg = build(flat)
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.source("momentum")) == (0.1, 0.9, "default")
    plain = build({**flat, "delay_compensation": False})
    assert plain.optim.momentum == 0.5
    assert plain.source("momentum") == f"default for {schedule} --no-delay-compensation"
    risky = build({**flat, "delay_compensation": False, "momentum": 0.9})
    (line,) = risks(risky.to_flat(), risky.sources)
    assert f"momentum 0.9 (flag) under --schedule {schedule} --no-delay-compensation" in line
    chosen = build({**flat, "momentum": 0.9})
    assert risks(chosen.to_flat(), chosen.sources) == []


def test_ssp_gets_a_bound_and_then_counts_as_asynchronous():
    cfg = build({"strategy": "ps", "consistency": "ssp", "workers": 4})
    assert cfg.strategy.staleness == 2 and cfg.source("staleness") == "default for ps/ssp"
    assert cfg.optim.momentum == 0.0  # ssp with a bound above 0 is asynchronous
    # A bound of 0 set by the user is bsp, and keeps the synchronous momentum.
    assert build({"strategy": "ps", "consistency": "ssp", "staleness": 0, "workers": 4}).optim.momentum == 0.9


@pytest.mark.parametrize("source", ["flag", "file", "spec", "api"])
def test_a_value_the_user_set_is_never_overridden_and_a_risky_one_is_named(source):
    cfg = build({"strategy": "ps", "workers": 4, "optimizer": "sgd", "momentum": 0.9}, source)
    assert cfg.optim.momentum == 0.9 and cfg.source("momentum") == source
    (line,) = risks(cfg.to_flat(), cfg.sources)
    assert f"momentum 0.9 ({source}) under ps/asp" in line and "Mitliagkas" in line
    cfg = build({"strategy": "ps", "workers": 4, "momentum": 0.9}, source)
    (line,) = risks(cfg.to_flat(), cfg.sources)
    assert "has no effect with optimizer adam (default for ps/asp)" in line
    assert risks(build({"strategy": "ps", "workers": 4}).to_flat(), build({"strategy": "ps", "workers": 4}).sources) \
        == []


def test_replace_resolves_the_defaults_again_but_keeps_the_users_values():
    cfg = build({"strategy": "ps", "workers": 4, "lr": 0.05})
    sync = cfg.replace(strategy="allreduce")
    assert sync.optim.momentum == 0.9 and sync.optim.lr == 0.05 and sync.source("lr") == "flag"
    assert sync.source("strategy") == "api"


def test_resolve_names_only_what_the_user_left_unset():
    values, sources = resolve({"strategy": "ps", "consistency": "asp", "workers": 4, "momentum": 0.5,
                               "optimizer": "sgd", "lr": 0.1})
    assert values == {} and sources == {}


def test_sources_survive_config_json():
    cfg = build({"strategy": "ps", "workers": 4})
    again = JobConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.sources == cfg.sources
    assert again.settings()["optimizer"] == {"value": "adam", "source": "default for ps/asp"}


def test_a_value_of_the_wrong_type_names_its_key_and_source():
    with pytest.raises(ConfigError, match=r"workers must be int, got 'two' \(str, from file\)"):
        build({"workers": "two"}, "file")
    with pytest.raises(ConfigError, match="lr must be float"):
        build({"lr": "fast"})


def test_print_config_shows_effective_values_and_sources(capsys, tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('lr = 0.05\nworkers = 4\n')
    assert main(["train", "--strategy", "ps", "--config", str(toml), "--print-config"]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
             if not line.startswith("[")}
    assert lines["optimizer"] == ['"adagrad"', "default", "for", "ps/asp", "with", "lr", "set"]
    assert lines["lr"] == ["0.05", "file"] and lines["strategy"] == ['"ps"', "flag"]
    assert lines["weight_decay"] == ["0.0", "default"]
    assert not list(tmp_path.glob("runs"))  # nothing trained, nothing written
