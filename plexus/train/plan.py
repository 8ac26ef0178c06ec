"""The role plan: which role every global rank of a job plays.

One pure function of the configuration and the world size, computed the same way by the
local launcher (which spawns exactly this plan) and by every process ``torchrun`` starts
(which reads its own slot from ``RANK`` and ``WORLD_SIZE``), so every strategy, servers,
aggregators and coordinators included, runs across machines with no extra flags.

Order. ``--place workers-first`` (the default) gives the workers ranks 0 .. P-1 and the
strategy's other roles (``Strategy.extra_roles``: servers, aggregators, a coordinator) the
ranks after them; ``--place roles-first`` puts those roles first. torchrun numbers ranks
node by node (node 0 holds ranks 0 .. nproc-1), so with ``workers-first`` the servers land
on the last node and with ``roles-first`` on the first: give that node as many processes
(``--nproc-per-node``) as the plan has servers, and they have a machine of their own.

Fit. The workers are what is left of the world size once the other roles are counted;
the roles may depend on the workers (a tree-ps tree has aggregators per group of
workers), so the plan takes the number of workers P for which P + roles(P) is the world
size. A world size that no P fits is a ConfigError naming the sizes that would.
"""
from __future__ import annotations

from dataclasses import dataclass

from plexus.config import JobConfig
from plexus.errors import ConfigError
from plexus.strategies import strategy_class

__all__ = ["Slot", "format_plan", "other_roles", "plan_for_world", "role_plan", "stage_position", "writer_slot"]


@dataclass(frozen=True)
class Slot:
    """One process of the plan: ``role`` and its rank within the role."""

    role: str
    rank: int

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"


def role_plan(cfg: JobConfig) -> list[Slot]:
    """The slots of ``cfg``'s processes, by global rank, for its ``--workers``. With
    ``--stages K`` (plexus/parallel/executor.py) the processes are the K stages of each
    of the ``--workers`` R replicas: ``stage r*K + k`` is stage k of replica r."""
    if cfg.parallel.partitioned:
        workers = [Slot("stage", k) for k in range(cfg.parallel.per_replica * cfg.cluster.workers)]
    else:
        workers = [Slot("worker", r) for r in range(cfg.cluster.workers)]
    others = [Slot(role, r) for role, count in other_roles(cfg) for r in range(count)]
    return others + workers if cfg.cluster.place == "roles-first" else workers + others


def other_roles(cfg: JobConfig) -> list[tuple[str, int]]:
    """The job's processes besides its workers (or stages), as (role, count): the
    strategy's ``extra_roles``, or under ``--stages`` those of every stage group
    (``stage_groups.py``: stage k's servers, then stage k+1's)."""
    if cfg.parallel.partitioned:
        from plexus.train.stage_groups import group_role_counts
        return group_role_counts(cfg)
    return strategy_class(cfg.strategy.strategy).extra_roles(cfg)


def _with_workers(cfg: JobConfig, workers: int, why: list[str] | None = None) -> JobConfig | None:
    """``cfg`` with ``workers`` workers; None (the reason appended to ``why``) where that
    many cannot run it, e.g. a batch size that does not split over them."""
    if cfg.cluster.workers == workers:
        return cfg
    try:
        return cfg.replace(workers=workers)
    except ConfigError as exc:
        if why is not None:
            why.append(str(exc))
        return None


def plan_for_world(cfg: JobConfig, world_size: int) -> tuple[JobConfig, list[Slot]]:
    """(the configuration with the workers that fit, its plan) for ``world_size``
    processes; ConfigError, naming the world sizes that fit, when none does."""
    fits: list[int] = []
    for workers in range(1, world_size + 1):
        why: list[str] = []
        sized = _with_workers(cfg, workers, why)
        if sized is None:
            if len(role_plan(cfg)) - cfg.cluster.workers + workers == world_size and why:
                raise ConfigError(f"world size {world_size} means {workers} workers for strategy "
                                  f"{cfg.strategy.strategy}, which cannot run this job: {why[0]}")
            continue
        slots = role_plan(sized)
        if len(slots) == world_size:
            return sized, slots
        if len(fits) < 6:
            fits.append(len(slots))
    for workers in range(world_size + 1, world_size + 8):
        sized = _with_workers(cfg, workers)
        if sized is not None and len(fits) < 6:
            fits.append(len(role_plan(sized)))
    extra = other_roles(cfg)
    roles = ", ".join(f"{count} {role}{'s' if count != 1 else ''}" for role, count in extra) or "no other role"
    fix = "start that many processes, or change --servers" if extra else "start that many processes"
    raise ConfigError(f"world size {world_size} does not fit strategy {cfg.strategy.strategy} ({roles} besides the "
                      f"workers): world sizes that fit are {', '.join(map(str, sorted(set(fits))))}; {fix}")


def writer_slot(cfg: JobConfig) -> Slot:
    """The process that writes the run directory and the summary under torchrun: worker 0,
    or under ``--stages`` replica 0's output stage (its last: the plan cuts the model's
    graph in order, and the output is the graph's last node), shard 0, which evaluates and
    logs for the job (``stage_runner.stage_main``)."""
    if cfg.parallel.partitioned:
        return Slot("stage", (cfg.parallel.stages - 1) * cfg.parallel.tensor_parallel)
    return Slot("worker", 0)


def stage_position(rank: int, stages: int, shards: int = 1) -> tuple[int, int, int]:
    """(replica, stage, shard) of stage process ``rank``: a replica's K x T processes are
    consecutive, stage by stage, each stage's T tensor-parallel shards together."""
    replica, within = divmod(rank, stages * shards)
    return (replica, *divmod(within, shards))


def format_plan(slots: list[Slot], per_node: int | None = None, stages: int = 1, shards: int = 1) -> str:
    """The plan as lines ``rank  role  (node n)``, for ``plexus train --print-plan``; a
    stage process also names its replica, its stage in the replica and, under
    ``--tensor-parallel``, its shard of the stage's layers."""
    lines = []
    for rank, slot in enumerate(slots):
        node = f"  node {rank // per_node}" if per_node else ""
        where = ""
        if slot.role == "stage":
            r, k, t = stage_position(slot.rank, stages, shards)
            where = f"  (replica {r}, stage {k}{f', shard {t}' if shards > 1 else ''})"
        lines.append(f"  rank {rank:>3}  {slot.name}{where}{node}")
    return "\n".join(lines)
