"""One server process's duties to the other shards under ``--replication k``: it keeps a
standby replica of each shard whose successor it is, and serves a shard it took over in a
``ParameterServer`` of its own, beside its own shard (``replication.py``)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from plexus.cluster.rendezvous import store_set_json
from plexus.cluster.traffic import Traffic
from plexus.config import JobConfig
from plexus.ps.heartbeat import Log
from plexus.ps.replication import ShardState, Standby, replicated_shards
from plexus.ps.server import KEYS, ParameterServer

__all__ = ["ServerGroup"]

logger = logging.getLogger(__name__)


class ServerGroup:
    """Server ``host``'s standbys, and the shards it took over."""

    def __init__(self, store: dist.Store, host: int, cfg: JobConfig, traffic: Traffic, log: Log | None) -> None:
        self.store, self.host, self.cfg, self.traffic, self.log = store, host, cfg, traffic, log
        self.lock = threading.Lock()
        self.taken: list[tuple[ParameterServer, threading.Thread]] = []
        self.standbys = [Standby(store, host, shard, cfg, traffic, self._promote,
                                 drained=lambda shard=shard: store.check([KEYS.drained(shard)]))
                         for shard in replicated_shards(host, max(1, cfg.cluster.servers), cfg.strategy.replication)]
        for standby in self.standbys:
            standby.thread.start()

    def _promote(self, state: ShardState, times: dict[str, float]) -> None:
        """Serve shard ``state.shard`` from here on, from the state this standby holds."""
        logger.warning("server %d: takes shard %d over at version %d", self.host, state.shard, state.version)
        server = ParameterServer(self.store, state.shard, self.cfg, self.traffic, log=self.log, host=self.host,
                                 state=state, recovery=times)
        thread = threading.Thread(target=self._serve, args=(server,), name=f"server {self.host}: shard {state.shard}",
                                  daemon=True)
        with self.lock:
            self.taken.append((server, thread))
        thread.start()

    def _serve(self, server: ParameterServer) -> None:
        record: dict[str, Any] = server.serve()
        store_set_json(self.store, f"stats/server/{server.index}", record)

    def finish(self) -> None:
        """Once this server's own shard is done: wait for the standbys (their primaries send
        a final state when they drain) and for the shards taken over to drain."""
        deadline = time.monotonic() + 2 * self.cfg.cluster.timeout
        for standby in self.standbys:
            standby.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self.lock:
            taken = list(self.taken)
        for _, thread in taken:
            while thread.is_alive():  # serve() ends by the job's own timeouts
                thread.join(timeout=1.0)
