"""Processes, roles, rendezvous, links and timeouts: the only layer that sets up
``torch.distributed``."""
from __future__ import annotations

from plexus.cluster.emulation import Emulator
from plexus.cluster.group import Endpoint, Group, Link, Work
from plexus.cluster.launcher import RoleSpec, launch
from plexus.cluster.rendezvous import ProcessInfo, connect_store, host_store, new_token
from plexus.cluster.traffic import Traffic

__all__ = ["Emulator", "Endpoint", "Group", "Link", "Work", "RoleSpec", "launch", "ProcessInfo",
           "connect_store", "host_store", "new_token", "Traffic"]
