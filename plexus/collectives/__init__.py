"""All-reduce algorithms on point-to-point links, selectable by name (``--algorithm``)."""
from __future__ import annotations

from plexus.collectives.base import AllReduce, Handle, Op
from plexus.collectives.native import Native
from plexus.collectives.ring import Ring
from plexus.config import StrategyConfig
from plexus.errors import ConfigError

__all__ = ["AllReduce", "Handle", "Op", "ALGORITHMS", "get_algorithm"]

ALGORITHMS: dict[str, type[AllReduce]] = {cls.name: cls for cls in (Native, Ring)}


def get_algorithm(name: str, options: "StrategyConfig | None" = None) -> AllReduce:
    """The algorithm called ``name``, configured from ``options`` where it takes any
    (``local_size`` for hier); ConfigError lists the known ones otherwise."""
    try:
        return ALGORITHMS[name]()
    except KeyError:
        raise ConfigError(f"unknown all-reduce algorithm {name!r}: choose one of "
                          f"{', '.join(sorted(ALGORITHMS))}") from None
