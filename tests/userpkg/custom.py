"""A user's own model and dataset, trained by import path in the tests."""
from __future__ import annotations

import torch
from torch import nn


class TwoLayer(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(data) -> nn.Module:
    return TwoLayer(data.input_shape[0], data.num_classes)


def make_data(cfg, seed: int):
    """Two Gaussian blobs: (x_train, y_train, x_test, y_test)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (600,), generator=gen)
    x = torch.randn(600, 8, generator=gen) + 2.0 * y[:, None].float()
    return x[:500], y[:500], x[500:], y[500:]
