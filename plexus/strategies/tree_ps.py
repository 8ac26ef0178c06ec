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
- ``adv-star``: gradients go up the aggregator tree as in ``adv`` but as plain pushes, on
  a thread of the worker, while the weights come down a second tree formed by the workers
  themselves (``Tree.weight_parent``: worker 0 pulls from its aggregator, every other
  worker from a worker above it), fetched on another thread. A step swaps in the newest
  weights it has and never waits for either tree, except that a worker pushes one
  gradient at a time. A worker whose weight parent is gone pulls from its aggregator.

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
others, under every N; an aggregator's loss takes its subtree with it, and the summary's
``lost_with`` says whose gradients stopped reaching the root with which process.
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

from plexus.cluster.group import Link
from plexus.config import JobConfig
from plexus.errors import CommError, ConfigError
from plexus.ps.aggregator import Aggregator
from plexus.ps.protocol import HEADER_LEN, Header, Op, decode, encode
from plexus.ps.server import KEYS
from plexus.ps.tree import ROOT, Node, Tree
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
    def run_role(cls, role: str, rank: int, ctx: RoleContext) -> None:
        ctx = dataclasses.replace(ctx, cfg=cls.effective(ctx.cfg))
        if role != "aggregator":
            super().run_role(role, rank, ctx)
            return
        from plexus.cluster.rendezvous import store_set_json
        record = Aggregator(ctx.store, rank, ctx.cfg, ctx.traffic, group_size(ctx.cfg),
                            push_only=ctx.cfg.strategy.variant == "adv-star", emulator=ctx.emulator).serve()
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
                if a not in aggregators:
                    lost_with[f"aggregator {a}"] = list(tree.leaves(Node("aggregator", a)))
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
            lost_workers=sorted(lost), lost_with=lost_with,
            protocol_errors=out["protocol_errors"] + sum(r["protocol_errors"] for r in aggregators.values()),
        )
        return out

    # --- worker side --------------------------------------------------------------------

    def setup(self, model: nn.Module, loss_fn: LossFn, ctx: Context) -> None:
        self.tree = _tree(ctx.cfg)
        self.variant = ctx.cfg.strategy.variant
        super().setup(model, loss_fn, dataclasses.replace(ctx, cfg=self.effective(ctx.cfg)))
        self.star = _WeightTree(self) if self.variant == "adv-star" else None
        if self.star is not None:
            self.synchronous = False

    def lost_worker(self, rank: int) -> bool:
        """Declared lost by its parent, or cut off with an aggregator above it."""
        node = Node("worker", rank)
        while node != ROOT:
            if self.ctx.store.check([KEYS.lost(node.name)]):
                return True
            node = self.tree.parent(node) if self.variant != "base" else ROOT
        return False

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

    def final_model(self, rank: int) -> nn.Module | None:
        if self.star is not None:
            self.star.stop()
        return super().final_model(rank)

    def final_record(self) -> dict[str, Any]:
        record = super().final_record()
        if self.star is not None:
            record.update(weight_fetches=self.star.fetches, weight_fallback=self.star.fallback)
        return record

    def close(self) -> None:
        if self.star is not None:
            self.star.stop(check=False)
        super().close()


class _WeightTree:
    """Rudra-adv*'s worker side: a pusher thread sends gradients up the aggregator tree and a
    fetcher thread brings weights down the workers' own tree (see the module docstring)."""

    def __init__(self, worker: TreePSStrategy) -> None:
        self.w = worker
        self.rank, self.tree = worker.rank, worker.tree
        self.timeout = worker.cfg.cluster.timeout
        self.lock = threading.Lock()            # the client's links: pusher, fetcher and final pull
        self.cond = threading.Condition()
        self.latest: tuple[torch.Tensor, list[int]] = (worker.flat.clone(), list(worker.client.versions))
        self.version = sum(self.latest[1])      # of the weights in ``latest``
        self.used = self.version                # of the weights the replica holds
        self.held = list(self.latest[1])        # their shard versions
        self.fetches, self.fallback = 0, False
        self.error: BaseException | None = None
        self.want = threading.Event()
        self.stopping = threading.Event()
        self.outbox: queue.Queue[tuple[torch.Tensor, int, list[int]] | None] = queue.Queue(maxsize=1)
        self.pushed = threading.Semaphore(1)    # one gradient in flight
        self.threads = [threading.Thread(target=self._guard, args=(self._push_loop,), name="pusher", daemon=True),
                        threading.Thread(target=self._guard, args=(self._fetch_loop,), name="fetcher",
                                         daemon=True)]
        # The weight links are made here, in tree order (first the one to our parent, then
        # those to our children), which cannot deadlock. Made from the fetcher and serving
        # threads instead, they hung at start-up in some runs (observed with 4 workers).
        self.link = self._link(self.tree.weight_parent(self.rank))
        self.children: list[threading.Thread] = []
        for child in self.tree.weight_children(self.rank):
            link = self._link(child)
            if link is not None:
                self.children.append(threading.Thread(target=self._serve_child, args=(link,),
                                                      name=f"weights -> worker {child}", daemon=True))
        for thread in self.threads + self.children:
            thread.start()

    def _link(self, peer: int | None) -> Link | None:
        """The weight link to worker ``peer`` (None if there is none or it cannot be made)."""
        if peer is None:
            return None
        try:
            return Link(self.w.ctx.store, f"worker {self.rank}", f"worker {peer}", traffic=self.w.ctx.traffic,
                        timeout=self.timeout, net=self.w.cfg.cluster.net, tag="weights",
                        transport=self.w.cfg.cluster.transport)
        except CommError as exc:
            logger.warning("worker %d: no weight link to worker %d (%s)", self.rank, peer, exc)
            if peer == self.tree.weight_parent(self.rank):
                self.fallback = True
            return None

    def _guard(self, loop) -> None:
        try:
            loop()
        except BaseException as exc:  # surfaced in the training thread at its next step
            if not self.stopping.is_set():
                self.error = exc
                self.stopping.set()
                self.want.set()

    # --- the training thread ------------------------------------------------------------

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        w = self.w
        if self.error is not None:
            raise self.error
        with self.cond:
            flat, versions = self.latest
            newer = sum(versions) > self.used
        if newer:
            w.flat.copy_(flat)
            w._load()
            self.held, self.used = list(versions), sum(versions)
        self.want.set()  # the fetcher brings the next weights while we compute
        value = w._backward(x, y)
        if not math.isfinite(value):
            return StepStats(loss=value)
        while not self.pushed.acquire(timeout=1.0):  # the previous gradient has left (a step's only wait)
            if self.error is not None:
                raise self.error
        self.outbox.put((w.gflat.clone(), w.clock, self.held))
        w.clock += 1
        w.steps += 1
        return StepStats(loss=value)

    def stop(self, check: bool = True) -> None:
        """Let the last gradient leave, then stop both threads and the weight serving;
        raise what failed in them when ``check``."""
        deadline = time.monotonic() + self.timeout
        while self.error is None and self.threads[0].is_alive() and time.monotonic() < deadline:
            if self.pushed.acquire(timeout=0.1):  # the last gradient has left
                self.pushed.release()
                break
        self.stopping.set()
        self.want.set()
        try:
            self.outbox.put(None, timeout=1.0)
        except queue.Full:  # the pusher is gone
            pass
        for thread in self.threads + self.children:
            thread.join(timeout=self.timeout)
        if check and self.error is not None:
            raise self.error

    # --- gradients up -----------------------------------------------------------------------

    def _push_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            grad, clock, versions = item
            with self.lock:
                self.w.client.push(grad, clock, versions)
            self.pushed.release()

    # --- weights down -----------------------------------------------------------------------

    def _publish(self, flat: torch.Tensor, versions: list[int]) -> None:
        with self.cond:
            if sum(versions) > self.version:
                self.latest, self.version = (flat, versions), sum(versions)
                self.cond.notify_all()
        self.fetches += 1

    def _fetch_loop(self) -> None:
        parent, link = self.tree.weight_parent(self.rank), self.link
        answer = torch.empty(HEADER_LEN, dtype=torch.int64)
        versions = torch.empty(self.w.client.servers, dtype=torch.int64)
        try:
            while True:
                self.want.wait()
                self.want.clear()
                if self.stopping.is_set():
                    return
                flat = torch.empty_like(self.w.flat)
                if link is not None:
                    try:
                        link.send_to_peer(encode(Header(op=Op.PULL, sender=self.rank, shard=0,
                                                        version=self.version)))
                        link.recv_from_peer(answer)
                        link.recv_from_peer(flat)
                        link.recv_from_peer(versions)
                        decode(answer, link.peer)
                        self._publish(flat, versions.tolist())
                        continue
                    except CommError as exc:
                        logger.warning("worker %d: weight parent worker %d is gone (%s); pulling from the tree",
                                       self.rank, parent, exc)
                        link.close()
                        link, self.fallback = None, True
                with self.lock:
                    self.w.client.pull(flat, self.w.clock)
                    got = list(self.w.client.versions)
                self._publish(flat, got)
        finally:
            if link is not None:
                try:
                    link.send_to_peer(encode(Header(op=Op.SHUTDOWN, sender=self.rank, shard=0)), timeout=5.0)
                except CommError:
                    pass
                link.close()

    def _serve_child(self, link: Link) -> None:
        """Answer a weight child's pulls with the newest weights we have, once they are newer
        than what it has (or after a short wait, so that its thread stays responsive)."""
        request = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            while not self.stopping.is_set():
                link.recv_from_peer(request, timeout=2 * self.timeout)
                h = decode(request, link.peer)
                if h.op != Op.PULL:
                    return
                with self.cond:
                    self.cond.wait_for(lambda: self.version > h.version or self.stopping.is_set(), timeout=0.5)
                    flat, versions = self.latest
                link.send_to_peer(encode(Header(op=Op.REPLY, sender=self.rank, shard=0, version=sum(versions),
                                                count=flat.numel())))
                link.send_to_peer(flat)
                link.send_to_peer(torch.tensor(versions, dtype=torch.int64))
        except CommError as exc:
            logger.info("worker %d: weight child %s left (%s)", self.rank, link.peer, exc)
        finally:
            link.close()
