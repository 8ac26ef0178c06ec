"""Small models for the float64 oracles: logistic regression and an MLP on dense inputs."""
from __future__ import annotations

from torch import nn


def logreg(data) -> nn.Module:
    return nn.Linear(data.input_shape[0], data.num_classes)


def mlp(data) -> nn.Module:
    return nn.Sequential(nn.Linear(data.input_shape[0], 16), nn.Tanh(), nn.Linear(16, data.num_classes))
