"""Simulated ``tree-ps`` (Rudra, Gupta et al. 2016): gradients climb an aggregator tree to
the root's n-softsync gate and the weights come back down it (``adv``), or each learner
reads them straight from the root with one long-poll read outstanding while its pushes
climb the tree one at a time (``adv-star``: the next gradient is computed once the
previous one is acknowledged, on the newest weights read); ``base`` is the flat parameter server under
the same gate (``ParameterServerSim`` on the job as the servers see it).

It drives the real rules: the tree's shape (``ps/tree.py``), the aggregators' batching
rule (forward once the batch holds n gradients or every live child has pushed, children
summed in tree order: ``ps/aggregator.py``), the root's ``SoftSync`` gate over its
children with tree pushes weighted by their gradients, the server optimizer and staleness
per worker gradient. So a synchronous tree (n = P) equals the real one bit for bit.

Time: every node has one full-duplex link; a message to a node queues on that node's way
in (a FIFO), and a node's answers queue on its way out. An aggregator adds each
child's gradient in (bytes) x server_gamma seconds, as the root applies an update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
import torch

from plexus.ps.consistency import Push, SoftSync
from plexus.ps.optimizers import make_server_optimizer
from plexus.ps.staleness import StalenessHistogram
from plexus.ps.tree import ROOT, Node, Tree
from plexus.sim.engines import HEADER_BYTES, Outcome, Simulation, server_update
from plexus.sim.events import EventQueue
from plexus.train.batches import GlobalBatches, PartitionBatches

__all__ = ["TreePsSim"]


def _group_size(cfg) -> int:
    from plexus.strategies.tree_ps import group_size
    return group_size(cfg)


@dataclass
class _Entry:
    """A push waiting at a node: from which child, the summed gradient, and its members
    (worker, clock, version) in tree order."""

    child: int
    grad: torch.Tensor | None
    members: list[tuple[int, int, int]]
    reply_to: list["_Entry"] = field(default_factory=list)  # what a forwarded batch answers
    leaf: int | None = None  # the worker, for a worker's own push


class TreePsSim(Simulation):
    """Rudra-adv and adv-star with aggregators."""

    def run(self, steps: int) -> Outcome:
        cfg, p = self.cfg, self.workers
        s = cfg.strategy
        self.tree = Tree(p, s.fanout)
        self.n = _group_size(cfg)
        self.synchronous = self.n >= p
        self.star = s.variant == "adv-star"
        self.root_children = list(self.tree.children(ROOT))
        self.gate = SoftSync(self.n)
        for i in range(len(self.root_children)):
            self.gate.join(i)
        self.queue = EventQueue()
        self.hist = StalenessHistogram()
        self.version = 0
        self.params = self.replica.flat() if self.replica is not None else None
        if self.params is not None:
            self.optimizer = make_server_optimizer(cfg.optim, self.numel)
        self.msg = self.nbytes + HEADER_BYTES
        # The root is --servers shards, each with its own link: a message to or from the root
        # occupies each shard's link for its slice only.
        servers = max(1, cfg.cluster.servers)
        self.root_msg = -(-self.numel // servers) * 4 + HEADER_BYTES
        # When each node's link is free, per direction (full duplex): pushes queue on the
        # receiver's way in, answers on the sender's way out.
        self.link_in: dict[Node, float] = {}
        self.link_out: dict[Node, float] = {}
        self.pending: dict[Node, list[_Entry]] = {}
        self.uplink_busy: dict[Node, bool] = {}
        self.root_clock = [0] * len(self.root_children)  # pushes each root child has sent
        self.finished = [False] * p            # a worker that has made its last push
        self.gone: set[Node] = set()           # nodes that said goodbye to their parent
        self.held: list[torch.Tensor | None] = [self.params] * p
        self.versions = [0] * p
        self.steps_done = [0] * p
        self.loss: list[float | None] = [None] * p
        self.sent = np.zeros(p, dtype=np.int64)
        self.compute = np.zeros(p)
        self.busy = [False] * p
        self.reading = [True] * p              # adv-star: its long-poll read waits at the root
        self.budget = None if self.synchronous else steps * p
        self.claimed = 0
        self.steps = steps
        self.end = 0.0
        self.order: list[tuple[int, int]] = []
        self.root_waiting: list[tuple[int, _Entry]] = []  # (sender, forwarded entry) awaiting a read
        n = len(self.data.x_train)
        if self.params is None:
            self.batches = None
        elif self.synchronous:
            self.batches = GlobalBatches(n, cfg.run.batch_size, cfg.run.seed)
        else:
            self.batches = [PartitionBatches(n, self.share, cfg.run.seed, r, p) for r in range(p)]
        for r in range(p):
            self._start(r)
        self.queue.run()
        out = Outcome(virtual_seconds=self.end, steps_per_worker=list(self.steps_done),
                      bytes_sent=[int(b) for b in self.sent], updates_applied=self.version, staleness=self.hist,
                      order=self.order, events=self.queue.events)
        out.steps = sum(self.steps_done) if not self.synchronous else max(self.steps_done)
        out.samples = sum(self.steps_done) * self.share
        out.compute_seconds = float(self.compute.mean())
        out.wait_seconds = max(0.0, self.end - out.compute_seconds)
        out.extra = {"aggregators": self.tree.aggregators, "height": self.tree.height, "softsync": self.n,
                     "variant": self.cfg.strategy.variant}
        if self.params is not None:
            self.replica.load(self.params)
        return out

    # --- workers ----------------------------------------------------------------------

    def _claim(self, r: int) -> bool:
        if self.budget is None:
            return self.steps_done[r] < self.steps
        if self.claimed >= self.budget:
            return False
        self.claimed += 1
        return True

    def _start(self, r: int) -> None:
        if self.busy[r] or self.finished[r]:
            return
        if not self._claim(r):
            self.finished[r] = True
            self._goodbye(Node("worker", r))
            return
        self.busy[r] = True
        t = float(self.compute_times(np.array([r]))[0])
        self.compute[r] += t
        grad = None
        if self.params is not None:
            idx = (self.batches.worker_indices(self.steps_done[r], r, self.workers) if self.synchronous
                   else self.batches[r].indices(self.steps_done[r]))
            self.replica.load(self.held[r])
            grad, self.loss[r] = self.replica.flat_grad(self.data.x_train[idx], self.data.y_train[idx])
        self.queue.after(t, self._computed, r, grad, self.versions[r])

    def _computed(self, r: int, grad, version: int) -> None:
        node = Node("worker", r)
        entry = _Entry(self.tree.position(node), grad, [(r, self.steps_done[r], version)], leaf=r)
        self.steps_done[r] += 1
        self.sent[r] += self.msg
        if r == 0 and self.steps_done[0] % self.cfg.run.log_every == 0:
            self.log_train(self.queue.now, self.steps_done[0], self.loss[0], sum(self.steps_done) * self.share,
                           int(self.sent[0]))
        self._send(node, self.tree.parent(node), entry)

    def _acked(self, r: int, weights, version: int) -> None:
        """adv-star: the root took worker ``r``'s push (on arrival, before the gate applies
        it). One gradient is in flight at a time, and the next is computed only now, on the
        newest weights the reader has brought, which need not yet hold the last push (the
        real learner waits here: computing meanwhile added a trip up the tree to every
        gradient's staleness, ``strategies/tree_ps.py``)."""
        self.end = self.queue.now
        self.busy[r] = False
        self._start(r)

    def _ask(self, r: int) -> None:
        """adv-star: worker ``r``'s reader asks again; the root answers once it has newer weights."""
        self.reading[r] = True
        if self.version > self.versions[r]:
            self._read(r)

    def _read(self, r: int) -> None:
        self.reading[r] = False
        self._reply(ROOT, Node("worker", r), self.params, self.version, None)

    def _weights_reach(self, r: int, weights, version: int) -> None:
        """adv: the answer to worker ``r``'s push, the weights of its next step; adv-star: a
        version its reader fetched, swapped in at its next step."""
        self.end = self.queue.now
        self.held[r], self.versions[r] = weights, version
        if self.star:
            self.queue.after(self.net.alpha, self._ask, r)
            self._eval_if_due(r)
            return
        self.busy[r] = False
        self._eval_if_due(r)
        self._start(r)

    # --- links --------------------------------------------------------------------------

    def _send(self, src: Node, dst: Node, entry: _Entry) -> None:
        """A push from ``src`` queues on ``dst``'s link."""
        reach = self.queue.now + self.net.alpha + self.msg * self.net.beta
        arrive = max(reach, self.link_in.get(dst, 0.0) + self._bytes(dst) * self.net.beta)
        self.link_in[dst] = arrive
        self.queue.at(arrive, self._arrive, src, dst, entry)

    def _bytes(self, node: Node) -> int:
        """What one message occupies on ``node``'s link."""
        return self.root_msg if node == ROOT else self.msg

    def _reply(self, src: Node, dst: Node, weights, version: int, entry: _Entry) -> None:
        """Weights from ``src`` to child ``dst`` (the answer to ``entry``), on ``src``'s link;
        under adv-star the answer to a push is an acknowledgement, a header without weights
        (``ps/server.py`` and ``ps/aggregator.py`` answer PUSH so), and only reads carry them."""
        size = HEADER_BYTES if self.star and entry is not None else self._bytes(src)
        depart = max(self.queue.now, self.link_out.get(src, 0.0)) + size * self.net.beta
        self.link_out[src] = depart
        if dst.role == "worker":
            answer = self._acked if self.star and entry is not None else self._weights_reach
            self.queue.at(depart + self.net.alpha, answer, dst.rank, weights, version)
        else:
            self.queue.at(depart + self.net.alpha, self._answered, dst, weights, version, entry)

    def _arrive(self, src: Node, dst: Node, entry: _Entry) -> None:
        if dst == ROOT:
            self._at_root(self.root_children.index(src), entry)
            return
        self.pending.setdefault(dst, []).append(entry)
        self._maybe_forward(dst)

    # --- aggregators --------------------------------------------------------------------

    def _live_children(self, node: Node) -> list[int]:
        """Children that have not said goodbye (the real ones send BYE when done)."""
        return [i for i, c in enumerate(self.tree.children(node)) if c not in self.gone]

    def _goodbye(self, node: Node) -> None:
        """``node`` has nothing more to push: its parent stops counting it (an aggregator
        once all its children have left and its last batch is answered), and so on up."""
        if node in self.gone:
            return
        if node.role == "aggregator" and (self._live_children(node) or self.pending.get(node)
                                          or self.uplink_busy.get(node)):
            return
        self.gone.add(node)
        parent = self.tree.parent(node)
        if parent == ROOT:
            for group in self.gate.leave(self.root_children.index(node)):
                self._apply(group)
            self._serve()
        else:
            self._maybe_forward(parent)
            self._goodbye(parent)

    def _maybe_forward(self, node: Node) -> None:
        pending = self.pending.get(node, [])
        if not pending or self.uplink_busy.get(node):
            return
        waiting = {e.child for e in pending}
        ready = sum(len(e.members) for e in pending) >= self.n or all(i in waiting for i in self._live_children(node))
        if not ready:
            return
        batch = sorted(pending, key=lambda e: e.child)
        self.pending[node] = []
        grad = None
        if self.params is not None:
            grad = batch[0].grad
            if len(batch) > 1:
                grad = grad.clone()
                for e in batch[1:]:
                    grad.add_(e.grad)
        members = [m for e in batch for m in e.members]
        self.uplink_busy[node] = True
        work = len(batch) * self.nbytes * self.spec.server_gamma
        parent = self.tree.parent(node)
        up = _Entry(self.tree.position(node), grad, members, reply_to=batch)
        self.queue.after(work, self._send, node, parent, up)

    def _answered(self, node: Node, weights, version: int, entry: _Entry) -> None:
        """The parent's weights reach aggregator ``node``: answer every push of the batch."""
        self.uplink_busy[node] = False
        for child_entry in entry.reply_to:
            self._reply(node, self.tree.children(node)[child_entry.child], weights, version, child_entry)
        self._maybe_forward(node)
        self._goodbye(node)

    # --- the root ----------------------------------------------------------------------

    def _at_root(self, sender: int, entry: _Entry) -> None:
        self.end = self.queue.now
        clock = self.root_clock[sender]
        self.root_clock[sender] = clock + 1
        version = max(v for _, _, v in entry.members)
        groups = self.gate.push(Push(sender, clock, version, entry, weight=len(entry.members)))
        for group in groups:
            self._apply(group)
        if self.star:  # a plain push: the servers acknowledge it on arrival, whatever the gate
            self._reply(ROOT, self.root_children[sender], None, self.version, entry)
            return
        self.root_waiting.append((sender, entry))
        self._serve()

    def _apply(self, group: list[Push]) -> None:
        stale = [self.version - v for push in group for _, _, v in push.payload.members]
        for push in group:
            for w, c, v in push.payload.members:
                self.hist.record(self.version - v)
                self.order.append((w, c))
        if self.params is not None:
            self.params = server_update(self.params, self.optimizer, [push.payload.grad for push in group],
                                        self.gate.divisor(group), stale, self.cfg.strategy.staleness_lr)
        self.version += 1
        if self.star:  # the learners' outstanding long-poll reads return the new weights
            for r in range(self.workers):
                if self.reading[r]:
                    self._read(r)

    def _serve(self) -> None:
        """Answer the root children whose reads the gate allows."""
        keep = []
        for sender, entry in self.root_waiting:
            if self.gate.may_serve(sender, self.root_clock[sender]):
                self._reply(ROOT, self.root_children[sender], self.params, self.version, entry)
            else:
                keep.append((sender, entry))
        self.root_waiting = keep

    def _eval_if_due(self, r: int) -> None:
        step = self.steps_done[0]
        if r == 0 and self.snapshot_due(step, None if self.budget is not None else self.steps) and \
                self.snapshot(self.queue.now, step, sum(self.steps_done) * self.share, self.params):
            self.queue.stop()
