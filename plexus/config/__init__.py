"""Configuration: one frozen dataclass per component, checked on construction.

The CLI and TOML files are thin layers over these classes. Every field name is unique
across components, so a flat mapping (``--batch-size 64`` on the command line,
``batch_size = 64`` in TOML) places each key in exactly one component; see
``JobConfig.from_flat``. Keys the user leaves unset take the defaults of their strategy
and consistency model (``defaults.py``), and every value records where it came from.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from plexus.config.applies import check_strategy
from plexus.errors import ConfigError

__all__ = [
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "OptimConfig",
    "SlowSpec",
    "KillSpec",
    "NetSpec",
    "TRANSPORTS",
    "SPIN_MODES",
    "ClusterConfig",
    "StrategyConfig",
    "RunConfig",
    "JobConfig",
    "parse_slow",
    "parse_kill",
    "parse_net",
    "parse_size",
    "field_default",
]


# What may carry a point-to-point link (ClusterConfig.transport, cluster.group.Link).
TRANSPORTS = ("auto", "socket", "shm")
# How a shared-memory receive waits (ClusterConfig.spin, train.runner.spin_seconds).
SPIN_MODES = ("auto", "on", "off")


def _require(ok: bool, name: str, rule: str, value: Any, fix: str) -> None:
    """Raise a ConfigError naming the field, the rule, the value and the fix."""
    if not ok:
        raise ConfigError(f"{name} {rule}, got {value!r}: {fix}")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    # A built-in dataset (digits, mnist1d, teacher, text, sparse, mnist, cifar10) or a
    # user factory "pkg.module:function" returning a plexus.train.data.Dataset.
    dataset: str = "digits"
    # Folder with local files for the mnist and cifar10 loaders; text corpus root for text.
    data_dir: str | None = None
    # Samples to generate for generated datasets (mnist1d, teacher, sparse, text); None
    # means the dataset's own default.
    num_samples: int | None = None

    def __post_init__(self) -> None:
        _require(bool(self.dataset), "dataset", "must be named", self.dataset, "pass --dataset NAME")
        if self.num_samples is not None:
            _require(self.num_samples >= 10, "num_samples", "must be at least 10", self.num_samples,
                     "pass --num-samples 10 or more")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    # A built-in model (mlp, cnn, lm, logreg, towers, deep-mlp) or a user factory "pkg.module:function"
    # called with the Dataset and returning an nn.Module.
    model: str = "mlp"
    # Width of hidden layers (units for mlp, channels for cnn, embedding size for lm).
    hidden: int = 128
    # Floating-point type of the parameters and inputs (float64 for the exact oracles).
    dtype: Literal["float32", "float64"] = "float32"

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must be named", self.model, "pass --model NAME")
        _require(self.hidden >= 1, "hidden", "must be at least 1", self.hidden, "pass --hidden 1 or more")
        _require(self.dtype in ("float32", "float64"), "dtype", "must be float32 or float64", self.dtype,
                 "pass --dtype float32")


_SIZE = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Parse ``2GB``, ``512MB``, ``1.5GiB`` or a plain byte count into bytes (kB, MB, GB
    are powers of 1000; KiB, MiB, GiB powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _SIZE) or float(m.group(1)) <= 0:
        raise ConfigError(f"stage_memory must be a positive size such as 2GB, 512MB or 1.5GiB, got {text!r}: "
                          f"units are B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB")
    return int(float(m.group(1)) * _SIZE[unit or "b"])


# How plexus.parallel.partition chooses a cut (its METHODS; tested equal).
PARTITION_METHODS = ("uniform", "params", "time", "manual")
# The pipeline schedules the stage executor runs (plexus/parallel/schedules.py).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "pipedream-2bw")
# Those that never flush: the stages step on their own after each mini-batch's backward,
# with the weight versions the schedule's ops carry (each step one mini-batch).
ASYNCHRONOUS_SCHEDULES = ("pipedream", "pipedream-2bw")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Model parallelism: how ONE replica's model is cut into stages (plexus/parallel/)."""

    # Stages per replica: the model's torch.fx graph cut into this many partitions, each
    # run by its own process (1: the whole model in every worker).
    stages: int = 1
    # How the cut is chosen: uniform (equal numbers of computing nodes), params (balanced
    # parameter bytes), time (profiled forward + backward + transfer seconds, the slowest
    # stage minimised), manual (--split-points). params is the default: deterministic,
    # needs no profiling, and balances what dominates a stage's memory (parameters, their
    # gradients and optimizer state); time profiles the model first.
    partition: Literal["uniform", "params", "time", "manual"] = "params"
    # manual: comma-separated fx node names or module qualified names; each starts a stage.
    split_points: str | None = None
    # Bytes each stage's process may hold (parameters, gradients, optimizer state,
    # activations), as "2GB" or "512MB"; None: no cap.
    stage_memory: str | None = None
    # Processes each stage's layers are split across, inside the layers (Linear by
    # output then input features, Conv by output channels; parallel/tensor.py).
    tensor_parallel: int = 1
    # A pipeline: each replica's batch split into this many micro-batches that the stages
    # run in the order of --schedule (parallel/schedules.py); 1: no pipeline.
    microbatches: int = 1
    # The order each stage runs its micro-batches' forwards and backwards: gpipe (every
    # forward, then every backward), 1f1b (one forward, one backward; at most K
    # micro-batches' activations held, not M) or zb-h1 (1f1b with each backward split
    # into the input gradient, sent at once, and the weight gradient, run later in the
    # holes where 1f1b waits; Qi et al. 2023). pipedream is asynchronous: 1f1b that never
    # flushes, each step's batch one mini-batch in flight and each stage stepping after
    # its backward, with weight stashing (Harlap et al. 2018). pipedream-2bw: the same
    # without a flush, but each batch M micro-batches with one step after the last
    # backward, every stage computing with the weights of one step before (two versions,
    # Narayanan et al. 2021); needs M >= K. interleaved: 1f1b over --chunks v model chunks
    # per process (the model cut into K*v stages, process s holding s, K+s, ...), which
    # divides the fill and drain by v (Megatron-LM's; needs M a multiple of K).
    schedule: str = "1f1b"
    # --schedule interleaved: model chunks (virtual stages) per process, v >= 2.
    chunks: int = 1
    # A pipeline's micro-batch keeps only its inputs between its forward and its backward,
    # which runs the forward again (activation recomputation: compute for memory).
    recompute: bool = False
    # --schedule pipedream: every stage computes an input with the weight version stage 0
    # used for it (vertical sync, Narayanan et al. 2019), so each input sees one model.
    vertical_sync: bool = False
    # Asynchronous schedules: an input's backward uses the weights its forward used
    # (weight stashing). False (--no-weight-stashing) backpropagates with the newest
    # weights instead, which gives no model's gradient: only to measure what stashing buys.
    weight_stashing: bool = True
    # Asynchronous schedules: compensate each stage's delay D (the optimizer steps between
    # the weights its forwards use and those its gradients are applied to: K-1-k on stage k
    # under pipedream, K-1 under --vertical-sync, 1 under 2bw): the stage's lr is divided
    # by 1 + 2D, its momentum SGD is spike compensated, and its forwards run on the weights
    # the last step predicts D steps ahead (linear weight prediction; parallel/stash.py).
    # False (--no-delay-compensation): PipeDream's plain rule.
    delay_compensation: bool = True

    def __post_init__(self) -> None:
        _require(self.stages >= 1, "stages", "must be at least 1", self.stages, "pass --stages 2")
        _require(self.tensor_parallel >= 1, "tensor_parallel", "must be at least 1", self.tensor_parallel,
                 "pass --tensor-parallel 2")
        _require(self.microbatches >= 1, "microbatches", "must be at least 1", self.microbatches,
                 "pass --microbatches 4")
        _require(self.schedule in PIPELINE_SCHEDULES, "schedule", f"must be one of {', '.join(PIPELINE_SCHEDULES)}",
                 self.schedule, "pass --schedule 1f1b")
        _require(not self.recompute or self.microbatches > 1, "recompute", "applies to pipelines",
                 self.recompute, "pass --microbatches M (2 or more), or drop --recompute")
        asynchronous = self.schedule in ASYNCHRONOUS_SCHEDULES
        _require(self.chunks >= 1, "chunks", "must be at least 1", self.chunks, "pass --chunks 2")
        _require(self.chunks == 1 or self.schedule == "interleaved", "chunks",
                 "applies to --schedule interleaved (model chunks per process)", self.chunks,
                 "pass --schedule interleaved, or drop --chunks")
        if self.schedule == "interleaved":
            _require(self.chunks >= 2, "chunks", "must be at least 2 under --schedule interleaved (with one chunk "
                     "it is 1f1b)", self.chunks, "pass --chunks 2")
            _require(self.stages > 1 and self.microbatches > 1 and self.microbatches % self.stages == 0,
                     "microbatches", f"must be a multiple of --stages K ({self.stages}, at least 2) under --schedule "
                     f"interleaved: whole rounds of K micro-batches per chunk", self.microbatches,
                     f"pass --microbatches {2 * max(2, self.stages)}")
        _require(not asynchronous or self.stages > 1, "schedule", "pipelines the stages of --stages K, K at least 2",
                 self.schedule, "pass --stages 2 or more")
        _require(self.schedule != "pipedream" or self.microbatches == 1, "microbatches",
                 "must be 1 under --schedule pipedream, whose every batch is one mini-batch in flight (it steps "
                 "after each backward)", self.microbatches, "drop --microbatches")
        _require(self.schedule != "pipedream-2bw" or self.microbatches >= self.stages, "microbatches",
                 f"must be at least --stages K ({self.stages}) under --schedule pipedream-2bw, so that each "
                 f"stage holds two weight versions at most", self.microbatches,
                 f"pass --microbatches {1 << (self.stages - 1).bit_length()} (at least K, dividing each "
                 f"replica's batch)")
        _require(not self.recompute or not asynchronous, "recompute", "applies to the synchronous schedules",
                 self.recompute, "drop --recompute")
        _require(not self.vertical_sync or self.schedule == "pipedream", "vertical_sync",
                 "applies to --schedule pipedream", self.vertical_sync, "pass --schedule pipedream, or drop it")
        _require(self.weight_stashing or self.schedule == "pipedream", "weight_stashing",
                 "can be turned off only under --schedule pipedream (the other schedules step once no "
                 "backward is pending, so their weights never change under one)", self.weight_stashing,
                 "drop --no-weight-stashing")
        _require(self.delay_compensation or asynchronous, "delay_compensation",
                 "can be turned off only under --schedule pipedream or pipedream-2bw (the synchronous schedules "
                 "compute every gradient on the weights it is applied to)", self.delay_compensation,
                 "drop --no-delay-compensation")
        _require(self.weight_stashing or not self.vertical_sync, "vertical_sync",
                 "keeps old weight versions for the forwards, which needs weight stashing", self.vertical_sync,
                 "drop --no-weight-stashing or --vertical-sync")
        _require(self.microbatches == 1 or self.stages > 1, "microbatches",
                 "pipelines the stages of --stages K, K at least 2", self.microbatches,
                 "pass --stages 2 or more, or drop --microbatches")
        _require(self.partition in PARTITION_METHODS, "partition", "must be uniform, params, time or manual",
                 self.partition, "pass --partition params")
        points = self.split_point_names
        if self.partition == "manual":
            _require(bool(points), "split_points", "must name at least one node under --partition manual",
                     self.split_points, "pass --split-points NAME[,NAME...] (--print-partition lists the nodes)")
            if self.schedule == "interleaved":  # the points cut K x v model chunks
                _require(self.stages * self.chunks == len(points) + 1, "split_points",
                         f"must number --stages K x --chunks v - 1 ({self.stages} x {self.chunks} - 1 = "
                         f"{self.stages * self.chunks - 1}) under --partition manual with --schedule interleaved, "
                         f"which cuts K x v model chunks", self.split_points,
                         f"name {self.stages * self.chunks - 1} split points")
            else:
                _require(self.stages == len(points) + 1, "stages",
                         f"must be one more than the {len(points)} split points under --partition manual",
                         self.stages, f"pass --stages {len(points) + 1}")
        else:
            _require(not points, "split_points", "apply to --partition manual only", self.split_points,
                     "pass --partition manual, or drop --split-points")
        if self.stage_memory is not None:
            parse_size(self.stage_memory)

    @property
    def split_point_names(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in (self.split_points or "").split(",") if p.strip())

    @property
    def stage_memory_bytes(self) -> int | None:
        return None if self.stage_memory is None else parse_size(self.stage_memory)

    @property
    def per_replica(self) -> int:
        """Processes per model replica: stages x tensor-parallel shards."""
        return self.stages * self.tensor_parallel

    @property
    def partitioned(self) -> bool:
        """Whether a replica spans several processes (role ``stage``)."""
        return self.per_replica > 1

    @property
    def flags(self) -> str:
        """The flags that cut a replica, as a user wrote them: ``--stages 2 --tensor-parallel 2``."""
        parts = [f"--stages {self.stages}"] if self.stages > 1 else []
        if self.tensor_parallel > 1:
            parts.append(f"--tensor-parallel {self.tensor_parallel}")
        return " ".join(parts) or "--stages 1"


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    # The optimizer every worker (or server) runs on the averaged gradient.
    optimizer: Literal["sgd", "adam", "adagrad"] = "sgd"
    # Learning rate (step size), dimensionless.
    lr: float = 0.1
    # Heavy-ball momentum for sgd (0.9, the usual recipe value; 0 for plain SGD).
    momentum: float = 0.9
    # L2 penalty added to the gradient.
    weight_decay: float = 0.0
    # Not a flag: the steps a pipeline stage's gradients are stale by, set per stage by
    # delay compensation (train/stage_groups.group_config); momentum SGD then steps with
    # spike compensation (strategies/base.SpikeCompensatedSGD).
    delay_steps: int = 0

    def __post_init__(self) -> None:
        _require(self.optimizer in ("sgd", "adam", "adagrad"), "optimizer", "must be sgd, adam or adagrad",
                 self.optimizer, "pass --optimizer sgd|adam|adagrad")
        _require(self.lr > 0, "lr", "must be positive", self.lr, "pass --lr 0.1 for example")
        _require(0 <= self.momentum < 1, "momentum", "must lie in [0, 1)", self.momentum, "pass --momentum 0.9 for example")
        _require(self.weight_decay >= 0, "weight_decay", "must be non-negative", self.weight_decay, "pass --weight-decay 0")
        _require(self.delay_steps >= 0, "delay_steps", "must be non-negative", self.delay_steps, "leave it unset")


@dataclass(kw_only=True, frozen=True)
class SlowSpec:
    """``--slow worker:K=F``: process ``role`` ``rank`` takes ``factor`` times its compute time."""

    role: str
    rank: int
    factor: float


@dataclass(kw_only=True, frozen=True)
class KillSpec:
    """``--kill worker:K@step=N``: process ``role`` ``rank`` dies abruptly at step ``step``;
    ``--kill coordinator:0@time=S``: ``seconds`` after training starts (any process)."""

    role: str
    rank: int
    step: int | None = None
    seconds: float | None = None

    @property
    def when(self) -> str:
        return f"step={self.step}" if self.step is not None else f"time={self.seconds:g}"


@dataclass(kw_only=True, frozen=True)
class NetSpec:
    """``--net bandwidth=100mbit,latency=2ms``: a message takes bytes / bandwidth on the wire
    and arrives latency later. Over shared memory it leaves through the sending process's
    one emulated card (``emulation.Interface``) and the receiver gets it on arrival; over
    gloo's sockets the send itself waits ``delay``."""

    # Bytes per second; None for no bandwidth limit.
    bandwidth: float | None = None
    # Seconds added to every message.
    latency: float = 0.0

    def wire(self, nbytes: int) -> float:
        """Seconds ``nbytes`` bytes spend on the wire."""
        return nbytes / self.bandwidth if self.bandwidth else 0.0

    def delay(self, nbytes: int) -> float:
        """Seconds a send of ``nbytes`` is held back."""
        return self.latency + self.wire(nbytes)


_ROLES = ("worker", "server", "aggregator", "coordinator")


def _split_role(text: str, flag: str, example: str) -> tuple[str, int, str]:
    m = re.fullmatch(r"(\w+):(\d+)(.*)", text.strip())
    if not m or m.group(1) not in _ROLES:
        raise ConfigError(f"--{flag} must look like {example}, got {text!r}: name a role "
                          f"({', '.join(_ROLES)}) and its rank")
    return m.group(1), int(m.group(2)), m.group(3)


def parse_slow(text: str) -> tuple[SlowSpec, ...]:
    """Parse ``worker:0=4,worker:2=1.5`` into SlowSpecs."""
    specs = []
    for part in filter(None, text.split(",")):
        role, rank, rest = _split_role(part, "slow", "worker:0=4")
        m = re.fullmatch(r"=([0-9.]+)", rest)
        factor = float(m.group(1)) if m else -1.0
        _require(factor >= 1.0, "--slow factor", "must be a number >= 1", part, "write worker:K=F with F >= 1")
        specs.append(SlowSpec(role=role, rank=rank, factor=factor))
    return tuple(specs)


def parse_kill(text: str) -> tuple[KillSpec, ...]:
    """Parse ``worker:1@step=50`` into KillSpecs."""
    specs = []
    for part in filter(None, text.split(",")):
        role, rank, rest = _split_role(part, "kill", "worker:1@step=50")
        m = re.fullmatch(r"@step=(\d+)", rest)
        t = re.fullmatch(r"@time=([0-9]*\.?[0-9]+)s?", rest)
        _require(m is not None or t is not None, "--kill", "must say when, as @step=N or @time=SECONDS", part,
                 "write worker:K@step=N, or ROLE:K@time=S for S seconds after training starts")
        specs.append(KillSpec(role=role, rank=rank, step=int(m.group(1))) if m is not None
                     else KillSpec(role=role, rank=rank, seconds=float(t.group(1))))
    return tuple(specs)


_RATE = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
         "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_net(text: str) -> NetSpec:
    """Parse ``bandwidth=100mbit,latency=2ms`` (bandwidth units bit/kbit/mbit/gbit per
    second or b/kb/mb/gb bytes per second; latency units s/ms/us)."""
    bandwidth, latency = None, 0.0
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        m = re.fullmatch(r"([0-9.]+)\s*([a-zA-Z]*)", value.strip())
        if key == "bandwidth" and m and m.group(2).lower() in _RATE:
            bandwidth = float(m.group(1)) * _RATE[m.group(2).lower()]
            _require(bandwidth > 0, "--net bandwidth", "must be positive", value, "write bandwidth=100mbit")
        elif key == "latency" and m and (m.group(2).lower() or "s") in _TIME:
            latency = float(m.group(1)) * _TIME[m.group(2).lower() or "s"]
        else:
            raise ConfigError(f"--net must look like bandwidth=100mbit,latency=2ms, got {part!r}: "
                              f"bandwidth takes bit|kbit|mbit|gbit|b|kb|mb|gb, latency takes s|ms|us")
    return NetSpec(bandwidth=bandwidth, latency=latency)


@dataclass(kw_only=True, frozen=True)
class ClusterConfig:
    # Worker processes (data-parallel replicas).
    workers: int = 1
    # Parameter-server processes, for strategies that have servers.
    servers: int = 0
    # Address the rendezvous store binds to; loopback unless the user gives one.
    host: str = "127.0.0.1"
    # Rendezvous port; 0 picks a free one.
    port: int = 0
    # Seconds any blocking operation waits before raising CommTimeout.
    timeout: float = 60.0
    # Seconds of silence after which a peer is declared lost.
    peer_timeout: float = 10.0
    # Communication backend: gloo on CPU, nccl with CUDA; auto picks by device.
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Where workers compute: auto uses CUDA when present.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Threads torch may use inside each process; 0 leaves torch's default. Several
    # processes share this machine's cores, so one thread each avoids oversubscription.
    threads: int = 1
    slow: tuple[SlowSpec, ...] = ()
    kill: tuple[KillSpec, ...] = ()
    net: NetSpec = field(default_factory=NetSpec)
    # What carries point-to-point links (parameter servers, aggregators, gossip, easgd,
    # D-PSGD's neighbours, and the messages of allreduce's and local-sgd's all-reduce
    # algorithms other than native):
    # auto uses shared memory between processes on one machine and gloo's sockets
    # otherwise; socket always uses the sockets; shm requires shared memory.
    transport: Literal["auto", "socket", "shm"] = "auto"
    # How a receive over shared memory waits: on polls its link for up to 10 ms before it
    # sleeps, sparing each hand-off the wake-up, at the price of the core it polls on; auto
    # does so where this machine has two cores for every torch thread of the job here
    # (train.runner.spin_seconds); off never does.
    spin: Literal["auto", "on", "off"] = "auto"
    # Global ranks of the role plan (train/plan.py): workers first, then the strategy's other
    # roles (servers, aggregators, coordinator), or those roles first. torchrun numbers ranks
    # node by node, so this says which node the servers land on.
    place: Literal["workers-first", "roles-first"] = "workers-first"

    def __post_init__(self) -> None:
        _require(self.workers >= 1, "workers", "must be at least 1", self.workers, "pass --workers 1 or more")
        _require(self.place in ("workers-first", "roles-first"), "place", "must be workers-first or roles-first",
                 self.place, "pass --place roles-first")
        _require(self.servers >= 0, "servers", "must be non-negative", self.servers, "pass --servers 0 or more")
        _require(0 <= self.port < 65536, "port", "must lie in [0, 65535]", self.port, "pass --port 0 for a free port")
        _require(self.timeout > 0, "timeout", "must be positive seconds", self.timeout, "pass --timeout 60")
        _require(self.peer_timeout > 0, "peer_timeout", "must be positive seconds", self.peer_timeout,
                 "pass --peer-timeout 10")
        _require(self.backend in ("auto", "gloo", "nccl"), "backend", "must be auto, gloo or nccl",
                 self.backend, "pass --backend auto")
        _require(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda", self.device,
                 "pass --device auto")
        _require(self.transport in TRANSPORTS, "transport", "must be auto, socket or shm",
                 self.transport, "pass --transport auto")
        _require(self.spin in SPIN_MODES, "spin", "must be auto, on or off", self.spin,
                 "pass --spin auto")
        _require(self.threads >= 0, "threads", "must be non-negative", self.threads, "pass --threads 1")
        for spec in (*self.slow, *self.kill):
            if spec.role != "worker":
                continue  # servers and aggregators depend on the strategy (train/preflight.py)
            count = self.workers if spec.role == "worker" else self.servers
            _require(spec.rank < count, f"--{'slow' if isinstance(spec, SlowSpec) else 'kill'}",
                     f"must name an existing {spec.role} (there are {count})", f"{spec.role}:{spec.rank}",
                     f"pick a rank below {count}")


@dataclass(kw_only=True, frozen=True)
class StrategyConfig:
    # The distributed architecture: allreduce, ps, tree-ps, gossip, local-sgd, easgd,
    # sandblaster.
    strategy: str = "allreduce"
    # The all-reduce algorithm, for strategies that average tensors.
    algorithm: str = "native"
    # Gradient bucket size in MiB: each bucket's all-reduce starts as soon as its
    # gradients are ready during backward.
    bucket_mb: float = 25.0
    # allreduce: survivors of a lost worker re-form the group and go on with the global
    # batch split over fewer workers; workers may join at a step boundary (strategies/elastic.py).
    elastic: bool = False
    # Ranks per group for the hierarchical all-reduce (hier); 0 means ranks per machine.
    local_size: int = 0

    # --- parameter server (ps, tree-ps) ---
    # When the servers apply pushes: bsp (average all live workers' pushes per clock),
    # asp (each on arrival), ssp (asp, but no worker runs more than `staleness` clocks
    # ahead of the slowest), softsync (average every `softsync` pushes).
    consistency: Literal["bsp", "asp", "ssp", "softsync"] = "asp"
    # SSP bound T in clocks (0 behaves as bsp).
    staleness: int = 0
    # Pushes averaged per update under softsync (Rudra's n); 0 means the number of workers.
    softsync: int = 0
    # Pull parameters every this many steps (DistBelief's n_fetch).
    fetch_every: int = 1
    # Push the accumulated gradient every this many steps (DistBelief's n_push).
    push_every: int = 1
    # Divide each push's learning rate by its staleness (Zhang et al. 2016).
    staleness_lr: bool = False
    # Tree PS: children per aggregator, and the Rudra variant.
    fanout: int = 2
    variant: Literal["base", "adv", "adv-star"] = "adv"

    # --- decentralized and model averaging (gossip, local-sgd, easgd) ---
    # Gossip graph: ring, torus, exp (peers at distances 1, 2, 4, ...), complete.
    topology: Literal["ring", "torus", "exp", "complete"] = "ring"
    # Mixing weights: uniform over neighbours and self, or Metropolis-Hastings.
    mixing: Literal["uniform", "metropolis"] = "uniform"
    # combine-first: mix while computing the gradient at the own parameters (Lian et al.
    # 2017, Algorithm 1); adapt-first: local step, then mix the updated parameters.
    gossip_order: Literal["combine-first", "adapt-first"] = "combine-first"
    # Asynchronous pairwise gossip (AD-PSGD, Lian et al. 2018).
    async_gossip: bool = False
    # Local steps between averagings (local-sgd), or between elastic pulls (easgd).
    period: int = 1
    # AdaComm (Wang and Joshi 2019): shrink the period as the training loss falls.
    adaptive: bool = False
    # Also average momentum and Adam buffers when averaging parameters.
    average_optimizer_state: bool = False
    # Synchronous all-reduce steps before local SGD starts (post-local SGD).
    warmup_steps: int = 0
    # EASGD moving rate alpha = lr * rho: the elastic force's weight per pull.
    elastic_alpha: float = 0.1

    # --- scheduler (ps) ---
    # static: each asynchronous worker walks its own partition of the data; dynamic: every
    # worker takes the job's next unit of data when it is idle, so a slow worker trains on
    # fewer samples (Dean et al. 2012, section 4.2).
    assignment: Literal["static", "dynamic"] = "static"
    # bsp: b of the `workers` processes are backups: each step averages the first
    # workers - b gradients to arrive, late ones dropped (Chen et al. 2016).
    backup_workers: int = 0

    # --- the server group (ps) ---
    # Each shard is replicated on its k successors on the ring of servers, and a successor
    # takes it over when its primary dies (ps/replication.py; 0: no replicas, as Li et al.'s
    # servers without replication: a dead server ends the job).
    replication: int = 0
    # Test mode (Jepsen-style): every push carries worker * 10^6 + clock in the first element
    # of each shard, and the summary checks acknowledged <= applied <= sent, each once.
    ledger: bool = False
    # Planned removal: server:S@step=N drains server S once its shard reaches version N; its
    # shard moves to a spare (plexus server --join) or its successor, with training going on.
    drain: str = ""

    # --- Sandblaster L-BFGS (sandblaster) ---
    # L-BFGS history m: the (s, y) pairs kept on the server shards.
    history: int = 10
    # The direction's recursion: two-loop (2m + O(1) round trips to the shards per
    # iteration) or vector-free (Chen, Wang and Zhou 2014: one Gram matrix, O(1)).
    lbfgs: Literal["two-loop", "vector-free"] = "two-loop"
    # Line search: backtracking Armijo, strong_wolfe (as torch.optim.LBFGS), or none (the
    # fixed step lr, as torch.optim.LBFGS without line_search_fn).
    line_search: Literal["armijo", "strong_wolfe", "none"] = "armijo"
    # Samples per work unit; 0 picks batch_size / (8 x workers), at least 1.
    unit_size: int = 0
    # Backup copies of outstanding units go to idle replicas once at most this fraction
    # of the batch's units is outstanding (0 turns backup tasks off).
    backup_after: float = 0.1

    def __post_init__(self) -> None:
        check_strategy(self.strategy)
        _require(self.bucket_mb > 0, "bucket_mb", "must be positive MiB", self.bucket_mb, "pass --bucket-mb 25")
        _require(self.local_size >= 0, "local_size", "must be non-negative", self.local_size, "pass --local-size 2")
        _require(self.consistency in ("bsp", "asp", "ssp", "softsync"), "consistency",
                 "must be bsp, asp, ssp or softsync", self.consistency, "pass --consistency asp")
        _require(self.staleness >= 0, "staleness", "must be non-negative clocks", self.staleness, "pass --staleness 2")
        _require(self.softsync >= 0, "softsync", "must be non-negative", self.softsync, "pass --softsync 2")
        _require(self.fetch_every >= 1, "fetch_every", "must be at least 1", self.fetch_every, "pass --fetch-every 1")
        _require(self.push_every >= 1, "push_every", "must be at least 1", self.push_every, "pass --push-every 1")
        _require(self.fanout >= 2, "fanout", "must be at least 2", self.fanout, "pass --fanout 2")
        _require(self.variant in ("base", "adv", "adv-star"), "variant", "must be base, adv or adv-star",
                 self.variant, "pass --variant adv")
        _require(self.topology in ("ring", "torus", "exp", "complete"), "topology",
                 "must be ring, torus, exp or complete", self.topology, "pass --topology ring")
        _require(self.mixing in ("uniform", "metropolis"), "mixing", "must be uniform or metropolis",
                 self.mixing, "pass --mixing uniform")
        _require(self.gossip_order in ("combine-first", "adapt-first"), "gossip_order",
                 "must be combine-first or adapt-first", self.gossip_order, "pass --gossip-order combine-first")
        _require(self.period >= 1, "period", "must be at least 1 step", self.period, "pass --period 8")
        _require(self.warmup_steps >= 0, "warmup_steps", "must be non-negative", self.warmup_steps,
                 "pass --warmup-steps 0")
        _require(0 < self.elastic_alpha <= 1, "elastic_alpha", "must lie in (0, 1]", self.elastic_alpha,
                 "pass --elastic-alpha 0.1")
        _require(self.assignment in ("static", "dynamic"), "assignment", "must be static or dynamic",
                 self.assignment, "pass --assignment dynamic")
        _require(self.backup_workers >= 0, "backup_workers", "must be non-negative", self.backup_workers,
                 "pass --backup-workers 1")
        _require(self.replication >= 0, "replication", "must be non-negative", self.replication,
                 "pass --replication 1")
        _require(all(k.role == "server" for k in parse_kill(self.drain)), "drain", "names servers only",
                 self.drain, "write server:1@step=50")
        _require(self.history >= 1, "history", "must be at least 1 (s, y) pair", self.history,
                 "pass --history 10")
        _require(self.lbfgs in ("two-loop", "vector-free"), "lbfgs", "must be two-loop or vector-free", self.lbfgs,
                 "pass --lbfgs two-loop")
        _require(self.line_search in ("armijo", "strong_wolfe", "none"), "line_search",
                 "must be armijo, strong_wolfe or none", self.line_search, "pass --line-search armijo")
        _require(self.unit_size >= 0, "unit_size", "must be non-negative samples", self.unit_size,
                 "pass --unit-size 32 (0 picks one)")
        _require(0 <= self.backup_after < 1, "backup_after", "must lie in [0, 1)", self.backup_after,
                 "pass --backup-after 0.1 (0 turns backup tasks off)")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    # Global batch: every synchronous step consumes this many samples in all, split
    # evenly over the workers (contract 1).
    batch_size: int = 64
    # Training length: steps, epochs or seconds; the first reached ends the run. When
    # none is given the run lasts one epoch or 300 steps, whichever is longer.
    steps: int | None = None
    epochs: float | None = None
    time_limit: float | None = None
    # Stop when the test accuracy of a snapshot reaches this fraction (0..1).
    target_accuracy: float | None = None
    # Snapshot and evaluate the global model every this many steps (0: only at the end).
    eval_every: int = 50
    # Write a training event to metrics.jsonl every this many steps.
    log_every: int = 10
    # Seed of the data order and the initial model (numpy and torch take 0 .. 2**32 - 1).
    seed: int = 0
    # Run directory; None writes nowhere.
    out: str | None = None
    # Write into an --out directory that already holds files (an earlier run's results
    # there are replaced); without it such a directory is refused, so no run is lost.
    overwrite: bool = False
    save_model: bool = False
    # Write a checkpoint of the whole job every N steps ("100") or seconds ("30s") into
    # RUN_DIR/checkpoints (train/checkpoint.py).
    checkpoint_every: str | None = None
    # The checkpoint folder this run continues from (set by --resume RUN_DIR, which
    # picks the run's newest whole checkpoint).
    resume: str | None = None
    # Skip the plots and index.html (summary.json and metrics.jsonl are still written;
    # `plexus report DIR` draws them later). PLEXUS_NO_REPORT=1 in the environment does
    # the same for every run, as the test suite does.
    no_report: bool = False
    json: bool = False
    quiet: bool = False
    debug: bool = False

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "batch_size", "must be at least 1", self.batch_size, "pass --batch-size 64")
        _require(self.steps is None or self.steps >= 1, "steps", "must be at least 1", self.steps, "pass --steps 100")
        _require(self.epochs is None or self.epochs > 0, "epochs", "must be positive", self.epochs, "pass --epochs 1")
        _require(self.time_limit is None or self.time_limit > 0, "time_limit", "must be positive seconds",
                 self.time_limit, "pass --time-limit 60")
        _require(self.target_accuracy is None or 0 < self.target_accuracy <= 1, "target_accuracy",
                 "must be a fraction in (0, 1]", self.target_accuracy, "pass --target-accuracy 0.9")
        if self.checkpoint_every is not None:
            from plexus.train.checkpoint import parse_every
            parse_every(self.checkpoint_every)
        _require(self.eval_every >= 0, "eval_every", "must be non-negative", self.eval_every, "pass --eval-every 50")
        _require(self.log_every >= 1, "log_every", "must be at least 1", self.log_every, "pass --log-every 10")
        _require(0 <= self.seed < 2**32, "seed", "must lie in [0, 2**32 - 1] (numpy's and torch's seed range)",
                 self.seed, "pass --seed 0 or another non-negative integer")


# Keys that name a field by another name: ``async = true`` in TOML, as the flag is
# ``--async`` (the field is async_gossip, since ``async`` is a Python keyword).
_ALIASES = {"async": "async_gossip"}

_COMPONENTS = {"data": DataConfig, "model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig,
               "cluster": ClusterConfig, "strategy": StrategyConfig, "run": RunConfig}
_OWNER = {f.name: comp for comp, klass in _COMPONENTS.items() for f in dataclasses.fields(klass)}
_FIELDS = {f.name: f for klass in _COMPONENTS.values() for f in dataclasses.fields(klass)}


def field_default(key: str) -> Any:
    """The dataclass default of flat key ``key`` (before any per-strategy default)."""
    f = _FIELDS[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """Everything one training job needs, grouped by component."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # Where each flat key's value came from (see defaults.py); keys absent here are the
    # dataclass defaults.
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Contract 1: each worker takes an equal contiguous slice of the global batch
        # (sandblaster's replicas take units of it instead, as many as they can).
        _require(self.strategy.strategy == "sandblaster" or self.run.batch_size % self.cluster.workers == 0,
                 "batch_size",
                 f"must be divisible by workers ({self.cluster.workers})", self.run.batch_size,
                 "each worker takes an equal slice of the global batch; pick a multiple of --workers")

    @classmethod
    def from_flat(cls, flat: dict[str, Any], sources: dict[str, str] | None = None) -> "JobConfig":
        """Build from flat keys (``batch_size``, ``workers``...), the CLI's and TOML's form.

        ``sources`` names where each given key came from (``flag``, ``file``, ``spec``;
        ``api`` where not named). Keys not given take their strategy's defaults
        (``defaults.resolve``). ``slow``, ``kill`` and ``net`` may be given as their flag
        strings.
        """
        from plexus.config.defaults import resolve
        given: dict[str, Any] = {}
        origin = {_ALIASES.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in (sources or {}).items()}
        for key, value in flat.items():
            key = key.replace("-", "_")
            key = _ALIASES.get(key, key)
            if key not in _OWNER:
                raise ConfigError(f"unknown configuration key {key!r}: known keys are "
                                  f"{', '.join(sorted(_OWNER))}")
            given[key] = value
        origin = {key: origin.get(key, "api") for key in given}
        _check_types(given, origin)
        if given.get("delay_steps", 0):  # 0, as config.json records it, may come back
            raise ConfigError(f"delay_steps ({origin['delay_steps']}) is set per pipeline stage by delay "
                              f"compensation (--schedule pipedream or pipedream-2bw), not by a job: drop it")
        defaults, default_sources = resolve(given)
        parts: dict[str, dict[str, Any]] = {name: {} for name in _COMPONENTS}
        for key, value in {**defaults, **given}.items():
            if key == "slow" and isinstance(value, str):
                value = parse_slow(value)
            elif key == "kill" and isinstance(value, str):
                value = parse_kill(value)
            elif key == "net" and isinstance(value, str):
                value = parse_net(value)
            parts[_OWNER[key]][key] = value
        try:
            built = {comp: _COMPONENTS[comp](**kw) for comp, kw in parts.items()}
        except TypeError as exc:  # a value of the wrong type reached a check
            raise ConfigError(f"invalid configuration value: {exc}") from None
        return cls(**built, sources={**default_sources, **origin})

    def replace(self, **flat: Any) -> "JobConfig":
        """A copy with some flat keys changed (as ``api`` values); keys that took a
        strategy default are resolved again, so changing the strategy changes them."""
        from plexus.config.defaults import USER_SOURCES
        current = self.to_flat()
        chosen = {k: current[k] for k, src in self.sources.items() if src in USER_SOURCES}
        return JobConfig.from_flat({**chosen, **flat}, {**{k: self.sources[k] for k in chosen},
                                                         **{k: "api" for k in flat}})

    def source(self, key: str) -> str:
        """Where the value of flat key ``key`` came from."""
        return self.sources.get(key, "default")

    def settings(self) -> dict[str, dict[str, Any]]:
        """Every effective value with its source, as plain data: {key: {value, source}}."""
        nested = self.to_dict()
        return {key: {"value": nested[_OWNER[key]][key], "source": self.source(key)} for key in _OWNER}

    def to_flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for comp in _COMPONENTS:
            sub = getattr(self, comp)
            for f in dataclasses.fields(sub):
                out[f.name] = getattr(sub, f.name)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data, as written to config.json (with ``sources``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        """Inverse of ``to_dict``."""
        cluster = dict(data["cluster"])
        cluster["slow"] = tuple(SlowSpec(**s) for s in cluster.get("slow", ()))
        cluster["kill"] = tuple(KillSpec(**k) for k in cluster.get("kill", ()))
        cluster["net"] = NetSpec(**cluster.get("net", {}))
        return cls(data=DataConfig(**data["data"]), model=ModelConfig(**data["model"]),
                   parallel=ParallelConfig(**data.get("parallel", {})),  # absent from older runs' config.json
                   optim=OptimConfig(**data["optim"]), cluster=ClusterConfig(**cluster),
                   strategy=StrategyConfig(**data["strategy"]), run=RunConfig(**data["run"]),
                   sources=dict(data.get("sources", {})))


def _type_name(kind: Any) -> str:
    return " or ".join(sorted({t.__name__ for t in kind})) if isinstance(kind, tuple) else kind.__name__


def _check_types(given: dict[str, Any], origin: dict[str, str]) -> None:
    """A value of the wrong type (``workers = "two"`` in TOML) named with its key, its
    source and the type it needs, before any check compares it."""
    import typing
    hints = {}
    for klass in _COMPONENTS.values():
        hints.update(typing.get_type_hints(klass))
    for key, value in given.items():
        hint = hints[key]
        if key in ("slow", "kill", "net") or value is None:
            continue
        args = typing.get_args(hint)
        if typing.get_origin(hint) is Literal:
            kinds: Any = tuple({type(a) for a in args})
        elif args:  # X | None
            kinds = tuple(a for a in args if a is not type(None))
        else:
            kinds = hint
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if float in kinds:
            kinds = (*kinds, int)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok:
            raise ConfigError(f"{key} must be {_type_name(kinds)}, got {value!r} ({type(value).__name__}, "
                              f"from {origin.get(key, 'api')}): write e.g. {key} = "
                              f"{field_default(key)!r}")
