"""``hier``: the two-level all-reduce (intra-node, then inter-node, as Horovod's and NCCL's
hierarchical modes): ranks form groups of ``local_size`` consecutive ranks (the ranks of
one machine under torchrun); each group's first rank, its leader, adds the vectors of its
group (fan-in local_size - 1), the leaders all-reduce among themselves with an inner
algorithm (rhd by default), and each leader sends the result back to its group.

Only P / local_size ranks use the slow inter-node links, each carrying the inner
algorithm's bytes once; the price is the leaders' local fan-in and fan-out.

``local_size`` 0 means ranks per machine: ``LOCAL_WORLD_SIZE`` when torchrun says the job
spans several machines, otherwise 2, because on one machine "per machine" would be a
single group and hier would degenerate into master.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_GATHER, TAG_REDUCE, AllReduce, sum_from, wait_all
from plexus.collectives.dbtree import DoubleTree
from plexus.collectives.master import Master
from plexus.collectives.ps import ParameterServer
from plexus.collectives.rhd import Rhd
from plexus.collectives.ring import Ring
from plexus.collectives.schedule import hier_groups
from plexus.errors import ConfigError

__all__ = ["Hierarchical", "SubGroup", "INNER", "DEFAULT_LOCAL_SIZE"]

INNER: dict[str, type[AllReduce]] = {cls.name: cls for cls in (Rhd, Ring, DoubleTree, ParameterServer, Master)}
DEFAULT_LOCAL_SIZE = 2


class SubGroup:
    """Members ``members`` of ``parent`` renumbered 0 .. k - 1, so that an algorithm can run
    among a subset of a group over the group's own links (and counters)."""

    def __init__(self, parent: Any, members: list[int]) -> None:
        self.parent = parent
        self.members = members
        self.rank = members.index(parent.rank)
        self.size = len(members)
        self.names = [parent.names[m] for m in members]
        self.me = parent.me
        self.traffic = parent.traffic
        self.timeout = parent.timeout

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        return self.parent.isend(tensor, self.members[peer], tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        return self.parent.irecv(tensor, self.members[peer], tag)


class Hierarchical(AllReduce):
    name = "hier"

    def __init__(self, local_size: int = 0, inner: str = "rhd") -> None:
        if local_size < 0:
            raise ConfigError(f"local_size must be 0 (ranks per machine) or positive, got {local_size}: "
                              f"pass --local-size 2")
        if inner not in INNER:
            raise ConfigError(f"hier's inner algorithm must be one of {', '.join(INNER)}, got {inner!r}")
        self.local_size = local_size
        self.inner = inner
        self._inner = INNER[inner]()

    @classmethod
    def from_options(cls, options: Any = None) -> "Hierarchical":
        return cls(local_size=getattr(options, "local_size", 0) or 0)

    def group_size(self, procs: int) -> int:
        """The local size in effect for ``procs`` ranks."""
        if self.local_size:
            return min(self.local_size, procs)
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if 1 < per_machine < procs:
            return per_machine
        return min(DEFAULT_LOCAL_SIZE, procs)

    def options(self, group: Endpoint, flat: torch.Tensor) -> tuple[int, int]:
        return (self.group_size(group.size), list(INNER).index(self.inner))

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        groups = hier_groups(group.size, self.group_size(group.size))
        mine = next(g for g in groups if group.rank in g)
        leader = mine[0]
        if group.rank != leader:
            back = group.irecv(flat, leader, TAG_GATHER)  # arrives after the leader read ours
            group.isend(flat, leader, TAG_REDUCE).wait()
            back.wait()
            return
        members = mine[1:]
        if members:
            sum_from(group, flat, members, self.name)
        leaders = [g[0] for g in groups]
        if len(leaders) > 1:
            self._inner._reduce(flat, SubGroup(group, leaders))
        wait_all([group.isend(flat, m, TAG_GATHER) for m in members])
