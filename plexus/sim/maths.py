"""The real maths of a simulated job: the job's model, its gradients and its optimizers,
with the exact code paths of the real runtime where a run must match it bit for bit.

- ``Replica`` holds one ``nn.Module`` built as a worker builds it (same seed, same
  initial weights) and computes gradients with the same forward and backward.
- ``BucketedGradients`` lays gradients out in the all-reduce buckets
  (``collectives/bucketing.py``) and sums the workers' buckets in the order the real
  algorithm adds them: for ``ring``, chunk c of P is folded from rank c around the ring
  (c, c + 1, ..., c + P - 1), which is what ``ring.py``'s reduce-scatter computes; the
  other algorithms add in rank order (equal to the real sum up to float rounding).
"""
from __future__ import annotations

import torch

from plexus.collectives.base import Handle
from plexus.collectives.bucketing import GradientBuckets
from plexus.collectives.schedule import chunk_bounds
from plexus.train.evaluation import evaluate, loss_fn

__all__ = ["Replica", "BucketedGradients", "ring_sum", "rank_sum"]


class Replica:
    """One model, loaded from and read as a flat vector in ``parameters()`` order (the
    parameter server's layout, ``ps/sharding.py``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward on (x, y); the gradients are left in ``.grad``."""
        for p in self.params:
            p.grad = None
        loss = loss_fn(self.model, x, y)
        loss.backward()
        return loss.item()

    def flat_grad(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        value = self.backward(x, y)
        return torch.cat([p.grad.reshape(-1) for p in self.params]), value

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(test loss, test accuracy) of the current weights."""
        return evaluate(self.model, x, y, torch.device("cpu"))


def ring_sum(buffers: list[torch.Tensor]) -> torch.Tensor:
    """The sum ring all-reduce computes: chunk c folded in ring order from rank c."""
    p = len(buffers)
    out = torch.empty_like(buffers[0])
    for c, (a, b) in enumerate(chunk_bounds(out.numel(), p)):
        if a == b:
            continue
        acc = buffers[c][a:b].clone()
        for k in range(1, p):
            acc.add_(buffers[(c + k) % p][a:b])
        out[a:b] = acc
    return out


def rank_sum(buffers: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order, 0 first."""
    out = buffers[0].clone()
    for more in buffers[1:]:
        out.add_(more)
    return out


class BucketedGradients:
    """Workers' gradients in the all-reduce buckets of ``replica``'s model; ``reduce``
    leaves their mean in the model's ``.grad``, as the real all-reduce does."""

    def __init__(self, replica: Replica, bucket_bytes: int, algorithm: str) -> None:
        self.replica = replica
        self.buckets = GradientBuckets(replica.params, bucket_bytes, lambda buffer, last: Handle())
        self.sum = ring_sum if algorithm == "ring" else rank_sum

    def worker(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], float]:
        """One worker's bucket buffers after its forward and backward."""
        self.buckets.zero()
        value = loss_fn(self.replica.model, x, y)
        value.backward()
        self.buckets.finish()
        return [b.buffer.clone() for b in self.buckets.buckets], value.item()

    @torch.no_grad()
    def reduce(self, per_worker: list[list[torch.Tensor]]) -> None:
        p = len(per_worker)
        for i, bucket in enumerate(self.buckets.buckets):
            total = self.sum([w[i] for w in per_worker])
            bucket.buffer.copy_(total)
            if p > 1:
                bucket.buffer.div_(p)

    def whole_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The mean gradient of the whole global batch in one backward (equal, up to
        rounding, to the mean of the workers' equal shares)."""
        self.buckets.zero()
        value = loss_fn(self.replica.model, x, y)
        value.backward()
        self.buckets.finish()
        return value.item()

    def close(self) -> None:
        self.buckets.remove()
