"""``plexus reproduce NAME``: a seed paper's experiment, simulated at a scale this machine
cannot run, with a table, a plot and a one-line verdict.

Each recipe runs its configurations through ``plexus.sim.simulate`` (real maths, simulated
time) into ``OUT/NAME/<config>/`` run directories, writes ``table.md`` (one row per
configuration, the measured numbers the verdict uses), ``accuracy_time.png`` (test accuracy
against simulated seconds) and ``verdict.txt``, and prints the verdict: ``holds``, ``partly``
(some of the paper's claims hold) or ``does not hold``, with the numbers. A verdict is
computed from the measured numbers by the recipe's stated criterion, never written by hand.

Every recipe uses the digits MLP (a CPU-sized stand-in for the papers' models; mnist1d
where the paper's effect needs a harder task), the job's own defaults except the flags the
paper's experiment fixes, and one fixed compute time, ``COMPUTE`` (0.2 ms per step plus
5 us per sample, about what this machine measures for these models), so that a recipe
gives the same numbers and verdict on every machine. ``--quick`` runs each configuration
for a quarter of the steps (for tests: the verdict is then marked ``quick``, not a
reproduction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from plexus.errors import ConfigError
from plexus.sim.cluster import ComputeModel

__all__ = ["RECIPES", "Recipe", "run_recipe", "COMPUTE"]


# Every recipe's compute time (module docstring).
COMPUTE = ComputeModel(per_sample=5e-6, overhead=2e-4)


@dataclass(frozen=True)
class Config:
    label: str
    flags: dict[str, Any]
    sim: dict[str, Any]


@dataclass(frozen=True)
class Recipe:
    name: str
    paper: str
    claim: str
    configs: Callable[[], list[Config]]
    # (summaries by label, eval curves by label) -> (verdict, why with numbers)
    judge: Callable[[dict[str, dict], dict[str, list[dict]]], tuple[str, str]]
    steps: int


def _common(**flags: Any) -> dict[str, Any]:
    return {"dataset": "digits", "model": "mlp", "eval_every": 10, **flags}


# --- zhang2016-softsync ---------------------------------------------------------------------
# Zhang, Gupta, Lian and Liu 2016, "Staleness-aware async-SGD": with lambda learners and
# n-softsync (the server updates every lambda / n gradients) the mean staleness is about n;
# with a fixed learning rate alpha0 a large n converges worse than synchronous SGD, while
# alpha0 / <sigma> (our --staleness-lr) brings it back to the synchronous accuracy.
_LEARNERS = 16


def _zhang_configs() -> list[Config]:
    # Plain SGD for every configuration, as in the paper: a rate set without an optimizer
    # selects Adagrad under asynchrony and SGD under synchrony (config/defaults.py), which
    # would compare two optimizers, not two gates.
    def ps(**kw: Any) -> dict[str, Any]:
        return _common(strategy="ps", consistency="softsync", workers=_LEARNERS, batch_size=4 * _LEARNERS,
                       optimizer="sgd", momentum=0.0, lr=0.1, **kw)
    return [
        Config("sync (n=1)", ps(softsync=_LEARNERS), {}),
        Config("n=4, fixed lr", ps(softsync=_LEARNERS // 4), {}),
        Config(f"n={_LEARNERS}, fixed lr", ps(softsync=1), {}),
        Config(f"n={_LEARNERS}, lr/<sigma>", ps(softsync=1, staleness_lr=True), {}),
    ]


def _zhang_judge(s: dict[str, dict], curves: dict[str, list[dict]]) -> tuple[str, str]:
    n = _LEARNERS
    sync, fixed, scaled = s["sync (n=1)"], s[f"n={n}, fixed lr"], s[f"n={n}, lr/<sigma>"]
    sigma4, sigma_n = s["n=4, fixed lr"]["staleness_mean"], fixed["staleness_mean"]
    sigma_ok = 0.5 * 4 <= sigma4 <= 1.5 * 4 and 0.5 * n <= sigma_n <= 1.5 * n
    a_sync, a_fixed, a_scaled = (x["final_test_accuracy"] for x in (sync, fixed, scaled))
    scaled_ok = a_scaled >= a_sync - 0.02
    fixed_worse = a_fixed < a_scaled - 0.01
    held = [sigma_ok, scaled_ok, fixed_worse]
    why = (f"<sigma> = {sigma4:.1f} at n=4 and {sigma_n:.1f} at n={n} ({'~n' if sigma_ok else 'not ~n'}); "
           f"accuracy sync {a_sync:.3f}, n={n} fixed lr {a_fixed:.3f}, n={n} lr/<sigma> {a_scaled:.3f}")
    return _verdict(held), why


# --- dean2012-downpour ----------------------------------------------------------------------
# Dean et al. 2012, Figure 4: Downpour SGD with Adagrad reaches a given accuracy first;
# Downpour with a fixed learning rate lags it; one replica (plain SGD) is slowest.
_DOWNPOUR_TARGET = 0.9


def _dean_configs() -> list[Config]:
    def ps(**kw: Any) -> dict[str, Any]:
        return _common(strategy="ps", consistency="asp", workers=32, servers=4, batch_size=128,
                       target_accuracy=_DOWNPOUR_TARGET, **kw)
    # One learning rate for all three (0.05, the ps asp default, diverges at 32 replicas
    # with a staleness of about 31 under Adagrad and fixed lr alike: measured).
    return [
        Config("Downpour + Adagrad", ps(optimizer="adagrad", lr=0.01), {}),
        Config("Downpour, fixed lr", ps(optimizer="sgd", momentum=0.0, lr=0.01), {}),
        Config("one replica, SGD", _common(strategy="allreduce", workers=1, batch_size=4, lr=0.01, momentum=0.0,
                                           target_accuracy=_DOWNPOUR_TARGET), {}),
    ]


def _dean_judge(s: dict[str, dict], curves: dict[str, list[dict]]) -> tuple[str, str]:
    t = {k: v["time_to_target_seconds"] for k, v in s.items()}
    inf = {k: (math.inf if v is None else v) for k, v in t.items()}
    adagrad_first = inf["Downpour + Adagrad"] < min(inf["Downpour, fixed lr"], inf["one replica, SGD"])
    fixed_before_one = inf["Downpour, fixed lr"] < inf["one replica, SGD"]
    why = "time to {:.0%}: ".format(_DOWNPOUR_TARGET) + ", ".join(
        f"{k} {'not reached' if v is None else f'{v:.3f} s'}" for k, v in t.items())
    return _verdict([adagrad_first, fixed_before_one]), why


# --- lian2017-dpsgd -------------------------------------------------------------------------
# Lian et al. 2017: D-PSGD on a ring reaches the accuracy of centralised (all-reduce) SGD per
# epoch, and is faster in time on a network with high latency and low bandwidth.
_SLOW_NET = "bandwidth=100mbit,latency=5ms"


def _lian_configs() -> list[Config]:
    common = dict(workers=16, batch_size=128, net=_SLOW_NET)
    return [
        Config("allreduce ring", _common(strategy="allreduce", algorithm="ring", **common), {}),
        Config("D-PSGD ring", _common(strategy="gossip", topology="ring", **common), {}),
    ]


def _lian_judge(s: dict[str, dict], curves: dict[str, list[dict]]) -> tuple[str, str]:
    ar, dp = s["allreduce ring"], s["D-PSGD ring"]
    same = dp["final_test_accuracy"] >= ar["final_test_accuracy"] - 0.02
    faster = dp["wall_seconds"] < ar["wall_seconds"]
    why = (f"same steps: accuracy allreduce {ar['final_test_accuracy']:.3f}, D-PSGD {dp['final_test_accuracy']:.3f}; "
           f"simulated time allreduce {ar['wall_seconds']:.2f} s, D-PSGD {dp['wall_seconds']:.2f} s on {_SLOW_NET}")
    return _verdict([same, faster]), why


# --- li2014-bounded-delay -------------------------------------------------------------------
# Li et al. 2014 (OSDI), Figure 13: as the bounded delay tau grows, workers idle less; a
# moderate tau converges about as fast per update as tau = 0, so it wins in time.
_TAUS = (0, 1, 2, 4, 8)


def _li_configs() -> list[Config]:
    # Plain SGD with one step size for every tau, as the paper compares them: 0.01, the rate
    # at which 16 asynchronous workers stay stable (the ps ssp default, Adagrad at 0.05,
    # diverges at this scale: measured).
    return [Config(f"tau={tau}", _common(strategy="ps", consistency="ssp", staleness=tau, workers=16, batch_size=64,
                                         optimizer="sgd", lr=0.01, momentum=0.0),
                   {"compute_jitter": "pareto:2.5"}) for tau in _TAUS]


def _li_judge(s: dict[str, dict], curves: dict[str, list[dict]]) -> tuple[str, str]:
    idle = [s[f"tau={tau}"]["wait_seconds_mean"] / max(s[f"tau={tau}"]["wall_seconds"], 1e-12) for tau in _TAUS]
    acc = [s[f"tau={tau}"]["final_test_accuracy"] for tau in _TAUS]
    wall = [s[f"tau={tau}"]["wall_seconds"] for tau in _TAUS]
    less_idle = all(b <= a + 0.01 for a, b in zip(idle, idle[1:])) and idle[-1] < idle[0]
    moderate = max(range(1, len(_TAUS) - 1), key=lambda i: acc[i])
    moderate_ok = acc[moderate] >= acc[0] - 0.02 and wall[moderate] < wall[0]
    why = ("idle fraction " + ", ".join(f"tau={t} {i:.2f}" for t, i in zip(_TAUS, idle)) + "; accuracy " +
           ", ".join(f"{a:.3f}" for a in acc) + "; simulated s " + ", ".join(f"{w:.2f}" for w in wall))
    return _verdict([less_idle, moderate_ok]), why


# --- wang2019-adacomm -----------------------------------------------------------------------
# Wang and Joshi 2019: local SGD with an adaptive period (AdaComm) reaches a lower training
# loss than any fixed period at the same runtime on a slow network.
_PERIODS = (1, 4, 16)
_WANG_DATA = "mnist1d"  # harder than digits: a long period's error floor shows


def _wang_configs() -> list[Config]:
    common = dict(strategy="local-sgd", workers=16, batch_size=128, net="bandwidth=100mbit,latency=2ms",
                  dataset=_WANG_DATA)
    return ([Config(f"H={h}", _common(period=h, **common), {}) for h in _PERIODS]
            + [Config("AdaComm (H0=16)", _common(period=16, adaptive=True, **common), {})])


def _wang_judge(s: dict[str, dict], curves: dict[str, list[dict]]) -> tuple[str, str]:
    # The accuracy each configuration has reached by the time the fastest one finished.
    horizon = min(v["wall_seconds"] for v in s.values())
    at = {k: max((e["test_accuracy"] for e in c if e["time"] <= horizon), default=0.0) for k, c in curves.items()}
    ada = at["AdaComm (H0=16)"]
    best_fixed = max(at[f"H={h}"] for h in _PERIODS)
    why = f"test accuracy at {horizon:.2f} simulated s: " + ", ".join(f"{k} {v:.3f}" for k, v in at.items())
    return _verdict([ada >= best_fixed - 0.005]), why


# --- chen2016-backup-workers ---------------------------------------------------------------
# Chen, Pan, Monga, Bengio and Jozefowicz 2016, "Revisiting distributed synchronous SGD":
# with stragglers, synchronous SGD that waits for the first P - b of P workers (b backup
# workers) reaches a given accuracy sooner than synchronous SGD that waits for all of them,
# and sooner than asynchronous SGD.
_CHEN_TARGET = 0.93


def _chen_configs() -> list[Config]:
    # Two persistent stragglers (4x slower), a spread of compute times (lognormal, CV 0.3)
    # and a fast network (100 Gbit/s, 10 us), so that compute, not the server's link, sets
    # the pace, as for the paper's Inception model.
    # One optimizer for all three, as the paper trains each with RMSProp: Adam (at its
    # default rate, 0.003), whose second moment is RMSProp's.
    def ps(**kw: Any) -> dict[str, Any]:
        return _common(strategy="ps", workers=16, batch_size=64, target_accuracy=_CHEN_TARGET, optimizer="adam",
                       slow="worker:3=4,worker:11=4", net="bandwidth=100gbit,latency=10us", **kw)
    stragglers = {"compute_jitter": "lognormal:0.3"}
    return [
        Config("sync", ps(consistency="bsp"), stragglers),
        Config("sync, 2 backup workers", ps(consistency="bsp", backup_workers=2), stragglers),
        Config("async", ps(consistency="asp"), stragglers),
    ]


def _chen_judge(s: dict[str, dict], curves: dict[str, list[dict]]) -> tuple[str, str]:
    t = {k: (math.inf if v["time_to_target_seconds"] is None else v["time_to_target_seconds"]) for k, v in s.items()}
    backup = t["sync, 2 backup workers"]
    why = "time to {:.0%} with two 4x stragglers of 16: ".format(_CHEN_TARGET) + ", ".join(
        f"{k} {'not reached' if math.isinf(v) else f'{v:.3f} s'}" for k, v in t.items())
    return _verdict([backup < t["sync"], backup < t["async"]]), why


def _verdict(held: list[bool]) -> str:
    if all(held):
        return "holds"
    return "partly" if any(held) else "does not hold"


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("zhang2016-softsync", "Zhang et al. 2016, Staleness-aware async-SGD",
           "<sigma> ~ n under n-softsync; fixed lr at large n converges worse; lr/<sigma> matches sync",
           _zhang_configs, _zhang_judge, 400),
    Recipe("dean2012-downpour", "Dean et al. 2012, Large scale distributed deep networks",
           "Downpour + Adagrad reaches the target first; fixed-lr Downpour lags; one replica is slowest",
           _dean_configs, _dean_judge, 2000),
    Recipe("lian2017-dpsgd", "Lian et al. 2017, Can decentralized algorithms outperform centralized ones?",
           "D-PSGD matches all-reduce accuracy per epoch and wins in time on a slow network",
           _lian_configs, _lian_judge, 300),
    Recipe("li2014-bounded-delay", "Li et al. 2014, Scaling distributed ML with the parameter server",
           "idle time falls as the delay bound tau grows; a moderate tau converges as well and sooner",
           _li_configs, _li_judge, 300),
    Recipe("chen2016-backup-workers", "Chen et al. 2016, Revisiting distributed synchronous SGD",
           "with stragglers, sync SGD with backup workers reaches the target before plain sync and async",
           _chen_configs, _chen_judge, 1000),
    Recipe("wang2019-adacomm", "Wang and Joshi 2019, Adaptive communication strategies (AdaComm)",
           "an adaptive local-SGD period beats every fixed period in accuracy at the same runtime",
           _wang_configs, _wang_judge, 400),
]}


def run_recipe(name: str, out: Path, quick: bool = False, seed: int = 0) -> tuple[str, str]:
    """Run recipe ``name`` into ``out / name``; returns (verdict, why)."""
    from plexus.config import JobConfig
    from plexus.sim.cluster import SimSpec, network_of
    from plexus.sim.run import simulate
    from plexus.train.job import prepare_run_dir
    from plexus.train.metrics import read_events
    if name not in RECIPES:
        raise ConfigError(f"no recipe {name!r}: choose one of {', '.join(RECIPES)} (plexus reproduce --list)")
    recipe = RECIPES[name]
    root = out / name
    root.mkdir(parents=True, exist_ok=True)
    steps = max(20, recipe.steps // 4) if quick else recipe.steps
    summaries: dict[str, dict] = {}
    curves: dict[str, list[dict]] = {}
    for config in recipe.configs():
        folder = root / "".join(c if c.isalnum() or c in "-=." else "_" for c in config.label)
        flat = {**config.flags, "steps": steps, "seed": seed, "quiet": True, "out": str(folder), "overwrite": True}
        cfg = JobConfig.from_flat(flat, {k: "flag" for k in flat})
        run_dir = prepare_run_dir(cfg)
        compute = replace(COMPUTE, jitter=config.sim.get("compute_jitter", COMPUTE.jitter))
        spec = SimSpec(workers=cfg.cluster.workers, servers=cfg.cluster.servers, compute=compute,
                       network=network_of(cfg.cluster.net))
        summary = simulate(cfg, spec, run_dir)
        summaries[config.label] = summary
        curves[config.label] = read_events(run_dir, "eval")
    verdict, why = recipe.judge(summaries, curves)
    if quick:
        verdict = f"{verdict} (quick: {steps} steps, not a reproduction)"
    _write(root, recipe, summaries, curves, verdict, why, steps)
    return verdict, why


def _write(root: Path, recipe: Recipe, summaries: dict[str, dict], curves: dict[str, list[dict]], verdict: str,
           why: str, steps: int) -> None:
    rows = ["| configuration | final test accuracy | simulated s | time to target s | staleness mean | "
            "idle fraction |", "|---|---|---|---|---|---|"]
    for label, s in summaries.items():
        acc, ttt = s["final_test_accuracy"], s["time_to_target_seconds"]
        idle = s["wait_seconds_mean"] / s["wall_seconds"] if s["wall_seconds"] else 0.0
        rows.append(f"| {label} | {'-' if acc is None else f'{acc:.3f}'} | {s['wall_seconds']:.3f} | "
                    f"{'-' if ttt is None else f'{ttt:.3f}'} | {s['staleness_mean']:.2f} | {idle:.2f} |")
    text = (f"# {recipe.name}\n\n{recipe.paper}: {recipe.claim}.\n\n"
            f"`plexus reproduce {recipe.name}`, {steps} steps per configuration, simulated workers "
            f"with a fixed compute time of 0.2 ms per step plus 5 us per sample.\n\n" + "\n".join(rows)
            + f"\n\n**Verdict: {verdict}.** {why}\n")
    (root / "table.md").write_text(text)
    (root / "verdict.txt").write_text(f"{recipe.name}: {verdict}: {why}\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, curve in curves.items():
        ax.plot([e["time"] for e in curve], [e["test_accuracy"] for e in curve], label=label)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("test accuracy")
    ax.set_title(recipe.name)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "accuracy_time.png", dpi=100)
    plt.close(fig)
