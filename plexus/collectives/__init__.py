"""All-reduce algorithms on point-to-point links, selectable by name (``--algorithm``).

=========  ==========================================================================
name       algorithm (one file each)
=========  ==========================================================================
master     reduce everything to rank 0, broadcast back (``master.py``)
ps         reduce-scatter to shard owners, all-gather (``ps.py``)
rhd        recursive halving + doubling, any P (``rhd.py``; Thakur et al. 2005)
ring       ring reduce-scatter + all-gather (``ring.py``; Patarasuk and Yuan 2009)
dbtree     double binary tree, pipelined (``dbtree.py``; Sanders et al. 2009, NCCL)
hier       groups of local_size, leaders all-reduce, broadcast back (``hier.py``)
native     the backend's own all-reduce (``native.py``)
auto       the cost model's pick per call (``auto.py``, ``cost.py``)
=========  ==========================================================================
"""
from __future__ import annotations

from plexus.collectives.auto import Auto
from plexus.collectives.base import AllReduce, Handle, Op
from plexus.collectives.dbtree import DoubleTree
from plexus.collectives.hier import Hierarchical
from plexus.collectives.master import Master
from plexus.collectives.native import Native
from plexus.collectives.ps import ParameterServer
from plexus.collectives.rhd import Rhd
from plexus.collectives.ring import Ring
from plexus.config import StrategyConfig
from plexus.errors import ConfigError

__all__ = ["AllReduce", "Handle", "Op", "ALGORITHMS", "get_algorithm"]

ALGORITHMS: dict[str, type[AllReduce]] = {
    cls.name: cls for cls in (Master, ParameterServer, Rhd, Ring, DoubleTree, Hierarchical, Native, Auto)}


def get_algorithm(name: str, options: "StrategyConfig | None" = None) -> AllReduce:
    """The algorithm called ``name``, configured from ``options`` where it takes any
    (``local_size`` for hier); ConfigError lists the known ones otherwise."""
    try:
        cls = ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown all-reduce algorithm {name!r}: choose one of "
                          f"{', '.join(sorted(ALGORITHMS))}") from None
    return cls.from_options(options)
