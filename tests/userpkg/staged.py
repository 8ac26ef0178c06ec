"""A model for --stages tests: a value crossing a cut as a non-contiguous view (a
transpose), and one value read by two later stages, whose gradients come back from both."""
from __future__ import annotations

import torch
from torch import nn


class SkipTranspose(nn.Module):
    def __init__(self, dim: int, classes: int, hidden: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.c = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        t = h.t()  # [hidden, batch]: the batch is dimension 1, and the view is not contiguous
        u = torch.tanh(self.b(t.t()) + h)
        v = self.c(u) + h
        return self.head(v)


def make_model(data) -> nn.Module:
    return SkipTranspose(data.input_shape[0], data.num_classes)
