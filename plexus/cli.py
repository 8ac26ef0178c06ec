"""``plexus``: the command line, a thin layer over ``plexus.config`` and ``plexus.train``.

    plexus train   [flags]            train one job, write a run directory
    plexus compare SPEC... [flags]    run several strategies on the same model, data and seed
    plexus report  DIR... [--out D]   plots and index.html from run directories
    plexus worker  --join HOST:PORT   one more worker for a running ps, sandblaster or elastic allreduce job
    plexus server  --join HOST:PORT   one more server (a spare) for a running ps job
    plexus drain   HOST:PORT --server S   move server S's shards away, training going on
    plexus bench   ddp|collectives    benchmarks that print tables

Errors print one line on stderr: status 2 for usage and configuration, non-zero
otherwise; ``--debug`` adds the traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from plexus.config import PIPELINE_SCHEDULES, SPIN_MODES, TRANSPORTS

if TYPE_CHECKING:
    from plexus.report.judging import Judged

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _flag(group, name: str, **kw) -> None:
    group.add_argument(f"--{name}", dest=name.replace("-", "_"), **kw)


# What the default --algorithm, native, runs on one machine (strategies/base.py, algorithm_for).
_DEFAULT_ALGORITHM = "runs ring where every worker computes on this machine's CPUs"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job flags shared by train and compare; each maps to one config field."""
    g = parser.add_argument_group("strategy")
    _flag(g, "strategy", help="allreduce, ps, tree-ps, gossip, local-sgd, easgd, sandblaster")
    _flag(g, "algorithm", help=f"all-reduce algorithm: native, ring, ... (default native; {_DEFAULT_ALGORITHM})")
    _flag(g, "bucket-mb", type=float, help="gradient bucket size in MiB (default 25)")
    _flag(g, "local-size", type=int, help="ranks per group for the hier algorithm")
    _flag(g, "elastic", action="store_const", const=True,
          help="allreduce: when a worker dies the others re-form the group and go on; workers may join")
    g = parser.add_argument_group("parameter server (ps, tree-ps)")
    _flag(g, "consistency", choices=["bsp", "asp", "ssp", "softsync"], help="when servers apply pushes (default asp)")
    _flag(g, "staleness", type=int, help="SSP bound in clocks (default 0)")
    _flag(g, "softsync", type=int, help="pushes averaged per update under softsync (default: workers)")
    _flag(g, "fetch-every", type=int, help="pull parameters every N steps (default 1)")
    _flag(g, "push-every", type=int, help="push accumulated gradients every N steps (default 1)")
    _flag(g, "staleness-lr", action="store_const", const=True, help="divide each push's lr by its staleness")
    _flag(g, "fanout", type=int, help="children per aggregator in tree-ps (default 2)")
    _flag(g, "variant", choices=["base", "adv", "adv-star"], help="tree-ps variant (default adv)")
    _flag(g, "assignment", choices=["static", "dynamic"],
          help="ps data: static partitions, or dynamic units taken when idle (default static)")
    _flag(g, "backup-workers", type=int, help="bsp: b of the --workers processes are backups; each step uses the first workers - b gradients")
    _flag(g, "replication", type=int,
          help="keep each shard on its k successor servers; one takes over when the primary dies (default 0)")
    _flag(g, "drain", help="move a server's shard away while training goes on: server:S@step=N (its shard's "
                           "version)")
    _flag(g, "ledger", action="store_const", const=True,
          help="test mode: pushes carry known integers and the summary checks that none was lost or applied twice")
    g = parser.add_argument_group("Sandblaster L-BFGS (sandblaster)")
    _flag(g, "history", type=int, help="L-BFGS history m (default 10)")
    _flag(g, "lbfgs", choices=["two-loop", "vector-free"], help="direction recursion (default two-loop)")
    _flag(g, "line-search", choices=["armijo", "strong_wolfe", "none"], help="line search (default armijo)")
    _flag(g, "unit-size", type=int, help="samples per work unit (default batch / (8 x workers))")
    _flag(g, "backup-after", type=float, help="back up outstanding units once this fraction is left (default 0.1)")
    g = parser.add_argument_group("decentralized and model averaging (gossip, local-sgd, easgd)")
    _flag(g, "topology", choices=["ring", "torus", "exp", "complete"], help="gossip graph (default ring)")
    _flag(g, "mixing", choices=["uniform", "metropolis"], help="gossip mixing weights (default uniform)")
    _flag(g, "gossip-order", choices=["combine-first", "adapt-first"], help="D-PSGD order (default combine-first)")
    g.add_argument("--async", dest="async_gossip", action="store_const", const=True,
                   help="asynchronous pairwise gossip (AD-PSGD)")
    _flag(g, "period", type=int, help="local steps between averagings or elastic pulls (default 1)")
    _flag(g, "adaptive", action="store_const", const=True, help="AdaComm: shrink the period as the loss falls")
    _flag(g, "average-optimizer-state", action="store_const", const=True, help="also average optimizer buffers")
    _flag(g, "warmup-steps", type=int, help="synchronous all-reduce steps before local SGD (default 0)")
    _flag(g, "elastic-alpha", type=float, help="EASGD moving rate (default 0.1)")
    g = parser.add_argument_group("cluster")
    _flag(g, "workers", type=int, help="worker processes (default 1); with --stages K, model replicas of K stages each")
    _flag(g, "replicas", type=int, help="with --stages K: model replicas (R x K processes); another name for --workers")
    _flag(g, "servers", type=int, help="parameter-server processes")
    _flag(g, "host", help="address the rendezvous store binds to (default 127.0.0.1)")
    _flag(g, "port", type=int, help="rendezvous port (default 0: a free one)")
    _flag(g, "timeout", type=float, help="seconds any blocking operation waits (default 60)")
    _flag(g, "peer-timeout", type=float, help="seconds of silence before a peer is lost (default 10)")
    _flag(g, "backend", choices=["auto", "gloo", "nccl"], help="communication backend")
    _flag(g, "transport", choices=list(TRANSPORTS),
          help="point-to-point messages, all-reduce algorithms' too: auto (shared memory on one machine), "
               "socket or shm")
    _flag(g, "spin", choices=list(SPIN_MODES),
          help="shared-memory receives poll up to 10 ms before sleeping: on, off, or auto (where this machine "
               "has two cores per torch thread of the job)")
    _flag(g, "device", choices=["auto", "cpu", "cuda"], help="compute device")
    _flag(g, "place", choices=["workers-first", "roles-first"],
          help="global ranks: workers first (servers on the last node under torchrun) or roles first")
    _flag(g, "threads", type=int, help="torch threads per process (default 1; 0: torch's default)")
    _flag(g, "slow", help="emulate slow workers: worker:K=F[,worker:J=G]")
    _flag(g, "net", help="emulate the network: bandwidth=100mbit,latency=2ms")
    _flag(g, "kill", help="kill a process on purpose: worker:K@step=N")
    g = parser.add_argument_group("data and model")
    _flag(g, "dataset", help="digits, mnist1d, teacher, text, sparse, mnist, cifar10 or pkg.module:factory")
    _flag(g, "data-dir", help="folder with local dataset files (mnist, cifar10, text)")
    _flag(g, "num-samples", type=int, help="samples to generate for generated datasets")
    _flag(g, "model", help="mlp, cnn, lm, logreg, towers, deep-mlp or pkg.module:factory")
    _flag(g, "hidden", type=int, help="hidden width (default 128)")
    _flag(g, "dtype", choices=["float32", "float64"], help="parameter and input type (default float32)")
    g = parser.add_argument_group("model parallelism")
    _flag(g, "stages", type=int, help="cut each replica's model into K stages, one process each (default 1)")
    _flag(g, "partition", choices=["uniform", "params", "time", "manual"],
          help="how the cut is chosen: equal node counts, balanced parameters (default), profiled time, or "
               "--split-points")
    _flag(g, "split-points", metavar="NAME[,NAME...]",
          help="--partition manual: fx node or module names, each starting a stage (under --schedule "
               "interleaved a model chunk: K x V - 1 names)")
    _flag(g, "stage-memory", metavar="SIZE", help="bytes each stage's process may hold, e.g. 2GB or 512MB")
    _flag(g, "tensor-parallel", type=int, metavar="T",
          help="split each stage's large Linear and Conv layers across T processes (default 1)")
    _flag(g, "microbatches", type=int, metavar="M",
          help="pipeline the stages: each replica's batch in M micro-batches (default 1, no pipeline)")
    _flag(g, "schedule", choices=list(PIPELINE_SCHEDULES),
          help="the order each stage runs its micro-batches' forwards and backwards (default 1f1b); zb-h1 "
               "splits each backward into input and weight gradients; pipedream is asynchronous (no flush, "
               "a step per batch, weight stashing)")
    _flag(g, "chunks", type=int, metavar="V",
          help="--schedule interleaved: model chunks per process (at least 2), the model cut into K x V stages")
    _flag(g, "vertical-sync", action="store_const", const=True,
          help="--schedule pipedream: every stage computes an input with the weights stage 0 used for it")
    g.add_argument("--no-weight-stashing", dest="weight_stashing", action="store_const", const=False,
                   help="--schedule pipedream: backpropagate with the newest weights, not the forward's "
                        "(to measure what weight stashing is for)")
    g.add_argument("--no-delay-compensation", dest="delay_compensation", action="store_const", const=False,
                   help="--schedule pipedream or pipedream-2bw: keep every stage's lr and run its forwards on "
                        "stashed weights as they are, PipeDream's plain rule (by default a stage D steps behind "
                        "divides its lr by 1 + 2D, spike-compensates its momentum and predicts its weights D "
                        "steps ahead)")
    _flag(g, "recompute", action="store_const", const=True,
          help="keep only each micro-batch's inputs and run its forward again for its backward")
    g = parser.add_argument_group("optimisation")
    _flag(g, "optimizer", choices=["sgd", "adam", "adagrad"], help="optimizer (default sgd)")
    _flag(g, "lr", type=float, help="learning rate (default 0.1)")
    _flag(g, "momentum", type=float, help="sgd momentum (default 0.9; 0 for plain SGD)")
    _flag(g, "weight-decay", type=float, help="L2 penalty (default 0)")
    _flag(g, "batch-size", type=int, help="global batch size (default 64)")
    _flag(g, "steps", type=int, help="training steps")
    _flag(g, "epochs", type=float, help="training epochs (default: one epoch or 300 steps, whichever is longer)")
    _flag(g, "time-limit", type=float, help="seconds of training")
    _flag(g, "target-accuracy", type=float, help="stop when a snapshot reaches this test accuracy (0..1)")
    _flag(g, "eval-every", type=int, help="snapshot and evaluate every N steps (default 50)")
    _flag(g, "log-every", type=int, help="log a training event every N steps (default 10)")
    _flag(g, "seed", type=int, help="seed of data order and initial model (default 0)")
    g = parser.add_argument_group("output")
    _flag(g, "out", help="run directory (default runs/<time>-<strategy>); one that holds files is refused")
    _flag(g, "overwrite", action="store_const", const=True,
          help="write into an --out that holds files, replacing the earlier run's results")
    _flag(g, "save-model", action="store_const", const=True, help="write the final model's state_dict to DIR/model.pt")
    _flag(g, "checkpoint-every", help="write a checkpoint of the whole job every N steps (100) or seconds (30s) "
                                      "into DIR/checkpoints (allreduce, ps)")
    _flag(g, "resume", metavar="RUN_DIR", help="continue the job of RUN_DIR from its newest whole checkpoint, "
                                               "into a new run directory; only the run's length and output may change")
    _flag(g, "no-report", action="store_const", const=True,
          help="no plots or index.html in the run directory (`plexus report DIR` draws them later)")
    _flag(g, "json", action="store_const", const=True, help="print the summary as JSON on the last stdout line")
    _flag(g, "quiet", action="store_const", const=True, help="no progress display")
    _flag(g, "debug", action="store_const", const=True, help="verbose logs and tracebacks")
    _flag(g, "config", help="TOML file with the same keys as the flags (flags win)")
    g.add_argument("--print-plan", dest="print_plan", nargs="?", type=int, const=0, metavar="WORLD_SIZE",
                   help="print which role each global rank plays (for WORLD_SIZE processes, or torchrun's "
                        "WORLD_SIZE, or --workers plus the strategy's roles) and exit")
    _flag(g, "print-config", action="store_const", const=True,
          help="print every effective value and its source (flag, file, default, default for ps/asp) and exit")
    _flag(g, "print-partition", action="store_const", const=True,
          help="print how --stages cuts the model (nodes, parameters, predicted time and memory, bytes "
               "crossing each cut) and exit")


# Flags of `plexus train` that say how its processes start, not what the job is.
LAUNCHER_KEYS = ("launcher", "ray_address", "ray_server_resource")


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """How ``plexus train`` starts the job's processes (``train/ray_job.py`` for Ray)."""
    g = parser.add_argument_group("launcher")
    _flag(g, "launcher", choices=["local", "ray"],
          help="local: every process on this machine (default); ray: one Ray actor per process (plexus[ray])")
    _flag(g, "ray-address", metavar="ADDR",
          help="the Ray cluster's head, HOST:PORT (default: RAY_ADDRESS, else a Ray instance on this machine)")
    _flag(g, "ray-server-resource", metavar="NAME",
          help="place servers, aggregators and the coordinator on nodes that advertise custom resource NAME")


# Flags of `plexus simulate` that describe the simulated cluster, not the job.
SIMULATE_KEYS = ("sim_workers", "sim_servers", "compute", "compute_jitter", "fail", "fail_rate", "timing_only",
                 "validate")


def add_simulate_arguments(parser: argparse.ArgumentParser, validate: bool = True) -> None:
    """The simulated cluster (``plexus/sim/cluster.py``); --net and --slow are the job's."""
    g = parser.add_argument_group("simulated cluster")
    _flag(g, "sim-workers", type=int, metavar="P", help="workers to simulate (default: --workers)")
    _flag(g, "sim-servers", type=int, metavar="S", help="parameter servers to simulate (default: --servers)")
    _flag(g, "compute", type=float, metavar="SECONDS",
          help="seconds of forward and backward per sample (default: measured here on the job's model)")
    _flag(g, "compute-jitter", metavar="DIST",
          help="random factor of mean 1 on each compute time: none (default), lognormal:CV or pareto:A")
    _flag(g, "fail", metavar="ROLE:K@t=SECONDS", help="kill a process at a simulated time, e.g. worker:3@t=2.5")
    _flag(g, "fail-rate", type=float, metavar="R", help="failures per machine-hour of every worker (default 0)")
    _flag(g, "timing-only", action="store_const", const=True, help="skip the maths: time and traffic only")
    if validate:
        _flag(g, "validate", action="store_const", const=True,
              help="train seven configurations at 2, 4 and 8 workers for real and simulated; print the errors")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="plexus", description="Distributed training under every classic architecture.",
                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"plexus {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train one job", argument_default=argparse.SUPPRESS)
    add_job_arguments(train)
    add_launcher_arguments(train)
    compare = sub.add_parser("compare", help="run several strategies on the same model, data and seed",
                             argument_default=argparse.SUPPRESS)
    compare.add_argument("specs", nargs="+", metavar="SPEC",
                         help="STRATEGY[:key=value,...], e.g. allreduce:algorithm=ring,workers=4")
    add_job_arguments(compare)
    compare.add_argument("--seeds", dest="seeds", type=int, metavar="N",
                         help="run every spec with seeds --seed, --seed+1, ..., --seed+N-1 and judge each over "
                              "them: time to best and to target, extra hyper-parameters, stability, cost (default 1)")
    compare.add_argument("--simulate", dest="simulate", action="store_true",
                         help="run every spec on the simulated cluster (plexus simulate) instead of processes")
    add_simulate_arguments(compare, validate=False)
    simulate = sub.add_parser("simulate", help="the same job on a simulated cluster: real maths, virtual time",
                              argument_default=argparse.SUPPRESS)
    add_job_arguments(simulate)
    add_simulate_arguments(simulate)
    reproduce = sub.add_parser("reproduce", help="a seed paper's experiment, simulated, with a verdict")
    reproduce.add_argument("name", nargs="?", metavar="NAME", help="the recipe (plexus reproduce --list)")
    reproduce.add_argument("--list", action="store_true", help="list the recipes and exit")
    reproduce.add_argument("--out", default="runs/reproduce", help="folder for OUT/NAME/ (default runs/reproduce)")
    reproduce.add_argument("--quick", action="store_true", help="a quarter of the steps (a smoke test, not a "
                                                                 "reproduction)")
    reproduce.add_argument("--seed", type=int, default=0, help="seed of data order and initial model (default 0)")
    report = sub.add_parser("report", help="plots and index.html from run directories")
    report.add_argument("dirs", nargs="+", metavar="DIR")
    report.add_argument("--out", default=None, help="output folder (default: the run directory)")
    worker = sub.add_parser("worker", help="join a running job as one more worker (token from PLEXUS_TOKEN)")
    worker.add_argument("--join", required=True, metavar="HOST:PORT", help="the job's rendezvous store")
    worker.add_argument("--timeout", type=float, default=None,
                        help="seconds any blocking operation of this worker waits (default: 60 until it has "
                             "joined, then the job's --timeout)")
    worker.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    server = sub.add_parser("server", help="join a running ps job as one more server: a spare that drains hand "
                                           "their shards to (token from PLEXUS_TOKEN)")
    server.add_argument("--join", required=True, metavar="HOST:PORT", help="the job's rendezvous store")
    server.add_argument("--timeout", type=float, default=None, help="seconds to wait for the job (default 60)")
    server.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    drain = sub.add_parser("drain", help="move a server's shards of a running ps job to a spare or to the next "
                                         "server, with training going on (token from PLEXUS_TOKEN)")
    drain.add_argument("join", metavar="HOST:PORT", help="the job's rendezvous store")
    drain.add_argument("--server", type=int, required=True, help="the server to drain")
    drain.add_argument("--timeout", type=float, default=None, help="seconds to wait for the move (default 60)")
    drain.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    bench = sub.add_parser("bench", help="benchmarks that print tables")
    which = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from plexus.bench import BENCHMARKS
    for name, (summary, module) in BENCHMARKS.items():
        b = which.add_parser(name, help=summary)
        _import(module).add_arguments(b)
    return parser


def _version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    from importlib import metadata
    try:
        return metadata.version("plexus")
    except metadata.PackageNotFoundError:
        from plexus import __version__
        return __version__


def _import(module: str):
    import importlib
    return importlib.import_module(module)


def _load_toml(path: str) -> dict[str, Any]:
    from plexus.errors import ConfigError
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist: pass an existing --config FILE") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a directory, not a TOML file: pass --config FILE, e.g. "
                          f"--config {os.path.join(path, 'job.toml')}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror}): pass a readable --config FILE") \
            from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def job_config(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    """Defaults < TOML file < flags < ``extra`` (a compare spec); each value keeps its
    source (file, flag, spec) and the keys left unset take their strategy's defaults."""
    from plexus.config import JobConfig
    from plexus.errors import ConfigError
    flat = vars(args).copy()
    if "replicas" in flat:  # --replicas R is --workers R (the replicas of --stages K)
        replicas = flat.pop("replicas")
        if flat.get("workers", replicas) != replicas:
            raise ConfigError(f"--replicas {replicas} and --workers {flat['workers']} name the same count (model "
                              f"replicas, the workers of --stages K): pass one of them")
        flat["workers"] = replicas
    for key in ("command", "specs", "seeds", "simulate", "config", "print_config", "print_plan", "print_partition",
                *LAUNCHER_KEYS, *SIMULATE_KEYS):
        flat.pop(key, None)
    merged = _load_toml(args.config) if getattr(args, "config", None) else {}
    merged = {k.replace("-", "_"): v for k, v in merged.items()}
    sources = {k: "file" for k in merged}
    merged.update(flat)
    sources.update({k: "flag" for k in flat})
    merged.update(extra or {})
    sources.update({k: "spec" for k in extra or {}})
    if merged.get("resume"):
        from plexus.train.checkpoint import resumed_config
        return resumed_config(merged)
    if extra is not None:
        # compare: a flag shared by every spec applies to the specs whose strategy reads
        # it; the others leave it out (a spec's own key that does not apply is an error).
        from plexus.config.applies import drop_inapplicable
        drop_inapplicable(str(merged.get("strategy", "allreduce")), merged, sources)
    return JobConfig.from_flat(merged, sources)


def _print_config(cfg) -> None:
    """``--print-config``: every effective value and its source, by component. Keys that
    do not apply to the strategy (``config/applies.py``, the table that refuses them when
    set) show ``n/a`` and the strategies they apply to."""
    import dataclasses
    from plexus.config.applies import applies, applies_to
    settings = cfg.settings()
    width = max(map(len, settings))
    strategy = cfg.strategy.strategy
    for comp in ("strategy", "optim", "cluster", "data", "model", "parallel", "run"):
        print(f"[{comp}]")
        for f in dataclasses.fields(getattr(cfg, comp)):
            item = settings[f.name]
            if applies(f.name, strategy):
                source = item["source"]
                if f.name == "algorithm" and item["value"] == "native" and source.startswith("default"):
                    source += f" ({_DEFAULT_ALGORITHM})"
                print(f"  {f.name:<{width}}  {json.dumps(item['value']):<24}  {source}")
            else:
                users = f"applies to {', '.join(applies_to(f.name))}"
                if not item["source"].startswith("default"):  # the user set it: training refuses it
                    users = f"{item['source']} {json.dumps(item['value'])}, refused: {users}"
                print(f"  {f.name:<{width}}  {'n/a':<24}  {users}")


class _Progress:
    """Progress of a running job on stderr (``plexus.train.progress``): the start-up phase
    (spawning, rendezvous, first step), then step, the job's samples/s (summed over
    workers, as in summary.json), loss, test accuracy, elapsed and ETA.

    On a terminal it is one live line (rich). Elsewhere (a pipe, a log file, CI) it is plain
    lines: one per start-up phase, then one every ``every`` seconds (5, or
    ``PLEXUS_PROGRESS_EVERY``), so a long job is never silent."""

    def __init__(self, live: bool, time_limit: float | None = None, every: float | None = None) -> None:
        self.time_limit = time_limit
        self.every = every if every is not None else float(os.environ.get("PLEXUS_PROGRESS_EVERY") or 5.0)
        self.live = None
        if live:
            from rich.console import Console
            from rich.live import Live
            self.live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
        self.tail = None
        self.started, self.last, self.printed, self.phase = time.monotonic(), 0.0, 0.0, None

    def __enter__(self) -> "_Progress":
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def poll(self, run_dir: Path, probe=None) -> None:
        from plexus.train.progress import MetricsTail, describe
        now = time.monotonic()
        if now - self.last < 0.25:  # the launcher calls about 20 times a second
            return
        self.last = now
        if self.tail is None or self.tail.run_dir != run_dir:
            self.tail = MetricsTail(run_dir)
        snap = self.tail.read()
        elapsed = now - self.started
        if not snap.seen:
            phase = probe.phase() if probe is not None else None
            if phase is None:
                return
            text = f"start-up: {phase}"
            # Off a terminal: a line when the phase changes (not when only its count does),
            # and every `every` seconds while it lasts.
            if self.live is None and (phase.split(":")[0] == (self.phase or "").split(":")[0]
                                      and now - self.printed < self.every):
                return
            self.phase = phase
        else:
            text = describe(snap, elapsed, probe.total() if probe is not None else None, self.time_limit)
            if self.live is None and now - self.printed < self.every:
                return
        if self.live is not None:
            self.live.update(f"{text}  [{elapsed:.1f} s]" if not snap.seen else text)
        else:
            self.printed = now
            print(f"plexus: {text}" + (f"  [{elapsed:.1f} s]" if not snap.seen else ""), file=sys.stderr,
                  flush=True)


def _train(args: argparse.Namespace) -> int:
    from plexus.errors import ConfigError
    cfg = job_config(args)  # before torch's import (seconds): bad input fails at once
    from plexus.train.job import run_local, run_torchrun
    if getattr(args, "print_config", False):
        _print_config(cfg)
        return 0
    if getattr(args, "print_plan", None) is not None:
        _print_plan(cfg, args.print_plan or int(os.environ.get("WORLD_SIZE", "0")))
        return 0
    if getattr(args, "print_partition", False):
        _print_partition(cfg)
        return 0
    launcher = getattr(args, "launcher", "local")
    if launcher != "ray":
        for key in LAUNCHER_KEYS[1:]:
            if hasattr(args, key):
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"{flag} applies to --launcher ray only: pass --launcher ray, or drop {flag}")
    under_torchrun = "RANK" in os.environ and "PLEXUS_ROLE" not in os.environ
    if launcher == "ray" and cfg.parallel.partitioned:
        raise ConfigError(f"{cfg.parallel.flags} with --launcher ray is not supported yet: drop "
                          f"--launcher ray (the local launcher runs the stages)")
    if launcher == "ray":
        if under_torchrun:
            raise ConfigError("--launcher ray starts the job's processes itself, and this one was started by "
                              "torchrun (RANK is set): run plexus train --launcher ray once, outside torchrun")
        from plexus.train.ray_job import RayOptions, run_ray
        options = RayOptions(address=getattr(args, "ray_address", None),
                             server_resource=getattr(args, "ray_server_resource", None))
        if cfg.run.quiet:
            run_dir, summary = run_ray(cfg, options)
        else:
            with _Progress(live=sys.stderr.isatty(), time_limit=cfg.run.time_limit) as progress:
                run_dir, summary = run_ray(cfg, options, poll=progress.poll)
        _print_summary(summary, run_dir, cfg.run.json)
        return 0
    if under_torchrun:
        summary = run_torchrun(cfg)
        if summary is not None:
            _print_summary(summary, cfg.run.out or "", cfg.run.json)
        return 0
    if cfg.run.quiet:
        run_dir, summary = run_local(cfg)
    else:
        # Progress everywhere: a live line on a terminal, plain lines in a pipe or a log.
        with _Progress(live=sys.stderr.isatty(), time_limit=cfg.run.time_limit) as progress:
            run_dir, summary = run_local(cfg, poll=progress.poll)
    _print_summary(summary, str(run_dir), cfg.run.json)
    return 0


def _refuse_stages(cfg) -> None:
    """--stages K > 1 plans a cut (--print-partition), and plexus train and compare run
    it (parallel/executor.py); the simulator does not run a cut model yet."""
    from plexus.errors import ConfigError
    if cfg.parallel.partitioned:
        raise ConfigError(f"{cfg.parallel.flags}: the simulator does not run a cut model yet; pass "
                          f"--print-partition to see the plan, or --stages 1 to simulate the whole model per worker")


def _print_partition(cfg) -> None:
    """``plexus train --stages K --print-partition``: the plan of plexus.parallel.partition
    for the configured model and dataset, at each replica's slice of the batch."""
    import torch
    from plexus.parallel.executor import make_plan
    from plexus.parallel.partition import format_plan
    from plexus.strategies.base import make_optimizer
    from plexus.train.data import load_dataset
    from plexus.train.models import build_model
    data = load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, data)
    if cfg.model.dtype == "float64":
        data, model = data.to_dtype(torch.float64), model.double()
    batch = max(1, cfg.run.batch_size // cfg.cluster.workers)
    threads = torch.get_num_threads()
    if cfg.cluster.threads:  # profile with the threads each stage's process will have
        torch.set_num_threads(cfg.cluster.threads)
    try:  # the plan the run makes: under time, priced on its own stage programs
        graph, plan = make_plan(cfg, model, data.x_train[:batch],
                                optimizer=lambda params: make_optimizer(params, cfg.optim))
    finally:
        torch.set_num_threads(threads)
    stages, chunks = cfg.parallel.stages, cfg.parallel.chunks
    what = f"{plan.stages} stage{'s' * (plan.stages > 1)}" if chunks == 1 else \
        f"{plan.stages} model chunks ({stages} processes, process s running chunks s, {stages} + s, ...)"
    print(f"{cfg.model.model} on {cfg.data.dataset}: {what} by --partition {plan.method}, "
          f"{len(graph.compute)} computing nodes, batch {batch} per replica")
    print(format_plan(plan, graph))
    shards = cfg.parallel.tensor_parallel
    if shards > 1:  # each stage's layers split inside, as its T processes will hold them
        from plexus.parallel.executor import stage_examples
        from plexus.parallel.stages import build_stages
        from plexus.parallel.tensor import format_tensor_plan, plan_tensor_split, predict_traffic
        programs = build_stages(graph, plan)
        for program, example in zip(programs, stage_examples(programs, data.x_train[:batch])):
            split = plan_tensor_split(program.module, shards, example)
            traffic = predict_traffic(split, batch, shards)
            print(f"\n{'model chunk' if chunks > 1 else 'stage'} {program.index}, --tensor-parallel {shards}: "
                  f"{traffic['messages']} messages, "
                  f"{traffic['bytes']:,} bytes per process per step in its shards' collectives")
            print(format_tensor_plan(split))


def _print_plan(cfg, world_size: int) -> None:
    """``plexus train --print-plan [N]``: the role of every global rank (train/plan.py)."""
    from plexus.train.plan import format_plan, plan_for_world, role_plan
    if world_size:
        cfg, slots = plan_for_world(cfg, world_size)
    else:
        slots = role_plan(cfg)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    print(f"{cfg.strategy.strategy}: {len(slots)} processes, {cfg.cluster.workers} workers, "
          f"--place {cfg.cluster.place}")
    print(format_plan(slots, per_node, cfg.parallel.stages, cfg.parallel.tensor_parallel))


def _summary_line(summary: dict[str, Any]) -> str:
    """The final line, with the figures of ``plexus.train.metrics.FIGURES``: steps say whose
    (global, or every worker's summed), samples/s is the job's (summed over workers), bytes
    are MiB (2**20), and a target that was reached says so with the final accuracy when it
    fell back below."""
    acc, loss = summary.get("final_test_accuracy"), summary.get("final_test_loss")
    ttt, target = summary.get("time_to_target_seconds"), summary.get("target_accuracy")
    steps, per = summary.get("steps"), summary.get("steps_per_worker") or []
    if summary.get("steps_kind") == "worker" and len(per) > 1:
        each = sorted({p for p in per if p is not None})
        span = "–" if not each else str(each[0]) if len(each) == 1 else f"{each[0]}-{each[-1]}"
        steps_text = f"{steps} worker steps ({span} per worker)"
    else:
        steps_text = f"{steps} steps"
    line = (f"final test accuracy {'–' if acc is None else f'{100 * acc:.2f}%'}  "
            f"loss {'–' if loss is None else f'{loss:.4f}'}  {steps_text} in {summary['wall_seconds']:.1f} s "
            f"({summary['samples_per_second'] or 0:,.0f} samples/s, all workers)")
    sent = summary.get("bytes_sent_total")
    if sent:
        line += f"  {sent / 2**20:,.2f} MiB sent"
    if ttt is not None:
        goal = f"target {100 * target:g}%" if target is not None else "target"
        line += f"  {goal} reached at {ttt:.1f} s"
        if target is not None and acc is not None and acc < target:
            line += f" (final {100 * acc:.2f}%)"
    elif target is not None:
        line += f"  target {100 * target:g}% not reached"
    return line


def _warn_health(summary: dict[str, Any]) -> None:
    """One line on stderr when the run stalled or diverged, with the hint."""
    if summary.get("health") in (None, "ok"):
        return
    where = ""
    if summary.get("diverging_workers"):
        where = f" on worker(s) {', '.join(map(str, summary['diverging_workers']))}"
    print(f"warning: training {summary['health']}{where} (detected at step {summary['health_step']}): "
          f"{summary['health_hint']}", file=sys.stderr)


def _print_summary(summary: dict[str, Any], run_dir: str, as_json: bool) -> None:
    print(_summary_line(summary))
    if summary.get("ledger_verdict"):  # --ledger: the run's own check of every push
        print(summary["ledger_verdict"])
    _warn_health(summary)
    print(f"run directory: {run_dir}")
    if as_json:
        print(json.dumps({**summary, "run_dir": run_dir}))


def _literal(text: str) -> Any:
    """A spec value as the type it reads as: true/false, int, float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> dict[str, Any]:
    """``allreduce:algorithm=ring,workers=4`` -> {"strategy": "allreduce", "algorithm": "ring", "workers": 4}."""
    from plexus.errors import ConfigError
    strategy, _, rest = spec.partition(":")
    out: dict[str, Any] = {"strategy": strategy.strip()}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"compare spec {spec!r}: {part!r} must be key=value")
        out[key.strip().replace("-", "_")] = _literal(value.strip())
    return out


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text)


def _compare(args: argparse.Namespace) -> int:
    """Run every spec on the same model, data and seed; one table, one report.

    Every spec is built and validated (``plexus.train.job.validate``) before any trains, so
    a bad one costs nothing. A spec that fails while training becomes a failed row with
    its error and the others go on; the status is then 1.

    With ``--seeds N`` (N > 1) each spec runs with seeds --seed (or the spec's own seed),
    +1, ..., +N-1, into ``OUT/NN-spec/seed-S``, and the table judges each spec over its
    seeds (``plexus.report.judging``) instead of listing the runs.
    """
    from plexus.errors import ConfigError, PlexusError
    from plexus.report import write_report
    from plexus.train.job import run_local, validate
    seeds = getattr(args, "seeds", 1)
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}: pass --seeds 3 to run every spec with 3 seeds")
    simulated = getattr(args, "simulate", False)
    sim_flags = [f"--{k.replace('_', '-')}" for k in SIMULATE_KEYS if k in vars(args)]
    if sim_flags and not simulated:
        raise ConfigError(f"{', '.join(sim_flags)} describe a simulated cluster: add --simulate, or drop them")
    if simulated:
        _sim_workers(vars(args))
    base = job_config(args)
    root = Path(base.run.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    if base.run.out:  # the runs go into sub-directories of --out: refuse an earlier compare's
        from plexus.train.preflight import check_run_dir
        check_run_dir(root, base.run.overwrite)
    jobs: list[tuple[int, str, Any]] = []  # (spec number, spec, config) of every run, spec by spec
    for i, text in enumerate(args.specs, 1):
        try:
            spec = parse_spec(text)
            folder = root / f"{i:02d}-{_slug(text)}"
            cfgs = [job_config(args, {**spec, "out": str(folder)})]
            if seeds > 1:
                first = cfgs[0].run.seed  # --seed, or the spec's own
                cfgs = [job_config(args, {**spec, "seed": seed, "out": str(folder / f"seed-{seed}")})
                        for seed in range(first, first + seeds)]
            if simulated:
                _refuse_stages(cfgs[0])
                from plexus.sim.run import check
                check(cfgs[0], _sim_spec(cfgs[0], vars(args)))
            else:
                validate(cfgs[0])  # the other seeds differ in the seed only, which cfgs checked
        except ConfigError as exc:
            raise ConfigError(f"compare spec {i} {text!r}: {exc} (nothing was trained)") from None
        jobs.extend((i, text, cfg) for cfg in cfgs)
    _shared_flags_apply(base, [cfg for _, _, cfg in jobs])
    rows: list[tuple[str, Path, dict[str, Any], str | None]] = []
    for n, (i, text, cfg) in enumerate(jobs, 1):
        what = text if seeds == 1 else f"{text} (seed {cfg.run.seed})"
        print(f"== [{n}/{len(jobs)}] {what}", file=sys.stderr)
        try:
            run_dir, summary = _simulate_one(cfg, vars(args)) if simulated else run_local(cfg)
            rows.append((text, run_dir, summary, None))
        except PlexusError as exc:
            print(f"plexus: spec {what!r} failed: {exc}; going on with the others", file=sys.stderr)
            rows.append((text, Path(cfg.run.out), {"status": "failed", "error": str(exc)}, str(exc)))
        except KeyboardInterrupt:
            print(f"plexus: interrupted during spec {what!r}; the table covers the runs that finished",
                  file=sys.stderr)
            rows.append((text, Path(cfg.run.out), {"status": "failed", "error": "interrupted"}, "interrupted"))
            break
    # Each spec's runs (its seeds), in spec order: what the judging table judges.
    groups = [(text, [d for (k, _, _), (_, d, _, _) in zip(jobs, rows) if k == i])
              for i, text in enumerate(args.specs, 1)]
    groups = [(text, dirs) for text, dirs in groups if dirs]
    html = write_report([d for _, d, _, _ in rows], root, title="plexus compare",
                        errors={d: err for _, d, _, err in rows if err is not None},
                        configurations=groups if seeds > 1 else None)
    judged = None
    if seeds == 1:
        _print_compare(rows)
    else:
        judged = _print_judging(groups, {d: err for _, d, _, err in rows if err is not None})
    print(f"report: {html}")
    if base.run.json:
        runs = [{**s, "spec": spec, "run_dir": str(d)} for spec, d, s, _ in rows]
        print(json.dumps(runs if judged is None else {"configurations": [j.to_dict() for j in judged],
                                                      "runs": runs}))
    failed = [spec for spec, _, _, err in rows if err is not None]
    if failed:
        what = "specs" if seeds == 1 else "runs"
        print(f"plexus: {len(failed)} of {len(jobs)} {what} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _shared_flags_apply(base, configs) -> None:
    """A flag given to compare for every spec must apply to at least one of them (it is left
    out of the specs whose strategy ignores it: ``job_config``), or it does nothing."""
    from plexus.config.applies import APPLIES, applies, check_applies
    from plexus.errors import ConfigError
    strategies = sorted({c.strategy.strategy for c in configs})
    for key in APPLIES:
        if base.source(key) in ("flag", "file") and not any(applies(key, s) for s in strategies):
            try:
                check_applies(strategies[0], base.to_flat(), {key: base.source(key)})
            except ConfigError as exc:
                raise ConfigError(f"{exc} (no spec of this compare runs one: {', '.join(strategies)})") from None


def _print_compare(rows: Sequence[tuple[str, Path, dict[str, Any], str | None]]) -> None:
    """The comparison as a table ranked like the report, with labels that show every knob
    that applies and differs. Off a terminal the table takes the width it needs, so no
    label is ever cut; on one, long labels wrap."""
    from rich.console import Console
    from rich.table import Table
    from plexus.report import load_run, run_labels
    from plexus.report.analysis import mib, rank
    runs = [load_run(d, error=err) for _, d, _, err in rows]
    labels = run_labels(runs)
    ranked = {r.index: r for r in rank([r.summary for r in runs], [r.config for r in runs], [r.events for r in runs])}
    target = next(iter(ranked.values())).target if ranked else None
    # Off a terminal the title goes on its own line: rich centres it over the widest row.
    table = Table(title="plexus compare" if sys.stdout.isatty() else None)
    if not sys.stdout.isatty():
        print("plexus compare")
    heads = ("place", "#", "run", "spec", "health", "test acc", "wall s", "samples/s",
             f"time to {target:.0%} s" if target is not None else "time to target s", "MiB sent/worker")
    for col in heads:
        left = col in ("run", "spec", "health")
        table.add_column(col, justify="left" if left else "right", overflow="fold" if left else "ellipsis",
                         no_wrap=not left)
    for i in sorted(ranked, key=lambda k: ranked[k].place):
        spec, _, s, err = rows[i]
        r = ranked[i]
        if err is not None:
            health = "[bold red]FAILED[/]"
        else:
            health = s.get("health", "ok")
            health = health if health == "ok" else f"[bold red]{health.upper()}[/]"
        acc, own = s.get("final_test_accuracy"), s.get("worker0_test_accuracy")
        acc_text = "–" if acc is None else f"{100 * acc:.2f}%"
        if own is not None:
            acc_text += f" / {100 * own:.2f}% w0"  # averaged model / worker 0's replica
        ttt = r.time_to_target
        ttt_text = "–" if ttt is None else f"{ttt:.2f}"
        if ttt is not None and acc is not None and target is not None and acc < target:
            ttt_text += f" (final {100 * acc:.2f}%)"
        # Lost workers have no byte count (None): average over those that reported.
        per = [b for b in s.get("bytes_sent_per_worker") or [] if b is not None]
        wall, rate = s.get("wall_seconds"), s.get("samples_per_second")
        table.add_row(str(r.place), str(i + 1), labels[i], spec, health if err is None else f"{health} {err}",
                      acc_text, "–" if wall is None else f"{wall:.2f}", "–" if rate is None else f"{rate:,.0f}",
                      ttt_text, f"{mib(sum(per) / len(per)):.2f}" if per else "–")
    # Off a terminal rich would fold the table into 80 columns; give it all it needs.
    console = Console()
    if not sys.stdout.isatty():
        from rich.measure import Measurement
        wide = Console(width=100_000)
        console = Console(width=Measurement.get(wide, wide.options, table).maximum)
    console.print(table)
    for i in sorted(ranked, key=lambda k: ranked[k].place):
        print(f"  {ranked[i].place}. #{i + 1} {labels[i]}: {ranked[i].why}")


def _print_judging(groups: Sequence[tuple[str, Sequence[Path]]], errors: dict[Path, str]) -> list[Judged]:
    """The judging table of ``compare --seeds N`` (``plexus.report.judging``), best first,
    then each configuration's reason; returns the judged configurations. Off a terminal
    the table takes the width it needs, as ``_print_compare``'s does."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    from plexus.report import load_run
    from plexus.report.judging import TABLE_HEAD, judge, table_cells, target_heading
    judged = judge([(text, [load_run(d, error=errors.get(d)) for d in dirs]) for text, dirs in groups])
    table = Table(title="plexus compare: judging" if sys.stdout.isatty() else None)
    if not sys.stdout.isatty():
        print("plexus compare: judging")
    for name, _ in TABLE_HEAD:
        left = name == "configuration"
        table.add_column(target_heading(judged) if name == "time to target s" else name,
                         justify="left" if left else "right", overflow="fold" if left else "ellipsis", no_wrap=not left)
    for j in judged:
        table.add_row(*(Text(text) for text, _ in table_cells(j)))  # a spec's brackets are not markup
    console = Console()
    if not sys.stdout.isatty():
        from rich.measure import Measurement
        wide = Console(width=100_000)
        console = Console(width=Measurement.get(wide, wide.options, table).maximum)
    console.print(table)
    for j in judged:
        print(f"  {j.place}. {j.name}: {j.why}")
    return judged


def _job_store(args: argparse.Namespace, who: str, role: str = "worker"):
    """The store of the running job at ``args.join`` (HOST:PORT), reached with the token in
    PLEXUS_TOKEN within ``args.timeout`` (60 s when not given); returns (store, host, port, token)."""
    from plexus.cluster.rendezvous import ProcessInfo, await_listener, connect_store
    from plexus.errors import ConfigError
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    timeout = 60.0 if args.timeout is None else args.timeout
    host, _, port = args.join.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--join must be HOST:PORT, got {args.join!r}: pass the address of the job's store, "
                          f"e.g. --join 127.0.0.1:29500")
    token = os.environ.get("PLEXUS_TOKEN")
    if not token:
        raise ConfigError(f"PLEXUS_TOKEN is not set: {who} needs the job's token; export the PLEXUS_TOKEN the job "
                          f"was started with")
    # Nothing may wait past --timeout, nor print c10d's retries: check that a store listens.
    await_listener(host, int(port), timeout, "start the ps job first, and pass the host and --port it was "
                   "started with (e.g. plexus train --strategy ps --port 29500)")
    probe = ProcessInfo(role=role, rank=-1, world_size=0, master_addr=host, master_port=int(port), token=token)
    return connect_store(probe, timeout), host, int(port), token


def _ps_job(store, address: str, timeout: float):
    """The running ps job's configuration (ConfigError for another strategy's job)."""
    from plexus.config import JobConfig
    from plexus.errors import ConfigError
    from plexus.strategies.downpour import DownpourStrategy
    from plexus.train.job import JOB_KEY
    if store.check([JOB_KEY]) and json.loads(store.get(JOB_KEY).decode())["strategy"] != "ps":
        raise ConfigError(f"the job at {address} does not run --strategy ps: only a parameter server's group "
                          f"takes servers that join or drain")
    return JobConfig.from_dict(DownpourStrategy.job_record(store, timeout)["config"])


def _server(args: argparse.Namespace) -> int:
    """``plexus server --join HOST:PORT``: one more server for a running ``ps`` job. It
    waits as a spare: a drain hands it the shards of the server that leaves (two phases:
    copy, then switch), and it serves them until the job ends."""
    from plexus.cluster.traffic import Traffic
    from plexus.ps.server import KEYS
    from plexus.ps.server_group import ServerGroup
    store, _, _, _ = _job_store(args, "a server that joins", role="server")
    cfg = _ps_job(store, args.join, args.timeout or 60.0)
    if store.check([KEYS.drained(0)]):
        from plexus.errors import ConfigError
        raise ConfigError("the job has already finished: its servers drained; start a new job")
    index = max(1, cfg.cluster.servers) + int(store.add(KEYS.spares, 1)) - 1
    print(f"plexus: joined the job at {args.join} as server {index}, a spare", file=sys.stderr)
    group = ServerGroup(store, index, cfg, Traffic(), log=None)
    group.wait_for_the_job()
    group.finish()
    print(f"plexus: server {index} finished", file=sys.stderr)
    return 0


def _drain(args: argparse.Namespace) -> int:
    """``plexus drain HOST:PORT --server S``: ask server S of a running ps job to hand its
    shards over, and wait until they have moved."""
    from plexus.errors import CommTimeout, ConfigError
    from plexus.ps.replication import owner_of
    from plexus.ps.server import KEYS
    store, _, _, _ = _job_store(args, "a drain")
    cfg = _ps_job(store, args.join, args.timeout or 60.0)
    servers = max(1, cfg.cluster.servers) + int(store.add(KEYS.spares, 0))
    if not 0 <= args.server < servers:
        raise ConfigError(f"--server must name one of the job's {servers} servers (0 to {servers - 1}), got "
                          f"{args.server}")
    shards = [s for s in range(max(1, cfg.cluster.servers)) if owner_of(store, s) == args.server]
    store.set(KEYS.draining(args.server), "1")
    deadline = time.monotonic() + (args.timeout or 60.0)
    while any(owner_of(store, s) == args.server for s in shards):
        if time.monotonic() > deadline:
            raise CommTimeout(f"server {args.server} did not hand its shards over within {args.timeout or 60.0:g} s")
        time.sleep(0.05)
    moved = ", ".join(f"shard {s} to server {owner_of(store, s)}" for s in shards) or "no shard (it held none)"
    print(f"plexus: server {args.server} drained: {moved}", file=sys.stderr)
    return 0


def _worker(args: argparse.Namespace) -> int:
    """``plexus worker --join HOST:PORT``: one more worker for a running ``ps``,
    ``sandblaster`` or ``allreduce --elastic`` job. It reads
    the job's configuration from the store, takes the next free rank, and trains as the
    job's workers do, from the current weights."""
    import dataclasses
    from plexus.cluster.rendezvous import ProcessInfo
    from plexus.config import JobConfig
    from plexus.errors import ConfigError
    from plexus.strategies.allreduce import AllReduceStrategy
    from plexus.strategies.downpour import DownpourStrategy
    from plexus.strategies.sandblaster import SandblasterStrategy
    from plexus.train.data import load_dataset
    from plexus.train.runner import worker_main
    given = args.timeout
    store, host, port, token = _job_store(args, "a worker that joins")
    args.timeout = 60.0 if given is None else given
    from plexus.train.job import JOB_KEY
    joinable = {"ps": DownpourStrategy, "sandblaster": SandblasterStrategy, "allreduce": AllReduceStrategy}
    strategy = DownpourStrategy
    if store.check([JOB_KEY]):  # written by the launcher of every job (plexus train)
        job = json.loads(store.get(JOB_KEY).decode())
        if job["strategy"] not in joinable or (job["strategy"] == "allreduce" and not job.get("elastic")):
            raise ConfigError(f"the job at {args.join} runs strategy {job['strategy']}"
                              f"{' without --elastic' if job['strategy'] == 'allreduce' else ''}, which admits no "
                              f"workers after the start: joining works for --strategy ps jobs with --consistency "
                              f"asp, ssp or softsync, for sandblaster, and for allreduce --elastic; start such a job "
                              f"to add workers to it")
        strategy = joinable[job["strategy"]]
    record = strategy.job_record(store, args.timeout)
    cfg = JobConfig.from_dict(record["config"])
    if given is not None:  # this worker's own waits; the job's other processes keep theirs
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, timeout=given))
    rank = strategy.admit(store, cfg)
    info = ProcessInfo(role="worker", rank=rank, world_size=cfg.cluster.workers, master_addr=host,
                       master_port=port, token=token)
    run_dir = Path(record["run_dir"]) if record["run_dir"] and Path(record["run_dir"]).is_dir() else None
    print(f"plexus: joined the job at {args.join} as worker {rank}", file=sys.stderr)
    worker_main(cfg, info, store, run_dir, load_dataset(cfg.data, cfg.run.seed))
    print(f"plexus: worker {rank} finished", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    from plexus.errors import ConfigError
    from plexus.report import write_report
    try:
        html = write_report(args.dirs, args.out)
    except OSError as exc:  # an --out (or run directory) this user cannot write
        where = exc.filename or args.out or args.dirs[0]
        raise ConfigError(f"cannot write the report to {str(where)!r} ({exc.strerror or exc}): pass --out DIR "
                          f"with a folder you can write") from None
    print(f"report: {html}")
    return 0


def _run_simulation(cfg, given: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """Simulate job ``cfg`` on the cluster of ``given``'s flags into its run directory
    (summary, metrics, report); returns the directory and the summary."""
    from plexus.sim.run import simulate
    from plexus.train.job import _write_report, prepare_run_dir, warn_risks
    run_dir = prepare_run_dir(cfg)
    warn_risks(cfg)  # as plexus train says them: the values set that are risky here
    summary = simulate(cfg, _sim_spec(cfg, given), run_dir)
    _write_report(cfg, run_dir)
    return run_dir, summary


def _simulate_one(cfg, given: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """One compare spec on the simulated cluster; a simulated job that failed (a process
    killed by --fail) fails the spec."""
    from plexus.errors import JobFailed
    run_dir, summary = _run_simulation(cfg, given)
    if summary["status"] != "completed":
        raise JobFailed(f"the simulated job failed: {summary['error']}")
    return run_dir, summary


def _sim_workers(given: dict[str, Any]) -> None:
    """``--sim-workers`` and ``--sim-servers`` become the job's workers and servers (batch
    shares, softsync's N and the role plan follow them)."""
    from plexus.errors import ConfigError
    if given.get("sim_workers", 1) < 1:
        raise ConfigError(f"--sim-workers must be at least 1, got {given['sim_workers']}: pass --sim-workers 1000 "
                          f"for example")
    if given.get("sim_servers", 0) < 0:
        raise ConfigError(f"--sim-servers must be non-negative, got {given['sim_servers']}")
    for flag, key in (("sim_workers", "workers"), ("sim_servers", "servers")):
        if flag in given:
            given[key] = given[flag]


def _sim_spec(cfg, given: dict[str, Any]):
    """The simulated cluster of job ``cfg`` from ``plexus simulate``'s own flags."""
    from plexus.sim.cluster import ComputeModel, SimSpec, network_of, parse_fail
    return SimSpec(workers=cfg.cluster.workers, servers=cfg.cluster.servers,
                   compute=ComputeModel(per_sample=given.get("compute"), jitter=given.get("compute_jitter") or "none"),
                   network=network_of(cfg.cluster.net), failures=parse_fail(given.get("fail") or ""),
                   fail_rate=given.get("fail_rate") or 0.0, timing_only=bool(given.get("timing_only")))


def _simulate(args: argparse.Namespace) -> int:
    """``plexus simulate``: the job's flags plus the cluster's; a run directory marked simulated."""
    from plexus.sim.run import check
    given = vars(args)
    if given.get("validate"):
        from plexus.errors import ConfigError
        from plexus.sim.validate import DEFAULT_NET, VALIDATE_TAKES, table, validate
        other = [f"--{k.replace('_', '-')}" for k in given
                 if k not in ("command", "validate", "debug", *VALIDATE_TAKES)]
        if other:
            takes = ", ".join(f"--{k}" for k in VALIDATE_TAKES)
            raise ConfigError(f"{', '.join(other)} {'does' if len(other) == 1 else 'do'} not apply to --validate, "
                              f"which trains its own configurations at 2, 4 and 8 workers on digits: drop "
                              f"{'it' if len(other) == 1 else 'them'} (it takes {takes})")
        out = Path(given.get("out") or f"runs/validate-{time.strftime('%Y%m%d-%H%M%S')}")
        net = given.get("net", DEFAULT_NET)
        quiet = bool(given.get("quiet"))
        rows, calibration = validate(out, steps=given.get("steps") or 150, net=None if net == "none" else net,
                                     device=given.get("device", "auto"),
                                     echo=(lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr)))
        print(table(rows, calibration))
        return 0
    _sim_workers(given)
    cfg = job_config(args)
    _refuse_stages(cfg)
    check(cfg, _sim_spec(cfg, given))  # before the run directory is made
    run_dir, summary = _run_simulation(cfg, given)
    acc = summary["final_test_accuracy"]
    said = f"final test accuracy {acc:.2%}  " if acc is not None else ""
    print(f"simulated {summary['workers']} workers: {said}{summary['steps']} steps in "
          f"{summary['wall_seconds']:.3f} simulated s ({summary['sim']['real_seconds']:.1f} s real, "
          f"{summary['sim']['events']:,} events)  {summary['bytes_sent_total'] / 2**20:,.2f} MiB sent")
    if summary["status"] != "completed":
        print(f"plexus: the simulated job failed: {summary['error']}", file=sys.stderr)
    _warn_health(summary)
    print(f"run directory: {run_dir}")
    if cfg.run.json:
        print(json.dumps(summary))
    return 0 if summary["status"] == "completed" else 1


def _reproduce(args: argparse.Namespace) -> int:
    """``plexus reproduce NAME``: one recipe's table, plot and verdict; ``--list`` the recipes."""
    from plexus.errors import ConfigError
    from plexus.sim.reproduce import RECIPES, run_recipe
    if args.list:
        for recipe in RECIPES.values():
            print(f"{recipe.name:22} {recipe.paper}: {recipe.claim}")
        return 0
    if not args.name:
        raise ConfigError(f"name a recipe: {', '.join(RECIPES)} (plexus reproduce --list)")
    verdict, why = run_recipe(args.name, Path(args.out), quick=args.quick, seed=args.seed)
    print(f"{args.name}: {verdict}: {why}")
    print(f"table, plot and runs: {Path(args.out) / args.name}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s")
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "plexus-mpl"))
    if not debug:
        # c10d logs a failed store or socket call as a warning with its C++ stack (20 lines)
        # before the error reaches plexus, which says in one line who was lost and where.
        # Read when torch is first imported (not yet, here); --debug keeps them.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from plexus.errors import PlexusError
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM stops plexus as Ctrl-C does (the launcher handles both while a job runs,
    # and writes its summary.json marked interrupted); not Python's silent death.
    import signal
    previous = signal.signal(signal.SIGTERM, _terminate) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "server":
            return _server(args)
        if args.command == "drain":
            return _drain(args)
        if args.command == "report":
            return _report(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "reproduce":
            return _reproduce(args)
        if args.command == "bench":
            from plexus.bench import BENCHMARKS, machine_line, reference_op_ms
            before = reference_op_ms()
            status = _import(BENCHMARKS[args.bench][1]).main(args)
            if status == 0:  # on stderr: stdout's last line is the rows under --json
                print(machine_line(before), file=sys.stderr)
            return status
    except PlexusError as exc:
        if debug:
            raise
        print(f"plexus: error: {exc}" if exc.exit_code == 2 else f"plexus: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        signum = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        print(f"plexus: interrupted by {signum.name}", file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would raise KeyboardInterrupt."""


def _terminate(signum, frame) -> None:
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
