"""The arithmetic of decentralized training, on tensors only (no processes).

- ``FlatParameters``: a model's parameters as views of one contiguous float buffer, so a
  whole model is mixed, sent or averaged as one tensor without copies.
- ``mix``: one gossip step, sum_j W_ij x_j, summed in rank order so that every worker
  that holds the same inputs computes the very same bits (on a complete graph with
  uniform weights the replicas then stay bit-identical, as contract 1 needs).
- ``consensus_distance``: (1/P) sum_i ||x_i - x_bar||, the quantity D-PSGD's analysis
  bounds by O(lr / spectral gap) (Lian et al. 2017, Theorem 1; Kong et al. 2021 call its
  square the consensus distance).
- ``elastic_difference``: EASGD's elastic force alpha (x - x_centre) (Zhang, Choromanska
  and LeCun 2015, eqs. 5-6): the worker subtracts it, the centre adds it, so worker plus
  centre is conserved by every exchange.
- ``optimizer_buffers``: the per-parameter state tensors of an optimizer (momentum,
  Adam's moments, Adagrad's sums), for local SGD's ``--average-optimizer-state``.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

__all__ = ["FlatParameters", "mix", "consensus_distance", "elastic_difference", "optimizer_buffers"]


class FlatParameters:
    """Rebinds every parameter of ``model`` to a view of one flat buffer, ``self.flat``.

    Build it before the optimizer: the optimizer keeps the same Parameter objects, whose
    data now live in ``flat``. Parameters of one dtype and device only (a mixed model
    would need one buffer per dtype).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters()]
        if not params:
            raise ValueError("the model has no parameters to average")
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"decentralized strategies need parameters of one dtype and device, got {dtypes}")
        self.params = params
        with torch.no_grad():
            self.flat = torch.cat([p.detach().reshape(-1) for p in params])
            offset = 0
            for p in params:
                n = p.numel()
                p.data = self.flat[offset:offset + n].view_as(p)
                offset += n

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def grads(self) -> list[torch.Tensor]:
        """The parameters' gradients (zeros where backward produced none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]


@torch.no_grad()
def mix(weights: Mapping[int, float], tensors: Mapping[int, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = sum_j weights[j] * tensors[j]`` over the keys of ``weights`` in rank order.
    ``out`` may be one of the inputs (it is written only at the end)."""
    order = sorted(weights)
    acc = tensors[order[0]] * weights[order[0]]
    for j in order[1:]:
        acc.add_(tensors[j], alpha=weights[j])
    return out.copy_(acc)


def consensus_distance(replicas: Iterable[torch.Tensor]) -> float:
    """(1/P) sum_i ||x_i - x_bar||_2 over the given flat replicas."""
    stack = torch.stack([r.detach().double() for r in replicas])
    mean = stack.mean(0)
    return float((stack - mean).norm(dim=1).mean())


def elastic_difference(local: torch.Tensor, centre: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * (local - centre): the worker does local -= it and the centre += it."""
    return (local - centre).mul_(alpha)


def optimizer_buffers(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's state tensors shaped like their parameter, in parameter order and
    then key order (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``; ``sum``). Scalars such
    as Adam's ``step`` are skipped: every worker takes the same number of steps."""
    out: list[torch.Tensor] = []
    for p in params:
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.is_floating_point():
                out.append(value)
    return out
