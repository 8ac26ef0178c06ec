"""``sandblaster``: Sandblaster L-BFGS (Dean et al. 2012, section 4.2).

Processes. A ``coordinator`` runs L-BFGS (``sandblaster/lbfgs.py``) without holding a
parameter: it sends small commands (dot, axpy, scale, copy, linear combination, Gram
matrix) to ``--servers S`` shards, each of which holds its range of every vector,
including the (s, y) history (``sandblaster/shard.py``). ``--workers N`` replicas compute
gradients.

Work units. Each evaluation of the objective (the loss and gradient at a trial point) is
one pass over the batch (``--batch-size``; one at least the training set is full-batch
L-BFGS) in units of ``--unit-size`` samples. An idle replica claims the next unit
(``sandblaster/scheduler.py``), pulls the trial point once per evaluation, and pushes the
unit's gradient sum and loss sum to every shard, tagged with the unit's id; fast replicas
do more units. Near the end of an evaluation idle replicas take backup copies of the
outstanding units (``--backup-after``); a unit counts once however many copies finish.

Membership. ``plexus worker --join HOST:PORT`` adds a replica to a running job: the shards
open a link to it and it takes units from the next evaluation on.

Faults. A replica that dies loses only the unit it held: its shards' links break, the
unit is re-run by an idle replica, and the summary names the lost replica.
``--kill worker:K@step=N`` kills replica K while it holds its N-th unit, after pushing it
to the first shard only, which is the case the exactly-once rule must survive.

Length. ``--steps`` counts L-BFGS iterations (each one direction and line search); a
worker's steps in the summary are the units it computed. Full-batch runs stop early when
torch.optim.LBFGS's tolerances say the optimum is reached.
"""
from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from plexus.cluster.group import Link
from plexus.cluster.rendezvous import store_get_json, store_set_json, wait_keys
from plexus.config import JobConfig
from plexus.errors import ConfigError, ProtocolError
from plexus.sandblaster import wire
from plexus.sandblaster.coordinator import Coordinator, ShardVectors
from plexus.sandblaster.lbfgs import Settings, Slot
from plexus.sandblaster.scheduler import PREFIX, Claims, Opening
from plexus.sandblaster.shard import Shard, shard_range
from plexus.sandblaster.wire import Accepted, Kind
from plexus.strategies.base import Context, LossFn, RoleContext, StepStats, Strategy
from plexus.train.batches import GlobalBatches
from plexus.train.feed import ClaimFeed, Feed, total_steps

__all__ = ["SandblasterStrategy", "unit_size"]

_MODEL_KEY = f"{PREFIX}/model"
_SAMPLES_KEY = f"{PREFIX}/samples"
_JOB_KEY = f"{PREFIX}/job"
_JOINED_KEY = f"{PREFIX}/joined"
_DONE_KEY = f"{PREFIX}/done"
_STOP_REQUEST = f"{PREFIX}/stop_request"


def unit_size(cfg: JobConfig, samples: int) -> int:
    """``--unit-size``, or batch / (8 x workers): units much smaller than 1/N of the batch,
    so that a fast replica can take more of them."""
    batch = min(cfg.run.batch_size, samples)
    return cfg.strategy.unit_size or max(1, batch // (8 * cfg.cluster.workers))


def _servers(cfg: JobConfig) -> int:
    return max(1, cfg.cluster.servers)


class SandblasterStrategy(Strategy):
    name = "sandblaster"
    synchronous = False

    # --- configuration and roles ---------------------------------------------------------

    @classmethod
    def check_config(cls, cfg: JobConfig) -> None:
        s = cfg.strategy
        if s.unit_size > cfg.run.batch_size:
            raise ConfigError(f"unit_size must not exceed batch_size ({cfg.run.batch_size}), got {s.unit_size}: a "
                              f"unit is a part of the batch; pass --unit-size {max(1, cfg.run.batch_size // 8)} "
                              f"or less")

    @classmethod
    def extra_roles(cls, cfg: JobConfig) -> list[tuple[str, int]]:
        return [("server", _servers(cfg)), ("coordinator", 1)]

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        return role == "worker"

    @classmethod
    def job_record(cls, store, timeout: float) -> dict[str, Any]:
        """The running job's configuration and run directory, as the coordinator published them."""
        wait_keys(store, [_JOB_KEY], timeout, "the coordinator of the sandblaster job")
        return store_get_json(store, _JOB_KEY)

    @classmethod
    def joined_workers(cls, store) -> int:
        return int(store.add(_JOINED_KEY, 0))

    @classmethod
    def admit(cls, store, cfg: JobConfig) -> int:
        """A rank for a replica that joins the running job: the shards watch the counter and
        open a link to it, and it takes units from the next evaluation on."""
        if store.check([_DONE_KEY]):
            raise ConfigError("the job has already finished: its coordinator stopped; start a new job")
        return cfg.cluster.workers + store.add(_JOINED_KEY, 1) - 1

    @classmethod
    def run_role(cls, role: str, rank: int, ctx: RoleContext) -> None:
        cfg = ctx.cfg
        wait_keys(ctx.store, [_MODEL_KEY], cfg.cluster.timeout, "worker 0's model description")
        model = store_get_json(ctx.store, _MODEL_KEY)
        # Shards and the coordinator hold host tensors: their links are gloo whatever the
        # replicas compute on (a replica moves its gradients to the host to push them).
        link_args = dict(traffic=ctx.traffic, timeout=cfg.cluster.timeout, backend="gloo",
                         net=cfg.cluster.net, transport=cfg.cluster.transport)
        if role == "server":
            shard = Shard(ctx.store, rank, _servers(cfg), model["numel"], getattr(torch, model["dtype"]),
                          cfg.cluster.workers, joined=lambda: cls.joined_workers(ctx.store), **link_args)
            record = shard.serve()
            store_set_json(ctx.store, f"stats/server/{rank}", {**record, "bytes_sent": ctx.traffic.bytes_sent,
                                                                "bytes_recv": ctx.traffic.bytes_recv,
                                                                "traffic": ctx.traffic.snapshot()})
            return
        if role != "coordinator":
            raise ConfigError(f"strategy sandblaster has no role {role!r}")
        store_set_json(ctx.store, _JOB_KEY, {"config": cfg.to_dict(),
                                             "run_dir": str(ctx.run_dir) if ctx.run_dir else None})
        links = [Link(ctx.store, "coordinator 0", f"server {s}", tag="sandblaster", **link_args)
                 for s in range(_servers(cfg))]
        vectors = ShardVectors(links, cfg.cluster.timeout)
        s = cfg.strategy
        settings = Settings(lr=cfg.optim.lr, history=s.history, line_search=s.line_search, recursion=s.lbfgs)
        wait_keys(ctx.store, [_SAMPLES_KEY], cfg.cluster.timeout, "worker 0's training set size")
        samples = int(ctx.store.get(_SAMPLES_KEY).decode())
        coordinator = Coordinator(ctx.store, vectors, settings, batch_size=min(cfg.run.batch_size, samples),
                                  unit_size=unit_size(cfg, samples), samples=samples, timeout=cfg.cluster.timeout,
                                  weight_decay=cfg.optim.weight_decay, log=ctx.log.log, clock=time.time)
        wait_keys(ctx.store, ["train/t0"], cfg.cluster.timeout, "worker 0's start time")
        t0 = float(ctx.store.get("train/t0").decode())
        iterations = total_steps(cfg, coordinator.steps_per_epoch)
        stop_requested = lambda: ctx.store.check([_STOP_REQUEST])  # noqa: E731
        try:
            record = coordinator.run(iterations, cfg.run.time_limit, start=t0, stopped=stop_requested)
        finally:
            ctx.store.set(_DONE_KEY, "1")  # no replica joins after this
            for link in links:
                try:
                    link.send_to_peer(wire.header(Kind.STOP))
                    link.recv_from_peer(torch.empty(wire.HEADER_LEN, dtype=torch.int64))
                finally:
                    link.close()
        store_set_json(ctx.store, "stats/coordinator/0", {
            **record, "units_per_evaluation": coordinator.units, "batch_size": coordinator.batch_size,
            "unit_size": unit_size(cfg, samples), "numel": model["numel"], "element_bytes": model["element_bytes"],
            "bytes_sent": ctx.traffic.bytes_sent, "bytes_recv": ctx.traffic.bytes_recv,
            "traffic": ctx.traffic.snapshot()})

    # --- a replica -----------------------------------------------------------------------

    def setup(self, model: nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.model, self.loss_fn, self.ctx, self.cfg = model, loss_fn, ctx, ctx.cfg
        self.rank = ctx.info.rank
        self.params = [p for p in model.parameters() if p.requires_grad]
        flat = parameters_to_vector(self.params).detach().cpu()
        self.numel, self.dtype = flat.numel(), flat.dtype
        self.shards = _servers(self.cfg)
        self.ranges = [shard_range(self.numel, self.shards, s) for s in range(self.shards)]
        self.trial_model = copy.deepcopy(model)
        self.claims: Claims | None = None
        self.rejected = {Accepted.DUPLICATE.name.lower(): 0, Accepted.STALE.name.lower(): 0}
        self.steps = 0
        if self.rank == 0:
            store_set_json(ctx.store, _MODEL_KEY, {"numel": self.numel, "dtype": str(self.dtype).split(".")[-1],
                                                   "element_bytes": flat.element_size()})
        self.links = [Link(ctx.store, f"worker {self.rank}", f"server {s}", tag="sandblaster",
                           traffic=ctx.traffic, timeout=self.cfg.cluster.timeout, backend="gloo",
                           net=self.cfg.cluster.net, transport=self.cfg.cluster.transport)
                      for s in range(self.shards)]
        if self.rank == 0:
            for link, (start, end) in zip(self.links, self.ranges):
                link.send_to_peer(wire.header(Kind.INIT, end - start))
                link.send_to_peer(flat[start:end].contiguous())
                self._reply(link)

    def feed(self, ctx: Context, samples: int, shared_budget: bool = True) -> Feed:
        """The coordinator's scheduler hands out the units of data (``Claims``), and says
        when the run ends, whatever ``--steps``."""
        if self.rank == 0:
            self.ctx.store.set(_SAMPLES_KEY, str(samples))
        batch = min(self.cfg.run.batch_size, samples)
        batches = GlobalBatches(samples, batch, self.cfg.run.seed)
        self.claims = Claims(self.ctx.store, self.rank, batch, unit_size(self.cfg, samples),
                             self.cfg.strategy.backup_after, batches.indices, self._pull_trial,
                             self.cfg.cluster.timeout)
        return ClaimFeed(self.cfg, ctx.store, self.rank, ctx.info.world_size, self.claims)

    def _reply(self, link: Link) -> tuple[Kind, int]:
        head = torch.empty(wire.HEADER_LEN, dtype=torch.int64)
        link.recv_from_peer(head)
        kind, a, *_ = wire.check(head, f"worker {self.rank}")
        if kind != Kind.REPLY:
            raise ProtocolError(f"worker {self.rank}: {link.peer} answered {kind.name}")
        return kind, a

    def _pull(self, slot: int, evaluation: int, into: nn.Module) -> None:
        flat = torch.empty(self.numel, dtype=self.dtype)
        for link in self.links:
            link.send_to_peer(wire.header(Kind.PULL, slot, evaluation))
        for link, (start, end) in zip(self.links, self.ranges):
            _, count = self._reply(link)
            if count != end - start:
                raise ProtocolError(f"worker {self.rank}: {link.peer} sent {count} elements, {end - start} expected")
            link.recv_from_peer(flat[start:end])
        params = [p for p in into.parameters() if p.requires_grad]
        with torch.no_grad():
            vector_to_parameters(flat.to(params[0].device), params)

    def _pull_trial(self, opening: Opening) -> None:
        self._pull(Slot.T, opening.evaluation, self.model)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        """Compute the claimed unit's gradient sum and loss sum at the trial point and push
        them to every shard. The loss reported is the objective L-BFGS has accepted so far
        (trial points of a line search may be far worse, and are not the run's progress);
        the unit's own loss until there is one."""
        evaluation, unit = self.claims.current
        n = len(x)
        with self.ctx.emulator.compute():
            for p in self.params:
                p.grad = None
            loss = self.loss_fn(self.model, x, y)
            (loss * n).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in self.params]).detach().cpu()
        loss_sum = torch.tensor([float(loss.detach()) * n], dtype=torch.float64)
        for s, (link, (start, end)) in enumerate(zip(self.links, self.ranges)):
            if s == 1:
                # --kill lands here: pushed to the first shard only (module docstring).
                self.ctx.emulator.at_step(self.steps + 1)
            link.send_to_peer(wire.header(Kind.PUSH, evaluation, unit, end - start))
            link.send_to_peer(grad[start:end].contiguous())
            link.send_to_peer(loss_sum)
            _, answer = self._reply(link)
            if answer != Accepted.YES:
                self.rejected[Accepted(answer).name.lower()] += 1
        if self.shards == 1:
            self.ctx.emulator.at_step(self.steps + 1)
        self.claims.finished()
        self.steps += 1
        objective = self.claims.opening.objective
        return StepStats(loss=float(loss.detach()) if objective is None else objective)

    def global_model(self) -> nn.Module:
        return self.trial_model

    def prepare_snapshot(self, final: bool = False) -> dict[str, Any]:
        if self.rank == 0:
            self._pull(Slot.X, -1, self.trial_model)
        return {}

    def agree(self, flag: bool) -> bool:
        """A time limit or target reached: ask the coordinator to stop after its iteration;
        the replicas go on until it has."""
        if flag:
            self.ctx.store.set(_STOP_REQUEST, "1")
        return False

    def final_record(self) -> dict[str, Any]:
        claims = self.claims.record() if self.claims is not None else {}
        return {**claims, "pushes_rejected": self.rejected}

    def close(self) -> None:
        for link in getattr(self, "links", []):
            try:
                link.send_to_peer(wire.header(Kind.BYE))
            except Exception:  # noqa: BLE001 - the shard may be gone at the end of a failed job
                pass
            link.close()

    # --- summary -------------------------------------------------------------------------

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        coord = records.get("coordinator", {}).get(0) or records.get("coordinator", {}).get("0") or {}
        servers = records.get("server", {})
        workers = records["worker"]
        history = coord.get("lbfgs_history", [])
        later = [row for row in history[1:]]
        steady = [row for row in later if row["pairs"] == cfg.strategy.history] or later
        lost = sorted({r for rec in servers.values() for r in rec["lost"]}
                      | {r for r in range(cfg.cluster.workers) if r not in workers})
        evaluations = coord.get("evaluations", 0)
        units = coord.get("units_per_evaluation", 0)
        vector_bytes = coord.get("numel", 0) * coord.get("element_bytes", 0)
        samples = sum(w.get("units_done", 0) for w in workers.values()) * (coord.get("unit_size") or 0)
        wall = records["eval"].get("wall_seconds") or max((w["wall_seconds"] for w in workers.values()), default=0)
        return {
            "samples": samples,
            "samples_per_second": samples / wall if wall else None,
            "updates_applied": coord.get("iterations"),
            "servers": _servers(cfg),
            "lbfgs": cfg.strategy.lbfgs,
            "line_search": cfg.strategy.line_search,
            "iterations": coord.get("iterations"),
            "converged": coord.get("converged"),
            "objective_evaluations": evaluations,
            "final_objective": coord.get("final_objective"),
            "objective_by_iteration": [row["loss"] for row in history],
            "round_trips_per_iteration": (sum(r["round_trips"] for r in later) / len(later)) if later else None,
            "direction_round_trips_per_iteration":
                (sum(r["direction_round_trips"] for r in steady) / len(steady)) if steady else None,
            "batch_seconds_mean": coord["evaluation_seconds"] / evaluations if evaluations else None,
            "units_per_evaluation": units,
            "unit_size": coord.get("unit_size"),
            "units_by_worker": {str(r): w.get("units_done", 0) for r, w in sorted(workers.items())},
            "unit_seconds_by_worker": {str(r): w.get("unit_seconds", 0.0) for r, w in sorted(workers.items())},
            "backups_by_worker": {str(r): w.get("backups_taken", 0) for r, w in sorted(workers.items())},
            "reruns_by_worker": {str(r): w.get("reruns_taken", 0) for r, w in sorted(workers.items())},
            "duplicates_dropped": sum(w.get("duplicates", 0) for w in workers.values()),
            "units_accepted_by_shard": [servers[s]["accepted"] for s in sorted(servers)],
            "duplicate_pushes_by_shard": [servers[s]["duplicates"] for s in sorted(servers)],
            "units_expected": evaluations * units,
            "lost_workers": lost,
            "coordinator_bytes_recv": coord.get("bytes_recv"),
            "coordinator_largest_message": coord.get("largest_message"),
            "round_trips_total": coord.get("round_trips"),
            "coordinator_bytes_sent": coord.get("bytes_sent"),
            "parameter_vector_bytes": vector_bytes,
        }
