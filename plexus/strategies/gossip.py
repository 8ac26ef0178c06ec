"""``gossip``: decentralized parallel SGD (D-PSGD) and its asynchronous form (AD-PSGD).

No server and no all-reduce: each worker keeps its own replica x_i and talks only to its
neighbours in a graph (``--topology``, ``decentral/topology.py``) with symmetric doubly
stochastic mixing weights W (``--mixing``).

**D-PSGD** (Lian et al. 2017, "Can decentralized algorithms outperform centralized
algorithms?"), in lockstep, worker r on the r-th slice of every global batch (contract 1):

- ``--gossip-order combine-first`` (their Algorithm 1, the default): the worker sends x_i
  to its neighbours and receives theirs on the communication thread *while* it computes
  the gradient g_i at its own x_i, then sets x_i <- sum_j W_ij x_j - lr * g_i. The
  exchange overlaps the computation, which is where D-PSGD gains time on a slow network.
- ``--gossip-order adapt-first``: the local step first, x_i <- x_i - lr * g_i, then the
  neighbours average the updated parameters (no overlap). On ``complete`` with uniform
  weights every worker ends each step with the same average, so training equals
  synchronous SGD (contract 1, tested); with combine-first the average after one step
  equals it.

Momentum (and weight decay) stay local to each replica; with sgd the update is linear,
so the average of the replicas still follows momentum SGD with the averaged gradient.
Per step a worker sends its whole model to each neighbour: degree x model bytes (tested
against the counters), against 2 (P-1)/P model bytes for a ring all-reduce, but in one
hop, so it pays one latency per neighbour instead of 2 (P-1) in sequence.

**AD-PSGD** (``--async``; Lian et al. 2018, "Asynchronous decentralized parallel SGD"):
no lockstep and no barrier. Each worker reads its replica, computes a gradient on that
copy, averages its replica with one random neighbour atomically for the pair, then
applies the gradient to its (possibly since averaged) replica. Deadlock freedom comes
from the orientation in ``decentral/pairing.py``: active workers start averagings,
passive ones answer them on a listener thread, so a slow worker's slowness is only its
own (its listeners keep serving while it computes), and a killed worker breaks only its
own pair links (``cluster.Link``): its neighbours log it, drop it and go on. Each worker
walks its own partition of the data, as the paper's workers do.

AD-PSGD's workers stop together on one budget of updates (``train/budget.py``): with
``--steps N`` and P workers the job makes N x P updates in all, each claimed from a counter
in the store before it is made, as the paper counts its K iterations over all workers
(Lian et al. 2018, Theorem 1). Fast workers make more, a lost worker's unspent share goes
to the survivors, and no worker trains alone at the end: with N updates each, a slow
worker would go on long after its neighbours had left, with nobody to average with, and
its drifting replica would spoil the average of the final replicas.

Measurement (``strategies/replicas.py``): the global model evaluated is the average of
the replicas, computed at each snapshot over an uncounted probe group, and the consensus
distance (1/P) sum_i ||x_i - x_bar|| is logged with it (``strategy`` events). AD-PSGD
cannot take that collective without a barrier, so during the run its global model is
worker 0's replica; after the last step every worker leaves its final replica in the
job's store and worker 0 averages those of the workers that finished (the summary's
``averaged_test_accuracy`` and ``consensus_distance``).
"""
from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
import time
from typing import Any

import torch

from plexus.cluster.group import Link
from plexus.cluster.rendezvous import lost_key
from plexus.collectives.base import comm_executor
from plexus.config import JobConfig
from plexus.decentral.averaging import FlatParameters, mix
from plexus.decentral.pairing import Pairing
from plexus.decentral.topology import make_topology
from plexus.errors import CommError, CommTimeout, ConfigError
from plexus.strategies.base import Context, LossFn, Strategy, StepStats, make_optimizer
from plexus.strategies.replicas import (ReplicaProbe, collect_replicas, final_consensus, leave_replica,
                                        replica_summary, store_agree)

__all__ = ["GossipStrategy", "TAG_GOSSIP"]

logger = logging.getLogger(__name__)

TAG_GOSSIP = 0x6A00
# AD-PSGD messages carry an op code in element 0 and the replica after it: one message
# per request (one emulated latency), not a header and a payload.
_OP_AVERAGE = 1.0
_OP_BYE = 2.0
_STOP_KEY = "gossip/stop"


class GossipStrategy(Strategy):
    name = "gossip"
    # D-PSGD is lockstep on slices of the global batch; setup() sets the instance's value
    # to False under --async (AD-PSGD: own partitions, no final barrier).
    synchronous = True

    @classmethod
    def check_config(cls, cfg: JobConfig) -> None:
        s = cfg.strategy
        make_topology(s.topology, cfg.cluster.workers, s.mixing)
        if s.async_gossip and s.gossip_order != "combine-first":
            raise ConfigError(f"gossip_order {s.gossip_order!r} applies to synchronous D-PSGD only: AD-PSGD "
                              f"(--async) always computes its gradient on a read copy, averages with one "
                              f"neighbour, then applies the gradient; drop --gossip-order or --async")

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        # Worker 0 holds the model that is evaluated; the others may die under AD-PSGD.
        return cfg.strategy.async_gossip and role == "worker" and rank != 0

    @classmethod
    def shares_budget(cls, cfg: JobConfig) -> bool:
        # AD-PSGD stops on N x P updates in all, so that its workers end together.
        return cfg.strategy.async_gossip

    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        s = ctx.cfg.strategy
        self.model, self.loss_fn, self.ctx = model, loss_fn, ctx
        self.rank = ctx.info.rank
        self.topology = make_topology(s.topology, ctx.info.world_size, s.mixing)
        self.params = FlatParameters(model)
        self.optimizer = make_optimizer(model.parameters(), ctx.cfg.optim)
        self.asynchronous = s.async_gossip
        self.order = s.gossip_order
        self.averagings = 0
        self.served = 0
        self.final: dict[str, Any] = {}
        if self.asynchronous:
            self._setup_async()
        else:
            self._setup_sync()

    # --- D-PSGD ---------------------------------------------------------------------------

    def _setup_sync(self) -> None:
        self.group = self.ctx.worker_group()
        self.lane = comm_executor(self.group)
        self.peers = self.topology.peers(self.rank)
        # Neighbours on this machine exchange over shared memory (Group.connect): every
        # member sends to and receives from the same neighbours, so the relation is symmetric.
        self.group.connect(self.peers, self.ctx.cfg.cluster.transport)
        self.weights = self.topology.weights(self.rank)
        self.inbox = {j: torch.empty_like(self.params.flat) for j in self.peers}
        self.probe = ReplicaProbe(self.ctx, "gossip", self.model)
        self.holder = self.probe.holder

    def _exchange(self) -> None:
        """Send the replica to every neighbour and receive theirs (all posted at once)."""
        flat = self.params.flat
        recvs = [self.group.irecv(self.inbox[j], j, TAG_GOSSIP) for j in self.peers]
        sends = [self.group.isend(flat, j, TAG_GOSSIP) for j in self.peers]
        for work in recvs + sends:
            work.wait()

    def _finish(self, pending: concurrent.futures.Future) -> None:
        # Every wait inside the exchange has the group's timeout; this bound only catches
        # a communication thread that never returns.
        limit = 2 * self.ctx.cfg.cluster.timeout + 1
        try:
            pending.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            names = ", ".join(f"worker {j}" for j in self.peers)
            raise CommTimeout(f"worker {self.rank}: gossip exchange with {names} did not finish within "
                              f"{limit:g} s", peer=names) from None

    @torch.no_grad()
    def _mix(self) -> None:
        mix(self.weights, {self.rank: self.params.flat, **self.inbox}, out=self.params.flat)

    def _step_sync(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        self.optimizer.zero_grad()
        combine = self.order == "combine-first" and bool(self.peers)
        pending = self.lane.submit(self._exchange) if combine else None
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.model, x, y)
            loss.backward()
        if pending is not None:
            # x_i <- sum_j W_ij x_j - lr * g_i(x_i): mix, then step with the gradient taken
            # at the replica as it was before mixing.
            self._finish(pending)
            self._mix()
            self.optimizer.step()
        else:
            self.optimizer.step()
            if self.peers:
                self.lane.call(self._exchange)
                self._mix()
        self.averagings += 1 if self.peers else 0
        return StepStats(loss=loss.item())

    # --- AD-PSGD --------------------------------------------------------------------------

    def _setup_async(self) -> None:
        ctx = self.ctx
        self.synchronous = False  # see the class attribute
        self.pairing = Pairing(self.topology, ctx.cfg.run.seed)
        # Guards the replica: the training thread's read, averaging and update, and the
        # listeners' averagings, each happen whole.
        self.lock = threading.Lock()
        self.lost: set[int] = set()
        self.compute_model = copy.deepcopy(self.model)
        self.compute = FlatParameters(self.compute_model)
        self.holder = copy.deepcopy(self.model)
        self.holder_flat = FlatParameters(self.holder)
        n = self.params.numel
        self.outbox = torch.empty(n + 1, dtype=self.params.flat.dtype, device=self.params.flat.device)
        self.reply = torch.empty_like(self.params.flat)
        # Every process opens its links in the same global order of edges (lower rank
        # first), so the pair that is first in that order always finds both ends ready and
        # opening cannot deadlock, whatever the orientation.
        sources, targets = self.pairing.sources(self.rank), self.pairing.targets(self.rank)
        self.links: dict[int, Link] = {}
        self.in_links: dict[int, Link] = {}
        self.live: set[int] = set()
        for peer in sorted(sources + targets, key=lambda j: (min(j, self.rank), max(j, self.rank))):
            try:
                (self.links if peer in targets else self.in_links)[peer] = self._link(peer)
            except CommError as exc:
                self._lose(peer, exc)
        self.live = set(self.links)
        self.listeners = [threading.Thread(target=self._serve, args=(j, link), name=f"adpsgd-listen-{j}",
                                           daemon=True) for j, link in self.in_links.items()]
        for thread in self.listeners:
            thread.start()

    def _link(self, peer: int) -> Link:
        ctx = self.ctx
        return Link(ctx.store, f"worker {self.rank}", f"worker {peer}", traffic=ctx.traffic,
                    timeout=ctx.cfg.cluster.timeout, backend=ctx.backend, net=ctx.cfg.cluster.net, tag="adpsgd",
                    transport=ctx.cfg.cluster.transport)

    def _lose(self, peer: int, exc: BaseException) -> None:
        if peer not in self.lost:
            logger.warning("worker %d: lost worker %d in AD-PSGD (%s); carrying on without it", self.rank, peer, exc)
        self.lost.add(peer)
        self.live.discard(peer)

    def _serve(self, peer: int, link: Link) -> None:
        """Answer ``peer``'s averaging requests until it says goodbye or is lost."""
        flat = self.params.flat
        inbox = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        reply = torch.empty_like(flat)
        while True:
            try:
                link.recv_from_peer(inbox, TAG_GOSSIP)
            except CommError as exc:
                self._lose(peer, exc)
                return
            if inbox[0].item() == _OP_BYE:
                return
            with self.lock, torch.no_grad():
                flat.add_(inbox[1:]).mul_(0.5)
                reply.copy_(flat)
                self.served += 1
            try:
                link.send_to_peer(reply, TAG_GOSSIP)
            except CommError as exc:
                self._lose(peer, exc)
                return

    def _average_with_a_neighbour(self) -> None:
        """One atomic pairwise averaging with a random live target (Lian et al. 2018,
        Algorithm 1, line 'x_i = x_j = (x_i + x_j) / 2')."""
        peer = self.pairing.pick(self.rank, self.live)
        if peer is None:
            return
        link = self.links[peer]
        failure: CommError | None = None
        with self.lock, torch.no_grad():
            self.outbox[0] = _OP_AVERAGE
            self.outbox[1:].copy_(self.params.flat)
            try:
                link.send_to_peer(self.outbox, TAG_GOSSIP)
                link.recv_from_peer(self.reply, TAG_GOSSIP)
                self.params.flat.copy_(self.reply)
                self.averagings += 1
            except CommError as exc:
                failure = exc
        if failure is not None:
            self._lose(peer, failure)

    def _step_async(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        with self.lock:
            self.compute.flat.copy_(self.params.flat)
        self.compute_model.zero_grad(set_to_none=True)
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.compute_model, x, y)
            loss.backward()
        if self.pairing.active(self.rank):
            self._average_with_a_neighbour()
        with self.lock:
            for p, g in zip(self.params.params, self.compute.grads()):
                p.grad = g
            self.optimizer.step()
        return StepStats(loss=loss.item())

    def _say_goodbye(self) -> None:
        self.outbox.zero_()
        self.outbox[0] = _OP_BYE
        for peer in sorted(self.live):
            try:
                self.links[peer].send_to_peer(self.outbox, TAG_GOSSIP)
            except CommError as exc:
                self._lose(peer, exc)
        self.live.clear()

    def _wait_for_listeners(self) -> None:
        """Keep answering until every neighbour that averages with us has said goodbye
        (or was lost), at most the job's timeout."""
        deadline = time.monotonic() + self.ctx.cfg.cluster.timeout
        for thread in self.listeners:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _final_async(self) -> dict[str, Any]:
        """Say goodbye, finish answering, leave this replica in the store; worker 0
        averages the replicas of every worker that finished (waiting at most the job's
        timeout for the others). Goodbyes go out before any wait, so no worker waits on
        one that waits on it."""
        store = self.ctx.store
        self._say_goodbye()
        self._wait_for_listeners()
        for peer in sorted(self.lost):
            store.set(lost_key(f"worker {peer}"), "no answer in AD-PSGD")
        with self.lock:
            mine = self.params.flat.detach().cpu().clone()
        leave_replica(store, "gossip", self.rank, mine)
        if self.rank != 0:
            return {}
        replicas = collect_replicas(store, "gossip", mine, self.topology.size, self.ctx.cfg.cluster.timeout,
                                    gone=lambda r: store.check([lost_key(f"worker {r}")]))
        mean, self.final = final_consensus(replicas)
        self.holder_flat.flat.copy_(mean)
        return dict(self.final)

    # --- the interface --------------------------------------------------------------------

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        return self._step_async(x, y) if self.asynchronous else self._step_sync(x, y)

    def global_model(self) -> torch.nn.Module:
        return self.holder

    def replica(self) -> torch.nn.Module:
        return self.model

    def prepare_snapshot(self, final: bool = False) -> dict[str, Any]:
        if self.asynchronous:
            if final:
                return self._final_async()
            with self.lock:
                self.holder_flat.flat.copy_(self.params.flat)
            return {}
        fields = self.probe.average(self.params.flat)  # a collective: every worker takes part
        if final:
            self.final = dict(fields)
        return fields if self.rank == 0 else {}

    def agree(self, flag: bool) -> bool:
        if self.asynchronous:
            return store_agree(self.ctx.store, _STOP_KEY, flag)
        return self.probe.agree(flag, self.ctx.device)

    def final_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"averagings": self.averagings, "served": self.served, **self.final}
        if self.asynchronous:
            out["lost_peers"] = sorted(self.lost)
        return out

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        s = cfg.strategy
        topology = make_topology(s.topology, cfg.cluster.workers, s.mixing)
        workers = records["worker"]
        first = workers.get(0, {})
        out: dict[str, Any] = {
            **replica_summary(records), "algorithm": None, "topology": s.topology, "mixing": s.mixing,
            "degree": [topology.degree(r) for r in range(topology.size)],
            "spectral_gap": topology.spectral_gap(),
            "gossip_order": None if s.async_gossip else s.gossip_order, "async": s.async_gossip,
            "consensus_distance": first.get("consensus_distance"),
            "consensus_distance_relative": first.get("consensus_distance_relative"),
        }
        if s.async_gossip:
            # Each worker walks its own partition at its own pace: count every worker's steps
            # (the budget of N x P updates, less what lost workers made or held).
            steps = sum(w["steps"] for w in workers.values())
            samples = steps * (cfg.run.batch_size // cfg.cluster.workers)
            wall = max((w["wall_seconds"] for w in workers.values()), default=0.0)
            out.update(steps=steps, samples=samples, updates_applied=steps, wall_seconds=wall,
                       wall_seconds_per_worker=[workers[r]["wall_seconds"] if r in workers else None
                                                for r in range(cfg.cluster.workers)],
                       steps_per_worker=[workers[r]["steps"] if r in workers else None
                                         for r in range(cfg.cluster.workers)],
                       update_budget=next((w["update_budget"] for w in workers.values()
                                           if w.get("update_budget") is not None), None),
                       samples_per_second=samples / wall if wall else None,
                       pairwise_averagings=sum(w.get("averagings", 0) for w in workers.values()),
                       replicas_averaged=first.get("replicas_averaged"))
        return out

    def close(self) -> None:
        if self.asynchronous:
            self._wait_for_listeners()  # already done after a normal end; bounded after an error
            for link in list(self.links.values()) + list(self.in_links.values()):
                link.close()
            return
        self.probe.close()
        self.group.close()
