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
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.func import functional_call

__all__ = ["WeightStash"]


class WeightStash:
    """Copies of ``module``'s trainable parameters by version (optimizer steps applied)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self.copies: dict[int, list[torch.Tensor]] = {}
        self.peak = 0  # the most copies held at once

    @property
    def live(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps, in ``names``' order."""
        params = dict(self.module.named_parameters())
        return [params[name] for name in self.names]

    def keep(self, version: int) -> None:
        """Copy the live weights as ``version`` (call when exactly ``version`` steps are
        applied and a forward may still ask for it); a copy that needs a gradient, a leaf
        of each graph built on it."""
        if version not in self.copies:
            self.copies[version] = [p.detach().clone().requires_grad_(True) for p in self.live]
            self.peak = max(self.peak, len(self.copies))

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
