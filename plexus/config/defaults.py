"""Effective defaults: the value of every option the user did not set, chosen from the
strategy and its consistency model, with the source of each value.

One global default cannot serve every strategy. Heavy-ball momentum 0.9 is right for
synchronous SGD, but a parameter server that applies stale gradients with it sits at
chance: asynchrony already acts as momentum (Mitliagkas et al. 2016, "Asynchrony begets
momentum"), about 1 - 1/P of it with P workers, and the two together overshoot. So the
table below gives asynchronous configurations their own values. The values come from a
sweep over digits and mnist1d (``benchmarks/defaults_sweep.py``; README, "Defaults";
docs/results/defaults-sweep.md). The staleness-dependent rate alpha0 / <sigma> (Zhang et
al. 2016, ``--staleness-lr``) is not a default: at 4 workers, where the staleness is about
3, it lagged on mnist1d (0.69-0.86x allreduce) where Adagrad did not.

Rules:
- a value the user set (flag, TOML file, compare spec, Python dict) is never overridden;
  where it is risky for the configuration, ``risks`` says why in one line;
- the first rule of ``TABLE`` that matches a configuration and names a key decides it;
  keys no rule names keep the dataclass default (source ``default``);
- every effective value carries its source: ``flag``, ``file``, ``spec``, ``api``,
  ``default`` or ``default for <rule>`` (``JobConfig.sources``, config.json, summary.json,
  ``plexus train --print-config``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Rule", "TABLE", "USER_SOURCES", "gradients_per_update", "is_asynchronous", "resolve", "risks"]

# Adam's rate for one worker gradient per update (the sweep's best; scaled by sqrt(n) for n).
_ADAM_LR = 0.003
# Each optimizer's asynchronous rate (Adam's for one gradient per update), and how many
# updates late a gradient may land before that rate falls in proportion (the rules "over P
# workers"): under asynchrony a gradient is applied about P / n updates after the weights it
# was taken on (P workers, n gradients per update). Adam's step is bounded by its rate, and
# it bears 16 (simulated ps asp); SGD's grows with the gradient and bears 4, Adagrad's 8 (real
# ps asp at 8, 16 and 32 workers; docs/results/defaults-sweep.md).
_ASYNC_LR = {"adam": _ADAM_LR, "sgd": 0.2, "adagrad": 0.05}
_STALE_UPDATES = {"adam": 16, "sgd": 4, "adagrad": 8}
# What each optimizer did at twice its rate over many workers or more (the risk line).
_TOO_FAST = {
    "adam": "ps asp at 32 and 64 simulated workers lagged or sat at chance",
    "sgd": "ps asp over 16 real workers ended at 10-35 % on digits, and over 32 at chance",
    "adagrad": "ps asp over 16 and 32 real workers diverged or lagged on digits (86-96 %, against 97-99 % at "
               "the default)",
}

# Sources that mean the user chose the value.
USER_SOURCES = ("flag", "file", "spec", "api")


def _get(flat: Mapping[str, Any], key: str) -> Any:
    from plexus.config import field_default
    return flat[key] if key in flat else field_default(key)


def is_asynchronous(flat: Mapping[str, Any]) -> bool:
    """Whether a ps or tree-ps configuration applies gradients computed on older weights
    than the ones they update: asp and ssp, n-softsync with fewer pushes per update than
    workers (Gupta et al. 2016), and tree-ps adv-star under any gate. bsp, and softsync over
    every worker, are synchronous."""
    strategy = _get(flat, "strategy")
    if strategy not in ("ps", "tree-ps") or _get(flat, "workers") == 1:
        return False
    if strategy == "tree-ps" and _get(flat, "variant") == "adv-star":
        return True  # learners read the weights on their own clock whatever the gate (Rudra-adv*)
    return gradients_per_update(flat) < _get(flat, "workers")  # an update waits for fewer than all


def gradients_per_update(flat: Mapping[str, Any]) -> int:
    """Worker gradients one update of a ps or tree-ps configuration averages: every
    worker's under bsp (and ssp with bound 0, which is bsp), n under n-softsync, one under
    asp and ssp (and for any other strategy)."""
    strategy, consistency, workers = _get(flat, "strategy"), _get(flat, "consistency"), _get(flat, "workers")
    if strategy not in ("ps", "tree-ps"):
        return 1
    if consistency == "bsp" or (consistency == "ssp" and _get(flat, "staleness") == 0):
        return workers
    if consistency == "softsync" or (strategy == "tree-ps" and _get(flat, "softsync")):
        return min(_get(flat, "softsync") or workers, workers)
    return 1


def _updates_behind(flat: Mapping[str, Any]) -> float:
    """About how many updates an asynchronous gradient is old when applied: P / n (the
    measured mean staleness of ps asp was 6.8, 14.8, 30.8 and 62.7 at 8, 16, 32 and 64
    simulated workers)."""
    return _get(flat, "workers") / gradients_per_update(flat)


def _async_optimizer(flat: Mapping[str, Any]) -> str:
    """The optimizer of an asynchronous configuration: the one set, else Adam (the table's
    default there where no rate is set)."""
    return flat.get("optimizer", "adam")


def _far_behind(flat: Mapping[str, Any]) -> bool:
    """An asynchronous configuration without --staleness-lr whose gradients land more
    updates late than its optimizer bears (16 for Adam, 4 for SGD, 8 for Adagrad): where
    that optimizer's default rate falls."""
    return (is_asynchronous(flat) and not _get(flat, "staleness_lr")
            and _updates_behind(flat) > _STALE_UPDATES.get(_async_optimizer(flat), math.inf))


def _async_rate(flat: Mapping[str, Any]) -> float:
    """The optimizer's asynchronous default: 0.003 sqrt(n) for Adam, 0.2 for SGD, 0.05 for
    Adagrad, times its bearable lateness over P / n where a gradient lands later than that."""
    name = _async_optimizer(flat)
    rate = _ASYNC_LR[name] * (math.sqrt(gradients_per_update(flat)) if name == "adam" else 1.0)
    rate *= min(1.0, _STALE_UPDATES[name] / _updates_behind(flat))
    return round(rate, max(4, 1 - math.floor(math.log10(rate))))  # four decimals, or two significant digits


_SGD_FAR_BEHIND = (
    "SGD's and Adagrad's steps grow with the gradient, and an asynchronous gradient lands about P / n updates "
    "after the weights it was taken on: beyond 4 such updates for SGD, 8 for Adagrad, the rate falls in "
    "proportion. Real ps asp, digits at 300 steps: SGD at 0.2 sat at chance over 16 and 32 workers (tree-ps asp "
    "over 8) and reached 97-99 % at 0.05 and 0.025; on mnist1d at 800 steps over 16 workers 0.42x allreduce at "
    "0.2 against 1.02x at 0.05. Adagrad at 0.05 reached 86-96 % over 16 and 32 workers, 97-99 % at 0.025 and "
    "0.0125 (docs/results/defaults-sweep.md); up to 4 workers nothing changes")


def _is_stale_pipeline(flat: Mapping[str, Any]) -> bool:
    """Whether a pipeline's stages step on gradients of older weights (pipedream, 2bw)."""
    return _get(flat, "schedule") in ("pipedream", "pipedream-2bw")


def _is_uncompensated_pipeline(flat: Mapping[str, Any]) -> bool:
    """A stale pipeline whose stages step on their stale gradients as they are
    (--no-delay-compensation): the momentum they take by default differs."""
    return _is_stale_pipeline(flat) and not _get(flat, "delay_compensation")


def _label(flat: Mapping[str, Any]) -> str:
    return f"{_get(flat, 'strategy')}/{_get(flat, 'consistency')}"


@dataclass(frozen=True)
class Rule:
    """Values for the configurations ``applies`` accepts; ``label`` names them in sources."""

    label: Callable[[Mapping[str, Any]], str]
    applies: Callable[[Mapping[str, Any]], bool]
    values: Mapping[str, Any]  # a callable value is computed from the configuration
    why: str


def _optimizer_is(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda flat: _get(flat, "optimizer") == name


TABLE: tuple[Rule, ...] = (
    Rule(label=lambda flat: "sandblaster",
         applies=lambda flat: _get(flat, "strategy") == "sandblaster",
         values={"lr": 1.0, "batch_size": 8192, "steps": 200, "weight_decay": 1e-4},
         why="L-BFGS scales its direction by the line search from a unit step (torch.optim.LBFGS's lr 1); "
             "batch optimisation wants a large batch: one at least the training set (digits 1438, mnist1d "
             "8000) is full-batch L-BFGS; full-batch L-BFGS overfits digits' MLP without an L2 term (94 % "
             "against 97-98 % with 1e-4 at 200-300 iterations, torch.optim.LBFGS strong_wolfe)"),
    Rule(label=lambda flat: "allreduce --elastic",
         applies=lambda flat: _get(flat, "strategy") == "allreduce" and bool(_get(flat, "elastic")),
         values={"algorithm": "ring"},
         why="a survivor can abandon an all-reduce made of point-to-point messages halfway, not the "
             "backend's native collective (strategies/elastic.py); ring sends the fewest bytes of those"),
    Rule(label=lambda flat: "ps/ssp",
         applies=lambda flat: _get(flat, "strategy") == "ps" and _get(flat, "consistency") == "ssp",
         values={"staleness": 2},
         why="ssp with bound 0 is bsp; a bound of 2 clocks lets a straggler fall behind a little "
             "(Ho et al. 2013) without stalling the others"),
    Rule(label=lambda flat: f"{_label(flat)} over {_get(flat, 'workers')} workers",
         applies=lambda flat: "lr" not in flat and _far_behind(flat) and _async_optimizer(flat) == "adam",
         values={"optimizer": "adam", "momentum": 0.0, "lr": _async_rate},
         why="Adam's step is about lr per update, and an asynchronous gradient lands about P / n updates after "
             "the weights it was taken on (P workers, n gradients per update): beyond 16 such updates the rate "
             "falls in proportion, as Zhang et al. 2016 divide it by the staleness. On the simulator (real "
             "maths), ps asp at 64 workers went from chance on digits and 0.88x allreduce on mnist1d at 0.003 "
             "to 0.97-0.99 and 1.03x at 0.00075, and at 32 workers from 0.83-0.89 and 0.99x to 0.97-0.98 and "
             "1.06x at 0.0015 (docs/results/defaults-sweep.md); up to 16 workers nothing changes"),
    Rule(label=lambda flat: f"{_label(flat)} over {_get(flat, 'workers')} workers",
         applies=lambda flat: "lr" not in flat and _far_behind(flat) and _async_optimizer(flat) in ("sgd", "adagrad"),
         values={"momentum": 0.0, "lr": _async_rate},
         why=_SGD_FAR_BEHIND),
    Rule(label=lambda flat: f"{_label(flat)}, {gradients_per_update(flat)} gradients per update",
         applies=lambda flat: (is_asynchronous(flat) and "lr" not in flat and gradients_per_update(flat) > 1
                               and _async_optimizer(flat) == "adam"),
         values={"optimizer": "adam", "momentum": 0.0,
                 "lr": _async_rate},
         why="Adam's step is about lr per update whatever the batch, and an update that averages n gradients "
             "takes a batch n times larger in n times fewer updates: the square-root rule for adaptive methods "
             "(Malladi et al. 2022) gives 0.003 sqrt(n). tree-ps adv-star under softsync over 4 workers (800 "
             "updates of 4 gradients, staleness 0.7) went from 0.90x allreduce at 0.003 to 0.96x at 0.006 on "
             "mnist1d at four seeds; Adam at 0.005-0.006 was the only setting of 16 tried at 0.95x or more"),
    Rule(label=_label,
         applies=lambda flat: is_asynchronous(flat) and "lr" not in flat,
         values={"optimizer": "adam", "momentum": 0.0},
         why="Adam at 0.003 on the servers reached 0.98-1.03x allreduce on every asynchronous configuration "
             "on mnist1d at 800 steps, where Downpour's Adagrad at 0.05 reached 0.93-0.96x, and 0.99-1.00x on "
             "digits; adv-star under asp, the row nearest its bar, went from 0.60-0.64 to 0.70-0.71"),
    Rule(label=lambda flat: f"{_label(flat)} with lr set",
         applies=is_asynchronous,
         values={"optimizer": "adagrad", "momentum": 0.0},
         why="a rate set without an optimizer keeps Downpour + Adagrad (Dean et al. 2012), the asynchronous "
             "default before Adam: rates were chosen at Adagrad's scale (0.05), where Adam's step of about lr "
             "per coordinate overshoots"),
    Rule(label=_label,
         applies=lambda flat: is_asynchronous(flat) and _get(flat, "optimizer") == "sgd",
         values={"momentum": 0.0, "lr": _ASYNC_LR["sgd"]},
         why="asynchrony acts as momentum (Mitliagkas et al. 2016): server momentum 0.9 on top of it left "
             "ps asp at chance (10 %) in the sweep; without momentum, twice the synchronous rate"),
    Rule(label=lambda flat: f"{_get(flat, 'schedule')} --no-delay-compensation",
         applies=lambda flat: _is_uncompensated_pipeline(flat) and _get(flat, "optimizer") == "sgd",
         values={"momentum": 0.5},
         why="a stage of an asynchronous pipeline steps on gradients of weights up to K - 1 steps old "
             "(pipedream) or one step old (2bw), which acts as momentum too: without delay compensation "
             "and with 0.9 on top, pipedream and 2bw ended at or near chance, or diverged, on digits with "
             "cnn over 3-4 stages, mlp over 4 and deep-mlp over 2-4; 0.5 learned every one, 0.7 still "
             "failed deep-mlp over 3-4 (docs/results/pipedream-defaults.md)"),
    Rule(label=lambda flat: "deep-mlp",
         applies=lambda flat: _get(flat, "model") == "deep-mlp" and _get(flat, "optimizer") == "sgd",
         values={"lr": 0.05},
         why="eight layers deep, momentum SGD at 0.1 diverged on digits at seed 1 (hidden 128) and seed 0 "
             "(hidden 1024) and reached 0.72-0.94 in a 1f1b pipeline over 3 stages; 0.05 learned every "
             "configuration of the sweep, pipedream and 2bw included (docs/results/deep-mlp-lr.md)"),
    Rule(label=lambda flat: "adagrad", applies=_optimizer_is("adagrad"), values={"lr": _ASYNC_LR["adagrad"]},
         why="Adagrad's step is lr over the root of the summed squared gradients: 0.1 overshot in the sweep"),
    Rule(label=lambda flat: "adam", applies=_optimizer_is("adam"), values={"lr": _ADAM_LR},
         why="Adam's step is about lr per coordinate: 0.1 overshoots; 0.003 was best in the sweep"),
)


def resolve(given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The values and sources of the keys ``given`` leaves unset that a rule decides."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for rule in TABLE:
        view = {**given, **values}  # a later rule sees what earlier ones decided
        if not rule.applies(view):
            continue
        for key, value in rule.values.items():
            if key not in view:
                values[key] = value(view) if callable(value) else value
                sources[key] = f"default for {rule.label(view)}"
    return values, sources


def risks(flat: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """One line for each value the user set that the table advises against here."""
    lines = []
    if is_asynchronous(flat) and _get(flat, "optimizer") == "sgd" and _get(flat, "momentum") > 0 \
            and sources.get("momentum") in USER_SOURCES:
        lines.append(f"momentum {_get(flat, 'momentum'):g} ({sources['momentum']}) under {_label(flat)}: asynchrony "
                     f"already acts as momentum (Mitliagkas et al. 2016), and the two together can stall or "
                     f"diverge; the default here is 0 (drop --momentum), or pass --staleness-lr")
    if _is_uncompensated_pipeline(flat) and _get(flat, "optimizer") == "sgd" and _get(flat, "momentum") > 0.5 \
            and sources.get("momentum") in USER_SOURCES:
        lines.append(f"momentum {_get(flat, 'momentum'):g} ({sources['momentum']}) under --schedule "
                     f"{_get(flat, 'schedule')} --no-delay-compensation: stale weights already act as momentum, "
                     f"and above 0.5 the two together left cnn, mlp and deep-mlp at chance on digits; the default "
                     f"here is 0.5")
    if sources.get("lr") in USER_SOURCES and _far_behind(flat) and _get(flat, "lr") >= 2 * _async_rate(flat):
        name = _async_optimizer(flat)
        lines.append(f"lr {_get(flat, 'lr'):g} ({sources['lr']}) for {name} under {_label(flat)} over "
                     f"{_get(flat, 'workers')} workers: a gradient lands about {_updates_behind(flat):g} updates "
                     f"late, and at twice the default here ({_async_rate(flat):g}) or more, {_TOO_FAST[name]}; "
                     f"drop --lr, or pass --staleness-lr")
    if _get(flat, "optimizer") != "sgd" and _get(flat, "momentum") > 0 and sources.get("momentum") in USER_SOURCES:
        lines.append(f"momentum {_get(flat, 'momentum'):g} ({sources['momentum']}) has no effect with optimizer "
                     f"{_get(flat, 'optimizer')} ({sources.get('optimizer', 'default')}): pass --optimizer sgd "
                     f"to use it")
    return lines
