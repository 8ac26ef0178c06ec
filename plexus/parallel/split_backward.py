"""zb-h1's split backward (Qi et al. 2023): B, the gradients of a stage's received values,
and W, its parameters' gradients, run apart over one micro-batch's autograd graph.

B is ``torch.autograd.grad`` of the received values with the graph kept. W must not walk
the activation gradients again: that would cost a whole backward, not the weight half.
So before B, a hook is put on each node where the gradient stops serving the inputs and
starts serving only parameters (for a Linear, its matmul node: B takes its input's
gradient there and leaves its weight's); B's pass records the gradient arriving at each
such node, and W restarts from those nodes with those gradients, asking autograd for the
parameters alone (``torch.autograd.graph.GradientEdge``), so each W computes only the
weight products. torch.distributed.pipelining's ``stage_backward_input`` and
``stage_backward_weight`` split the same way.

Parameters are grouped by the set of such nodes they are reached from, and each group's
restart asks only for its own parameters, so no gradient is counted twice. Two graphs
cannot be split this way, and W then walks the whole graph from the outputs as one
backward would (``split`` is False; B still returns the inputs' gradients first):
a parameter reached from an output without passing the inputs' path (stage 0, which
receives nothing, or an output that does not depend on what the stage received), and a
parameter used at two points of the inputs' path (tied weights), where one restart would
reach the other's node.

A Linear's W needs no autograd at all: its weight's gradient is dY^T X, from the gradient
B recorded at its matmul node and the input that node saved, and its bias's the sum of
dY. ``weight_gradients(into=...)`` adds that product into the step's accumulator in the
matrix product itself (``addmm_``), where autograd would write a new gradient and the
caller then add it: on a CPU core that addition was a third of a 1024-wide layer's W.

Each micro-batch makes a new graph, of the same shape when it runs the same stage program
(an fx graph, without control flow). Where the plan is Linears alone, ``template`` keeps
its shape as indices, and the next micro-batches' plans follow it (``template=``): a walk
down the graph to its matmul nodes, each checked to read the same weight, instead of the
whole plan.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SplitBackward", "Template"]


# A Linears-only plan's shape: per matmul node met walking down the graph, the indices of
# its Linear's weight and bias (None: a matmul of no Linear). See SplitBackward.template.
Template = tuple[tuple[int, int | None] | None, ...]
_MATMULS = ("AddmmBackward0", "MmBackward0")


def _matmuls(tensors: Sequence[torch.Tensor]) -> list[Node]:
    """The matmul nodes below ``tensors``' outputs, in breadth-first order from them."""
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen, todo, found = set(roots), deque(roots), []
    while todo:
        node = todo.popleft()
        if node.name() in _MATMULS:
            found.append(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return found


def _reach(starts: list[Node], edges: dict[Node, list[Node]]) -> set[Node]:
    """Every node reachable from ``starts`` (included) along ``edges``."""
    seen, todo = set(starts), deque(starts)
    while todo:
        for nxt in edges.get(todo.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


class SplitBackward:
    """One micro-batch's backward from ``tensors`` seeded with ``seeds``, as zb-h1's B
    (``input_gradients``, of ``leaves``) then W (``weight_gradients``, of ``params``)."""

    def __init__(self, tensors: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor],
                 leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 template: Template | None = None) -> None:
        self.tensors, self.seeds = list(tensors), list(seeds)
        self.leaves, self.params = list(leaves), list(params)
        self.groups: list[tuple[list[Node], list[int]]] = []  # (restart nodes, indices of their params)
        # Groups that are one Linear: (its matmul node, index of the weight, of the bias or None).
        self.linears: list[tuple[Node, int, int | None]] = []
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.split = (template is not None and self._follow(template)) or self._plan()

    @property
    def template(self) -> Template | None:
        """Where the plan is Linears alone: the (weight, bias) indices of the Linear at
        each matmul node that a walk down the graph meets, in the walk's order (None for
        a matmul of no Linear). The next micro-batch of the same stage program, whose
        graph has the same shape, follows it (``template=``) instead of planning again.
        It holds no node, so no micro-batch's graph outlives its backward."""
        if not self.split or self.groups or not self.linears:
            return None
        at = {node: (w, b) for node, w, b in self.linears}
        return tuple(at.get(node) for node in _matmuls(self.tensors))

    def _follow(self, template: Template) -> bool:
        """The plan of a graph shaped as the one ``template`` came from (a stage
        program's fx graph has no control flow, so each micro-batch's has one shape): its
        matmul nodes met in the same order, each reading the same weight. False, and
        nothing kept, where they differ: then ``_plan``. It checks the weight alone, not
        the rest of ``_linear`` (alpha and beta, the bias, the dimensions), which one fx
        program's graphs repeat: asking ``_linear`` of each node made a followed plan
        15-30 us dearer here (65-89 against 47-59 us for two layers), before B's sends."""
        nodes = _matmuls(self.tensors)
        if len(nodes) != len(template) or not self.leaves:
            return False
        linears = []
        for node, entry in zip(nodes, template):
            if entry is not None:
                w, b = entry
                t_fn = self._transposed(node)
                if t_fn is None or getattr(t_fn.next_functions[0][0], "variable", None) is not self.params[w]:
                    return False
                linears.append((node, w, b))
        self.linears = linears
        return True

    def _plan(self) -> bool:
        """Find each parameter's restart nodes; False when the graph cannot be split."""
        roots = [t.grad_fn for t in self.tensors if t.grad_fn is not None]
        if not roots or not self.leaves:
            return False
        children: dict[Node, list[Node]] = {}
        # A leaf tensor's node is the AccumulateGrad that holds it: found on the way down,
        # by tensor, rather than asked of autograd for each parameter and leaf
        # (``get_gradient_edge``, a quarter of this plan's time on a stage of Linears).
        held: dict[int, Node] = {}
        nodes, todo = set(roots), deque(roots)
        while todo:  # the graph below the outputs, and its edges both ways
            node = todo.popleft()
            below = children[node] = [nxt for nxt, _ in node.next_functions if nxt is not None]
            if not below and node.name() == "torch::autograd::AccumulateGrad":
                held[id(node.variable)] = node
            for nxt in below:
                if nxt not in nodes:
                    nodes.add(nxt)
                    todo.append(nxt)
        parents: dict[Node, list[Node]] = {}
        for node, below in children.items():
            for nxt in below:
                parents.setdefault(nxt, []).append(node)

        def node_of(tensor: torch.Tensor) -> Node | None:
            """The tensor's node in this graph, None where the graph does not reach it."""
            return tensor.grad_fn if tensor.grad_fn is not None else held.get(id(tensor))

        leaf_nodes = [node_of(leaf) for leaf in self.leaves if leaf.requires_grad]
        serves_inputs = _reach([n for n in leaf_nodes if n in nodes], parents)
        by_restarts: dict[frozenset[Node], list[int]] = {}
        for i, param in enumerate(self.params):
            start = node_of(param)
            if start not in nodes:
                continue  # unused: its gradient is None, as autograd.grad's with allow_unused
            restarts, seen, todo = set(), {start}, deque([start])
            while todo:  # up from the parameter until the inputs' path
                node = todo.popleft()
                ups = parents.get(node, [])
                if not ups and node not in serves_inputs:
                    return False  # reached an output without passing the inputs' path
                for up in ups:
                    if up in serves_inputs:
                        restarts.add(up)
                    elif up not in seen:
                        seen.add(up)
                        todo.append(up)
            by_restarts.setdefault(frozenset(restarts), []).append(i)
        for restarts, indices in by_restarts.items():
            for node in restarts if len(restarts) > 1 else ():
                if len(_reach([node], children) & restarts) > 1:
                    return False  # a restart that reaches another of its group counts it twice
            linear = self._linear(list(restarts), indices)
            if linear is not None:
                self.linears.append(linear)
            else:
                self.groups.append((list(restarts), indices))
        return True

    def _linear(self, restarts: list[Node], indices: list[int]) -> tuple[Node, int, int | None] | None:
        """``(node, weight, bias)`` when the group is exactly one Linear's parameters behind
        its matmul node (``x @ W.t() + b`` as addmm, or ``x @ W.t()`` as mm, 2-D), else None."""
        if len(restarts) != 1:
            return None
        node, name = restarts[0], restarts[0].name()
        if name == "AddmmBackward0":
            if getattr(node, "_saved_alpha", None) != 1 or getattr(node, "_saved_beta", None) != 1:
                return None
            bias_fn = node.next_functions[0][0]
        elif name == "MmBackward0":
            bias_fn = None
        else:
            return None
        t_fn = self._transposed(node)
        if t_fn is None or t_fn.name() != "TBackward0" or not hasattr(t_fn.next_functions[0][0], "variable"):
            return None
        weight = t_fn.next_functions[0][0].variable
        bias = getattr(bias_fn, "variable", None)
        at = {id(self.params[i]): i for i in indices}
        if id(weight) not in at or weight.dim() != 2 or (bias is not None and (id(bias) not in at or bias.dim() != 1)):
            return None
        if len(indices) != 1 + (bias is not None) or self._input(node).dim() != 2:
            return None
        return node, at[id(weight)], None if bias is None else at[id(bias)]

    @staticmethod
    def _transposed(node: Node) -> Node | None:
        """The node of ``W.t()`` that a Linear's matmul node (addmm or mm) multiplies by."""
        return node.next_functions[2 if node.name() == "AddmmBackward0" else 1][0]

    @staticmethod
    def _input(node: Node) -> torch.Tensor:
        """The input a Linear's matmul node saved (x of ``x @ W.t()``)."""
        return node._saved_mat1 if node.name() == "AddmmBackward0" else node._saved_self

    def input_gradients(self) -> list[torch.Tensor | None]:
        """B: the gradients of ``leaves``, the graph kept, and (split) the gradient
        arriving at each restart node recorded for W."""
        if not self.tensors or not self.leaves:
            return [None] * len(self.leaves)
        handles = []
        for node in [node for restarts, _ in self.groups for node in restarts] + [node for node, _, _ in self.linears]:
            def record(grads, node=node):
                self.captured[node] = tuple(grads)
            handles.append(node.register_prehook(record))
        try:
            return list(torch.autograd.grad(self.tensors, self.leaves, self.seeds, retain_graph=True,
                                            allow_unused=True))
        finally:
            for handle in handles:
                handle.remove()

    def weight_gradients(self, into: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
        """W: the gradients of ``params`` (None where unused). Split: from each group's
        restart nodes with the gradients B recorded; otherwise the whole backward again.
        With ``into``, accumulators aligned with ``params`` (None where none is made yet),
        each Linear's gradients are added there (made there, where None) and returned as
        None: the caller adds the rest."""
        if not self.tensors or not self.params:
            return [None] * len(self.params)
        if not self.split:
            return list(torch.autograd.grad(self.tensors, self.params, self.seeds, allow_unused=True))
        out: list[torch.Tensor | None] = [None] * len(self.params)
        acc = into if into is not None else out
        # Not recorded: the saved input is an activation that requires grad, and a
        # product recorded with it would tie the accumulator, and through the optimizer's
        # buffers every later step, to this micro-batch's graph.
        with torch.no_grad():
            for node, w, b in self.linears:
                dy = self.captured.get(node, (None,))[0]
                if dy is None:
                    continue  # no gradient reached this layer
                x = self._input(node)
                if acc[w] is None:
                    acc[w] = torch.mm(dy.t(), x)
                else:
                    acc[w].addmm_(dy.t(), x)
                if b is not None:
                    if acc[b] is None:
                        acc[b] = dy.sum(0)
                    else:
                        acc[b].add_(dy.sum(0))
        for restarts, indices in self.groups:
            edges, grads = [], []
            for node in restarts:
                for nr, grad in enumerate(self.captured.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, nr))
                        grads.append(grad)
            if not edges:
                continue  # no gradient reached these parameters
            got = torch.autograd.grad(edges, [self.params[i] for i in indices], grads, retain_graph=True,
                                      allow_unused=True)
            for i, g in zip(indices, got):
                out[i] = g
        self.captured = {}
        return out
