"""What the simulated cluster is: how many workers and servers, how long a worker computes,
how the network carries bytes, and when machines fail.

Compute: a step on ``n`` samples takes ``overhead + n * per_sample`` seconds, times the
worker's ``--slow`` factor, times a random factor of mean 1 (``--compute-jitter``):
``lognormal:CV`` (coefficient of variation CV) or ``pareto:A`` (a heavy tail of index
A > 1: a few steps take many times the mean, Dean et al.'s stragglers). By default both
times are measured here by profiling the job's model on this machine (``profile_compute``);
``--compute SECONDS`` gives ``per_sample`` instead, with no overhead.

Network: Hockney's alpha-beta model with a reduction term (``collectives/cost.py``):
``--net latency=…,bandwidth=…`` gives alpha and 1/beta, per message and per link. Where
messages from several ranks meet at one (a master's gather, a gossip worker's neighbours)
the simulator follows them through one card per rank as ``--net`` emulates it
(``cluster/emulation.py``): a message occupies its sender's card for its bytes x beta, in
the order sent, arrives alpha after it left (latency overlaps, it is not paid in turn),
and the receiver's card takes in one message at a time (``take_in``).

Failures: ``--fail worker:K@t=SECONDS`` kills one process at a virtual time;
``--fail-rate R`` gives each worker an exponential lifetime of mean 1/R machine-hours.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import numpy as np

from plexus.collectives.cost import Network
from plexus.errors import ConfigError

__all__ = ["ComputeModel", "FailSpec", "SimSpec", "parse_jitter", "parse_fail", "profile_compute", "network_of",
           "DEFAULT_NETWORK", "take_in", "take_in_each"]

# With no --net: a 10 Gbit/s link with 50 us per message (a data-centre network), and
# 0.25 ns per reduced byte (cost.Network's default).
DEFAULT_NETWORK = Network(alpha=50e-6, beta=1 / 1.25e9, gamma=0.25e-9)


@dataclass(kw_only=True, frozen=True)
class ComputeModel:
    # Seconds of forward and backward per sample, and per step besides the samples; None:
    # to be measured here (``profile_compute``).
    per_sample: float | None
    overhead: float = 0.0
    # Seconds of every step outside forward and backward (Python, the optimizer, handling
    # messages), which communication does not overlap; ``--validate`` calibrates it.
    outside: float = 0.0
    # Seconds of work each communication round costs besides what the network model
    # charges (the collective's or the exchange's Python, handling its messages);
    # ``--validate`` calibrates it. A strategy that communicates at every step pays it at
    # every step; local SGD, EASGD and AD-PSGD at their averagings and exchanges alone.
    per_round: float = 0.0
    # "none", "lognormal:CV" or "pareto:A".
    jitter: str = "none"
    # Whether per_sample and overhead were measured here (else given by --compute).
    measured: bool = False

    def __post_init__(self) -> None:
        if self.per_sample is not None and not (self.per_sample >= 0 and math.isfinite(self.per_sample)):
            raise ConfigError(f"--compute must be a finite time >= 0 seconds per sample, got {self.per_sample!r}: "
                              f"pass --compute 2e-5 for example, or leave it out to measure it here")
        for name in ("overhead", "outside", "per_round"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"a step's compute {name} must be >= 0 seconds, got {value!r}")
        parse_jitter(self.jitter)

    def step_time(self, samples: int) -> float:
        return self.overhead + self.outside + samples * self.per_sample


def take_in(first_bytes, wire: float) -> float:
    """When the last of messages whose first bytes reach one card at ``first_bytes`` is in,
    each ``wire`` seconds long, the card taking in one at a time in the order they come."""
    first = np.asarray(first_bytes, dtype=np.float64)
    return float(take_in_each(np.zeros(first.size, dtype=np.int64), first, wire, 1)[0])


def take_in_each(receivers: np.ndarray, first_bytes: np.ndarray, wire: float, ranks: int) -> np.ndarray:
    """``take_in`` for every card at once: message i reaches card ``receivers[i]`` (of
    ``ranks``) with its first byte at ``first_bytes[i]``; returns when each card has taken
    its last message in (-inf for a card that gets none)."""
    order = np.lexsort((first_bytes, receivers))
    card, first = receivers[order], first_bytes[order]
    out = np.full(ranks, -math.inf)
    if not card.size:
        return out
    starts = np.flatnonzero(np.r_[True, card[1:] != card[:-1]])
    counts = np.diff(np.r_[starts, card.size])
    place = np.arange(card.size) - np.repeat(starts, counts)  # each message's place in its card's queue
    # The last of n ends n - j wires after the j-th first byte (in order) whose queue it joins.
    out[card[starts]] = np.maximum.reduceat(first - place * wire, starts) + counts * wire
    return out


def parse_jitter(text: str) -> tuple[str, float]:
    """``none``, ``lognormal:CV`` (CV >= 0) or ``pareto:A`` (A > 1) as (kind, parameter)."""
    if text in ("", "none"):
        return "none", 0.0
    kind, _, value = text.partition(":")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if kind == "lognormal" and number >= 0 and math.isfinite(number):
        return kind, number
    if kind == "pareto" and number > 1 and math.isfinite(number):
        return kind, number
    raise ConfigError(f"--compute-jitter must be none, lognormal:CV with CV >= 0 or pareto:A with A > 1 (a "
                      f"distribution of positive times with mean 1), got {text!r}")


class Jitter:
    """Random factors of mean 1 for compute times, from a seeded generator."""

    def __init__(self, text: str, seed: int) -> None:
        self.kind, self.param = parse_jitter(text)
        self.rng = np.random.default_rng(seed + 7919)
        if self.kind == "lognormal":
            self.sigma = math.sqrt(math.log1p(self.param ** 2))
        elif self.kind == "pareto":
            self.scale = (self.param - 1) / self.param  # Pareto(scale, A) has mean 1

    def draw(self, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            return self.rng.lognormal(-self.sigma ** 2 / 2, self.sigma, n)
        if self.kind == "pareto":
            return self.scale * (1.0 + self.rng.pareto(self.param, n))
        return np.ones(n)


@dataclass(kw_only=True, frozen=True)
class FailSpec:
    """``--fail worker:K@t=SECONDS``: process ``role`` ``rank`` dies at virtual time ``time``."""

    role: str
    rank: int
    time: float


def parse_fail(text: str) -> tuple[FailSpec, ...]:
    specs = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(worker|server):(\d+)@t=([0-9.]+(?:e-?\d+)?)", part.strip())
        if not m:
            raise ConfigError(f"--fail must look like worker:K@t=SECONDS (or server:K@t=...), got {part!r}")
        specs.append(FailSpec(role=m.group(1), rank=int(m.group(2)), time=float(m.group(3))))
    return tuple(specs)


@dataclass(kw_only=True, frozen=True)
class SimSpec:
    """The simulated cluster (``plexus simulate``'s own flags)."""

    workers: int
    servers: int = 0
    compute: ComputeModel
    network: Network = DEFAULT_NETWORK
    # Seconds a server spends per byte of gradient it applies (an optimizer step's memory
    # traffic: read params, gradient and state, write params and state).
    server_gamma: float = 1e-9
    failures: tuple[FailSpec, ...] = ()
    # Failures per machine-hour of every worker (exponential lifetimes).
    fail_rate: float = 0.0
    timing_only: bool = False
    # Up to this many workers each worker's gradient is computed on its own and reduced in
    # the real code's order, so a synchronous run equals the real one bit for bit; above
    # it, workers that read the same model version are computed as one batch.
    exact_up_to: int = 64
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--sim-workers must be at least 1, got {self.workers}: pass --sim-workers 1000 "
                              f"for example")
        if self.servers < 0:
            raise ConfigError(f"--sim-servers must be non-negative, got {self.servers}")
        if not (self.fail_rate >= 0 and math.isfinite(self.fail_rate)):
            raise ConfigError(f"--fail-rate must be failures per machine-hour >= 0, got {self.fail_rate!r}")
        for f in self.failures:
            limit = self.workers if f.role == "worker" else self.servers
            if f.rank >= limit:
                raise ConfigError(f"--fail {f.role}:{f.rank}: the simulated cluster has {limit} {f.role}s "
                                  f"(ranks 0 to {limit - 1})")


def network_of(net) -> Network:
    """The alpha-beta-gamma network of ``--net`` (a NetSpec), defaults where it says nothing."""
    alpha = net.latency if net.latency else DEFAULT_NETWORK.alpha
    beta = 1 / net.bandwidth if net.bandwidth else DEFAULT_NETWORK.beta
    return Network(alpha=alpha, beta=beta, gamma=DEFAULT_NETWORK.gamma)


def profile_compute(model, loss_fn, x, y, share: int, repeats: int = 20) -> tuple[float, float]:
    """(overhead, per_sample) seconds of forward and backward of ``model``, measured here
    at one sample and at ``max(share, 64)`` samples (median of ``repeats`` each): a slope
    taken over a worker's few samples alone is lost in the timer's noise (it came out 0
    at 4 samples, and the next run 5 us)."""
    import torch

    def timed(n: int) -> float:
        xs, ys = x[:n], y[:n]
        runs = []
        for _ in range(repeats + 2):
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            loss_fn(model, xs, ys).backward()
            runs.append(time.perf_counter() - started)
        return float(np.median(runs[2:]))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker process runs (--threads 1)
    try:
        big = max(min(max(share, 64), len(x)), 2)
        one, many = timed(1), timed(big)
    finally:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
    per_sample = max(many - one, 0.0) / (big - 1)
    return max(one - per_sample, 0.0), per_sample
