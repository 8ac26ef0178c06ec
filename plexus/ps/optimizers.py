"""Server-side optimizers on a flat shard: sgd, momentum, adagrad, adam.

Each server applies updates to its own range of the flat buffer (and its own sparse
rows) with its own optimizer state, as DistBelief's parameter-server shards do (Dean et
al. 2012; Downpour with Adagrad, their best performer, keeps one accumulator per
parameter on the shard that owns it). These are pure objects over tensors: the server
drives them under its lock, the simulator drives them directly.

The dense updates are elementwise and follow ``torch.optim``'s single-tensor formulas
step for step (SGD with heavy-ball momentum and no dampening, Adagrad with eps 1e-10 and
no lr decay, Adam with betas (0.9, 0.999), eps 1e-8 and bias correction), so a server that
applies the average gradient of the global batch reproduces one-process training
(contract 1; tested against ``torch.optim``). Buffers start at zero: torch's first
momentum step copies the gradient, which is the same number.

Sparse rows are updated lazily: only the rows a push touches, and only their state, as
TensorFlow's lazy optimizers and ``torch.optim.SparseAdam`` do (which counts Adam's steps
per table, as we do). Plain SGD without weight decay is exactly the dense update; with
momentum, weight decay, Adagrad or Adam, rows a batch does not touch keep their state
until they are touched again.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from plexus.config import OptimConfig

__all__ = ["ServerOptimizer", "SGD", "Momentum", "Adagrad", "Adam", "make_server_optimizer"]


class ServerOptimizer(ABC):
    """Updates one shard: ``step`` on its dense range, ``step_rows`` on some of its rows."""

    name: str

    def __init__(self, cfg: OptimConfig, numel: int, rows: int = 0, width: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        self.lr, self.weight_decay = cfg.lr, cfg.weight_decay
        self.steps = 0
        self._shape = (numel,)
        self._table_shape = (rows, width)
        self._dtype = dtype

    def _zeros(self, table: bool) -> torch.Tensor:
        return torch.zeros(self._table_shape if table else self._shape, dtype=self._dtype)

    def step(self, params: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0,
             out: torch.Tensor | None = None) -> None:
        """``out = params - update(grad)`` for the whole dense range; in place without ``out``.
        (A server writes into a spare buffer, so replies still being sent from the old one
        need no copy.)"""
        if self.weight_decay:
            grad = grad.add(params, alpha=self.weight_decay)
        self._dense(params, grad, self.lr * lr_scale, params if out is None else out)

    def step_rows(self, table: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        """Update rows ``rows`` (unique local indices) of ``table`` with ``grad`` [len(rows), width]."""
        if not len(rows):
            return
        current = table.index_select(0, rows)
        if self.weight_decay:
            grad = grad.add(current, alpha=self.weight_decay)
        table.index_copy_(0, rows, self._rows(current, rows, grad, self.lr * lr_scale))

    def tick(self) -> None:
        """Count one update of the shard (dense and sparse parts together)."""
        self.steps += 1

    def state(self) -> list[torch.Tensor]:
        """The dense state tensors, in a fixed order (what a replica copies; ``replication.py``)."""
        return []

    @abstractmethod
    def _dense(self, params: torch.Tensor, grad: torch.Tensor, lr: float, out: torch.Tensor) -> None:
        ...

    @abstractmethod
    def _rows(self, current: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        """The updated values of ``current`` (the rows' present values)."""


class SGD(ServerOptimizer):
    name = "sgd"

    def _dense(self, params: torch.Tensor, grad: torch.Tensor, lr: float, out: torch.Tensor) -> None:
        torch.add(params, grad, alpha=-lr, out=out)

    def _rows(self, current: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        return current.add(grad, alpha=-lr)


class Momentum(ServerOptimizer):
    """Heavy-ball momentum: buf = m * buf + g; p -= lr * buf (torch.optim.SGD, no dampening)."""

    name = "momentum"

    def __init__(self, cfg: OptimConfig, numel: int, rows: int = 0, width: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, numel, rows, width, dtype)
        self.momentum = cfg.momentum
        self.buf, self.row_buf = self._zeros(False), self._zeros(True)

    def state(self) -> list[torch.Tensor]:
        return [self.buf]

    def _dense(self, params: torch.Tensor, grad: torch.Tensor, lr: float, out: torch.Tensor) -> None:
        self.buf.mul_(self.momentum).add_(grad)
        torch.add(params, self.buf, alpha=-lr, out=out)

    def _rows(self, current: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        buf = self.row_buf.index_select(0, rows).mul_(self.momentum).add_(grad)
        self.row_buf.index_copy_(0, rows, buf)
        return current.add(buf, alpha=-lr)


class Adagrad(ServerOptimizer):
    """sum += g^2; p -= lr * g / (sqrt(sum) + eps) (Duchi et al. 2011; torch.optim.Adagrad)."""

    name = "adagrad"
    eps = 1e-10

    def __init__(self, cfg: OptimConfig, numel: int, rows: int = 0, width: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, numel, rows, width, dtype)
        self.sum, self.row_sum = self._zeros(False), self._zeros(True)

    def state(self) -> list[torch.Tensor]:
        return [self.sum]

    def _dense(self, params: torch.Tensor, grad: torch.Tensor, lr: float, out: torch.Tensor) -> None:
        self.sum.addcmul_(grad, grad, value=1)
        torch.addcdiv(params, grad, self.sum.sqrt().add_(self.eps), value=-lr, out=out)

    def _rows(self, current: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        total = self.row_sum.index_select(0, rows).addcmul_(grad, grad, value=1)
        self.row_sum.index_copy_(0, rows, total)
        return current.addcdiv(grad, total.sqrt().add_(self.eps), value=-lr)


class Adam(ServerOptimizer):
    """Adam with bias correction (Kingma and Ba 2015; torch.optim.Adam's formulas)."""

    name = "adam"
    beta1, beta2, eps = 0.9, 0.999, 1e-8

    def __init__(self, cfg: OptimConfig, numel: int, rows: int = 0, width: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, numel, rows, width, dtype)
        self.m, self.v = self._zeros(False), self._zeros(False)
        self.row_m, self.row_v = self._zeros(True), self._zeros(True)

    def state(self) -> list[torch.Tensor]:
        return [self.m, self.v]

    def _moments(self, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, lr: float
                 ) -> tuple[torch.Tensor, float]:
        m.lerp_(grad, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        step = self.steps + 1  # tick() counts the update after it is applied
        step_size = lr / (1 - self.beta1 ** step)
        denom = (v.sqrt() / math.sqrt(1 - self.beta2 ** step)).add_(self.eps)
        return denom, step_size

    def _dense(self, params: torch.Tensor, grad: torch.Tensor, lr: float, out: torch.Tensor) -> None:
        denom, step_size = self._moments(self.m, self.v, grad, lr)
        torch.addcdiv(params, self.m, denom, value=-step_size, out=out)

    def _rows(self, current: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        m, v = self.row_m.index_select(0, rows), self.row_v.index_select(0, rows)
        denom, step_size = self._moments(m, v, grad, lr)
        self.row_m.index_copy_(0, rows, m)
        self.row_v.index_copy_(0, rows, v)
        return current.addcdiv(m, denom, value=-step_size)


def make_server_optimizer(cfg: OptimConfig, numel: int, rows: int = 0, width: int = 0,
                          dtype: torch.dtype = torch.float32) -> ServerOptimizer:
    """``--optimizer sgd`` with ``--momentum 0`` is plain SGD, with momentum > 0 heavy-ball
    momentum; ``adagrad`` and ``adam`` as named."""
    if cfg.optimizer == "sgd":
        klass = Momentum if cfg.momentum > 0 else SGD
    else:
        klass = {"adagrad": Adagrad, "adam": Adam}[cfg.optimizer]
    return klass(cfg, numel, rows, width, dtype)
