"""One server process's duties to the other shards: a standby replica of each shard whose
successor it is (``--replication k``), a standby for each shard a drain hands to it, and a
``ParameterServer`` of its own for each shard it took over, beside its own shard
(``replication.py``). A server that joined the running job (``plexus server --join``) has
no shard of its own: it waits as a spare for the shards drains hand to it."""
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
from plexus.ps.replication import ShardState, Standby, handoff_key, replicated_shards
from plexus.ps.server import KEYS, ParameterServer

__all__ = ["ServerGroup"]

logger = logging.getLogger(__name__)


class ServerGroup:
    """Server ``host``'s standbys, and the shards it took over."""

    def __init__(self, store: dist.Store, host: int, cfg: JobConfig, traffic: Traffic, log: Log | None) -> None:
        self.store, self.host, self.cfg, self.traffic, self.log = store, host, cfg, traffic, log
        self.shards = max(1, cfg.cluster.servers)
        self.lock = threading.Lock()
        self.taken: list[tuple[ParameterServer, threading.Thread]] = []
        self.standbys: dict[int, Standby] = {}
        self.store_closed = False  # a spare saw the job's store close as the job ended
        for shard in replicated_shards(host, self.shards, cfg.strategy.replication) if host < self.shards else []:
            self._follow(shard)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_handoffs, name=f"server {host}: handoffs", daemon=True)
        self._watch.start()

    def _follow(self, shard: int) -> None:
        """Keep a standby replica of ``shard``."""
        with self.lock:
            if shard in self.standbys:
                return
            standby = self.standbys[shard] = Standby(
                self.store, self.host, shard, self.cfg, self.traffic, self._promote,
                drained=lambda: self.store.check([KEYS.drained(shard)]))
        standby.thread.start()

    def _watch_handoffs(self) -> None:
        """A drain that hands a shard to this server names it in the shard's handoff key."""
        store = self.store.clone()
        while not self._stop.wait(0.05):
            for shard in range(self.shards):
                key = handoff_key(shard)
                if shard not in self.standbys and store.check([key]) and int(store.get(key).decode()) == self.host:
                    self._follow(shard)

    def _promote(self, state: ShardState, times: dict[str, float]) -> None:
        """Serve shard ``state.shard`` from here on, from the state this standby holds."""
        how = "is handed" if times.get("drained") else "takes"
        logger.warning("server %d: %s shard %d over at version %d", self.host, how, state.shard, state.version)
        server = ParameterServer(self.store, state.shard, self.cfg, self.traffic, log=self.log, host=self.host,
                                 state=state, recovery=times)
        thread = threading.Thread(target=self._serve, args=(server,), name=f"server {self.host}: shard {state.shard}",
                                  daemon=True)
        with self.lock:
            self.taken.append((server, thread))
        thread.start()

    def _serve(self, server: ParameterServer) -> None:
        record: dict[str, Any] = server.serve()
        if server.moved_to is None:  # a shard that moved on is recorded by its last server
            try:
                store_set_json(self.store, f"stats/server/{server.index}", record)
            except dist.DistError as exc:  # a spare outside the launcher: the job may be gone
                logger.warning("server %d: shard %d's record not kept: the job's store closed (%s)", self.host,
                               server.index, exc)

    def wait_for_the_job(self) -> None:
        """A spare's main loop: until every shard of the job has drained. The job's store
        may close between two looks once the last shard drained (the launcher ends the
        job once its own processes have): that ends the wait too, when every shard this
        server took over had drained."""
        keys = [KEYS.drained(s) for s in range(self.shards)]
        try:
            while not self.store.check(keys):
                time.sleep(0.1)
        except dist.DistError as exc:
            with self.lock:
                undrained = [server.index for server, _ in self.taken if not server.drained]
            if undrained:
                raise
            logger.warning("server %d: the job ended (its store closed: %s)", self.host, exc)
            self.store_closed = True

    def finish(self) -> None:
        """Once this server's own shard is done: wait for the standbys (their primaries send
        a final state when they drain; a server that drained itself stops following) and for
        the shards taken over to drain."""
        leaving = self.store_closed or self.store.check([KEYS.draining(self.host)])
        deadline = time.monotonic() + 2 * self.cfg.cluster.timeout
        with self.lock:
            standbys = list(self.standbys.values())
        for standby in standbys:
            if leaving:
                standby.stop()
            standby.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self.lock:
            taken = list(self.taken)
        for _, thread in taken:
            while thread.is_alive():  # serve() ends by the job's own timeouts
                thread.join(timeout=1.0)
        self._stop.set()
