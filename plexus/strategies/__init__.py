"""Strategies: one module per family, one interface (``base.Strategy``), chosen by name."""
from __future__ import annotations

from plexus.config.applies import check_strategy
from plexus.strategies.allreduce import AllReduceStrategy
from plexus.strategies.base import Context, RoleContext, Strategy, StepStats
from plexus.strategies.downpour import DownpourStrategy
from plexus.strategies.easgd import EasgdStrategy
from plexus.strategies.gossip import GossipStrategy
from plexus.strategies.local_sgd import LocalSgdStrategy
from plexus.strategies.sandblaster import SandblasterStrategy
from plexus.strategies.tree_ps import TreePSStrategy

__all__ = ["STRATEGIES", "strategy_class", "create_strategy", "Context", "RoleContext", "Strategy", "StepStats"]

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (AllReduceStrategy, DownpourStrategy, TreePSStrategy, GossipStrategy, LocalSgdStrategy,
                              EasgdStrategy, SandblasterStrategy)}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy called ``name``; ConfigError lists the known strategies otherwise."""
    check_strategy(name)
    return STRATEGIES[name]


def create_strategy(name: str) -> Strategy:
    """A new strategy object of the class called ``name``."""
    return strategy_class(name)()
