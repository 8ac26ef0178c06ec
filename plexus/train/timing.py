"""Where a worker's time goes: compute, communication and waiting, and the rest.

The report's per-worker time line needs the split without asking every strategy to
instrument itself. The runner hands each strategy a loss function; ``StepTimer.wrap``
times that call (forward) and, through a hook on the loss, the backward pass that
follows it, up to the end of autograd's execution (``queue_callback``, the point where
DDP also waits). Everything else inside ``Strategy.step`` is communication and waiting
for peers or servers (and the optimizer update, which is small next to either for the
models here). Time outside ``step`` is data loading, logging and snapshots.

Caveat, stated in the report: a strategy that overlaps communication with backward
(allreduce's bucket hooks) has the hooks' launch cost counted as compute, and one whose
emulated slow-down (``--slow``) sleeps inside ``step`` has that sleep counted where it
sleeps (``emulated_sleep_seconds`` in the summary says how much there was).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """Cumulative seconds of forward + backward (``compute``) and of ``Strategy.step``."""

    def __init__(self) -> None:
        self.compute = 0.0  # s, forward + backward passes, summed
        self.step = 0.0     # s, inside Strategy.step, summed (compute included)

    def wrap(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` that adds its own time and its backward's to ``compute``."""
        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            start = time.perf_counter()
            loss = loss_fn(*args, **kwargs)
            self.compute += time.perf_counter() - start
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.register_hook(self._backward_started)
            return loss
        return timed

    def _backward_started(self, grad: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()

        def finished() -> None:
            self.compute += time.perf_counter() - start
        # Runs once autograd has finished this backward pass (every gradient computed).
        torch.autograd.Variable._execution_engine.queue_callback(finished)
        return grad

    @contextmanager
    def stepping(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.step += time.perf_counter() - start

    def fields(self) -> dict[str, float]:
        """The cumulative split as logged with each train event (seconds)."""
        return {"compute_seconds": round(self.compute, 6), "step_seconds": round(self.step, 6)}
