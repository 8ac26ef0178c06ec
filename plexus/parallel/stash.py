"""Weight stashing for the asynchronous pipelines (``--schedule pipedream``, ``pipedream-2bw``).

A stage of an asynchronous pipeline steps its optimizer between the forward of an input
and that input's backward (PipeDream: after every backward, so stage s steps K-s-1 times
in between). Harlap et al. 2018 (section 3.3) and Narayanan et al. 2019 show that the
backward must then use the weights the forward used, or the gradient is that of no model
at all: the activations were computed with one version and the backward multiplies by
another. Weight stashing keeps, per version, a copy of the stage's parameters: the
forward of an input runs on its version's copy (``torch.func.functional_call``), and its
backward differentiates that same copy; the gradient is then deposited into the live
parameters that the optimizer steps.

``stashing=False`` reproduces the pipeline without it, for comparison (the weight
stashing recipe, benchmarks/weight_stashing.py): before the backward, the copy is
overwritten in place with the live weights, so the backward multiplies by the weights of
now, at the activations of then, as PipeDream without stashing does. The write goes
through ``.data``: autograd would otherwise refuse a tensor it saved that changed since.

Which version an op uses is the schedule's (``Op.version``); the stash only holds the
copies, each from the start of the step whose weights it is until no input in flight and
no later forward asks for it (the schedules' forwards ask for versions that never
decrease, so a version older than the next forward's and held by no input is done).

**Delay compensation** (the default; ``--no-delay-compensation`` turns it off). A stage
whose gradients are applied D steps after the version they were taken at
(``Schedule.delay``) is a delayed gradient method, and delay shrinks the stable step:
gradient descent on a quadratic with a gradient D steps old is stable only for
lr * curvature < 2 sin(pi / (2 (2D + 1))) (Levin and May 1976), about pi / (2D + 1),
against 2 without delay. Momentum makes it tighter, and the stale stages' steps with
momentum 0.9 overshoot (docs/results/pipedream-defaults.md). Three remedies together:
- ``delay_lr_scale``: the stage's learning rate times 1 / (1 + 2D), the bound's
  asymptotic form (milder scales, the exact sine ratio among them, left deep-mlp over
  3-4 stages behind on some seeds while this was chosen);
- spike compensation of momentum SGD (Kosson et al. 2020;
  ``strategies.base.SpikeCompensatedSGD``, which the stage's group config selects);
- linear weight prediction (Chen et al. 2018, SpecTrain; Kosson et al. 2020): the copy a
  forward uses is not version v's weights but those the last step predicts D steps on,
  W(v) + D (W(v) - W(v-1)), the weights its gradient will be applied to if the next D
  steps repeat the last. Stashing keeps the prediction for the backward, so the gradient
  is still that of the weights the forward ran on.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.func import functional_call

__all__ = ["WeightStash", "delay_lr_scale"]


def delay_lr_scale(delay: int) -> float:
    """The factor delay compensation applies to the learning rate of a stage whose
    gradients are ``delay`` steps stale (see the module docstring)."""
    return 1.0 / (1 + 2 * delay)


class WeightStash:
    """Copies of ``module``'s trainable parameters by version (optimizer steps applied).
    ``ahead`` > 0: each copy is the weights predicted ``ahead`` steps on from the last
    step (delay compensation); 0: the version's weights as they are."""

    def __init__(self, module: torch.nn.Module, ahead: int = 0) -> None:
        self.module = module
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self.copies: dict[int, list[torch.Tensor]] = {}
        self.peak = 0  # the most versions held at once
        self.peak_copies = 0  # the most copies of the weights held at once: those and the prediction's base
        self.ahead = ahead
        self._last: tuple[int, list[torch.Tensor]] | None = None  # the previous kept version's live weights

    @property
    def live(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps, in ``names``' order."""
        params = dict(self.module.named_parameters())
        return [params[name] for name in self.names]

    def keep(self, version: int) -> None:
        """Copy the live weights as ``version`` (call when exactly ``version`` steps are
        applied and a forward may still ask for it), predicted ``ahead`` steps on from the
        previous version kept; a copy that needs a gradient, a leaf of each graph built on
        it."""
        if version in self.copies:
            return
        now = [p.detach().clone() for p in self.live]
        last = self._last
        if self.ahead:
            self._last = (version, now)
        if self.ahead and last is not None and last[0] < version:
            # The last step's change (per step, if versions were skipped), ``ahead`` times.
            reach = self.ahead / (version - last[0])
            copy = [w + reach * (w - old) for w, old in zip(now, last[1])]
        else:  # under ``ahead``, ``now`` is kept for the next prediction: a copy of its own
            copy = [w.clone() for w in now] if self.ahead else now
        self.copies[version] = [w.requires_grad_(True) for w in copy]
        self.peak = max(self.peak, len(self.copies))
        self.peak_copies = max(self.peak_copies, len(self.copies) + (self._last is not None))

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s copy by parameter name, for ``functional_call``."""
        return dict(zip(self.names, self.copies[version]))

    def call(self, version: int, *args: torch.Tensor):
        """The module's forward with ``version``'s weights (its buffers are the module's)."""
        return functional_call(self.module, self.weights(version), args)

    def gradients(self, version: int, tensors: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor],
                  leaves: Sequence[torch.Tensor] = (), stashing: bool = True
                  ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The gradients, from the backward of ``tensors`` seeded with ``seeds``, of the
        weights (in ``names``' order) and of ``leaves`` (the stage's received values).
        With ``stashing`` the weights differentiated are ``version``'s, those the forward
        used; without, the live ones, written into the copy first (see the module's
        docstring). Frees the graph."""
        copy = self.copies[version]
        if not stashing:
            with torch.no_grad():
                for stashed, now in zip(copy, self.live):
                    stashed.data.copy_(now.data)
        inputs = [*copy, *leaves]
        if not tensors or not inputs:
            return [None] * len(copy), [None] * len(leaves)
        got = torch.autograd.grad(list(tensors), inputs, list(seeds), allow_unused=True)
        return list(got[:len(copy)]), list(got[len(copy):])

    def drop(self, held: set[int], next_forward: int | None) -> None:
        """Drop the copies no input in flight holds (``held``) and older than the version
        the next forward asks for (``next_forward``; None: no forward is left)."""
        for version in [v for v in self.copies if v not in held and (next_forward is None or v < next_forward)]:
            del self.copies[version]
