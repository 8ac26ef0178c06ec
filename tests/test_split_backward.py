"""zb-h1's split backward (parallel/split_backward.py): B's input gradients and W's
parameter gradients equal one whole backward's, and W runs only the weight products where
the graph can be split, falling back to a whole backward where it cannot."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plexus.parallel.split_backward import SplitBackward


def _whole(tensors, seeds, inputs):
    return torch.autograd.grad(tensors, inputs, seeds, retain_graph=True, allow_unused=True)


def _check(tensors, seeds, leaves, params, split: bool) -> SplitBackward:
    want = _whole(tensors, seeds, [*leaves, *params])
    sb = SplitBackward(tensors, seeds, leaves, params)
    assert sb.split is split
    got = [*sb.input_gradients(), *sb.weight_gradients()]
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    return sb


def test_a_chain_splits_and_w_runs_only_the_weight_products():
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)  # a received value
    w1, b1, w2 = torch.randn(8, 4, requires_grad=True), torch.randn(8, requires_grad=True), \
        torch.randn(3, 8, requires_grad=True)
    hidden = torch.tanh(F.linear(x, w1, b1))
    out = F.linear(hidden, w2)
    loss = F.cross_entropy(out, torch.tensor([0, 1, 2, 0, 1, 2]))
    tensors, seeds = [loss, hidden], [torch.ones(()), torch.randn(6, 8)]  # the loss and a value sent on
    want = _whole(tensors, seeds, [x, w1, b1, w2])
    sb = SplitBackward(tensors, seeds, [x], [w1, b1, w2])
    assert sb.split is True
    torch.testing.assert_close(sb.input_gradients()[0], want[0], rtol=0, atol=0)
    ran = []
    handle = hidden.grad_fn.register_prehook(lambda grads: ran.append(1))  # tanh: on the inputs' path only
    got = sb.weight_gradients()
    handle.remove()
    assert ran == []  # W did not walk the activation gradients again
    for g, w in zip(got, want[1:]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_tied_weights_fall_back_to_a_whole_backward():
    """One weight at two points of the inputs' path: a restart from the later one would
    reach the earlier one, so W walks the whole graph, and the sums are still right."""
    torch.manual_seed(1)
    x, w = torch.randn(5, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    out = F.linear(torch.tanh(F.linear(x, w)), w).sum()
    _check([out], [torch.ones(())], [x], [w], split=False)


def test_without_received_values_or_with_an_output_of_its_own_w_is_a_whole_backward():
    torch.manual_seed(2)
    data, w = torch.randn(5, 4), torch.randn(3, 4, requires_grad=True)
    _check([F.linear(data, w).sum()], [torch.ones(())], [], [w], split=False)  # stage 0: nothing received
    # An output (a value sent on) that does not depend on what the stage received: v's
    # gradient never meets the inputs' path, so there is nowhere to restart from.
    x, v = torch.randn(5, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    _check([F.linear(x, torch.eye(3)).square().sum(), F.linear(data, v)], [torch.ones(()), torch.randn(5, 3)],
           [x], [v], split=False)
    # Joining the inputs' path before the output, it splits: W restarts where they meet.
    out = (F.linear(x, torch.eye(3)) + F.linear(data, v)).square().sum()
    _check([out], [torch.ones(())], [x], [v], split=True)


def test_an_unused_parameter_has_no_gradient():
    torch.manual_seed(3)
    x, w, unused = torch.randn(5, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True), \
        torch.randn(2, requires_grad=True)
    _check([F.linear(x, w).square().sum()], [torch.ones(())], [x], [w, unused], split=True)


def test_a_linears_w_is_added_into_the_accumulators_by_its_matrix_product():
    """With ``into``, each Linear's weight and bias gradients (x @ W.t() + b as addmm, and
    without a bias as mm) are added into the step's accumulators, made there where none is
    yet, and returned as None; a parameter of another kind still comes back to be added."""
    torch.manual_seed(4)
    x = torch.randn(6, 4, requires_grad=True)
    first, second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3, bias=False)
    scale = torch.randn(3, requires_grad=True)
    params = [first.weight, first.bias, second.weight, scale]
    out = (second(torch.relu(first(x))) * scale).square().sum()
    want = _whole([out], [torch.ones(())], params)
    sb = SplitBackward([out], [torch.ones(())], [x], params)
    assert sb.split is True and len(sb.linears) == 2 and len(sb.groups) == 1  # scale: a restart of its own
    sb.input_gradients()
    earlier = [torch.ones_like(first.weight), None, torch.full_like(second.weight, 2.0), None]
    got = sb.weight_gradients(into=earlier)
    assert got[:3] == [None, None, None]
    torch.testing.assert_close(got[3], want[3])
    torch.testing.assert_close(earlier[0], want[0] + 1)
    torch.testing.assert_close(earlier[1], want[1])
    torch.testing.assert_close(earlier[2], want[2] + 2)
    assert earlier[3] is None


def test_w_leaves_no_micro_batch_graph_alive_under_the_executors_hooks():
    """W reads each Linear's saved input (node._saved_mat1). Under the executor's hooks,
    which count the bytes autograd saves, a saved tensor kept with its grad_fn made that
    read keep the whole micro-batch's graph alive (8 MB a step on a two-stage deep-mlp);
    once the micro-batch is dropped, nothing of its graph may survive."""
    import gc
    import weakref
    from plexus.parallel.executor import _counting_saved
    torch.manual_seed(5)
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    params = [first.weight, first.bias, second.weight, second.bias]
    grads: list = [None] * 4
    saved: dict = {}
    x = torch.randn(4, 8, requires_grad=True)
    with _counting_saved({p.data_ptr() for p in params}, saved):
        hidden = torch.relu(first(x))
        out = second(hidden).square().sum()
    assert saved  # the activations were counted
    alive = weakref.ref(hidden)
    sb = SplitBackward([out], [torch.ones(())], [x], params)
    sb.input_gradients()
    sb.weight_gradients(into=grads)
    assert all(g is not None and g.grad_fn is None for g in grads)
    del sb, out, hidden, x
    gc.collect()
    assert alive() is None


def test_a_later_micro_batch_follows_the_first_ones_plan():
    """A stage of Linears is planned once (``template``, indices only, no node) and each
    later micro-batch's graph, of the same shape, follows it to the same linears and the
    same gradients; a template from another graph falls back to planning."""
    torch.manual_seed(6)
    first, second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
    params = [first.weight, first.bias, second.weight, second.bias]

    def backward(template=None, seed=0):
        torch.manual_seed(seed)
        x = torch.randn(5, 4, requires_grad=True)
        out = second(torch.relu(first(x))).square().sum()
        return out, x, SplitBackward([out], [torch.ones(())], [x], params, template)

    _, _, planned = backward()
    template = planned.template
    assert template == ((2, 3), (0, 1))  # the walk down meets the second Linear first
    out, x, followed = backward(template, seed=1)
    want = _whole([out], [torch.ones(())], [x, *params])
    assert followed.split and [(w, b) for _, w, b in followed.linears] == [(2, 3), (0, 1)]
    assert not followed.groups
    torch.testing.assert_close(followed.input_gradients()[0], want[0], rtol=0, atol=0)
    for got, w in zip(followed.weight_gradients(), want[1:]):
        torch.testing.assert_close(got, w)
    # Another graph: one Linear fewer, or the weights of another stage, so planned afresh.
    torch.manual_seed(2)
    x = torch.randn(5, 4, requires_grad=True)
    alone = SplitBackward([first(x).sum()], [torch.ones(())], [x], params[:2], template)
    assert alone.split and [(w, b) for _, w, b in alone.linears] == [(0, 1)]
    other = torch.nn.Linear(8, 3)
    out = other(torch.relu(first(x))).sum()
    swapped = SplitBackward([out], [torch.ones(())], [x], [other.weight, other.bias, *params[:2]], template)
    # The template's index 2 is first's weight here, which the first matmul met does not read.
    assert swapped.split and swapped.template == ((0, 1), (2, 3))
    # A plan that is not Linears alone has no template.
    scale = torch.randn(3, requires_grad=True)
    mixed = SplitBackward([(second(first(x)) * scale).sum()], [torch.ones(())], [x], [*params, scale])
    assert mixed.split and mixed.groups and mixed.template is None
