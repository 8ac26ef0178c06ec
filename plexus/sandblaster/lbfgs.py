"""L-BFGS run by a coordinator that never holds a vector (Dean et al. 2012, section 4.2).

Every vector (the parameters, gradients, direction, trial point and the (s, y) history)
lives on the server shards, each shard holding its own range; the coordinator names them
by slot (``Slot``) and drives them through ``Vectors``: queued one-way commands (copy,
scale, axpy, linear combination) and reductions (dot products, norms, a Gram matrix) whose
partial sums come back as scalars. A reduction flushes the queue in the same message, so
each reduction is one round trip to the shards.

The algorithm is ``torch.optim.LBFGS``'s, step for step: the first direction is the
negative gradient with step min(1, 1 / |g|_1) x lr, a pair is kept only when y.s > 1e-10,
the initial Hessian is y.s / y.y, and the same termination tests apply (tolerance_grad
1e-7 on max |g|, tolerance_change 1e-9). The oracle test (tests/test_sandblaster.py) holds
the two to 1e-8 in float64. Two recursions compute the direction:

- ``two-loop`` (Nocedal 1980): 2m dot products in sequence, each needing the previous
  update, so 2m + 1 round trips per iteration with m pairs (the +1 is y.s and y.y);
- ``vector-free`` (Chen, Wang and Zhou, NIPS 2014): the direction is a combination of the
  2m + 1 basis vectors (s_i, y_i, g), so one round trip fetches their Gram matrix, the
  two-loop recursion runs on (2m + 1) coefficients on the coordinator, and one queued
  command forms the direction on the shards: O(1) round trips.

Line searches: ``armijo`` (backtracking by halves from the step above until
f(x + t d) <= f(x) + 1e-4 t g.d, at most 25 evaluations), ``strong_wolfe`` (torch's
``_strong_wolfe``, ported to slots) and ``none`` (the fixed step, as torch without a
``line_search_fn``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, Protocol, Sequence

import torch

__all__ = ["Slot", "Vectors", "Settings", "Lbfgs", "Iteration", "history_slots", "LocalVectors"]

TOLERANCE_GRAD = 1e-7
TOLERANCE_CHANGE = 1e-9
CURVATURE = 1e-10
MAX_LS = 25
C1, C2 = 1e-4, 0.9


class Slot(IntEnum):
    """The vectors every shard keeps, by number; history pairs follow ``HISTORY``."""

    X = 0  # parameters
    G = 1  # gradient at X (the last accepted evaluation)
    GP = 2  # previous gradient
    D = 3  # search direction
    T = 4  # trial point the replicas evaluate: X + t D
    GN = 5  # gradient at T, from the accumulator
    ACC = 6  # sum of the replicas' unit gradients for the open batch
    Q = 7  # two-loop work vector
    LS_PREV = 8  # strong Wolfe: the gradient at the previous trial
    LS_B0 = 9  # strong Wolfe: the bracket's gradients
    LS_B1 = 10
    HISTORY = 16


def history_slots(pairs: int) -> list[tuple[int, int]]:
    """(s, y) slot numbers of ``pairs`` history pairs."""
    return [(Slot.HISTORY + 2 * j, Slot.HISTORY + 2 * j + 1) for j in range(pairs)]


class Vectors(Protocol):
    """Slot operations, executed where the vectors are (``ShardVectors``, ``LocalVectors``)."""

    def copy(self, dst: int, src: int) -> None: ...
    def scale(self, dst: int, alpha: float) -> None: ...
    def axpy(self, dst: int, alpha: float, src: int) -> None: ...
    def lincomb(self, dst: int, terms: Sequence[tuple[float, int]]) -> None: ...
    def dots(self, pairs: Sequence[tuple[int, int]]) -> list[float]: ...
    def absmax(self, slot: int) -> float: ...
    def abssum(self, slot: int) -> float: ...
    def gram(self, slots: Sequence[int]) -> torch.Tensor: ...


# objective(t) evaluates the batch loss at X + t D, leaves its gradient in GN and returns
# (loss, GN . D).
Objective = Callable[[float], tuple[float, float]]


@dataclass(frozen=True)
class Settings:
    lr: float = 1.0
    history: int = 10
    line_search: str = "armijo"
    recursion: str = "two-loop"


@dataclass
class Iteration:
    """What one iteration did, for the metrics log."""

    loss: float
    step: float
    evaluations: int
    direction_round_trips: int
    converged: str | None = None


@dataclass
class Lbfgs:
    vectors: Vectors
    objective: Objective
    settings: Settings
    # Round trips so far (the vectors count them); read before and after the direction.
    round_trips: Callable[[], int]
    n_iter: int = 0
    loss: float = math.nan
    t: float = 0.0
    h_diag: float = 1.0
    pairs: list[tuple[int, int, float]] = field(default_factory=list)  # (s slot, y slot, 1 / y.s)
    free: list[tuple[int, int]] = field(default_factory=list)
    have_gradient: bool = False

    def __post_init__(self) -> None:
        self.free = history_slots(self.settings.history + 1)  # one spare pair for the candidate

    # --- one iteration -------------------------------------------------------------------

    def iterate(self, fresh_batch: bool, last: bool) -> Iteration:
        """One L-BFGS iteration. ``fresh_batch``: the objective changed (a new batch), so
        the gradient at X is evaluated first; ``last``: no evaluation after the step is
        needed (no line search)."""
        v, evals = self.vectors, 0
        if fresh_batch or not self.have_gradient:
            self.loss, _ = self._evaluate_at_x()
            evals += 1
            if v.absmax(Slot.G) <= TOLERANCE_GRAD:
                return Iteration(self.loss, 0.0, evals, 0, converged="gradient below tolerance_grad")
        self.n_iter += 1
        before = self.round_trips()
        if self.n_iter == 1:
            v.copy(Slot.D, Slot.G)
            v.scale(Slot.D, -1.0)
            self.h_diag = 1.0
        else:
            self._direction()
        direction_trips = self.round_trips() - before
        v.copy(Slot.GP, Slot.G)
        prev_loss = self.loss
        if self.n_iter == 1:
            t = min(1.0, 1.0 / v.abssum(Slot.G)) * self.settings.lr
        else:
            t = self.settings.lr
        (gtd,) = v.dots([(Slot.G, Slot.D)])
        if gtd > -TOLERANCE_CHANGE:
            self.t = t
            return Iteration(self.loss, 0.0, evals, direction_trips, converged="directional derivative above "
                                                                                "-tolerance_change")
        search = self.settings.line_search
        if search == "none":
            v.axpy(Slot.X, t, Slot.D)
            self.t = t
            if last:
                self.have_gradient = False
                return Iteration(self.loss, t, evals, direction_trips)
            self.loss, _ = self._evaluate_at_x()
            evals += 1
        else:
            if search == "armijo":
                self.loss, t, used = self._armijo(t, gtd)
            else:
                self.loss, t, used = self._strong_wolfe(t, gtd)
            evals += used
            v.axpy(Slot.X, t, Slot.D)
            self.t = t
            self.have_gradient = True
        converged = None
        if v.absmax(Slot.G) <= TOLERANCE_GRAD:
            converged = "gradient below tolerance_grad"
        elif abs(t) * v.absmax(Slot.D) <= TOLERANCE_CHANGE:
            converged = "step below tolerance_change"
        elif abs(self.loss - prev_loss) < TOLERANCE_CHANGE:
            converged = "loss change below tolerance_change"
        return Iteration(self.loss, t, evals, direction_trips, converged=converged)

    def _evaluate_at_x(self) -> tuple[float, float]:
        f, gtd = self.objective(0.0)
        self.vectors.copy(Slot.G, Slot.GN)
        self.have_gradient = True
        return f, gtd

    # --- the direction ---------------------------------------------------------------------

    def _candidate(self) -> tuple[int, int]:
        """y = g - g_prev and s = t d into the free pair of slots (not yet kept)."""
        v = self.vectors
        s, y = self.free[0]
        v.copy(y, Slot.G)
        v.axpy(y, -1.0, Slot.GP)
        v.copy(s, Slot.D)
        v.scale(s, self.t)
        return s, y

    def _keep(self, s: int, y: int, ys: float, yy: float) -> None:
        """torch's rule: keep the pair when y.s > 1e-10, dropping the oldest when full."""
        if ys <= CURVATURE:
            return
        if len(self.pairs) == self.settings.history:
            old_s, old_y, _ = self.pairs.pop(0)
            self.free.append((old_s, old_y))
        self.free.remove((s, y))
        self.pairs.append((s, y, 1.0 / ys))
        self.h_diag = ys / yy

    def _direction(self) -> None:
        if self.settings.recursion == "vector-free":
            self._direction_vector_free()
        else:
            self._direction_two_loop()

    def _direction_two_loop(self) -> None:
        v = self.vectors
        s, y = self._candidate()
        ys, yy = v.dots([(y, s), (y, y)])
        self._keep(s, y, ys, yy)
        al = [0.0] * len(self.pairs)
        v.copy(Slot.Q, Slot.G)
        v.scale(Slot.Q, -1.0)
        for i in range(len(self.pairs) - 1, -1, -1):
            s_i, y_i, ro = self.pairs[i]
            (sq,) = v.dots([(s_i, Slot.Q)])
            al[i] = sq * ro
            v.axpy(Slot.Q, -al[i], y_i)
        v.copy(Slot.D, Slot.Q)
        v.scale(Slot.D, self.h_diag)
        for i, (s_i, y_i, ro) in enumerate(self.pairs):
            (yr,) = v.dots([(y_i, Slot.D)])
            v.axpy(Slot.D, al[i] - yr * ro, s_i)

    def _direction_vector_free(self) -> None:
        """The two-loop recursion on coefficients over the basis (s_i, y_i, candidate, g)."""
        v = self.vectors
        s, y = self._candidate()
        old = list(self.pairs)
        basis = [p[0] for p in old] + [p[1] for p in old] + [s, y, Slot.G]
        gram = v.gram(basis).tolist()  # the one round trip
        index = {slot: k for k, slot in enumerate(basis)}
        self._keep(s, y, gram[index[y]][index[s]], gram[index[y]][index[y]])
        coef = [0.0] * len(basis)
        coef[index[Slot.G]] = -1.0

        def dot(slot: int) -> float:
            row = gram[index[slot]]
            return sum(c * row[k] for k, c in enumerate(coef) if c)

        al = [0.0] * len(self.pairs)
        for i in range(len(self.pairs) - 1, -1, -1):
            s_i, y_i, ro = self.pairs[i]
            al[i] = dot(s_i) * ro
            coef[index[y_i]] -= al[i]
        coef = [c * self.h_diag for c in coef]
        for i, (s_i, y_i, ro) in enumerate(self.pairs):
            coef[index[s_i]] += al[i] - dot(y_i) * ro
        v.lincomb(Slot.D, [(c, basis[k]) for k, c in enumerate(coef) if c])

    # --- line searches ---------------------------------------------------------------------

    def _armijo(self, t: float, gtd: float) -> tuple[float, float, int]:
        f0, evals = self.loss, 0
        while True:
            f_new, _ = self.objective(t)
            evals += 1
            if f_new <= f0 + C1 * t * gtd or evals >= MAX_LS:
                break
            t *= 0.5
        self.vectors.copy(Slot.G, Slot.GN)
        return f_new, t, evals

    def _strong_wolfe(self, t: float, gtd: float) -> tuple[float, float, int]:
        """torch.optim.lbfgs._strong_wolfe with the gradients kept in slots: the bracket's
        gradients in LS_B0 and LS_B1, the previous trial's in LS_PREV."""
        v, f = self.vectors, self.loss
        d_norm = v.absmax(Slot.D)
        f_new, gtd_new = self.objective(t)
        evals = 1
        t_prev, f_prev, gtd_prev = 0.0, f, gtd
        v.copy(Slot.LS_PREV, Slot.G)
        done, ls_iter = False, 0
        bracket: list[float] = []
        bracket_f: list[float] = []
        bracket_gtd: list[float] = []
        while ls_iter < MAX_LS:
            if f_new > f + C1 * t * gtd or (ls_iter > 1 and f_new >= f_prev):
                bracket, bracket_f, bracket_gtd = [t_prev, t], [f_prev, f_new], [gtd_prev, gtd_new]
                v.copy(Slot.LS_B0, Slot.LS_PREV)
                v.copy(Slot.LS_B1, Slot.GN)
                break
            if abs(gtd_new) <= -C2 * gtd:
                bracket, bracket_f = [t], [f_new]
                v.copy(Slot.LS_B0, Slot.GN)
                done = True
                break
            if gtd_new >= 0:
                bracket, bracket_f, bracket_gtd = [t_prev, t], [f_prev, f_new], [gtd_prev, gtd_new]
                v.copy(Slot.LS_B0, Slot.LS_PREV)
                v.copy(Slot.LS_B1, Slot.GN)
                break
            min_step, max_step = t + 0.01 * (t - t_prev), t * 10
            tmp = t
            t = _cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, bounds=(min_step, max_step))
            t_prev, f_prev, gtd_prev = tmp, f_new, gtd_new
            v.copy(Slot.LS_PREV, Slot.GN)
            f_new, gtd_new = self.objective(t)
            evals += 1
            ls_iter += 1
        if ls_iter == MAX_LS:
            bracket, bracket_f = [0.0, t], [f, f_new]
            v.copy(Slot.LS_B0, Slot.G)
            v.copy(Slot.LS_B1, Slot.GN)
        insuf_progress = False
        low, high = (0, 1) if bracket_f[0] <= bracket_f[-1] else (1, 0)
        grads = (Slot.LS_B0, Slot.LS_B1)
        while not done and ls_iter < MAX_LS:
            if abs(bracket[1] - bracket[0]) * d_norm < TOLERANCE_CHANGE:
                break
            t = _cubic_interpolate(bracket[0], bracket_f[0], bracket_gtd[0], bracket[1], bracket_f[1],
                                   bracket_gtd[1])
            eps = 0.1 * (max(bracket) - min(bracket))
            if min(max(bracket) - t, t - min(bracket)) < eps:
                if insuf_progress or t >= max(bracket) or t <= min(bracket):
                    t = max(bracket) - eps if abs(t - max(bracket)) < abs(t - min(bracket)) else min(bracket) + eps
                    insuf_progress = False
                else:
                    insuf_progress = True
            else:
                insuf_progress = False
            f_new, gtd_new = self.objective(t)
            evals += 1
            ls_iter += 1
            if f_new > f + C1 * t * gtd or f_new >= bracket_f[low]:
                bracket[high], bracket_f[high], bracket_gtd[high] = t, f_new, gtd_new
                v.copy(grads[high], Slot.GN)
                low, high = (0, 1) if bracket_f[0] <= bracket_f[1] else (1, 0)
            else:
                if abs(gtd_new) <= -C2 * gtd:
                    done = True
                elif gtd_new * (bracket[high] - bracket[low]) >= 0:
                    bracket[high], bracket_f[high], bracket_gtd[high] = bracket[low], bracket_f[low], bracket_gtd[low]
                    v.copy(grads[high], grads[low])
                bracket[low], bracket_f[low], bracket_gtd[low] = t, f_new, gtd_new
                v.copy(grads[low], Slot.GN)
        v.copy(Slot.G, grads[low])
        return bracket_f[low], bracket[low], evals


def _cubic_interpolate(x1: float, f1: float, g1: float, x2: float, f2: float, g2: float,
                       bounds: tuple[float, float] | None = None) -> float:
    """The minimiser of the cubic through two points with their slopes, clamped to
    ``bounds`` (torch.optim.lbfgs._cubic_interpolate)."""
    xmin_bound, xmax_bound = bounds if bounds is not None else ((x1, x2) if x1 <= x2 else (x2, x1))
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1 ** 2 - g1 * g2
    if d2_square >= 0:
        d2 = math.sqrt(d2_square)
        if x1 <= x2:
            min_pos = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
        else:
            min_pos = x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2))
        return min(max(min_pos, xmin_bound), xmax_bound)
    return (xmin_bound + xmax_bound) / 2.0


class LocalVectors:
    """Slots as whole tensors in one process: the same commands, executed in place (the
    shards run every command of a program through it, on their ranges; tests use it
    whole)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.numel, self.dtype = numel, dtype
        self.slots: dict[int, torch.Tensor] = {}
        self.trips = 0

    def __getitem__(self, slot: int) -> torch.Tensor:
        vec = self.slots.get(slot)
        if vec is None:
            vec = self.slots[slot] = torch.zeros(self.numel, dtype=self.dtype)
        return vec

    def copy(self, dst: int, src: int) -> None:
        self[dst].copy_(self[src])

    def scale(self, dst: int, alpha: float) -> None:
        self[dst].mul_(alpha)

    def axpy(self, dst: int, alpha: float, src: int) -> None:
        self[dst].add_(self[src], alpha=alpha)

    def lincomb(self, dst: int, terms: Sequence[tuple[float, int]]) -> None:
        out = torch.zeros(self.numel, dtype=self.dtype)
        for coef, src in terms:
            out.add_(self[src], alpha=coef)
        self[dst].copy_(out)

    # Reductions accumulate in float64 whatever the slots' dtype: a shard's partial sums
    # are added on the coordinator, and float32 partials would lose what float64 keeps.
    def dots(self, pairs: Sequence[tuple[int, int]]) -> list[float]:
        self.trips += 1
        return [float(self[a].double().dot(self[b].double())) for a, b in pairs]

    def absmax(self, slot: int) -> float:
        self.trips += 1
        return float(self[slot].abs().max()) if self.numel else 0.0

    def abssum(self, slot: int) -> float:
        self.trips += 1
        return float(self[slot].double().abs().sum())

    def gram(self, slots: Sequence[int]) -> torch.Tensor:
        self.trips += 1
        if not slots:
            return torch.zeros(0, 0, dtype=torch.float64)
        basis = torch.stack([self[s].double() for s in slots])
        return basis @ basis.T
