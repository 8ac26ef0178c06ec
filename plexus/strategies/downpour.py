"""``ps``: a sharded parameter server running Downpour SGD (Dean et al. 2012) under bsp,
asp, ssp or softsync consistency, with server-side optimizers (Li et al. 2014).

Processes. ``--servers S`` server processes each hold one shard of the model (a range of
the flat buffer and, for models with one embedding table, the rows that consistent
hashing gives them; ``plexus/ps/``) and update it with their own optimizer state: sgd,
momentum, adagrad (Downpour + Adagrad) or adam, from ``--optimizer`` and ``--momentum``.

Workers. Each worker keeps a replica of the model. Every ``--fetch-every`` steps it pulls
the weights, every ``--push-every`` steps it pushes the mean of the gradients it computed
since its last push (DistBelief's n_fetch and n_push; DistBelief sends their sum, which is
this mean times n_push, so our learning rate means the same whatever n_push). A push that
is due together with a fetch travels as one fused push-and-pull: one round trip per step
with the defaults. A replica is never updated locally: between fetches it computes on the
weights it last fetched. With the ``sparse`` dataset and ``logreg`` (any model with exactly
one ``nn.Embedding``/``nn.EmbeddingBag``, looked up by the input ids), a step pulls only
the rows its batch touches and pushes only their gradients (Li et al. 2014's sparse
push/pull), so its traffic scales with the rows touched, not with the table.

Consistency and data. Where every update averages one push per worker computed on the
same weights (bsp, ssp with T = 0, softsync with N = workers, or one worker) the job is
synchronous: worker r takes the r-th slice of global batch t, and training equals one
process with the whole batch (contract 1). Otherwise each worker walks its own partition
of the data with batches of ``--batch-size / workers``, as DistBelief's replicas do.

Scheduling (Dean et al. 2012, section 4.2; ARCHITECTURE.md, section 9). ``--assignment
dynamic`` replaces the fixed partitions of an asynchronous job with one queue of units of
``--batch-size / workers`` samples: a worker claims the job's next unit whenever it is idle
(a ticket from the job's update budget, ``train/budget.py``; unit u is ``UnitBatches``' u-th
slice), so a slow worker trains on fewer samples and the job ends when its ``--steps x
workers`` units are spent, not when the slowest worker has walked its partition.
``--backup-workers b`` under bsp (Chen et al. 2016) counts b of the ``--workers P`` worker
processes as backups: each step is the average of the first N = P - b gradients computed on
that step's weights to reach a server, and later ones are dropped (``late_gradients_dropped``).
``--workers`` still counts every worker process (the launcher, the summary and the per-worker
figures see P workers); each takes its slice of ``--batch-size / P`` samples of the job's
step, so a step uses N x B / P samples. A late worker reads the new weights and goes on with
the job's current step, and every worker stops once the job has made its ``--steps`` steps,
so a straggler holds nobody up.

Faults and membership. Worker losses are tolerated under every consistency model: a
worker whose link breaks, or whose heartbeat (a counter in the store, bumped every
``--peer-timeout / 5`` s) stands still for ``--peer-timeout`` s, is removed from the live
set, and the barrier or bound goes on with the others. ``plexus worker --join HOST:PORT``
adds a worker to a running asp, ssp or softsync job; it starts from the current weights.

Evaluation. Worker 0's replica is a snapshot of the global model right after each fetch,
so the runner evaluates it off the clock (sparse tables are refreshed in full at the
evaluation steps). At the end every surviving worker says BYE and waits until the servers
have drained; the lowest-ranked survivor pulls the final model and evaluates it, so the
summary has a final accuracy even when worker 0 was lost.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plexus.cluster.checkpoint_files import load_piece
from plexus.cluster.rendezvous import store_get_json, store_set_json, wait_keys
from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.ps.client import Heartbeat, PSClient, Reply
from plexus.ps.heartbeat import heartbeat_summary
from plexus.ps.consistency import is_synchronous
from plexus.ps.protocol import Op
from plexus.ps.server import KEYS, LEDGER_BASE, ParameterServer
from plexus.ps.replication import decode_state, owner_of
from plexus.ps.server_group import ServerGroup
from plexus.ps.staleness import StalenessHistogram
from plexus.strategies.base import Context, LossFn, RoleContext, StepStats, Strategy
from plexus.train.feed import CatchUpFeed, Feed, UnitFeed

__all__ = ["DownpourStrategy", "num_servers"]

logger = logging.getLogger(__name__)

_JOB_KEY = "ps/job"
_STOP_KEY = "ps/stop"


def _wait_for_server_records(ctx: RoleContext, keys: list[str], drained: bool) -> None:
    """Server 0's wait for the other servers' final records, which they write when the
    workers are done. Server 0 normally gets here when they are; one whose shard was
    drained away gets here at the drain, and training may go on for longer than
    ``--timeout``: it looks while some worker still trains (neither finished nor lost),
    and waits ``--timeout`` more after the last one did."""
    if drained:
        workers = range(ctx.cfg.cluster.workers)
        while not ctx.store.check(keys) and any(
                not ctx.store.check([KEYS.finished(w)]) and not ctx.store.check([KEYS.lost(f"worker {w}")])
                for w in workers):
            time.sleep(0.2)
    wait_keys(ctx.store, keys, ctx.cfg.cluster.timeout, "the final records of the other servers")


def num_servers(cfg: JobConfig) -> int:
    """``--servers`` for the ps strategy; 0 (the default) means one server."""
    return max(1, cfg.cluster.servers)


def _bsp(cfg: JobConfig) -> bool:
    """Whether the servers run BSP (``ssp`` with T = 0 is BSP, Ho et al. 2013)."""
    s = cfg.strategy
    return s.consistency == "bsp" or (s.consistency == "ssp" and s.staleness == 0)


def _sparse_module(model: nn.Module) -> nn.Module | None:
    """The model's only embedding table, if it has exactly one."""
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return tables[0] if len(tables) == 1 and tables[0].weight.requires_grad else None


class DownpourStrategy(Strategy):
    name = "ps"
    # Per job: setup() sets it on the instance from the consistency model (see the module
    # docstring). The class says asynchronous, which is how the summary counts steps.
    synchronous = False

    # --- configuration and roles -------------------------------------------------------

    @classmethod
    def check_config(cls, cfg: JobConfig) -> None:
        s, c = cfg.strategy, cfg.cluster
        if s.assignment == "dynamic" and is_synchronous(s.consistency, c.workers, s.staleness, s.softsync):
            why = "one worker" if c.workers == 1 else f"--consistency {s.consistency}"
            raise ConfigError(f"assignment dynamic needs an asynchronous job (asp, ssp with --staleness 1 or more, "
                              f"or --softsync below --workers), got {why}: a synchronous step takes one slice of "
                              f"its global batch from every worker, so there are no units to hand out; drop "
                              f"--assignment dynamic or pass --consistency asp")
        if s.backup_workers:
            if not _bsp(cfg):
                raise ConfigError(f"backup_workers needs --consistency bsp, got --consistency {s.consistency}: "
                                  f"backup workers drop the late gradients of a synchronous step; asynchronous "
                                  f"consistency waits for no straggler anyway (drop --backup-workers)")
            if s.backup_workers >= c.workers:
                raise ConfigError(f"backup_workers must be less than workers ({c.workers}), got {s.backup_workers}: "
                                  f"--workers counts every worker process, backups included, and each step needs "
                                  f"the gradients of workers - backup_workers of them; pass --workers "
                                  f"{s.backup_workers + 2} or more")
            if s.fetch_every != 1 or s.push_every != 1:
                raise ConfigError(f"backup_workers needs --fetch-every 1 and --push-every 1, got {s.fetch_every} and "
                                  f"{s.push_every}: a gradient belongs to the step of the weights it was computed "
                                  f"on, so a worker pushes and fetches once per step")
        if s.softsync > c.workers:
            raise ConfigError(f"softsync must not exceed workers ({c.workers}), got {s.softsync}: an update that "
                              f"waits for more pushes than there are workers never comes; pass --softsync "
                              f"{c.workers} or less (0 means all workers)")
        if s.replication:
            servers = num_servers(cfg)
            if s.replication >= servers:
                raise ConfigError(f"replication must be less than servers ({servers}), got {s.replication}: each "
                                  f"shard is copied to its k successors on the ring of servers, other than "
                                  f"itself; pass --servers {s.replication + 1} or more, or --replication "
                                  f"{servers - 1}")
            if s.backup_workers:
                raise ConfigError("replication does not combine with backup_workers yet: a takeover rebuilds the "
                                  "gate from the workers' clocks, and a backup step's late gradients have none; "
                                  "drop --backup-workers or --replication")
        if s.ledger and c.workers > 16:
            raise ConfigError(f"ledger needs 16 workers or fewer, got {c.workers}: its codes worker x 10^6 + "
                              f"clock must stay integers that float32 holds exactly (below 2^24)")
        if s.ledger and s.strategy == "tree-ps" and c.workers > 5:
            raise ConfigError(f"ledger under tree-ps needs 5 workers or fewer, got {c.workers}: an aggregator "
                              f"sums its children's codes, and the sum must stay below 2^24 to be exact")
        if cfg.run.checkpoint_every and (s.push_every > 1 or s.fetch_every > 1):
            raise ConfigError("checkpoint_every needs --push-every 1 and --fetch-every 1: a checkpoint is taken "
                              "at a step boundary, where a worker holds no gradient it has not pushed yet")
        if c.peer_timeout >= c.timeout:
            raise ConfigError(f"peer_timeout must be shorter than timeout ({c.timeout:g} s), got "
                              f"{c.peer_timeout:g}: servers must drop a silent worker before the others' waits "
                              f"for it time out; pass --peer-timeout {max(1.0, c.timeout / 6):g}")

    @classmethod
    def extra_roles(cls, cfg: JobConfig) -> list[tuple[str, int]]:
        return [("server", num_servers(cfg))]

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        """Workers under every consistency; servers too once their shards have replicas."""
        return role == "worker" or (role == "server" and cfg.strategy.replication > 0)

    @classmethod
    def shares_budget(cls, cfg: JobConfig) -> bool:
        """Under ``--assignment dynamic`` the budget's tickets are the job's data units."""
        return cfg.strategy.assignment == "dynamic"

    @classmethod
    def checkpoint_servers(cls, cfg: JobConfig) -> int:
        return num_servers(cfg)

    @classmethod
    def run_role(cls, role: str, rank: int, ctx: RoleContext) -> None:
        if role != "server":
            raise ConfigError(f"strategy ps has no role {role!r}")
        # A risky server momentum under asynchrony is reported once at start (config.defaults.risks).
        if rank == 0:
            # What a worker that joins later needs: the job and where it writes.
            store_set_json(ctx.store, _JOB_KEY, {"config": ctx.cfg.to_dict(),
                                                 "run_dir": str(ctx.run_dir) if ctx.run_dir else None})
        # Flat ps servers take part in the group: replicas, takeovers and drains (tree-ps's
        # root servers, whose children are aggregators, do not).
        group = ServerGroup(ctx.store, rank, ctx.cfg, ctx.traffic, ctx.log.log) \
            if cls.root_children(ctx.cfg) is None else None
        # --resume: the shard as the checkpoint holds it (train/checkpoint.py).
        state = decode_state(load_piece(Path(ctx.cfg.run.resume), f"server-{rank}")["shard"]) \
            if ctx.cfg.run.resume else None
        server = ParameterServer(ctx.store, rank, ctx.cfg, ctx.traffic, cls.root_children(ctx.cfg),
                                 readers=cls.root_readers(ctx.cfg), log=ctx.log.log, state=state,
                                 resumed=state is not None,
                                 checkpoints=ctx.run_dir if ctx.cfg.run.checkpoint_every else None)
        record = server.serve()
        if group is not None:
            group.finish()
        mine = server.moved_to is None  # a shard that moved on is recorded by its last server
        if rank == 0:
            # Before this server's own record: worker 0 ends the job, store included, once it
            # has every server's record (under torchrun nothing waits for this process after).
            servers = num_servers(ctx.cfg)
            keys = [f"stats/server/{s}" for s in range(servers) if s != rank or not mine]
            _wait_for_server_records(ctx, keys, drained=not mine)
            histogram = StalenessHistogram(record["staleness_counts"]) if mine else StalenessHistogram()
            for key in keys:
                histogram = histogram.merge(StalenessHistogram(store_get_json(ctx.store, key)["staleness_counts"]))
            t0 = float(ctx.store.get("train/t0").decode()) if ctx.store.check(["train/t0"]) else time.time()
            ctx.log.log("staleness_histogram", time=time.time() - t0, counts=histogram.counts,
                        mean=histogram.mean, max=histogram.max)
        if mine:
            store_set_json(ctx.store, f"stats/server/{rank}", record)

    @classmethod
    def root_children(cls, cfg: JobConfig) -> list[str] | None:
        """The processes that talk to the servers (None: the workers)."""
        return None

    @classmethod
    def root_readers(cls, cfg: JobConfig) -> list[str]:
        """Processes that only read the weights from the servers, on links of their own
        (``ps/readers.py``); none here, where every worker pulls on its push link."""
        return []

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        """Counts from the servers: a push counts as applied (acknowledged) when any shard
        applied (acknowledged) it; every push goes to every shard, which apply a worker's
        pushes in order, so per worker that is the maximum over shards."""
        servers = records.get("server", {})
        workers = sorted({int(w) for rec in servers.values() for w in rec["applied"]})

        def total(field: str) -> int:
            return sum(max(rec[field].get(str(w), 0) for rec in servers.values()) for w in workers)

        histogram = StalenessHistogram()
        for rec in servers.values():
            histogram = histogram.merge(StalenessHistogram(rec["staleness_counts"]))
        lost = {r for r in range(cfg.cluster.workers) if r not in records["worker"]}
        lost |= {int(w) for rec in servers.values() for w in rec["lost"]}
        s = cfg.strategy
        out: dict[str, Any] = {
            "servers": num_servers(cfg),
            "consistency": s.consistency,
            "updates_applied": total("applied"),
            "pushes_acknowledged": total("acked"),
            "server_versions": [servers[r]["version"] for r in sorted(servers)],
            "staleness_mean": histogram.mean,
            "staleness_max": histogram.max,
            "staleness_histogram": histogram.counts,
            "lost_workers": sorted(lost),
            "joined_workers": sorted({int(w) for rec in servers.values() for w in rec["joined"]}),
            # The shard version each joined worker started from (the oldest over shards).
            "join_versions": {w: min(rec["joined"][w] for rec in servers.values() if w in rec["joined"])
                              for w in sorted({w for rec in servers.values() for w in rec["joined"]}, key=int)},
            "updates_applied_by_worker": {str(w): max(rec["applied"].get(str(w), 0) for rec in servers.values())
                                          for w in workers},
            "protocol_errors": sum(rec["protocol_errors"] for rec in servers.values()),
            "assignment": s.assignment,
            # Samples each worker trained on (dynamic assignment gives a slow worker fewer).
            "samples_by_worker": {str(r): w.get("samples") for r, w in sorted(records["worker"].items())},
            "bytes_received_by_servers": sum(rec["bytes_recv"] for rec in servers.values()),
            **heartbeat_summary(records),
        }
        if records["worker"]:
            # The job lasts until its slowest worker is done, not until the evaluator is.
            wall = max(w["wall_seconds"] for w in records["worker"].values())
            share = cfg.run.batch_size // cfg.cluster.workers
            samples = sum(w["steps"] for w in records["worker"].values()) * share
            if s.backup_workers and servers:
                # A step is one version of every shard, made from N gradients of B / P samples.
                steps = min(rec["version"] for rec in servers.values())
                out.update(steps=steps)
                samples = steps * (cfg.cluster.workers - s.backup_workers) * share
            elif is_synchronous(s.consistency, cfg.cluster.workers, s.staleness, s.softsync):
                steps = max(w["steps"] for w in records["worker"].values())
                out.update(steps=steps)
                samples = steps * cfg.run.batch_size
            out.update(samples=samples, wall_seconds=wall, samples_per_second=samples / wall if wall else None)
        migrations = [m for rec in servers.values() for m in rec.get("migrations", [])]
        if migrations:  # drains: each shard that moved, when, and how long each phase took
            out["migrations"] = sorted(migrations, key=lambda m: (m["shard"], m["version"]))
        if s.replication:
            out.update(_replication_summary(cfg, records))
        if s.ledger:
            out.update(_ledger_summary(servers))
        if s.backup_workers:
            late = {str(w): max(rec.get("late", {}).get(str(w), 0) for rec in servers.values()) for w in workers}
            out.update(backup_workers=s.backup_workers, gradients_per_step=cfg.cluster.workers - s.backup_workers,
                       late_gradients_dropped=sum(late.values()), late_gradients_by_worker=late)
        return out

    # --- joining --------------------------------------------------------------------

    @classmethod
    def job_record(cls, store, timeout: float) -> dict[str, Any]:
        """The running job's configuration and run directory, as server 0 published them."""
        wait_keys(store, [_JOB_KEY], timeout, "the parameter servers of the job (is it a --strategy ps job?)")
        return store_get_json(store, _JOB_KEY)

    @classmethod
    def joined_workers(cls, store) -> int:
        return int(store.add(KEYS.joined, 0))

    @classmethod
    def late_records(cls, cfg: JobConfig, store) -> list[tuple[str, int]]:
        """A shard drained into a spare (``plexus server --join``) is recorded by the spare,
        after its last worker left, which may be after the launcher's processes ended."""
        if cls.root_children(cfg) is not None or not int(store.add(KEYS.spares, 0)):
            return []
        servers = num_servers(cfg)
        return [("server", s) for s in range(servers) if owner_of(store, s) >= servers]

    @classmethod
    def admit(cls, store, cfg: JobConfig) -> int:
        """A rank for a worker that joins the running job (the servers watch the counter)."""
        s = cfg.strategy
        if store.check([KEYS.drained(0)]):
            raise ConfigError("the job has already finished: its servers drained; start a new job")
        if not (s.consistency == "bsp" or (s.consistency == "ssp" and s.staleness == 0)):
            return cfg.cluster.workers + store.add(KEYS.joined, 1) - 1
        raise ConfigError(f"a --consistency {cfg.strategy.consistency} job admits no workers after the start: "
                          f"a synchronous barrier cannot grow; run the job with asp, ssp or softsync")

    # --- worker side ----------------------------------------------------------------------

    def setup(self, model: nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        cfg, s = ctx.cfg, ctx.cfg.strategy
        self.model, self.loss_fn, self.ctx, self.cfg = model, loss_fn, ctx, cfg
        self.rank = ctx.info.rank
        # A worker that joined (rank >= workers) walks a partition of its own: under asp a
        # job of one worker is synchronous, and the slice of the global batch it would take
        # at rank 1 of 1 is empty.
        self.synchronous = is_synchronous(s.consistency, cfg.cluster.workers, s.staleness, s.softsync) \
            and self.rank < cfg.cluster.workers
        self.fetch_every, self.push_every = s.fetch_every, s.push_every
        self.backups = s.backup_workers > 0
        module = self.table_of(model) if ctx.device.type == "cpu" else None
        self.table_module = module
        self.table = module.weight.data if module is not None else None
        if module is not None and s.backup_workers:
            raise ConfigError("backup_workers needs a model without an embedding table pushed by rows: a sparse "
                              "step fetches its rows only when the next step starts, too late to know which step "
                              "of the job it belongs to; drop --backup-workers or use a dense model")
        dense = [p for p in model.parameters() if module is None or p is not module.weight]
        dtypes = {p.dtype for p in dense} | ({module.weight.dtype} if module is not None else set())
        if len(dtypes) > 1:
            raise ConfigError(f"strategy ps keeps the model as one flat buffer and needs one parameter dtype, "
                              f"got {sorted(map(str, dtypes))}: cast the model to one dtype")
        dtype = dtypes.pop() if dtypes else torch.float32
        numel = sum(p.numel() for p in dense)
        # Dense parameters become views of one flat buffer (on CPU; elsewhere it is a staging copy).
        self.on_cpu = ctx.device.type == "cpu"
        self.dense = dense
        self.flat = torch.cat([p.detach().reshape(-1).cpu() for p in dense]) if dense else torch.empty(0, dtype=dtype)
        self.gflat = torch.zeros_like(self.flat)
        offset = 0
        self.views: list[tuple[nn.Parameter, torch.Tensor]] = []
        for p in dense:
            view, grad = self.flat[offset:offset + p.numel()].view_as(p), self.gflat[offset:offset + p.numel()]
            if self.on_cpu:
                p.data = view
            self.views.append((p, grad.view_as(p)))
            offset += p.numel()
        if module is not None:
            module.sparse = True  # backward yields the rows the batch touched, not a [rows, width] tensor
        rows, width = (self.table.shape[0], self.table.shape[1]) if module is not None else (0, 0)
        self.heartbeat = Heartbeat(ctx.store, self.rank, cfg.cluster.peer_timeout / 5, limit=cfg.cluster.peer_timeout,
                                   log=ctx.log.log if ctx.log is not None else None)
        self.client = PSClient(ctx.store, self.rank, num_servers(cfg), numel=numel, dtype=dtype, rows=rows,
                               width=width, traffic=ctx.traffic, timeout=cfg.cluster.timeout, net=cfg.cluster.net,
                               transport=cfg.cluster.transport, replicated=s.replication > 0,
                               **self.uplink())
        try:
            self.client.connect()
            self.client.init(self.flat, self.table)
        except BaseException:
            # The runner calls close() only after a successful setup.
            self.client.close()
            self.heartbeat.stop(cfg.cluster.timeout)
            raise
        self._load()
        self.init_versions = list(self.client.versions)
        self.steps = 0
        self.clock = 0                      # pushes so far
        self.fresh = True                   # the replica holds weights fetched after the last push
        self.acc_count = 0
        self.acc_versions = list(self.client.versions)
        self.acc_dense = torch.zeros_like(self.flat) if self.push_every > 1 else None
        self.acc_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.samples = 0                    # trained on by this worker
        self.finished = False

    # --- checkpoints: a worker's position; the shards hold the rest -------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        if self.table is not None:
            raise ConfigError("checkpoint_every does not cover a sparse table yet: its rows are not in a shard's "
                              "checkpoint; drop --checkpoint-every, or use a model without an embedding table")
        return {"clock": self.clock, "worker_steps": self.steps, "samples": self.samples}

    def restore_checkpoint(self, mine: dict[str, Any], read) -> None:
        self.clock, self.steps, self.samples = int(mine["clock"]), int(mine["worker_steps"]), int(mine["samples"])

    def table_of(self, model: nn.Module) -> nn.Module | None:
        """The embedding table pushed and pulled by rows, if any."""
        return _sparse_module(model)

    def uplink(self) -> dict[str, Any]:
        """Where this worker's client connects (PSClient's ``sender`` and ``parent``): the servers."""
        return {}

    def _load(self) -> None:
        """After a pull: make the model's parameters hold the flat buffer (a no-op on CPU)."""
        if not self.on_cpu:
            offset = 0
            with torch.no_grad():
                for p in self.dense:
                    p.copy_(self.flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _gather_grads(self) -> None:
        """Make the flat gradient hold every dense parameter's gradient."""
        for p, view in self.views:
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(view.shape))
                if self.on_cpu:
                    p.grad = view  # accumulate in place from now on

    def _row_grads(self, keys: torch.Tensor) -> torch.Tensor:
        """The table's gradient as rows [len(keys), width], checking it touched only ``keys``."""
        grad = self.table_module.weight.grad
        rows = torch.zeros(len(keys), self.table.shape[1], dtype=self.table.dtype)
        if grad is None:
            return rows
        grad = grad.coalesce() if grad.is_sparse else grad.to_sparse().coalesce()
        index, values = grad.indices()[0], grad.values()
        where = torch.searchsorted(keys, index)
        if len(index) and (bool((where >= len(keys)).any()) or not torch.equal(keys[where], index)):
            raise ConfigError("the model's embedding is not looked up by the input ids, so strategy ps cannot "
                              "tell which rows a batch touches: use a model whose only embedding takes the "
                              "input ids (like logreg), or one with no single embedding table")
        rows.index_add_(0, where, values.to(rows.dtype))
        return rows

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        fetch = self.steps % self.fetch_every == 0
        keys = None
        if self.table is not None:
            keys = torch.unique(x.cpu())
            if len(keys) and (int(keys[0]) < 0 or int(keys[-1]) >= self.table.shape[0]):
                raise ConfigError(f"input ids must lie in [0, {self.table.shape[0]}), the rows of the model's "
                                  f"embedding; got ids from {int(keys[0])} to {int(keys[-1])}")
            if fetch:
                self.client.sparse_pull(self.flat, self.table, keys, self.clock)
                self._load()
        elif fetch and not self.fresh:
            self.client.pull(self.flat, self.clock)
            self._load()
        self.fresh = False
        if self.acc_count == 0:
            versions = self.client.versions
            # With backup workers a gradient belongs to one step of the job on every shard,
            # the oldest its weights come from (shards may be one step apart): a shard that
            # is ahead drops it as late, so no shard makes a step past the job's last.
            self.acc_versions = [min(versions)] * len(versions) if self.backups else list(versions)
        value = self._backward(x, y)
        self.samples += len(x)
        if not math.isfinite(value):
            return StepStats(loss=value)  # never push a diverged gradient; the runner stops this worker
        rows = self._row_grads(keys) if keys is not None else None
        reply = self._accumulate_and_push(keys, rows)
        self.steps += 1
        if self.table is not None and self.rank == 0 and self.cfg.run.eval_every \
                and self.steps % self.cfg.run.eval_every == 0:
            self._pull_all()  # the runner snapshots worker 0's replica now: refresh every row
        return StepStats(loss=value, staleness=reply.staleness() if reply is not None else None)

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward on the replica; the flat gradient holds the dense
        gradients afterwards (unless the loss is not finite). Returns the loss."""
        for p in self.model.parameters():
            p.grad = None
        for p, view in self.views:
            view.zero_()
            if self.on_cpu:
                p.grad = view
        with self.ctx.emulator.compute():
            loss = self.loss_fn(self.model, x, y)
            loss.backward()
        value = loss.item()
        if math.isfinite(value):
            self._gather_grads()
        return value

    def _accumulate_and_push(self, keys: torch.Tensor | None, rows: torch.Tensor | None) -> Reply | None:
        if self.push_every > 1:
            self.acc_dense.add_(self.gflat)
        if keys is not None:
            self.acc_rows.append((keys, rows))
        self.acc_count += 1
        if self.acc_count < self.push_every:
            return None
        return self._push()

    def _push(self) -> Reply:
        """Push what was accumulated (the mean over its steps), fused with the next fetch when one is due."""
        grad, keys, rows = self.gflat, None, None
        if self.push_every > 1:
            grad = self.acc_dense.div_(self.acc_count)
        code = self._ledger_code(grad) if self.cfg.strategy.ledger else None
        if self.table is not None:
            if len(self.acc_rows) == 1:
                keys, rows = self.acc_rows[0]
            else:
                keys, rows = _merge_rows(self.acc_rows, self.table.shape[1], self.table.dtype)
                rows.div_(self.acc_count)
        reply = self._send(grad, keys, rows)
        if code is not None:
            self._ledger_acked(code)
        self.clock += 1
        self.acc_count = 0
        if self.acc_dense is not None:
            self.acc_dense.zero_()
        self.acc_rows = []
        return reply

    def _send(self, grad: torch.Tensor, keys: torch.Tensor | None, rows: torch.Tensor | None) -> Reply:
        """One push to the servers, fused with the next fetch when one is due."""
        if self.table is not None:
            return self.client.sparse_push(grad, keys, rows, self.clock, self.acc_versions)
        if (self.steps + 1) % self.fetch_every == 0:
            reply = self.client.push_pull(grad, self.flat, self.clock, self.acc_versions)
            self._load()
            self.fresh = True
            return reply
        return self.client.push(grad, self.clock, self.acc_versions)

    def _ledger_code(self, grad: torch.Tensor) -> int:
        """``--ledger``: write this push's code (rank x 10^6 + clock) into the first element
        of every shard's range, and count it as sent before it leaves."""
        code = self.rank * LEDGER_BASE + self.clock
        for s in range(self.client.servers):
            start, stop = self.client.sharding.range(s)
            if stop > start:
                grad[start] = code
        self.ctx.store.add(KEYS.ledger_sent(self.rank), code)
        return code

    def _ledger_acked(self, code: int) -> None:
        """``--ledger``: every shard acknowledged the push that carried ``code``."""
        for s in range(self.client.servers):
            self.ctx.store.add(KEYS.ledger_acked(s, self.rank), code)

    def _pull_all(self) -> None:
        """Fetch every dense element and every row of the table."""
        if self.table is not None:
            self.client.sparse_pull(self.flat, self.table, torch.arange(self.table.shape[0]), self.clock)
        else:
            self.client.pull(self.flat, self.clock)
        self._load()

    def global_model(self) -> nn.Module:
        return self.model

    def feed(self, ctx: Context, samples: int, shared_budget: bool = True) -> Feed:
        """``--assignment dynamic``: each step trains on the job's next unit, numbered by
        the shared budget's tickets. ``--backup-workers``: a worker that fell behind skips
        to the job's current step (``job_step``), and the job ends when it has made its
        steps. Otherwise the default: slices of global batches under a synchronous
        consistency, the worker's own partition under an asynchronous one."""
        cfg, rank, workers = ctx.cfg, ctx.info.rank, ctx.info.world_size
        if cfg.strategy.assignment == "dynamic" and shared_budget:
            return UnitFeed(cfg, ctx.store, rank, workers, samples)
        if cfg.strategy.backup_workers > 0 and self.synchronous:
            return CatchUpFeed(cfg, ctx.store, rank, workers, samples, self.job_step)
        return super().feed(ctx, samples, shared_budget)

    def job_step(self) -> int:
        """With backup workers: the job's steps made in the weights this worker holds, i.e.
        the step its next gradient belongs to (a worker that fell behind skips to it)."""
        return min(self.client.versions)

    def evaluates(self, rank: int) -> bool:
        """Worker 0, or once every worker below this one is lost, this one: evaluations
        (and the stop at --target-accuracy) go on without worker 0."""
        return rank == 0 or all(self.lost_worker(k) for k in range(rank))

    def lost_worker(self, rank: int) -> bool:
        """Whether a server declared worker ``rank`` lost."""
        return self.ctx.store.check([KEYS.lost(f"worker {rank}")])

    def agree(self, flag: bool) -> bool:
        if flag:
            self.ctx.store.set(_STOP_KEY, "1")
        return self.ctx.store.check([_STOP_KEY])

    def final_model(self, rank: int) -> nn.Module | None:
        """Leave the live set, wait until every other worker has too, and let one survivor
        (the lowest-ranked) pull and return the final model."""
        if self.acc_count:
            self._push()  # gradients computed since the last push are not thrown away
        self.ctx.store.set(KEYS.finished(self.rank), str(self.clock))
        self.client.signal(Op.BYE, self.clock)
        evaluator = self.client.wait_drained(self.cfg.cluster.peer_timeout)
        if evaluator == self.rank:
            self._pull_all()
        self.client.signal(Op.SHUTDOWN, self.clock)
        self.finished = True
        self.client.close()
        return self.model if evaluator == self.rank else None

    def final_record(self) -> dict[str, Any]:
        return {"pushes": self.clock, "acks": list(self.client.acks), "init_versions": self.init_versions,
                "heartbeat": self.heartbeat.record(), "samples": self.samples}

    def close(self) -> None:
        self.heartbeat.stop(self.cfg.cluster.timeout)
        if not self.finished:
            self.client.close()


def _replication_summary(cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
    """The server group's faults: servers lost, each takeover's times (seconds from the
    death's detection), and the bytes replication sent (apart from the workers' traffic)."""
    servers = records.get("server", {})
    recoveries = []
    for shard, rec in sorted(servers.items()):
        times = rec.get("recovery")
        if not times or times.get("drained"):  # a drain's handoff is a migration, not a recovery
            continue
        detected = times["detected"]
        recoveries.append({"shard": int(shard), "lost": f"server {times['from']}", "server": rec["host"],
                           "taken_over_by": f"server {rec['host']}", "detected_at": times.get("detected_at"),
                           "takeover_seconds": times["takeover"] - detected,
                           "first_update_seconds": times["first_update"] - detected if "first_update" in times
                           else None})
    return {"replication": cfg.strategy.replication,
            "lost_servers": sorted({int(s) for s in records.get("lost", {}).get("server", [])}),
            "recoveries": recoveries,
            "resent_pushes": sum(rec.get("resent_pushes", 0) for rec in servers.values()),
            "replication_bytes": sum(rec.get("replication", {}).get("bytes_sent", 0) for rec in servers.values())}


def _ledger_summary(servers: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """``--ledger``'s check per shard: acknowledged <= applied <= sent, nothing applied
    twice; and the one-line verdict."""
    shards = {str(s): rec["ledger"] for s, rec in sorted(servers.items()) if "ledger" in rec}
    bad = [s for s, x in shards.items() if not (x["acked"] <= x["final"] <= x["sent"]) or x["duplicates"]]
    lost = sum(x["sent"] - x["final"] for x in shards.values())
    if bad:
        verdict = "ledger FAILED on shard(s) " + ", ".join(
            f"{s} (acked {shards[s]['acked']}, applied {shards[s]['final']}, sent {shards[s]['sent']}, "
            f"{shards[s]['duplicates']} twice)" for s in bad)
    else:
        verdict = (f"ledger OK: {len(shards)} shard(s), acknowledged <= applied <= sent on each, none applied "
                   f"twice; unacknowledged pushes not applied: sum {lost}")
    return {"ledger": shards, "ledger_verdict": verdict}


def _merge_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum row gradients over several steps: (sorted unique keys, rows)."""
    if not parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, width, dtype=dtype)
    keys = torch.cat([k for k, _ in parts])
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = torch.zeros(len(unique), width, dtype=dtype).index_add_(0, inverse, torch.cat([r for _, r in parts]))
    return unique, rows
