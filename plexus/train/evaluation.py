"""Loss, evaluation, and the snapshot evaluator that keeps evaluation off the clock.

A training process hands the evaluator a copy of the global model's state with the
training-clock time at which it was taken; a background thread evaluates it on the
held-out set while training goes on, and logs the result against the snapshot's time.
"""
from __future__ import annotations

import copy
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from plexus.train.metrics import MetricsLog

__all__ = ["loss_fn", "evaluate", "SnapshotEvaluator", "Evaluation"]

logger = logging.getLogger(__name__)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; models put classes in the last dimension of their logits."""
    return logits_loss(model(x), y)


def logits_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (classes in the last dimension) against class
    indices ``y``: every model's loss, and a pipeline's output stage's."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@dataclass(frozen=True)
class Evaluation:
    step: int
    time: float
    samples: int
    accuracy: float
    loss: float


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             batch: int = 1024) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``x, y``, in batches."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(x), batch):
        xb, yb = x[start:start + batch].to(device), y[start:start + batch].to(device)
        logits = model(xb)
        flat, target = logits.reshape(-1, logits.shape[-1]), yb.reshape(-1)
        total_loss += F.cross_entropy(flat, target, reduction="sum").item()
        correct += (flat.argmax(-1) == target).sum().item()
        count += target.numel()
    model.train(was_training)
    return total_loss / max(count, 1), correct / max(count, 1)


class SnapshotEvaluator:
    """Evaluates snapshots of the global model on a background thread.

    ``submit`` copies the model's state (the only cost on the training path);
    ``reached`` is set once a snapshot meets ``target`` accuracy, and
    ``time_to_target`` holds that snapshot's training-clock time, which is also handed to
    ``on_target`` (so that it outlives this process: the summary reads it from the store).
    """

    def __init__(self, template: torch.nn.Module, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device, log: MetricsLog, target: float | None, model_label: str = "global",
                 max_pending: int = 4, on_target: Callable[[float], None] | None = None) -> None:
        self._model = copy.deepcopy(template)
        self._x, self._y, self._device = x_test, y_test, device
        self._log, self._target, self._label, self._on_target = log, target, model_label, on_target
        self._queue: queue.Queue = queue.Queue()
        self._max_pending = max_pending
        self.reached = threading.Event()
        self.time_to_target: float | None = None
        self.results: list[Evaluation] = []
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, name="evaluator", daemon=True)
        self._thread.start()

    def submit(self, model: torch.nn.Module, step: int, time: float, samples: int) -> None:
        if self._queue.qsize() >= self._max_pending:
            # Evaluation lags training: drop this snapshot rather than hold training up.
            self.skipped += 1
            return
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._queue.put((state, step, time, samples))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            state, step, time, samples = item
            try:
                self._model.load_state_dict(state)
                loss, acc = evaluate(self._model, self._x, self._y, self._device)
            except Exception:  # never kill training over an evaluation; say so
                logger.exception("evaluator: snapshot of step %d failed", step)
                continue
            self.record(Evaluation(step=step, time=time, samples=samples, accuracy=acc, loss=loss))

    def record(self, result: Evaluation) -> None:
        self.results.append(result)
        self._log.log("eval", time=result.time, step=result.step, samples=result.samples,
                      test_accuracy=result.accuracy, test_loss=result.loss, model=self._label)
        if self._target is not None and result.accuracy >= self._target and not self.reached.is_set():
            self.time_to_target = result.time
            self.reached.set()
            if self._on_target is not None:
                try:
                    self._on_target(result.time)
                except RuntimeError as exc:  # the store is gone: the job is ending anyway
                    logger.warning("evaluator: could not record the time to target: %s", exc)

    def close(self) -> None:
        """Finish every pending evaluation."""
        self._queue.put(None)
        self._thread.join()
