"""Checks before any process starts that nothing the user asked for silently does nothing.

- ``check_run_dir``: an ``--out`` that already holds files is refused unless
  ``--overwrite``, so an earlier run is never replaced without a word.
- ``check_applies``: a value the user set that the strategy ignores (``config/applies.py``).
- ``check_roles``: ``--kill``/``--slow`` name a process the strategy has, and one that
  counts steps (a ``--kill server:0`` would never fire: servers count no steps).
- ``check_schedule``: a fault or schedule that cannot happen within the run's length
  (``--kill worker:1@step=500`` in a 20-step run, ``--warmup-steps 50`` in a 40-step
  local-sgd run) is an error; the length is known once the dataset is loaded.

- ``check_device``: ``--device cuda`` or ``--backend nccl`` where torch sees no GPU, and
  ``--backend nccl`` with more processes on this machine than GPUs (NCCL refuses two
  ranks on one GPU, or waits), before the workers start and fail one by one.

Each raises ConfigError naming the flag, the rule, the value and the fix.
"""
from __future__ import annotations

from pathlib import Path

from plexus.config import JobConfig, KillSpec, SlowSpec
from plexus.config.applies import check_applies as _check_applies
from plexus.errors import ConfigError

__all__ = ["check_run_dir", "check_applies", "check_roles", "check_schedule", "check_device", "steps_per_worker",
           "run_length"]

_USER = ("flag", "file", "spec", "api")


def check_run_dir(out: str | Path | None, overwrite: bool, flag: str = "--out") -> None:
    """Refuse an existing directory that holds files unless ``overwrite``: the results of
    the run there would be replaced. An empty or missing directory is fine."""
    if out is None:
        return
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a file, not a directory: pass a new directory name")
    if not overwrite and path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{flag} {str(path)!r} already holds files (an earlier run?): pass a new directory "
                          f"name, or --overwrite to replace its results")


def check_applies(cfg: JobConfig) -> None:
    """Every value the user set applies to the chosen strategy (``config/applies.py``)."""
    _check_applies(cfg.strategy.strategy, cfg.to_flat(), cfg.sources)


def _spec_text(spec: KillSpec | SlowSpec) -> str:
    if isinstance(spec, KillSpec):
        return f"--kill {spec.role}:{spec.rank}@{spec.when}"
    return f"--slow {spec.role}:{spec.rank}={spec.factor:g}"


def check_roles(cfg: JobConfig) -> None:
    """``--kill`` and ``--slow`` name processes this strategy starts, and ones that obey
    them: workers (every strategy), aggregators (tree-ps, killed after N forwarded pushes),
    ps servers (killed once their shard reaches version N) and easgd's centre server
    (slowed; it counts no steps to die at)."""
    from plexus.strategies import strategy_class
    strategy = cfg.strategy.strategy
    roles = dict(strategy_class(strategy).extra_roles(cfg))
    for spec in (*cfg.cluster.kill, *cfg.cluster.slow):
        if spec.role == "worker":
            continue  # ClusterConfig checks the rank
        text = _spec_text(spec)
        count = roles.get(spec.role, 0)
        if count == 0:
            why = {"server": "servers belong to ps, tree-ps, easgd and sandblaster",
                   "aggregator": "aggregators belong to tree-ps --variant adv or adv-star",
                   "coordinator": "the coordinator belongs to sandblaster"}[spec.role]
            instead = (KillSpec(role="worker", rank=0, step=spec.step, seconds=spec.seconds)
                       if isinstance(spec, KillSpec)
                       else SlowSpec(role="worker", rank=0, factor=spec.factor))
            raise ConfigError(f"{text}: strategy {strategy} has no {spec.role}s ({why}): name a worker instead, "
                              f"e.g. {_spec_text(instead)}")
        if spec.rank >= count:
            raise ConfigError(f"{text}: strategy {strategy} has {count} {spec.role}(s) here, ranks 0 to {count - 1}: "
                              f"pick a rank below {count}")
        if isinstance(spec, KillSpec) and spec.step is not None and spec.role not in ("worker", "aggregator") \
                and not (spec.role == "server" and strategy == "ps"):
            raise ConfigError(f"{text}: {strategy}'s servers count no steps, so a planned kill would never fire: "
                              f"kill it at a time instead (--kill {spec.role}:{spec.rank}@time=2: two seconds after "
                              f"training starts), or a worker (any strategy), an aggregator (tree-ps) or a ps "
                              f"server (killed once its shard reaches that version) at a step")
        if isinstance(spec, SlowSpec) and not (spec.role == "server" and strategy == "easgd"):
            raise ConfigError(f"{text}: only workers and easgd's centre server emulate slowness; a {strategy} "
                              f"{spec.role} would run at full speed: slow a worker instead")


def steps_per_worker(cfg: JobConfig, n_train: int) -> int | None:
    """The steps each worker may take (``runner.total_steps``), None when only
    ``--time-limit`` bounds the run. Synchronous runs take global batches and
    asynchronous ones a partition each (``batches.py``); the two epochs differ by under a
    step, so the longer is taken and no check here refuses a run that would have fired."""
    from plexus.train.feed import total_steps
    if cfg.run.steps is None and cfg.run.epochs is None and cfg.run.time_limit is not None:
        return None
    workers, batch = cfg.cluster.workers, cfg.run.batch_size
    per_epoch = max(n_train // batch, (n_train // workers) // max(1, batch // workers), 1)
    return total_steps(cfg, per_epoch)


def run_length(cfg: JobConfig) -> str:
    """What sets the run's length, for messages: ``--steps 20``, ``--epochs 1``, or the default."""
    if cfg.run.steps is not None:
        return f"--steps {cfg.run.steps}"
    if cfg.run.epochs is not None:
        return f"--epochs {cfg.run.epochs:g}"
    return "the default, one epoch or 300 steps, whichever is longer"


def check_schedule(cfg: JobConfig, n_train: int) -> None:
    """Refuse a fault or schedule that cannot happen within ``steps_per_worker`` steps:
    it would silently do nothing. Runs bounded by ``--time-limit`` alone are not checked
    (their length is not known); a ``--target-accuracy`` may end a run earlier still, which
    no check can know."""
    limit = steps_per_worker(cfg, n_train)
    if limit is None:
        return
    length = f"this run is {limit} steps per worker ({run_length(cfg)})"
    more = "pass --steps {n} or more"
    for kill in cfg.cluster.kill:
        if kill.step is None:
            continue  # a time: whether the run lasts that long is not known beforehand
        if kill.role == "worker" and kill.step >= limit:
            raise ConfigError(f"--kill worker:{kill.rank}@step={kill.step} cannot fire: {length}: pick a step below "
                              f"{limit}, or {more.format(n=kill.step + 1)}")
        if kill.role == "server":
            # A shard makes at most one update per push (asp); bsp makes one per step.
            most = limit * cfg.cluster.workers
            if kill.step >= most:
                raise ConfigError(f"--kill server:{kill.rank}@step={kill.step} cannot fire: its shard makes at most "
                                  f"{most} updates in this run ({length}): pick a version below {most}, or "
                                  f"{more.format(n=kill.step // cfg.cluster.workers + 1)}")
        if kill.role == "aggregator":
            from plexus.ps.tree import Node, Tree
            tree = Tree(cfg.cluster.workers, cfg.strategy.fanout)
            # An aggregator forwards at most one push per step of each worker below it.
            most = limit * len(tree.leaves(Node("aggregator", kill.rank)))
            if kill.step >= most:
                raise ConfigError(f"--kill aggregator:{kill.rank}@step={kill.step} cannot fire: aggregator "
                                  f"{kill.rank} forwards at most {most} pushes in this run ({length}): pick a "
                                  f"step below {most}, or {more.format(n=limit * (kill.step + 1) // most + 1)}")
    s, strategy = cfg.strategy, cfg.strategy.strategy
    if strategy == "local-sgd":
        if s.warmup_steps >= limit:
            raise ConfigError(f"--warmup-steps {s.warmup_steps} leaves no local step: {length}, all of them "
                              f"synchronous warm-up: pick a warm-up below {limit}, or "
                              f"{more.format(n=s.warmup_steps + s.period)}")
        if s.period > limit - s.warmup_steps:
            raise ConfigError(f"--period {s.period} never averages: {length}, {limit - s.warmup_steps} after the "
                              f"warm-up: pick a period of at most {limit - s.warmup_steps}, or "
                              f"{more.format(n=s.warmup_steps + s.period)}")
    if strategy == "easgd" and s.period > limit:
        raise ConfigError(f"--period {s.period} never pulls towards the centre: {length}: pick a period of at most "
                          f"{limit}, or {more.format(n=s.period)}")
    if strategy in ("ps", "tree-ps"):
        for key in ("push_every", "fetch_every"):
            value = getattr(s, key)
            if value > limit:
                raise ConfigError(f"--{key.replace('_', '-')} {value} never fires: {length}: pick at most {limit}, "
                                  f"or {more.format(n=value)}")
    if cfg.source("eval_every") in _USER and cfg.run.eval_every > limit:
        raise ConfigError(f"--eval-every {cfg.run.eval_every} takes no snapshot before the end: {length}: pick at "
                          f"most {limit}, or 0 to evaluate only at the end")


def check_device(cfg: JobConfig, processes: int) -> None:
    """What --device and --backend ask of this machine, where the job's ``processes`` all
    run: CUDA for ``--device cuda`` and ``--backend nccl``, and for NCCL a GPU per process."""
    device, backend = cfg.cluster.device, cfg.cluster.backend
    if device != "cuda" and backend != "nccl":
        return
    if backend == "nccl" and device == "cpu":
        raise ConfigError("--backend nccl moves GPU tensors, and --device cpu keeps them on the CPU: "
                          "pass --backend gloo (or auto)")
    import torch
    if not torch.cuda.is_available():
        flag, fix = ("--device cuda", "--device cpu") if device == "cuda" else ("--backend nccl", "--backend gloo")
        raise ConfigError(f"{flag} needs CUDA, and torch sees no GPU here: pass {fix} (or auto)")
    gpus = torch.cuda.device_count()
    if backend == "nccl" and processes > gpus:
        raise ConfigError(f"--backend nccl needs a GPU for each process, and this job runs {processes} processes "
                          f"on {gpus} GPU{'s' if gpus != 1 else ''}: pass --backend auto, which picks gloo here "
                          f"and carries GPU tensors through host memory")
