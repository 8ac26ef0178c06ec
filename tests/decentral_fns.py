"""Functions run inside spawned worker processes by the decentralized-training tests."""
from __future__ import annotations


from torch import nn


def linear_model(data) -> nn.Module:
    """Softmax regression: a convex problem, for the consensus-distance test."""
    return nn.Sequential(nn.Flatten(), nn.Linear(data.input_shape[0], data.num_classes))


# The same runner-in-spawned-processes helper as the contract tests use.
from dist_fns import train_cases  # noqa: E402,F401
