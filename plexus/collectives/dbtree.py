"""``dbtree``: the double binary tree all-reduce (Sanders, Speck and Traeff 2009; NCCL 2.4).

Two complementary binary trees (``schedule.double_tree``) each carry half of the vector:
in each tree every rank adds its children's contributions and passes the sum to its
parent, and the root's sums flow back down. Each half is cut into chunks that follow each
other through the tree (pipelining), so after the pipeline fills every link is busy and
the reduction and the broadcast overlap: 2H + C - 1 steps for trees of height H and C
chunks, logarithmic latency at small sizes and near-ring bandwidth at large ones, because
a rank that is an inner node in one tree is mostly a leaf in the other.

One thread does all of a rank's work, in the order of the ideal pipeline's clock: in a
tree of height H, chunk i leaves a node whose subtree is h deep at step i + h + 1 on its
way up, and leaves a node at depth d at step i + H + d + 1 on its way down. Leaves push
all their chunks at once and wait for their results at the end; inner nodes handle their
events (add chunk i of both children and send it up, or the root straight down; forward
chunk j down) sorted by that step, across both trees. Each event waits only for messages
of earlier steps, which their senders handle before their own later events, and sends
never block, so it cannot deadlock, and the measured chain of messages is exactly
2H + C - 1 steps. Each tree uses its own pair of tags (two ranks can be linked in both
trees).
"""
from __future__ import annotations

import torch

from plexus.cluster.group import Endpoint
from plexus.collectives.base import TAG_GATHER, TAG_REDUCE, AllReduce, scratch, wait_all
from plexus.collectives.cost import DBTREE_CHUNK_BYTES
from plexus.collectives.schedule import chunk_bounds, dbtree_chunks, double_tree
from plexus.errors import ConfigError

__all__ = ["DoubleTree", "CHUNK_BYTES"]

# Pipeline chunk (1 MiB): big enough that the ~0.1 ms of Python and thread wake-up per
# message stays small next to the transfer (about 1 ms per MiB on loopback here), small
# enough to fill the pipeline quickly.
CHUNK_BYTES = DBTREE_CHUNK_BYTES
# Receives posted ahead per child, each into its own scratch chunk.
_WINDOW = 4


class DoubleTree(AllReduce):
    name = "dbtree"

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ConfigError(f"dbtree chunk_bytes must be positive, got {chunk_bytes}: pass e.g. {CHUNK_BYTES}")
        self.chunk_bytes = chunk_bytes

    def options(self, group: Endpoint, flat: torch.Tensor) -> tuple[int, int]:
        return (self.chunk_bytes, 0)

    def _reduce(self, flat: torch.Tensor, group: Endpoint) -> None:
        r = group.rank
        trees = double_tree(group.size)
        count = dbtree_chunks(flat.numel() * flat.element_size(), self.chunk_bytes)
        chunks = []  # chunks[t][i]: chunk i of the half that tree t carries
        for a, b in chunk_bounds(flat.numel(), 2):
            chunks.append([flat[a + x: a + y] for x, y in chunk_bounds(b - a, count)])
        width = chunks[0][0].numel()  # the largest chunk
        parents = [tree.parent[r] for tree in trees]
        kids = [tree.children[r] for tree in trees]
        sends = []
        # From the parent: the reduced chunks, straight into place. They come back only
        # after this rank's own contribution has gone up, so they can be posted now.
        down = [[group.irecv(c, parents[t], TAG_GATHER + t) if c.numel() else None for c in chunks[t]]
                if parents[t] >= 0 else [] for t in range(2)]
        slots = {(t, k, s): scratch(group, width, flat, (self.name, t, k, s))
                 for t in range(2) for k in range(len(kids[t])) for s in range(min(_WINDOW, count))}

        def post_up(t: int, k: int, i: int):
            if i >= count or not chunks[t][i].numel():
                return None
            size = chunks[t][i].numel()
            return group.irecv(slots[t, k, i % _WINDOW][:size], kids[t][k], TAG_REDUCE + t)

        up = {(t, k): [post_up(t, k, i) for i in range(min(_WINDOW, count))]
              for t in range(2) for k in range(len(kids[t]))}
        for t in range(2):
            if not kids[t] and parents[t] >= 0:  # a leaf: nothing to wait for
                sends += [group.isend(c, parents[t], TAG_REDUCE + t) for c in chunks[t] if c.numel()]
        events = []  # (step, kind, tree, chunk): kind 0 = reduce, 1 = forward down
        for t, tree in enumerate(trees):
            if kids[t]:
                events += [(i + tree.below(r) + 1, 0, t, i) for i in range(count)]
                if parents[t] >= 0:
                    events += [(i + tree.height + tree.depth(r) + 1, 1, t, i) for i in range(count)]
        for _, kind, t, i in sorted(events):
            mine = chunks[t][i]
            if kind == 1:
                if down[t][i] is not None:
                    down[t][i].wait()
                    sends += [group.isend(mine, kid, TAG_GATHER + t) for kid in kids[t]]
                continue
            for k in range(len(kids[t])):
                work = up[t, k][i]
                if work is not None:
                    work.wait()
                    mine.add_(slots[t, k, i % _WINDOW][: mine.numel()])
                up[t, k].append(post_up(t, k, i + _WINDOW))
            if not mine.numel():
                continue
            if parents[t] >= 0:
                sends.append(group.isend(mine, parents[t], TAG_REDUCE + t))
            else:  # the root: chunk i is complete, start it down at once
                sends += [group.isend(mine, kid, TAG_GATHER + t) for kid in kids[t]]
        for t in range(2):
            if not kids[t]:
                wait_all(down[t])
        wait_all(sends)
