"""Strategies: one module per family, one interface (``base.Strategy``), chosen by name."""
from __future__ import annotations

from plexus.errors import ConfigError
from plexus.strategies.allreduce import AllReduceStrategy
from plexus.strategies.base import Context, Strategy, StepStats

__all__ = ["STRATEGIES", "create_strategy", "Context", "Strategy", "StepStats"]

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (AllReduceStrategy,)}


def create_strategy(name: str) -> Strategy:
    """A new strategy object; ConfigError lists the known strategies otherwise."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}: choose one of {', '.join(sorted(STRATEGIES))}") from None
