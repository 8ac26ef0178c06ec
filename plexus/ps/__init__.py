"""The sharded parameter server (Dean et al. 2012's Downpour SGD, Li et al. 2014's
parameter server): wire protocol, sharding, consistency gates, staleness accounting and
server optimizers as pure parts; the server process loop and the worker's client on links.

The pure parts (``protocol``, ``sharding``, ``consistency``, ``staleness``, ``optimizers``)
know nothing of processes, so the tree parameter server and the simulator reuse them.
"""
from __future__ import annotations

from plexus.ps.consistency import ASP, BSP, SSP, Consistency, Push, SoftSync, is_synchronous, make_consistency
from plexus.ps.optimizers import ServerOptimizer, make_server_optimizer
from plexus.ps.sharding import HashRing, RangeSharding
from plexus.ps.staleness import StalenessHistogram, staleness_lr_scale

__all__ = ["ASP", "BSP", "SSP", "SoftSync", "Consistency", "Push", "is_synchronous", "make_consistency",
           "ServerOptimizer", "make_server_optimizer", "HashRing", "RangeSharding", "StalenessHistogram",
           "staleness_lr_scale"]
