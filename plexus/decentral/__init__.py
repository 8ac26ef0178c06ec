"""Decentralized training and model averaging as pure objects: gossip graphs and their
mixing weights (``topology.py``), AD-PSGD's pairing rule (``pairing.py``), local SGD's
averaging schedule with AdaComm (``adacomm.py``), and the arithmetic they share
(``averaging.py``). The strategies that run them over processes live in
``plexus/strategies/gossip.py``, ``local_sgd.py`` and ``easgd.py``.
"""
from __future__ import annotations

from plexus.decentral.adacomm import AdaComm, AveragingSchedule
from plexus.decentral.averaging import (FlatParameters, consensus_distance, elastic_difference, mix,
                                        optimizer_buffers)
from plexus.decentral.pairing import Pairing
from plexus.decentral.topology import TOPOLOGIES, Topology, make_topology, torus_shape

__all__ = ["AdaComm", "AveragingSchedule", "FlatParameters", "consensus_distance", "elastic_difference", "mix",
           "optimizer_buffers", "Pairing", "TOPOLOGIES", "Topology", "make_topology", "torus_shape"]
