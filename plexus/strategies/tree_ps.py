"""``tree-ps``: the hierarchical parameter server of IBM's Rudra (Gupta, Zhang and Wang,
"Model accuracy and runtime tradeoff in distributed deep learning", ICDM 2016).

The tree (``ps/tree.py``): ``--fanout K`` groups the P workers K at a time under
aggregator processes, level by level, until at most K nodes are left under the root,
which is the (``--servers``-sharded) parameter server of ``ps``.

Variants (``--variant``):

- ``base``: no aggregators; every worker pushes to the servers (the flat PS, Rudra-base),
  so the root hears from P senders.
- ``adv`` (the default): a worker pushes its gradient to its parent with a fused
  push-and-pull; aggregators sum their children's gradients and push the sum up
  (``ps/aggregator.py``); the root applies it and the new weights come back down the same
  path as the answers. The root hears from at most K senders.
- ``adv-star`` (Rudra-adv*): gradients go up the aggregator tree as in ``adv`` but as plain
  pushes, on a thread of the worker, while each worker fetches the weights asynchronously
  and straight from the servers, on a thread of its own that keeps one long-poll read
  outstanding (``ps/readers.py``): a new version reaches every learner one hop after the
  root applied it, instead of one level per step down a tree. A step swaps in the newest
  weights it has and waits for neither, except that a worker pushes one gradient at a
  time. The root's push fan-in stays at most K: the learners' fetches are reads, outside
  the consistency gate; a learner's loss ends only its own read links.

The protocol knobs, as the paper names them: sigma, n-softsync: the root applies an update
once it holds ``--softsync N`` worker gradients (our N is the paper's c = lambda / n,
gradients per update: N = 1 is asynchronous, N = P synchronous; ``--consistency bsp``
means N = P and ``asp``, the default, N = 1); mu, the mini-batch per learner, is
``--batch-size / --workers``; lambda, the learners, is ``--workers``. ``--staleness-lr``
divides each update's learning rate by the mean staleness of the gradients in it
(alpha = alpha0 / <sigma>, Zhang et al. 2016).

With N = P and ``adv`` every aggregator waits for its whole subtree and the root for every
subtree: synchronous training on global batches, equal to one process (contract 1).

Faults: a lost worker or aggregator (killed, crashed) leaves the job running with the
others, under every N. When an aggregator dies its children re-attach to the nearest live
ancestor (adv; adv*'s learners go straight to the root), which adopts them through the
job's store (``ps/aggregator.py``'s ``reattach``), and send again the push the dead one
held: the root recognises a push it already applied by its workers' clocks, so nothing is
applied twice and nothing acknowledged is lost. The summary's ``reattached`` lists each
move (who, from, to, at which step, in how many seconds), ``lost_aggregators`` the dead,
and ``lost_with`` the workers whose gradients stopped with a process (none when its
subtree re-attached). The root servers themselves are not replicated under tree-ps.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Any

import torch
from torch import nn

from plexus.config import JobConfig
from plexus.errors import CommError, ConfigError
from plexus.ps.aggregator import Aggregator, reattach
from plexus.ps.client import PSClient, Reply
from plexus.ps.protocol import Op
from plexus.ps.readers import WeightReader
from plexus.ps.server import KEYS
from plexus.ps.tree import ROOT, Node, Tree, node_of
from plexus.strategies.base import Context, LossFn, RoleContext, StepStats
from plexus.strategies.downpour import DownpourStrategy, num_servers

__all__ = ["TreePSStrategy", "group_size"]

logger = logging.getLogger(__name__)


def group_size(cfg: JobConfig) -> int:
    """N: worker gradients per root update (see the module docstring)."""
    s, workers = cfg.strategy, cfg.cluster.workers
    if s.softsync:
        return s.softsync
    return workers if s.consistency in ("bsp", "softsync") else 1


def _tree(cfg: JobConfig) -> Tree:
    return Tree(cfg.cluster.workers, cfg.strategy.fanout)


def _weight_hops(cfg: JobConfig, tree: Tree) -> int:
    """The most links new weights cross from the root to a learner: the tree's height in
    adv, where they come back down as the aggregators' answers; one in base and in adv*,
    whose learners read the servers directly (Gupta et al. 2016)."""
    return tree.height if cfg.strategy.variant == "adv" else 1


class TreePSStrategy(DownpourStrategy):
    name = "tree-ps"

    @classmethod
    def effective(cls, cfg: JobConfig) -> JobConfig:
        """The job as the servers see it: n-softsync with N = group_size(cfg)."""
        strategy = dataclasses.replace(cfg.strategy, consistency="softsync", softsync=group_size(cfg))
        return dataclasses.replace(cfg, strategy=strategy)

    @classmethod
    def check_config(cls, cfg: JobConfig) -> None:
        s, c = cfg.strategy, cfg.cluster
        if s.consistency == "ssp":
            raise ConfigError("tree-ps speaks Rudra's n-softsync protocol, not ssp: pass --softsync N (1 is "
                              "asynchronous, the number of workers synchronous)")
        if s.consistency == "bsp" and s.softsync not in (0, c.workers):
            raise ConfigError(f"--consistency bsp means --softsync {c.workers} (all workers); got --softsync "
                              f"{s.softsync}: drop one of the two")
        if s.variant != "base" and (s.fetch_every != 1 or s.push_every != 1):
            raise ConfigError(f"tree-ps --variant {s.variant} pushes and fetches once per step: --fetch-every and "
                              f"--push-every must be 1 (they apply to --variant base and to ps)")
        aggregators = _tree(cfg).aggregators if s.variant != "base" else 0
        for kill in c.kill:
            if kill.role == "aggregator" and kill.rank >= aggregators:
                raise ConfigError(f"--kill aggregator:{kill.rank}: this tree has {aggregators} aggregators "
                                  f"(--workers {c.workers}, --fanout {s.fanout}, --variant {s.variant})")
        super().check_config(cls.effective(cfg))

    @classmethod
    def extra_roles(cls, cfg: JobConfig) -> list[tuple[str, int]]:
        roles = [("server", num_servers(cfg))]
        aggregators = _tree(cfg).aggregators
        if cfg.strategy.variant != "base" and aggregators:
            roles.append(("aggregator", aggregators))
        return roles

    @classmethod
    def tolerates_loss(cls, cfg: JobConfig, role: str, rank: int) -> bool:
        return role in ("worker", "aggregator")

    @classmethod
    def root_children(cls, cfg: JobConfig) -> list[str] | None:
        if cfg.strategy.variant == "base":
            return None
        return [node.name for node in _tree(cfg).children(ROOT)]

    @classmethod
    def root_readers(cls, cfg: JobConfig) -> list[str]:
        """adv*'s learners read the weights straight from the servers (Gupta et al. 2016);
        reads do not count in the root's fan-in, which only its children's pushes make."""
        if cfg.strategy.variant != "adv-star":
            return []
        return [f"worker {w}" for w in range(cfg.cluster.workers)]

    @classmethod
    def run_role(cls, role: str, rank: int, ctx: RoleContext) -> None:
        ctx = dataclasses.replace(ctx, cfg=cls.effective(ctx.cfg))
        if role != "aggregator":
            super().run_role(role, rank, ctx)
            return
        from plexus.cluster.rendezvous import store_set_json
        record = Aggregator(ctx.store, rank, ctx.cfg, ctx.traffic, group_size(ctx.cfg),
                            push_only=ctx.cfg.strategy.variant == "adv-star", emulator=ctx.emulator,
                            log=ctx.log.log).serve()
        store_set_json(ctx.store, f"stats/aggregator/{rank}", record)

    @classmethod
    def admit(cls, store, cfg: JobConfig) -> int:
        raise ConfigError("a tree-ps job admits no workers after the start: its tree is fixed; use --strategy ps "
                          "for a job that workers may join")

    @classmethod
    def summary_fields(cls, cfg: JobConfig, records: dict[str, Any]) -> dict[str, Any]:
        """The ps summary, counted per worker gradient, plus the root's fan-in and bytes."""
        eff = cls.effective(cfg)
        out = super().summary_fields(eff, records)
        servers, aggregators = records.get("server", {}), records.get("aggregator", {})
        tree, workers = _tree(cfg), cfg.cluster.workers
        applied = {w: max(int(rec["gradients"].get(str(w), 0)) for rec in servers.values()) if servers else 0
                   for w in range(workers)}
        fan_in: dict[int, int] = {}
        for rec in servers.values():
            for k, n in rec["fan_in_counts"].items():
                fan_in[int(k)] = max(fan_in.get(int(k), 0), n)
        updates = max((rec["version"] for rec in servers.values()), default=0)
        received = sum(rec["bytes_recv"] for rec in servers.values())
        # Who was lost: workers and aggregators that left no record, and workers a server
        # (base) declared lost; each with the workers whose gradients stopped with it.
        lost_with: dict[str, list[int]] = {}
        if cfg.strategy.variant != "base":
            for a in range(tree.aggregators):
                if a not in aggregators:  # its children re-attached; the workers that did not finish
                    lost_with[f"aggregator {a}"] = [w for w in tree.leaves(Node("aggregator", a))
                                                    if w not in records["worker"]]
        cut = {w for ws in lost_with.values() for w in ws}
        for w in range(workers):
            if w not in records["worker"] and w not in cut:
                lost_with[f"worker {w}"] = [w]
        lost = {w for ws in lost_with.values() for w in ws}
        if cfg.strategy.variant == "base":  # the servers also name workers they dropped
            lost |= set(out["lost_workers"])
        acked = sum(max(rec.get("acks", [0]) or [0]) for rec in records["worker"].values())
        out.update(
            variant=cfg.strategy.variant, fanout=cfg.strategy.fanout, softsync=group_size(cfg),
            aggregators=tree.aggregators if cfg.strategy.variant != "base" else 0,
            tree_height=tree.height if cfg.strategy.variant != "base" else 1,
            updates_applied=sum(applied.values()), root_updates=updates,
            updates_applied_by_worker={str(w): n for w, n in applied.items()},
            pushes_acknowledged=acked,
            root_max_fan_in=max(fan_in, default=0),
            root_fan_in_counts={str(k): n for k, n in sorted(fan_in.items())},
            root_bytes_per_update=received / updates if updates else None,
            weight_hops=_weight_hops(cfg, tree),
            weight_reads_by_worker={str(w): int(servers[0]["reads"].get(f"worker {w}", 0)) if 0 in servers else 0
                                    for w in range(workers)} if cfg.strategy.variant == "adv-star" else {},
            lost_workers=sorted(lost), lost_with=lost_with,
            resent_pushes=sum(rec.get("resent_pushes", 0) for rec in servers.values()),
            lost_aggregators=sorted(a for a in range(tree.aggregators) if a not in aggregators)
            if cfg.strategy.variant != "base" else [],
            reattached=sorted((e for rec in [*records["worker"].values(), *aggregators.values()]
                               for e in rec.get("reattached", [])), key=lambda e: e["node"]),
            protocol_errors=out["protocol_errors"] + sum(r["protocol_errors"] for r in aggregators.values()),
        )
        return out

    # --- worker side --------------------------------------------------------------------

    def setup(self, model: nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.tree = _tree(ctx.cfg)
        self.variant = ctx.cfg.strategy.variant
        self.reattached: list[dict[str, Any]] = []
        super().setup(model, loss_fn, dataclasses.replace(ctx, cfg=self.effective(ctx.cfg)))
        try:
            self.star = _AsyncLearner(self) if self.variant == "adv-star" else None
        except BaseException:  # the runner calls close() only after a successful setup
            self.client.close()
            self.heartbeat.stop(ctx.cfg.cluster.timeout)
            raise
        if self.star is not None:
            self.synchronous = False

    def lost_worker(self, rank: int) -> bool:
        """Declared lost by its parent (a worker whose aggregator died re-attaches above it,
        and is not lost with it)."""
        return self.ctx.store.check([KEYS.lost(f"worker {rank}")])

    def table_of(self, model: nn.Module) -> nn.Module | None:
        # Aggregators sum dense gradients; an embedding table travels whole, like any weight.
        return super().table_of(model) if self.variant == "base" else None

    def uplink(self) -> dict[str, Any]:
        if self.variant == "base":
            return {}
        node = Node("worker", self.ctx.info.rank)
        parent = self.tree.parent(node)
        return {"sender": self.tree.position(node), "parent": None if parent == ROOT else parent.name}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        if self.star is None:
            return super().step(x, y)
        return self.star.step(x, y)

    # --- elastic tree: a worker whose aggregator died re-attaches above it ----------------

    def _send(self, grad: torch.Tensor, keys: torch.Tensor | None, rows: torch.Tensor | None) -> Reply:
        return self.upward(lambda: super(TreePSStrategy, self)._send(grad, keys, rows))

    def upward(self, call, clock: int | None = None):
        """``call()`` (the push of ``clock``, by default the next, through ``self.client``),
        sent again to a new parent for as long as the parent it went to died (each
        re-attachment climbs the tree)."""
        while True:
            try:
                return call()
            except CommError as exc:
                if self.client.parent is None:  # the servers: nothing above them to re-attach to
                    raise
                self._reattach(exc, self.clock if clock is None else clock)

    def _reattach(self, exc: CommError, clock: int) -> None:
        started = time.monotonic()
        me = Node("worker", self.rank)
        dead = node_of(self.client.parent)
        parent, sender = reattach(self.ctx.store, self.tree, me, dead, straight_to_root=self.variant == "adv-star")
        logger.warning("worker %d: lost its parent %s (%s); re-attaching to %s", self.rank, dead.name, exc,
                       "the servers" if parent == ROOT else parent.name)
        old = self.client
        self.client = PSClient(self.ctx.store, self.rank, old.servers, numel=self.flat.numel(), dtype=self.flat.dtype,
                               traffic=self.ctx.traffic, timeout=self.cfg.cluster.timeout, net=self.cfg.cluster.net,
                               transport=self.cfg.cluster.transport, sender=sender,
                               parent=None if parent == ROOT else parent.name)
        old.close()
        self.client.acks = list(old.acks)  # acknowledgements count across parents
        self.client.connect()
        self.client.init(self.flat.clone(), clock=clock)
        self.reattached.append({"node": me.name, "from": dead.name, "to": parent.name, "step": self.steps,
                                "seconds": time.monotonic() - started})

    def final_model(self, rank: int) -> nn.Module | None:
        if self.star is not None:
            self.star.stop()
        return super().final_model(rank)

    def final_record(self) -> dict[str, Any]:
        record = {**super().final_record(), "reattached": list(self.reattached)}
        if self.star is not None:
            record.update(weight_reads=self.star.reads, weight_swaps=self.star.swaps)
        return record

    def close(self) -> None:
        if self.star is not None:
            self.star.stop(check=False)
        super().close()


class _AsyncLearner:
    """Rudra-adv*'s learner (Gupta et al. 2016): a pusher thread sends gradients up the
    aggregator tree as plain pushes, and a fetcher thread keeps one long-poll read of the
    servers outstanding (``ps/readers.py``), so every new version reaches the learner one
    hop after the root applied it, and a step swaps in the newest weights it has without
    waiting for them. The only wait of a step is that one gradient at a time is in flight:
    the previous one must have been acknowledged, so by the time the next is computed the
    weights that hold it have usually arrived. The final model still comes down the tree
    (the aggregators forward a PULL), after both threads have stopped."""

    def __init__(self, worker: TreePSStrategy) -> None:
        self.w = worker
        self.timeout = worker.cfg.cluster.timeout
        self.lock = threading.Lock()            # the push client: pusher, then the final pull
        self.cond = threading.Condition()
        self.latest: tuple[torch.Tensor, list[int]] = (worker.flat.clone(), list(worker.client.versions))
        self.used = sum(self.latest[1])         # version of the weights the replica holds
        self.held = list(self.latest[1])        # their shard versions
        self.reads = self.swaps = 0             # reads answered; steps that swapped in newer weights
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.outbox: queue.Queue[tuple[torch.Tensor, int, list[int]] | None] = queue.Queue(maxsize=1)
        self.pushed = threading.Semaphore(1)    # one gradient in flight
        # The read links are opened here, from the training thread, after INIT has reached
        # the root through the tree (so the servers know the layout): link set-up from
        # several threads at once hung (ARCHITECTURE.md, section 8).
        self.reader = WeightReader(worker.ctx.store, worker.rank, worker.client.servers, numel=worker.flat.numel(),
                                   dtype=worker.flat.dtype, traffic=worker.ctx.traffic, timeout=self.timeout,
                                   net=worker.cfg.cluster.net, transport=worker.cfg.cluster.transport)
        try:
            self.reader.connect()
        except BaseException:
            self.reader.close()
            raise
        self.threads = [threading.Thread(target=self._guard, args=(self._push_loop,), name="pusher", daemon=True),
                        threading.Thread(target=self._guard, args=(self._fetch_loop,), name="fetcher",
                                         daemon=True)]
        for thread in self.threads:
            thread.start()

    def _guard(self, loop) -> None:
        try:
            loop()
        except BaseException as exc:  # surfaced in the training thread at its next step
            if not self.stopping.is_set():
                self.error = exc
                self.stopping.set()

    # --- the training thread ------------------------------------------------------------

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        w = self.w
        if self.error is not None:
            raise self.error
        # One gradient in flight: wait until the previous one has reached the root before
        # computing the next (the step's only wait). Computing it meanwhile, on weights that
        # cannot hold the previous gradient yet, added a whole trip up the tree to the
        # staleness of every gradient: 6.2 against adv's 2.7 at 4 workers, measured.
        while not self.pushed.acquire(timeout=1.0):
            if self.error is not None:
                raise self.error
        with self.cond:
            flat, versions = self.latest
        if sum(versions) > self.used:  # the newest weights the fetcher brought, never waited for
            w.flat.copy_(flat)
            w._load()
            self.held, self.used = list(versions), sum(versions)
            self.swaps += 1
        value = w._backward(x, y)
        if not math.isfinite(value):
            self.pushed.release()  # nothing goes up
            return StepStats(loss=value)
        grad = w.gflat.clone()
        code = w._ledger_code(grad) if w.cfg.strategy.ledger else None
        self.outbox.put((grad, w.clock, self.held, code))
        w.clock += 1
        w.steps += 1
        return StepStats(loss=value)

    def stop(self, check: bool = True) -> None:
        """Let the last gradient leave, then stop both threads and close the read links;
        raise what failed in them when ``check``."""
        deadline = time.monotonic() + self.timeout
        while self.error is None and self.threads[0].is_alive() and time.monotonic() < deadline:
            if self.pushed.acquire(timeout=0.1):  # the last gradient has left
                self.pushed.release()
                break
        self.stopping.set()
        try:
            self.outbox.put(None, timeout=1.0)
        except queue.Full:  # the pusher is gone
            pass
        for thread in self.threads:
            thread.join(timeout=self.timeout)
        if check and self.error is not None:
            raise self.error

    # --- gradients up -----------------------------------------------------------------------

    def _push_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            grad, clock, versions, code = item
            with self.lock:
                self.w.upward(lambda: self.w.client.push(grad, clock, versions), clock)
            if code is not None:
                self.w._ledger_acked(code)
            self.pushed.release()

    # --- weights straight from the servers ----------------------------------------------------

    def _fetch_loop(self) -> None:
        flat, clean = torch.empty_like(self.w.flat), False
        try:
            while not self.stopping.is_set():
                with self.cond:
                    held = list(self.latest[1])
                self.reader.read(flat, held)  # answered once newer than ``held``, or after READ_WAIT
                got = list(self.reader.versions)
                self.reads += 1
                if sum(got) > sum(held):
                    with self.cond:
                        self.latest = (flat, got)
                    flat = torch.empty_like(flat)  # the step may still be copying the one just published
            clean = True
        finally:
            try:
                if clean:  # the servers still answer: say goodbye so that they close the links too
                    self.reader.signal(Op.SHUTDOWN)
            except CommError as exc:
                logger.info("worker %d: read links closed before SHUTDOWN (%s)", self.w.rank, exc)
            finally:
                self.reader.close()
