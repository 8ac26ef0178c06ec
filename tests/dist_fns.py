"""Functions run inside spawned worker processes by the multi-process tests."""
from __future__ import annotations

import torch

from plexus.collectives import get_algorithm


def allreduce_check(group, algorithm: str, length: int, dtype: str, op: str = "sum") -> dict:
    """Each rank contributes rank-dependent values; compare with the exact sum."""
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1000 + group.rank)
    mine = torch.randn(length, generator=gen, dtype=torch.float64)
    expected = sum(torch.randn(length, generator=torch.Generator().manual_seed(1000 + r), dtype=torch.float64)
                   for r in range(group.size))
    if op == "mean":
        expected = expected / group.size
    tensor = mine.to(dt)
    get_algorithm(algorithm)(tensor, group, op)
    err = (tensor.double() - expected).abs().max().item() if length else 0.0
    return {"max_err": err, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
