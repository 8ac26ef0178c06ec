"""Which options apply to which strategy: one table, read by the check that refuses a
flag the chosen strategy would ignore and by ``plexus train --print-config``, which marks
the same keys ``n/a``, so the two cannot drift apart.

A key not in ``APPLIES`` applies to every strategy (``--workers``, ``--lr``, ``--seed``...).
Each entry lists the strategies whose code reads the key (``strategies/*.py`` and what
they call); a key that only some configurations of a strategy read (``--staleness``
outside ssp) still counts as applying to it, since the strategy is what the user picks.

Only values the user set count (sources ``flag``, ``file``, ``spec``, ``api``): a
dataclass default or a per-strategy default (``defaults.py``) never makes a run fail.
"""
from __future__ import annotations

from typing import Any, Mapping

from plexus.errors import ConfigError

__all__ = ["STRATEGY_NAMES", "check_strategy", "APPLIES", "applies", "applies_to", "strategy_keys", "inapplicable",
           "check_applies", "drop_inapplicable"]

# Every strategy, in the order the README's table lists them (``plexus.strategies.STRATEGIES``
# must hold the same names: tested).
STRATEGY_NAMES = ("allreduce", "ps", "tree-ps", "gossip", "local-sgd", "easgd", "sandblaster")


def check_strategy(name: str) -> None:
    """ConfigError listing the known strategies unless ``name`` is one (checked with the
    configuration, before anything imports torch)."""
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown strategy {name!r}: choose one of {', '.join(sorted(STRATEGY_NAMES))}")


_PS = ("ps", "tree-ps")
# Strategies that train with a first-order optimizer (sandblaster runs L-BFGS).
_SGD = tuple(name for name in STRATEGY_NAMES if name != "sandblaster")

APPLIES: dict[str, tuple[str, ...]] = {
    # the all-reduce algorithm: allreduce averages gradients with it, local-sgd parameters
    "algorithm": ("allreduce", "local-sgd"),
    "bucket_mb": ("allreduce",),  # gradient buckets overlap backward (collectives/bucketing.py)
    "elastic": ("allreduce",),
    # checkpoints hold the whole job's state for these (train/checkpoint.py)
    "checkpoint_every": ("allreduce", "ps"),  # the group re-forms when a worker dies or joins (strategies/elastic.py)
    "local_size": ("allreduce", "local-sgd"),  # the hier algorithm's group size
    # parameter servers (ps/server.py, shared by ps and tree-ps's root)
    "servers": (*_PS, "sandblaster"),  # easgd's centre is always one server process
    "consistency": _PS,
    "staleness": ("ps",),  # tree-ps speaks n-softsync, not ssp
    "softsync": _PS,
    "fetch_every": _PS,
    "push_every": _PS,
    "staleness_lr": _PS,
    # heartbeats of ps workers, tree-ps aggregators (ps/heartbeat.py) and sandblaster replicas
    "peer_timeout": (*_PS, "sandblaster"),
    "fanout": ("tree-ps",),
    "variant": ("tree-ps",),
    # decentralized
    "topology": ("gossip",),
    "mixing": ("gossip",),
    "gossip_order": ("gossip",),
    "async_gossip": ("gossip",),
    # model averaging
    "period": ("local-sgd", "easgd"),
    "adaptive": ("local-sgd",),
    "average_optimizer_state": ("local-sgd",),
    "warmup_steps": ("local-sgd",),
    "elastic_alpha": ("easgd",),
    # where the roles besides workers go in the role plan (train/plan.py)
    "place": ("ps", "tree-ps", "easgd", "sandblaster"),
    # the scheduler under ps (train/batches.py, ps/server.py)
    "assignment": ("ps",),
    "backup_workers": ("ps",),
    # the server group (ps/replication.py)
    "replication": ("ps",),
    "ledger": ("ps", "tree-ps"),
    "drain": ("ps",),
    # Sandblaster L-BFGS (sandblaster/)
    "history": ("sandblaster",),
    "lbfgs": ("sandblaster",),
    "line_search": ("sandblaster",),
    "unit_size": ("sandblaster",),
    "backup_after": ("sandblaster",),
    "dtype": ("sandblaster",),  # float64 for the L-BFGS oracle; the other strategies train in float32
    # first-order optimisation: sandblaster's step comes from L-BFGS and its line search
    # (its weight decay is the objective's L2 term)
    "optimizer": _SGD,
    "momentum": _SGD,
}

_USER = ("flag", "file", "spec", "api")


def strategy_keys() -> dict[str, frozenset[str]]:
    """{strategy: the table's keys that apply to it}: the knobs that tell its runs apart
    (``report/analysis.py`` labels and diffs compared runs with them)."""
    return {name: frozenset(k for k, users in APPLIES.items() if name in users) for name in STRATEGY_NAMES}


def applies(key: str, strategy: str) -> bool:
    """Whether flat key ``key`` means anything to ``strategy``."""
    return strategy in APPLIES.get(key, (strategy,))


def applies_to(key: str) -> tuple[str, ...]:
    """The strategies ``key`` applies to (every one for a general key)."""
    return APPLIES.get(key, STRATEGY_NAMES)


def inapplicable(strategy: str, sources: Mapping[str, str]) -> list[str]:
    """The keys the user set (``sources``) that do not apply to ``strategy``, in table order."""
    return [key for key in APPLIES if sources.get(key) in _USER and not applies(key, strategy)]


def _flag(key: str) -> str:
    return "--async" if key == "async_gossip" else f"--{key.replace('_', '-')}"


def _describe(key: str, value: Any, source: str) -> str:
    """How the user wrote it: ``--consistency ssp`` for a flag, ``consistency = 'ssp'
    (file)`` otherwise."""
    if source == "flag":
        return _flag(key) if isinstance(value, bool) else f"{_flag(key)} {value}"
    return f"{key} = {value!r} ({source})"


def check_applies(strategy: str, values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Raise ConfigError for the first value the user set that ``strategy`` would ignore,
    naming the strategies it applies to: a flag that silently does nothing is worse than
    none (a summary that records ``algorithm: ring`` for a ps run misleads)."""
    for key in inapplicable(strategy, sources):
        users = applies_to(key)
        raise ConfigError(f"{_describe(key, values.get(key), sources[key])} does not apply to strategy {strategy}: "
                          f"it applies to {', '.join(users)} only; drop it, or pass --strategy {users[0]}")


def drop_inapplicable(strategy: str, flat: dict[str, Any], sources: dict[str, str],
                      keep: tuple[str, ...] = ("spec",)) -> list[str]:
    """Remove from ``flat`` (and ``sources``) the keys that do not apply to ``strategy``,
    except those whose source is in ``keep``; returns the keys removed. ``plexus compare``
    uses it: a flag shared by every spec (``--servers 2``) applies to the specs whose
    strategy reads it and is left out of the others."""
    dropped = [key for key in APPLIES if key in flat and sources.get(key) not in keep and not applies(key, strategy)]
    for key in dropped:
        flat.pop(key)
        sources.pop(key, None)
    return dropped
