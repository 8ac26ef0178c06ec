"""``plexus``: the command line, a thin layer over ``plexus.config`` and ``plexus.train``.

    plexus train   [flags]            train one job, write a run directory
    plexus compare SPEC... [flags]    run several strategies on the same model, data and seed
    plexus report  DIR... [--out D]   plots and index.html from run directories
    plexus worker  --join HOST:PORT   one more worker for a running ps job
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
import time
from pathlib import Path
from typing import Any, Sequence

from plexus.config import TRANSPORTS

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _flag(group, name: str, **kw) -> None:
    group.add_argument(f"--{name}", dest=name.replace("-", "_"), **kw)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job flags shared by train and compare; each maps to one config field."""
    g = parser.add_argument_group("strategy")
    _flag(g, "strategy", help="allreduce, ps, tree-ps, gossip, local-sgd, easgd")
    _flag(g, "algorithm", help="all-reduce algorithm: native, ring, ...")
    _flag(g, "bucket-mb", type=float, help="gradient bucket size in MiB (default 25)")
    _flag(g, "local-size", type=int, help="ranks per group for the hier algorithm")
    g = parser.add_argument_group("parameter server (ps, tree-ps)")
    _flag(g, "consistency", choices=["bsp", "asp", "ssp", "softsync"], help="when servers apply pushes (default asp)")
    _flag(g, "staleness", type=int, help="SSP bound in clocks (default 0)")
    _flag(g, "softsync", type=int, help="pushes averaged per update under softsync (default: workers)")
    _flag(g, "fetch-every", type=int, help="pull parameters every N steps (default 1)")
    _flag(g, "push-every", type=int, help="push accumulated gradients every N steps (default 1)")
    _flag(g, "staleness-lr", action="store_const", const=True, help="divide each push's lr by its staleness")
    _flag(g, "fanout", type=int, help="children per aggregator in tree-ps (default 2)")
    _flag(g, "variant", choices=["base", "adv", "adv-star"], help="tree-ps variant (default adv)")
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
    _flag(g, "workers", type=int, help="worker processes (default 1)")
    _flag(g, "servers", type=int, help="parameter-server processes")
    _flag(g, "host", help="address the rendezvous store binds to (default 127.0.0.1)")
    _flag(g, "port", type=int, help="rendezvous port (default 0: a free one)")
    _flag(g, "timeout", type=float, help="seconds any blocking operation waits (default 60)")
    _flag(g, "peer-timeout", type=float, help="seconds of silence before a peer is lost (default 10)")
    _flag(g, "backend", choices=["auto", "gloo", "nccl"], help="communication backend")
    _flag(g, "transport", choices=list(TRANSPORTS),
          help="point-to-point links: auto (shared memory on one machine), socket or shm")
    _flag(g, "device", choices=["auto", "cpu", "cuda"], help="compute device")
    _flag(g, "threads", type=int, help="torch threads per process (default 1; 0: torch's default)")
    _flag(g, "slow", help="emulate slow workers: worker:K=F[,worker:J=G]")
    _flag(g, "net", help="emulate the network: bandwidth=100mbit,latency=2ms")
    _flag(g, "kill", help="kill a process on purpose: worker:K@step=N")
    g = parser.add_argument_group("data and model")
    _flag(g, "dataset", help="digits, mnist1d, teacher, text, sparse, mnist, cifar10 or pkg.module:factory")
    _flag(g, "data-dir", help="folder with local dataset files (mnist, cifar10, text)")
    _flag(g, "num-samples", type=int, help="samples to generate for generated datasets")
    _flag(g, "model", help="mlp, cnn, lm, logreg or pkg.module:factory")
    _flag(g, "hidden", type=int, help="hidden width (default 128)")
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
    _flag(g, "out", help="run directory (default runs/<time>-<strategy>)")
    _flag(g, "save-model", action="store_const", const=True, help="write the final model's state_dict to DIR/model.pt")
    _flag(g, "json", action="store_const", const=True, help="print the summary as JSON on the last stdout line")
    _flag(g, "quiet", action="store_const", const=True, help="no progress display")
    _flag(g, "debug", action="store_const", const=True, help="verbose logs and tracebacks")
    _flag(g, "config", help="TOML file with the same keys as the flags (flags win)")
    _flag(g, "print-config", action="store_const", const=True,
          help="print every effective value and its source (flag, file, default, default for ps/asp) and exit")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="plexus", description="Distributed training under every classic architecture.",
                     argument_default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train one job", argument_default=argparse.SUPPRESS)
    add_job_arguments(train)
    compare = sub.add_parser("compare", help="run several strategies on the same model, data and seed",
                             argument_default=argparse.SUPPRESS)
    compare.add_argument("specs", nargs="+", metavar="SPEC",
                         help="STRATEGY[:key=value,...], e.g. allreduce:algorithm=ring,workers=4")
    add_job_arguments(compare)
    report = sub.add_parser("report", help="plots and index.html from run directories")
    report.add_argument("dirs", nargs="+", metavar="DIR")
    report.add_argument("--out", default=None, help="output folder (default: the run directory)")
    worker = sub.add_parser("worker", help="join a running job as one more worker (token from PLEXUS_TOKEN)")
    worker.add_argument("--join", required=True, metavar="HOST:PORT", help="the job's rendezvous store")
    worker.add_argument("--timeout", type=float, default=60.0, help="seconds any blocking operation waits (default 60)")
    worker.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    bench = sub.add_parser("bench", help="benchmarks that print tables")
    which = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from plexus.bench import BENCHMARKS
    for name, (summary, module) in BENCHMARKS.items():
        b = which.add_parser(name, help=summary)
        _import(module).add_arguments(b)
    return parser


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
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def job_config(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    """Defaults < TOML file < flags < ``extra`` (a compare spec); each value keeps its
    source (file, flag, spec) and the keys left unset take their strategy's defaults."""
    from plexus.config import JobConfig
    flat = vars(args).copy()
    for key in ("command", "specs", "config", "print_config"):
        flat.pop(key, None)
    merged = _load_toml(args.config) if getattr(args, "config", None) else {}
    merged = {k.replace("-", "_"): v for k, v in merged.items()}
    sources = {k: "file" for k in merged}
    merged.update(flat)
    sources.update({k: "flag" for k in flat})
    merged.update(extra or {})
    sources.update({k: "spec" for k in extra or {}})
    return JobConfig.from_flat(merged, sources)


def _print_config(cfg) -> None:
    """``--print-config``: every effective value and its source, by component."""
    import dataclasses
    settings = cfg.settings()
    width = max(map(len, settings))
    for comp in ("strategy", "optim", "cluster", "data", "model", "run"):
        print(f"[{comp}]")
        for f in dataclasses.fields(getattr(cfg, comp)):
            item = settings[f.name]
            print(f"  {f.name:<{width}}  {json.dumps(item['value']):<24}  {item['source']}")


class _Progress:
    """A live line on the terminal (step, loss, test accuracy, samples/s, elapsed),
    read from the run directory's metrics.jsonl."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.offset, self.state, self.started, self.last = 0, {}, time.monotonic(), 0.0

    def __enter__(self) -> "_Progress":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def poll(self, run_dir: Path) -> None:
        now = time.monotonic()
        if now - self.last < 0.25:
            return
        self.last = now
        path = run_dir / "metrics.jsonl"
        if path.exists():
            with open(path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
            for line in complete.splitlines():
                event = json.loads(line)
                if event["event"] == "train" and event.get("worker") == 0:
                    self.state.update(step=event["step"], loss=event["loss"], samples=event["samples"],
                                      time=event["time"])
                elif event["event"] == "eval":
                    self.state["acc"] = event["test_accuracy"]
        s = self.state
        rate = s["samples"] / s["time"] if s.get("time") else 0.0
        acc = f"{100 * s['acc']:.2f}%" if "acc" in s else "–"
        loss = f"{s['loss']:.4f}" if s.get("loss") is not None else "–"
        self.live.update(f"step {s.get('step', 0)}  loss {loss}  test acc {acc}  "
                         f"{rate:,.0f} samples/s  elapsed {now - self.started:.1f} s")


def _train(args: argparse.Namespace) -> int:
    from plexus.train.job import run_local, run_torchrun
    cfg = job_config(args)
    if getattr(args, "print_config", False):
        _print_config(cfg)
        return 0
    if "RANK" in os.environ and "PLEXUS_ROLE" not in os.environ:
        summary = run_torchrun(cfg)
        if summary is not None:
            _print_summary(summary, cfg.run.out or "", cfg.run.json)
        return 0
    show = not cfg.run.quiet and sys.stderr.isatty()
    if show:
        with _Progress() as progress:
            run_dir, summary = run_local(cfg, poll=progress.poll)
    else:
        run_dir, summary = run_local(cfg)
    _print_summary(summary, str(run_dir), cfg.run.json)
    return 0


def _print_summary(summary: dict[str, Any], run_dir: str, as_json: bool) -> None:
    acc = summary.get("final_test_accuracy")
    ttt = summary.get("time_to_target_seconds")
    line = (f"final test accuracy {100 * acc:.2f}%  loss {summary['final_test_loss']:.4f}  "
            f"{summary['steps']} steps in {summary['wall_seconds']:.1f} s "
            f"({summary['samples_per_second']:,.0f} samples/s)")
    if ttt is not None:
        line += f"  target reached at {ttt:.1f} s"
    print(line)
    if summary.get("health", "ok") != "ok":
        where = ""
        if summary.get("diverging_workers"):
            where = f" on worker(s) {', '.join(map(str, summary['diverging_workers']))}"
        print(f"warning: training {summary['health']}{where} (detected at step {summary['health_step']}): "
              f"{summary['health_hint']}", file=sys.stderr)
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
    from plexus.report import write_report
    from plexus.train.job import run_local
    base = job_config(args)
    root = Path(base.run.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    specs = [parse_spec(s) for s in args.specs]
    # Build every config first so a bad spec fails before anything runs.
    configs = [job_config(args, {**spec, "out": str(root / f"{i:02d}-{_slug(text)}")})
               for i, (text, spec) in enumerate(zip(args.specs, specs))]
    rows = []
    for spec_text, cfg in zip(args.specs, configs):
        print(f"== {spec_text}", file=sys.stderr)
        run_dir, summary = run_local(cfg)
        rows.append((spec_text, run_dir, summary))
    html = write_report([r for _, r, _ in rows], root, title="plexus compare")
    _print_compare(rows)
    print(f"report: {html}")
    if base.run.json:
        print(json.dumps([{**s, "spec": spec, "run_dir": str(d)} for spec, d, s in rows]))
    return 0


def _print_compare(rows) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="plexus compare")
    for col in ("spec", "test acc", "health", "wall s", "samples/s", "time to target s", "MB sent/worker"):
        table.add_column(col, justify="right" if col not in ("spec", "health") else "left")
    for spec, _, s in rows:
        ttt = s.get("time_to_target_seconds")
        # Lost workers have no byte count (None): average over those that reported.
        per = [b for b in s["bytes_sent_per_worker"] if b is not None]
        acc = s.get("final_test_accuracy")
        health = s.get("health", "ok")
        table.add_row(spec, "–" if acc is None else f"{100 * acc:.2f}%",
                      health if health == "ok" else f"[bold red]{health.upper()}[/]", f"{s['wall_seconds']:.2f}",
                      f"{s['samples_per_second']:,.0f}", "–" if ttt is None else f"{ttt:.2f}",
                      f"{sum(per) / max(len(per), 1) / 1e6:.2f}")
    Console().print(table)


def _worker(args: argparse.Namespace) -> int:
    """``plexus worker --join HOST:PORT``: one more worker for a running ``ps`` job. It reads
    the job's configuration from the store, takes the next free rank, and trains as the
    job's workers do, from the current weights."""
    from plexus.cluster.rendezvous import ProcessInfo, connect_store
    from plexus.config import JobConfig
    from plexus.errors import ConfigError
    from plexus.strategies.downpour import DownpourStrategy
    from plexus.train.data import load_dataset
    from plexus.train.runner import worker_main
    host, _, port = args.join.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--join must be HOST:PORT, got {args.join!r}: pass the address of the job's store, "
                          f"e.g. --join 127.0.0.1:29500")
    token = os.environ.get("PLEXUS_TOKEN")
    if not token:
        raise ConfigError("PLEXUS_TOKEN is not set: a worker that joins needs the job's token; export the "
                          "PLEXUS_TOKEN the job was started with")
    probe = ProcessInfo(role="worker", rank=-1, world_size=0, master_addr=host, master_port=int(port), token=token)
    store = connect_store(probe, args.timeout)
    record = DownpourStrategy.job_record(store, args.timeout)
    cfg = JobConfig.from_dict(record["config"])
    rank = DownpourStrategy.admit(store, cfg)
    info = ProcessInfo(role="worker", rank=rank, world_size=cfg.cluster.workers, master_addr=host,
                       master_port=int(port), token=token)
    run_dir = Path(record["run_dir"]) if record["run_dir"] and Path(record["run_dir"]).is_dir() else None
    print(f"plexus: joined the job at {args.join} as worker {rank}", file=sys.stderr)
    worker_main(cfg, info, store, run_dir, load_dataset(cfg.data, cfg.run.seed))
    print(f"plexus: worker {rank} finished", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    from plexus.report import write_report
    html = write_report(args.dirs, args.out)
    print(f"report: {html}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s")
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "plexus-mpl"))
    from plexus.errors import PlexusError
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "report":
            return _report(args)
        if args.command == "bench":
            from plexus.bench import BENCHMARKS
            return _import(BENCHMARKS[args.bench][1]).main(args)
    except PlexusError as exc:
        if debug:
            raise
        print(f"plexus: error: {exc}" if exc.exit_code == 2 else f"plexus: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("plexus: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
