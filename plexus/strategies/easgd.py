"""``easgd``: elastic averaging SGD, workers tied to a centre variable by an elastic force.

Asynchronous EASGD (Zhang, Choromanska and LeCun 2015, "Deep learning with elastic
averaging SGD", Algorithm 1): each worker trains its own replica x_i on its own data
partition and, every ``--period`` (tau) steps, exchanges with a centre variable x~ held by
a server process:

    e = alpha * (x_i - x~);   x_i <- x_i - e;   x~ <- x~ + e

with ``--elastic-alpha`` alpha (the paper's moving rate, alpha = lr * rho). The force
pulls the worker towards the centre and the centre towards the worker by the same
amount, so x_i + x~ is conserved by every exchange; the replicas may explore further
from the centre than plain averaging allows, which the paper credits for better minima.

The centre lives in one small server role of its own (``run_role("server", 0)``), over a
``cluster.Link`` per worker; one request per exchange: the worker sends its replica, the
server answers with the centre *before* the update and applies e, so both sides compute
the same e and each exchange is atomic at the server. Messages carry an op code in
element 0 and the tensor after it (one message, one emulated latency); an int64 header
first tells the server the model's size and dtype, so it needs neither the model nor
the data. A worker that dies breaks only its own link; the server and the others go on.

The global model evaluated on worker 0 is the centre variable as worker 0 last saw it
(after its own exchange; at the end it fetches the latest one); worker 0's own replica
is evaluated too. Each exchange costs a worker 2 x model bytes, every tau steps. At the
end every worker leaves its final replica in the job's store, and worker 0 reports how
far the replicas are from their mean (the consensus distance, as gossip and local-sgd
do), waiting at most the job's timeout, and not for workers the server lost.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import torch

from plexus.cluster.group import Link
from plexus.cluster.rendezvous import lost_key, store_set_json
from plexus.config import JobConfig
from plexus.decentral.averaging import FlatParameters, elastic_difference
from plexus.errors import CommError, ProtocolError
from plexus.strategies.base import Context, LossFn, RoleContext, Strategy, StepStats, make_optimizer
from plexus.strategies.replicas import collect_replicas, final_consensus, leave_replica, replica_summary, store_agree

__all__ = ["EasgdStrategy", "TAG_EASGD"]

logger = logging.getLogger(__name__)

TAG_EASGD = 0x6B00
_OP_HELLO = 1.0
_OP_EXCHANGE = 2.0
_OP_FETCH = 3.0
_OP_BYE = 4.0
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_STOP_KEY = "easgd/stop"
_SERVER = "server 0"


class EasgdStrategy(Strategy):
    name = "easgd"
    # Asynchronous EASGD: each worker its own partition and pace (no barrier).
    synchronous = False

    @classmethod
    def extra_roles(cls, cfg: JobConfig) -> list[tuple[str, int]]:
        return [("server", 1)]

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        # Worker 0 holds the evaluated model and the server the centre; other workers may die.
        return role == "worker" and rank != 0

    # --- worker side ------------------------------------------------------------------------

    def setup(self, model: torch.nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.model, self.loss_fn, self.ctx = model, loss_fn, ctx
        self.rank = ctx.info.rank
        self.params = FlatParameters(model)
        if self.params.flat.dtype not in _DTYPES:
            raise ProtocolError(f"worker {self.rank}: easgd sends floating-point parameters, got "
                                f"{self.params.flat.dtype}", peer=_SERVER)
        self.optimizer = make_optimizer(model.parameters(), ctx.cfg.optim)
        self.alpha = ctx.cfg.strategy.elastic_alpha
        self.period = ctx.cfg.strategy.period
        self.holder = copy.deepcopy(model)
        self.centre = FlatParameters(self.holder).flat
        flat = self.params.flat
        self.outbox = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        self.reply = torch.empty_like(flat)
        self.steps = 0
        self.exchanges = 0
        self.last: dict[str, Any] = {}
        self.consensus: dict[str, Any] = {}
        self.link = Link(ctx.store, f"worker {self.rank}", _SERVER, traffic=ctx.traffic,
                         timeout=ctx.cfg.cluster.timeout, backend=ctx.backend, net=ctx.cfg.cluster.net, tag="easgd",
                         transport=ctx.cfg.cluster.transport)
        header = torch.tensor([flat.numel(), _DTYPES.index(flat.dtype)], dtype=torch.int64)
        self.link.send_to_peer(header, TAG_EASGD)
        self._send(_OP_HELLO)

    def _send(self, op: float) -> None:
        self.outbox[0] = op
        self.outbox[1:].copy_(self.params.flat)
        self.link.send_to_peer(self.outbox, TAG_EASGD)

    @torch.no_grad()
    def _exchange(self) -> None:
        """One elastic exchange with the centre (Zhang et al. 2015, Algorithm 1)."""
        self._send(_OP_EXCHANGE)
        self.link.recv_from_peer(self.reply, TAG_EASGD)
        e = elastic_difference(self.params.flat, self.reply, self.alpha)
        self.params.flat.sub_(e)
        # The centre right after our exchange: what worker 0 evaluates as the global model.
        self.centre.copy_(self.reply).add_(e)
        self.exchanges += 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        self.optimizer.zero_grad()
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.model, x, y)
            loss.backward()
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.period == 0:
            self._exchange()
        return StepStats(loss=loss.item())

    def global_model(self) -> torch.nn.Module:
        return self.holder

    def replica(self) -> torch.nn.Module:
        return self.model

    def prepare_snapshot(self, final: bool = False) -> dict[str, Any]:
        if final:
            store = self.ctx.store
            leave_replica(store, "easgd", self.rank, self.params.flat)
            if self.rank == 0:
                # First the others' final replicas (so they have made their last exchanges),
                # then the latest centre, as the last exchange of every worker left it.
                replicas = collect_replicas(store, "easgd", self.params.flat, self.ctx.info.world_size,
                                            self.ctx.cfg.cluster.timeout,
                                            gone=lambda r: store.check([lost_key(f"worker {r}")]))
                self.consensus = final_consensus(replicas)[1]
                self.outbox.zero_()
                self.outbox[0] = _OP_FETCH
                self.link.send_to_peer(self.outbox, TAG_EASGD)
                self.link.recv_from_peer(self.centre, TAG_EASGD)
            self.outbox.zero_()
            self.outbox[0] = _OP_BYE
            self.link.send_to_peer(self.outbox, TAG_EASGD)
        if self.rank != 0:
            return {}
        self.last = {"distance_to_centre": float((self.params.flat.double() - self.centre.double()).norm()),
                     **(self.consensus if final else {})}
        return dict(self.last)

    def agree(self, flag: bool) -> bool:
        return store_agree(self.ctx.store, _STOP_KEY, flag)

    def final_record(self) -> dict[str, Any]:
        return {"exchanges": self.exchanges, **self.last}

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        server = records.get("server", {}).get(0, {})
        workers = records["worker"]
        return {**replica_summary(records), "algorithm": None, "servers": 1,
                "elastic_alpha": cfg.strategy.elastic_alpha, "period": cfg.strategy.period,
                "exchanges": server.get("exchanges"), "lost_by_server": server.get("lost"),
                "wall_seconds": max((w["wall_seconds"] for w in workers.values()), default=0.0),
                "distance_to_centre": workers.get(0, {}).get("distance_to_centre"),
                "consensus_distance": workers.get(0, {}).get("consensus_distance"),
                "consensus_distance_relative": workers.get(0, {}).get("consensus_distance_relative"),
                "replicas_averaged": workers.get(0, {}).get("replicas_averaged")}

    def close(self) -> None:
        self.link.close()

    # --- the centre variable's server -----------------------------------------------------

    @classmethod
    def run_role(cls, role: str, rank: int, ctx: RoleContext) -> None:
        if role != "server" or rank != 0:
            raise NotImplementedError(f"easgd has one server role, not {role} {rank}")
        _CentreServer(ctx).run()


class _CentreServer:
    """Holds x~ and applies each worker's elastic exchange atomically; one thread per
    worker link, so a slow or dead worker holds up nobody else."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.alpha = ctx.cfg.strategy.elastic_alpha
        self.lock = threading.Lock()
        self.centre: torch.Tensor | None = None
        self.exchanges = 0
        self.lost: list[int] = []

    def run(self) -> None:
        started = time.monotonic()
        threads = [threading.Thread(target=self._serve, args=(r,), name=f"easgd-serve-{r}", daemon=True)
                   for r in range(self.ctx.cfg.cluster.workers)]
        for thread in threads:
            thread.start()
        # Each thread ends on its worker's goodbye, or when a receive times out or breaks.
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1.0)
        traffic = self.ctx.traffic
        store_set_json(self.ctx.store, "stats/server/0", {
            "steps": 0, "wall_seconds": time.monotonic() - started, "bytes_sent": traffic.bytes_sent,
            "bytes_recv": traffic.bytes_recv, "traffic": traffic.snapshot(), "exchanges": self.exchanges,
            "lost": sorted(self.lost)})

    def _serve(self, rank: int) -> None:
        ctx, worker = self.ctx, f"worker {rank}"
        try:
            link = Link(ctx.store, _SERVER, worker, traffic=ctx.traffic, timeout=ctx.cfg.cluster.timeout,
                        backend=ctx.backend, net=ctx.cfg.cluster.net, tag="easgd",
                        transport=ctx.cfg.cluster.transport)
        except CommError as exc:
            self._lose(rank, exc)
            return
        try:
            header = torch.empty(2, dtype=torch.int64)
            link.recv_from_peer(header, TAG_EASGD)
            numel, code = int(header[0]), int(header[1])
            if numel < 1 or not 0 <= code < len(_DTYPES):
                raise ProtocolError(f"server 0: {worker} announced {numel} elements of dtype code {code}",
                                    peer=worker)
            inbox = torch.empty(numel + 1, dtype=_DTYPES[code])
            reply = torch.empty(numel, dtype=_DTYPES[code])
            while True:
                link.recv_from_peer(inbox, TAG_EASGD)
                op = float(inbox[0])
                if op == _OP_BYE:
                    return
                with self.lock, torch.no_grad():
                    if self.centre is None:
                        self.centre = inbox[1:].clone()  # every replica starts equal (contract 2)
                    elif self.centre.shape != inbox[1:].shape or self.centre.dtype != inbox.dtype:
                        raise ProtocolError(f"server 0: {worker} sent {numel} elements of {inbox.dtype}, the "
                                            f"centre has {self.centre.numel()} of {self.centre.dtype}", peer=worker)
                    if op == _OP_HELLO:
                        continue
                    reply.copy_(self.centre)
                    if op == _OP_EXCHANGE:
                        with ctx.emulator.compute():
                            self.centre.add_(elastic_difference(inbox[1:], reply, self.alpha))
                        self.exchanges += 1
                    elif op != _OP_FETCH:
                        raise ProtocolError(f"server 0: {worker} sent unknown op {op}", peer=worker)
                link.send_to_peer(reply, TAG_EASGD)
        except CommError as exc:
            self._lose(rank, exc)
        finally:
            link.close()

    def _lose(self, rank: int, exc: BaseException) -> None:
        logger.warning("server 0: lost worker %d (%s); the centre carries on with the others", rank, exc)
        with self.lock:
            self.lost.append(rank)
            # Worker 0 then stops waiting for the lost worker's final replica.
            self.ctx.store.set(lost_key(f"worker {rank}"), str(exc))
