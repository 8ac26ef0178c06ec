"""Pipeline schedules: for each stage of a pipeline, the order of its forward and backward
operations over the micro-batches of a step (``plexus train --schedule``).

Pure objects: no processes, no clocks. ``Schedule.ops(stage)`` is the order the process of
that stage runs; the executor drives it with wall clocks and links, and ``simulate`` drives
the same lists with virtual clocks (each op waits for the op it depends on in the next or
previous stage, communication free), with a stage's cost per kind of op; ``replay`` does
so with each op's own duration, as a run measured it. ``Schedule.check`` simulates too, so a list that
breaks a dependency or deadlocks is found without a process.

Operations: ``F`` forward, ``B`` backward (the whole backward, except under zb-h1 where it
is only the input gradient) and ``W`` the weight gradient that zb-h1 splits off B. Stages
are 0-based; stage 0 holds the model's input, stage K-1 the loss. Under ``interleaved``
process s holds v model chunks, chunk c being virtual stage c*K + s.

Bubble, the idle share of a stage's time from the step's start to its end: with every
stage costing the same, GPipe and 1F1B both idle (K-1)(f+b) out of (M+K-1)(f+b) for
any forward cost f and backward cost b, so ``simulate`` gives (K-1)/(M+K-1) exactly,
whatever b/f is (tests/test_schedules.py checks b = f and b = 2f). Interleaved ops cost
f/v and b/v each (a chunk is 1/v of the stage), which divides the fill and drain by v:
(K-1)/(vM+K-1), also exact in simulation for any b/f (K <= 4, v <= 3 tested). zb-h1
idles (K-1)(f+b-w) per stage (Qi et al. 2023), with b and w the two halves of the
backward: (K-1)/(3M+K-1) when f = b = w as the paper draws it, under (K-1)/(3M). The
simulation gives exactly that once M >= K and while w <= f and w <= b; a W bigger than
that no longer fits the hole it fills. ``simulate``'s defaults (f = 1, a whole backward
of 2, halved into B = W = 1 under zb-h1) are the usual b = 2f.

Asynchronous schedules (pipedream, pipedream-2bw) list a run from a cold pipeline to a
drain; their bubble is that run's fill and drain, (K-1)/(N+K-1) over its N micro-batches,
and nothing in steady state. Each op carries the weight version it computes with and
whether the stage steps after it, so the executor never derives either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

from plexus.errors import ConfigError, PlexusError

__all__ = ["SCHEDULES", "Op", "Schedule", "GPipe", "OneFOneB", "Interleaved", "ZeroBubbleH1", "PipeDream",
           "PipeDream2BW", "Timeline", "ScheduleError", "simulate", "make_schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "pipedream-2bw")

Kind = Literal["F", "B", "W"]


class ScheduleError(PlexusError):
    """A schedule's op lists break a dependency, repeat or miss an op, or deadlock: a bug in
    the schedule, not in the user's input. Nothing to recover; report it."""


@dataclass(frozen=True)
class Op:
    kind: Kind
    microbatch: int
    # Model chunk within the process (virtual stage chunk*K + stage); 0 unless interleaved.
    chunk: int = 0
    # The weight version the op computes with: the number of optimizer steps this stage
    # had applied when the forward of its micro-batch began (weight stashing makes the
    # backward use its forward's version). 0 under the synchronous schedules.
    version: int = 0
    # The stage applies an optimizer step right after this op (synchronous schedules:
    # after the stage's last op; pipedream: after every B; 2bw: after a mini-batch's last B).
    step: bool = False

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(kw_only=True, frozen=True)
class Schedule:
    """One step of a pipeline of ``stages`` processes over ``microbatches`` micro-batches."""

    name = "schedule"
    synchronous = True
    splits_backward = False  # B is the input gradient only and W the weight gradient (zb-h1)
    takes_chunks = False  # accepts --chunks (interleaved)
    stages: int  # K, processes in the pipeline
    microbatches: int  # M, micro-batches per optimizer step
    chunks: int = 1  # v, model chunks (virtual stages) per process

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"stages must be >= 1, got {self.stages}: pass --stages K with K >= 1")
        if self.microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {self.microbatches}: pass --microbatches M >= 1")
        if self.chunks != 1 and not self.takes_chunks:
            raise ConfigError(f"--chunks {self.chunks} applies only to --schedule interleaved (model chunks per "
                              f"process), not {self.name}: drop --chunks or use --schedule interleaved")

    @property
    def inputs(self) -> int:
        """Micro-batches the op lists cover (more than M for the asynchronous schedules)."""
        return self.microbatches

    def ops(self, stage: int) -> tuple[Op, ...]:
        """The order in which the process of ``stage`` runs its operations."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage must lie in [0, {self.stages}), got {stage}")
        ops = list(self._ops(stage))
        if self.synchronous:  # one optimizer step per mini-batch, once the stage's last op is done
            ops[-1] = _replace(ops[-1], step=True)
        return tuple(ops)

    def _ops(self, stage: int) -> list[Op]:
        raise NotImplementedError

    def iter_ops(self, stage: int) -> Iterator[Op]:
        """``ops(stage)`` one at a time. The asynchronous schedules make each op as it is
        asked for: their lists cover a training run, which under --time-limit is as long
        as the time allows (2**62 steps, runner.total_steps), too long to hold."""
        return iter(self.ops(stage))

    def delay(self, stage: int) -> int:
        """Optimizer steps between the weight version ``stage``'s forwards use and the
        version their gradients are applied to, once the pipeline is full: 0 under the
        synchronous schedules, which step once no backward is pending."""
        _checked(self, stage)
        return 0

    def predicted_bubble(self) -> float:
        """Closed-form idle share of a stage's time over the op lists (equal op costs)."""
        k, m = self.stages, self.inputs
        return (k - 1) / (m + k - 1)

    def max_in_flight(self, stage: int, chunk: int | None = None) -> int:
        """Most micro-batches (of any chunk, or of ``chunk`` alone) whose forward has run
        on ``stage`` and whose backward has not finished (W under zb-h1): the activations
        the stage holds."""
        done = "W" if self.splits_backward else "B"
        live = peak = 0
        for op in self.ops(stage):
            if chunk is not None and op.chunk != chunk:
                continue
            live += (op.kind == "F") - (op.kind == done)
            peak = max(peak, live)
        return peak

    def max_versions(self, stage: int) -> int:
        """Most weight versions ``stage`` must keep at once: the newest, those stashed for
        micro-batches in flight, and the older ones a later forward will still ask for."""
        ops = self.ops(stage)
        # oldest[i]: the oldest version a forward at or after position i asks for.
        oldest = [len(ops) + 1] * (len(ops) + 1)
        for i in reversed(range(len(ops))):
            oldest[i] = min(oldest[i + 1], ops[i].version if ops[i].kind == "F" else oldest[i + 1])
        current = peak = 0
        stashed: dict[tuple[int, int], int] = {}
        for i, op in enumerate(ops):
            if op.kind == "F":
                stashed[(op.microbatch, op.chunk)] = op.version
            elif op.kind == "B":
                stashed.pop((op.microbatch, op.chunk), None)
            if op.step:
                current += 1
            live = {current, *stashed.values(), *range(oldest[i + 1], current + 1)}
            peak = max(peak, len(live))
        return peak

    def check(self) -> None:
        """Raise ScheduleError unless every stage runs each of its ops exactly once, each
        after the ops it depends on, without deadlock, using only weight versions it has."""
        expected = sorted(_key(Op(kind, m, c)) for m in range(self.inputs) for c in range(self.chunks)
                          for kind in (("F", "B", "W") if self.splits_backward else ("F", "B")))
        for s in range(self.stages):
            got = sorted(_key(op) for op in self.ops(s))
            if got != expected:
                raise ScheduleError(f"{self.name}: stage {s} does not run each F and B once per micro-batch and chunk")
            steps = 0
            forward_version: dict[tuple[int, int], int] = {}
            for op in self.ops(s):
                if op.kind == "F":
                    if op.version > steps:
                        raise ScheduleError(f"{self.name}: stage {s} runs {op} with weight version {op.version} "
                                            f"after only {steps} steps")
                    forward_version[(op.microbatch, op.chunk)] = op.version
                elif forward_version.get((op.microbatch, op.chunk)) != op.version:
                    raise ScheduleError(f"{self.name}: stage {s} runs {op} before its forward or with another "
                                        f"weight version than its forward's")
                steps += op.step
        simulate(self)  # raises on a broken dependency or a deadlock


def _key(op: Op) -> tuple[str, int, int]:
    return (op.kind, op.microbatch, op.chunk)


def _replace(op: Op, **changes: object) -> Op:
    fields = {"kind": op.kind, "microbatch": op.microbatch, "chunk": op.chunk, "version": op.version,
              "step": op.step}
    fields.update(changes)
    return Op(**fields)  # type: ignore[arg-type]


def _one_f_one_b(stages: int, stage: int, inputs: int) -> list[Op]:
    """K-s-1 forwards to fill the pipeline, then one forward and one backward in turn, then
    the backwards left: stage s never holds more than K-s micro-batches."""
    return list(_one_f_one_b_lazily(stages, stage, inputs))


def _one_f_one_b_lazily(stages: int, stage: int, inputs: int) -> Iterator[Op]:
    """``_one_f_one_b``'s ops, one at a time."""
    warmup = min(stages - stage - 1, inputs)
    for m in range(warmup):
        yield Op("F", m)
    for m in range(inputs - warmup):
        yield Op("F", m + warmup)
        yield Op("B", m)
    for m in range(inputs - warmup, inputs):
        yield Op("B", m)


def _checked(schedule: "Schedule", stage: int) -> int:
    if not 0 <= stage < schedule.stages:
        raise ValueError(f"stage must lie in [0, {schedule.stages}), got {stage}")
    return stage


@dataclass(kw_only=True, frozen=True)
class GPipe(Schedule):
    """Huang et al. 2019: every forward, then every backward, then one flush and step.

    Backwards run last micro-batch first, as GPipe's figure 2(c) draws them (B_{k,3} down
    to B_{k,0}): the last stage starts on the micro-batch whose forward it just finished.
    The order changes neither the bubble nor the memory: all M are live until the backwards.
    """

    name = "gpipe"

    def _ops(self, stage: int) -> list[Op]:
        m = self.microbatches
        return [Op("F", i) for i in range(m)] + [Op("B", i) for i in reversed(range(m))]


@dataclass(kw_only=True, frozen=True)
class OneFOneB(Schedule):
    """PipeDream-Flush (Narayanan et al. 2021, fig. 4 top), Megatron's default: GPipe's
    bubble, but at most K-s micro-batches of activations on stage s instead of M."""

    name = "1f1b"

    def _ops(self, stage: int) -> list[Op]:
        return _one_f_one_b(self.stages, stage, self.microbatches)


@dataclass(kw_only=True, frozen=True)
class Interleaved(Schedule):
    """Interleaved 1F1B (Narayanan et al. 2021, fig. 4 bottom), as Megatron-LM orders it.

    Forwards go by rounds of K micro-batches: chunk 0 of micro-batches 0..K-1, chunk 1 of
    the same, ..., then chunk 0 of K..2K-1; backwards the same with the chunks reversed.
    Stage s first runs 2(K-s-1) + (v-1)K forwards, then alternates, then drains. Needs
    M % K == 0, as Megatron does, so that the rounds are whole.
    """

    name = "interleaved"
    takes_chunks = True
    chunks: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunks < 2:
            raise ConfigError(f"--schedule interleaved needs --chunks v >= 2 model chunks per process, got "
                              f"{self.chunks}: with one chunk use --schedule 1f1b")
        if self.microbatches % self.stages:
            fix = self.stages * -(-self.microbatches // self.stages)
            raise ConfigError(f"--schedule interleaved needs --microbatches M to be a multiple of --stages K "
                              f"(whole rounds of K micro-batches per chunk), got M={self.microbatches}, "
                              f"K={self.stages}: pass --microbatches {fix}")

    def _virtual(self, k: int, forward: bool) -> tuple[int, int]:
        """(micro-batch, chunk) of a stage's k-th forward or backward."""
        group, rest = divmod(k, self.stages * self.chunks)
        chunk, index = divmod(rest, self.stages)
        return group * self.stages + index, chunk if forward else self.chunks - 1 - chunk

    def _ops(self, stage: int) -> list[Op]:
        k, v = self.stages, self.chunks
        total = self.microbatches * v
        warmup = min(2 * (k - stage - 1) + (v - 1) * k, total)
        order = [("F", i) for i in range(warmup)]
        for i in range(total - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(total - warmup, total)]
        return [Op(kind, *self._virtual(i, kind == "F")) for kind, i in order]

    def predicted_bubble(self) -> float:
        # Megatron's (1/v)(K-1)/M of the ideal time, as a share of the whole: the fill and
        # drain shrink v times because each op is 1/v of a stage.
        k, m, v = self.stages, self.microbatches, self.chunks
        return (k - 1) / (v * m + k - 1)


@dataclass(kw_only=True, frozen=True)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al. 2023, fig. 3): 1F1B with the backward split into B (input gradient,
    on the critical path) and W (weight gradient, free to move). Stage s runs the W of
    micro-batch i right after the B of micro-batch i+s, and the s left over at the end:
    the last stage defers K-1 W's into the holes where 1F1B's last stages wait. Each stage
    then holds at most K micro-batches until their W, 1F1B's peak (that of its stage 0),
    and the bubble is (K-1)(f+b-w) instead of (K-1)(f+b+w)."""

    name = "zb-h1"
    splits_backward = True

    def _ops(self, stage: int) -> list[Op]:
        ops: list[Op] = []
        backwards = 0
        for op in _one_f_one_b(self.stages, stage, self.microbatches):
            ops.append(op)
            if op.kind == "B":
                if backwards >= stage:
                    ops.append(Op("W", backwards - stage))
                backwards += 1
        return ops + [Op("W", m) for m in range(max(0, backwards - stage), backwards)]

    def predicted_bubble(self) -> float:
        # (K-1)(f+b-w) idle per stage with f = b = w, exact once M >= K; below that the
        # pipeline never reaches its steady state and idles more.
        k, m = self.stages, self.microbatches
        return (k - 1) / (3 * m + k - 1)


@dataclass(kw_only=True, frozen=True)
class PipeDream(Schedule):
    """PipeDream (Harlap et al. 2018, Narayanan et al. 2019): 1F1B without flushes, every
    micro-batch its own mini-batch, each stage stepping after every backward.

    The lists cover M inputs from a cold pipeline to a drain; training runs one long list
    (a list per M inputs would flush every M). Weight stashing: stage s's forward of input
    m uses the newest version it has, m-(K-s-1) steps, and the backward uses the same, so
    stage 0 keeps up to K versions. ``vertical_sync``: every stage uses the version stage 0
    used for that input, m-(K-1), so an input sees one consistent model.
    """

    name = "pipedream"
    synchronous = False
    vertical_sync: bool = False

    def _ops(self, stage: int) -> list[Op]:
        return list(self.iter_ops(stage))

    def delay(self, stage: int) -> int:
        return self.stages - 1 - (0 if self.vertical_sync else _checked(self, stage))

    def iter_ops(self, stage: int) -> Iterator[Op]:
        lag = self.delay(stage)
        return (Op(op.kind, op.microbatch, version=max(0, op.microbatch - lag), step=op.kind == "B")
                for op in _one_f_one_b_lazily(self.stages, stage, self.microbatches))


@dataclass(kw_only=True, frozen=True)
class PipeDream2BW(Schedule):
    """PipeDream-2BW (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN
    training"): 1F1B without flushes over ``minibatches`` mini-batches of M micro-batches,
    gradients accumulated over each mini-batch and a step after its last backward.

    Mini-batch g computes with version g-1 on every stage (version 0 for g = 0), so its
    gradient is one step stale: W(t+1) = W(t) - lr * grad f(W(t-1)). Version g-1 exists on
    stage s before mini-batch g's first forward as long as M >= K, and then only two
    versions are ever live: the one in-flight backwards use and the newest.
    """

    name = "pipedream-2bw"
    synchronous = False
    minibatches: int = 4  # mini-batches the lists cover, from a cold pipeline to a drain

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.microbatches < self.stages:
            raise ConfigError(f"--schedule pipedream-2bw needs --microbatches M >= --stages K so that two weight "
                              f"versions suffice, got M={self.microbatches}, K={self.stages}: pass --microbatches "
                              f"{self.stages} or more")
        if self.minibatches < 1:
            raise ConfigError(f"minibatches must be >= 1, got {self.minibatches}")

    @property
    def inputs(self) -> int:
        return self.microbatches * self.minibatches

    def delay(self, stage: int) -> int:
        _checked(self, stage)
        return 1

    def _ops(self, stage: int) -> list[Op]:
        return list(self.iter_ops(stage))

    def iter_ops(self, stage: int) -> Iterator[Op]:
        m = self.microbatches
        return (Op(op.kind, op.microbatch, version=max(0, op.microbatch // m - 1),
                   step=op.kind == "B" and op.microbatch % m == m - 1)
                for op in _one_f_one_b_lazily(self.stages, _checked(self, stage), self.inputs))


@dataclass(frozen=True)
class Timeline:
    """A virtual-time run of a schedule: each op's (start, end) per stage, in its order."""

    schedule: Schedule
    times: tuple[tuple[tuple[Op, float, float], ...], ...]
    makespan: float  # end of the last op; every stage starts at 0

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(end - start for _, start, end in stage) for stage in self.times)

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def bubble(self) -> float:
        """Idle share of the makespan, averaged over stages: what the runtime measures."""
        return sum(self.idle) / (self.makespan * len(self.times)) if self.makespan else 0.0


def simulate(schedule: Schedule, forward: float | Sequence[float] = 1.0, backward: float | Sequence[float] = 2.0,
             weight: float | Sequence[float] | None = None,
             after_send: float | Sequence[float] = 0.0) -> Timeline:
    """Run ``schedule``'s op lists in virtual time: ops of a stage one after another, each
    starting once the op it depends on in the neighbouring stage has ended (communication
    free). ``forward`` and ``backward`` are a stage's costs for one micro-batch: one for
    every stage, or one per stage (measured costs, say; a chunk op costs 1/v of them).
    Under zb-h1 ``backward`` is B's cost and ``weight`` W's; both default to half of
    ``backward``, the split of a whole backward into two equal halves; ``weight`` too may
    be one per stage. ``after_send`` (one, or one per stage): the part of each backward
    that runs after it has sent its input gradients, which the previous stage does not
    wait for (the executor adds a micro-batch's parameter gradients into the step's
    after sending); 0, the closed forms' atomic backward, by default. Raises
    ScheduleError when an op depends on one that never runs (a deadlock)."""
    k, v = schedule.stages, schedule.chunks
    forwards = [float(forward)] * k if isinstance(forward, (int, float)) else [float(f) for f in forward]
    backwards = [float(backward)] * k if isinstance(backward, (int, float)) else [float(b) for b in backward]
    if len(forwards) != k or len(backwards) != k:
        raise ConfigError(f"simulate: {k} stages need {k} forward and backward costs, got {len(forwards)} and "
                          f"{len(backwards)}")
    if weight is None:
        weights = [b / 2 for b in backwards]
    else:
        weights = [float(weight)] * k if isinstance(weight, (int, float)) else [float(w) for w in weight]
        if len(weights) != k:
            raise ConfigError(f"simulate: {k} stages need {k} weight-gradient costs, got {len(weights)}")
    if schedule.splits_backward and weight is None:
        backwards = [b / 2 for b in backwards]
    tails = [float(after_send)] * k if isinstance(after_send, (int, float)) else [float(t) for t in after_send]
    if len(tails) != k:
        raise ConfigError(f"simulate: {k} stages need {k} after-send costs, got {len(tails)}")
    costs = [{"F": forwards[s] / v, "B": backwards[s] / v, "W": (weights[s] if schedule.splits_backward else 0.0) / v}
             for s in range(k)]
    return _play(schedule, lambda s, i, op: costs[s][op.kind],
                 lambda s, i, op: tails[s] / v if op.kind == "B" else 0.0)


def replay(schedule: Schedule, durations: Sequence[Sequence[float]],
           after_send: Sequence[Sequence[float]] | None = None) -> Timeline:
    """Run ``schedule``'s op lists in virtual time as ``simulate`` does, but with each op's
    own duration: ``durations[s][i]`` is stage s's i-th op's (a step's ops as a run
    measured them), and ``after_send[s][i]`` the part of it, for a backward, that its
    dependents do not wait for (0 by default). Where ``simulate`` with a stage's mean
    costs leaves out how much its ops vary, this keeps it; what a measured step adds to
    its replay is then the time between an op's end and its dependent's start."""
    k = schedule.stages
    lengths = [len(schedule.ops(s)) for s in range(k)]
    tails = after_send if after_send is not None else [[0.0] * n for n in lengths]
    if [len(d) for d in durations] != lengths or [len(t) for t in tails] != lengths:
        raise ConfigError(f"replay: {schedule.name}'s stages have {lengths} ops, got durations for "
                          f"{[len(d) for d in durations]} and after-send parts for {[len(t) for t in tails]}")
    return _play(schedule, lambda s, i, op: float(durations[s][i]), lambda s, i, op: float(tails[s][i]))


def _play(schedule: Schedule, cost: Callable[[int, int, Op], float], tail: Callable[[int, int, Op], float]
          ) -> Timeline:
    """The virtual-time run of ``simulate`` and ``replay``: ``cost(s, i, op)`` is stage s's
    i-th op's duration and ``tail(s, i, op)`` the part of it its dependents do not wait for."""
    k, v = schedule.stages, schedule.chunks
    lists = [schedule.ops(s) for s in range(k)]
    ended: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end
    times: list[list[tuple[Op, float, float]]] = [[] for _ in range(k)]
    clock = [0.0] * k
    position = [0] * k
    while any(position[s] < len(lists[s]) for s in range(k)):
        progressed = False
        for s in range(k):
            while position[s] < len(lists[s]):
                i = position[s]
                op = lists[s][i]
                virtual = op.chunk * k + s
                needs = _dependencies(op, virtual, k * v)
                if any(need not in ended for need in needs):
                    break
                start = max([clock[s], *(ended[need] for need in needs)])
                clock[s] = start + cost(s, i, op)
                # What depends on a backward waits only for its sends.
                ended[(op.kind, op.microbatch, virtual)] = clock[s] - tail(s, i, op)
                times[s].append((op, start, clock[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {s} at {lists[s][position[s]]}" for s in range(k)
                                if position[s] < len(lists[s]))
            raise ScheduleError(f"{schedule.name} deadlocks: {waiting} wait on ops that never run")
    return Timeline(schedule, tuple(tuple(t) for t in times), max(clock))


def _dependencies(op: Op, virtual: int, depth: int) -> list[tuple[str, int, int]]:
    m = op.microbatch
    if op.kind == "F":
        return [("F", m, virtual - 1)] if virtual else []
    if op.kind == "W":
        return [("B", m, virtual)]
    return [("F", m, virtual)] + ([("B", m, virtual + 1)] if virtual + 1 < depth else [])


_CLASSES: dict[str, type[Schedule]] = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved,
                                       "zb-h1": ZeroBubbleH1, "pipedream": PipeDream, "pipedream-2bw": PipeDream2BW}


def compensated_delay(name: str, stages: int, stage: int, vertical_sync: bool = False,
                      compensation: bool = True) -> int:
    """The delay (``Schedule.delay``) that delay compensation makes up for on ``stage`` of
    ``--schedule name`` over ``stages`` stages: 0 under a synchronous schedule or without
    compensation (parallel/stash.py)."""
    schedule = _CLASSES.get(name)
    if not compensation or schedule is None or schedule.synchronous:
        return 0
    return make_schedule(name, stages, stages, vertical_sync=vertical_sync, minibatches=1).delay(stage)


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, vertical_sync: bool = False,
                  minibatches: int | None = None) -> Schedule:
    """The schedule ``--schedule name`` names; ConfigError (one line) on bad input.
    ``minibatches``: the mini-batches an asynchronous schedule's lists cover (a run's
    steps); pipedream's inputs are then ``microbatches`` x ``minibatches``."""
    if name not in _CLASSES:
        raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if vertical_sync and name != "pipedream":
        raise ConfigError(f"--vertical-sync applies only to --schedule pipedream, not {name}: drop it")
    if name == "interleaved":
        return Interleaved(stages=stages, microbatches=microbatches, chunks=chunks)
    if name == "pipedream":
        return PipeDream(stages=stages, microbatches=microbatches * (minibatches or 1), chunks=chunks,
                         vertical_sync=vertical_sync)
    if name == "pipedream-2bw" and minibatches is not None:
        return PipeDream2BW(stages=stages, microbatches=microbatches, chunks=chunks, minibatches=minibatches)
    return _CLASSES[name](stages=stages, microbatches=microbatches, chunks=chunks)
