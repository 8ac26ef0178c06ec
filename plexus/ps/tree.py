"""The shape of a hierarchical parameter server (Gupta, Zhang and Wang 2016, Rudra-adv), as a
pure object shared by the processes that run it and by the simulator.

Leaves are the P workers; interior nodes are aggregators; the root is the (possibly
sharded) parameter server. ``Tree(workers, fanout)`` groups each level's nodes into runs
of ``fanout`` consecutive nodes under a new aggregator, level by level, until at most
``fanout`` nodes are left, which become the root's children. A run of one node (the last
of a level that does not divide evenly) is not given an aggregator of its own: it moves up
a level unchanged, so no aggregator ever has a single child and the root sees at most
``fanout`` senders whatever P is. Aggregators are numbered bottom-up, left to right.

The tree carries gradients up. Weights come back down it in Rudra-adv (as the answers to
the pushes); in Rudra-adv* each learner reads them straight from the root (``readers.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["Node", "Tree", "ROOT", "adopt_key", "node_of"]


@dataclass(frozen=True, order=True)
class Node:
    role: str   # "worker", "aggregator" or "root"
    rank: int

    @property
    def name(self) -> str:
        """The process name (``worker 3``, ``aggregator 0``); the root is the servers."""
        return "root" if self.role == "root" else f"{self.role} {self.rank}"


ROOT = Node("root", 0)


class Tree:
    """Parents, children and depths of the aggregation tree over ``workers`` leaves."""

    def __init__(self, workers: int, fanout: int) -> None:
        if workers < 1:
            raise ValueError(f"a tree needs at least one worker, got {workers}")
        if fanout < 2:
            raise ValueError(f"fanout must be at least 2, got {fanout}")
        self.workers, self.fanout = workers, fanout
        self._parent: dict[Node, Node] = {}
        self._children: dict[Node, tuple[Node, ...]] = {}
        level = [Node("worker", r) for r in range(workers)]
        made = 0
        while len(level) > fanout:
            up: list[Node] = []
            for i in range(0, len(level), fanout):
                run = level[i:i + fanout]
                if len(run) == 1:
                    up.append(run[0])
                    continue
                node = Node("aggregator", made)
                made += 1
                self._adopt(node, run)
                up.append(node)
            level = up
        self._adopt(ROOT, level)
        self.aggregators = made

    def _adopt(self, parent: Node, children: list[Node]) -> None:
        self._children[parent] = tuple(children)
        for child in children:
            self._parent[child] = parent

    def parent(self, node: Node) -> Node:
        if node not in self._parent:
            raise ValueError(f"{node.name} is not a node below the root of this tree")
        return self._parent[node]

    def children(self, node: Node) -> tuple[Node, ...]:
        """A node's children, in order (a worker has none)."""
        return self._children.get(node, ())

    def position(self, node: Node) -> int:
        """The index of ``node`` among its parent's children (its sender id there)."""
        return self.children(self.parent(node)).index(node)

    def depth(self, node: Node) -> int:
        """Edges from the root: the root's children have depth 1."""
        depth = 0
        while node != ROOT:
            node, depth = self.parent(node), depth + 1
        return depth

    @cached_property
    def height(self) -> int:
        return max(self.depth(Node("worker", r)) for r in range(self.workers))

    def leaves(self, node: Node) -> tuple[int, ...]:
        """The ranks of the workers below ``node`` (itself, for a worker), in order."""
        if node.role == "worker":
            return (node.rank,)
        return tuple(r for child in self.children(node) for r in self.leaves(child))

    def nodes(self) -> list[Node]:
        """Every node but the root: workers, then aggregators."""
        return [Node("worker", r) for r in range(self.workers)] + \
               [Node("aggregator", a) for a in range(self.aggregators)]


def node_of(name: str) -> Node:
    """The node of process ``name`` (``aggregator 1``, ``worker 3``, ``root``)."""
    if name == "root":
        return ROOT
    role, rank = name.split()
    return Node(role, int(rank))


def adopt_key(parent: Node) -> str:
    """The store counter of the children that re-attached to ``parent`` after theirs
    died; ``<key>/<k>`` names the k-th (``TreePSStrategy``, ``Aggregator``)."""
    return f"tree/adopt/{parent.name}"
