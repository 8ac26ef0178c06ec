"""Stage groups: how R model-parallel replicas agree, one stage at a time.

Under ``--stages K --workers R`` (``--replicas R``), stage k of every replica holds the
same slice of the model, and those R processes are one data-parallel group that the
job's strategy synchronises alone, over that slice's parameters only (Dean et al.
2012's model replicas cut into partitions). The strategy does not know it: each stage
process drives it as worker r of a job of R workers whose model is its stage module
(``train/stage_runner.py``), and the strategy's other processes (servers, aggregators,
a centre) are started per group. Each group lives in a namespace of the job's store of
its own (``group_store``), so its keys, links and records are those of an ordinary job;
what the whole job reports is assembled from the groups' records (``group_records``).

Servers. A group gets its share of ``--servers`` S: stage k's parameters live on its own
servers only, so stage k pushes to and pulls from them and no other (DistBelief's
Downpour over model-parallel replicas). ``--servers 0`` (the default) gives each group
its strategy's default, one. S below K would leave a stage without a server: refused.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from plexus.config import ASYNCHRONOUS_SCHEDULES, JobConfig, ParallelConfig
from plexus.config.applies import applies
from plexus.config.defaults import is_asynchronous
from plexus.errors import ConfigError
from plexus.parallel.schedules import compensated_delay
from plexus.parallel.stash import delay_lr_scale
from plexus.strategies import strategy_class

__all__ = ["GROUP_STRATEGIES", "GroupSlot", "check_stages", "group_config", "group_records", "group_role_counts",
           "group_slots", "group_store", "locate", "server_traffic"]

# The strategies a stage group runs: every data-parallel synchroniser whose processes are
# the workers and roles that ``extra_roles`` names. Sandblaster's coordinator hands out
# units of data, which the stages of one replica must share: not a per-stage affair.
GROUP_STRATEGIES = ("allreduce", "ps", "tree-ps", "gossip", "local-sgd", "easgd")


@dataclasses.dataclass(frozen=True)
class GroupSlot:
    """One process of a group's strategy besides its workers: ``role`` ``rank`` of the job
    (its name in the launcher's plan) is ``role`` ``local`` of group ``group``."""

    role: str
    rank: int
    group: int
    local: int


def group_of(stage: int, shard: int, shards: int) -> int:
    """The group of stage ``stage``'s tensor-parallel shard ``shard`` (of ``shards``):
    the same slice of the model in every replica, synchronised together."""
    return stage * shards + shard


def check_stages(cfg: JobConfig) -> None:
    """Refuse, before anything starts, what stages cannot run yet."""
    if not cfg.parallel.partitioned:
        return
    cut = cfg.parallel.flags
    s, replicas = cfg.strategy, cfg.cluster.workers
    if s.strategy not in GROUP_STRATEGIES:
        raise ConfigError(f"strategy {s.strategy} over {cut} is not supported: its coordinator hands out "
                          f"units of data, which the stages of a replica share; pass --strategy "
                          f"{', '.join(GROUP_STRATEGIES[:-1])} or {GROUP_STRATEGIES[-1]}")
    for on, flag in ((s.elastic, "--elastic"), (s.assignment == "dynamic", "--assignment dynamic"),
                     (s.backup_workers > 0, "--backup-workers")):
        if on:
            raise ConfigError(f"{flag} with {cut} is not supported yet: a replica's stages would have to "
                              f"regroup or skip steps together; drop {flag}")
    settings = cfg.settings()
    for key in ("algorithm", "bucket_mb"):  # one replica all-reduces nothing: these would do nothing
        if s.strategy == "allreduce" and replicas == 1 and settings[key]["source"] != "default":
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} does not apply to {cut}: one replica cut into stages all-reduces "
                              f"nothing; drop {flag}")
    m_count, share = cfg.parallel.microbatches, cfg.run.batch_size // replicas
    if share % m_count:
        raise ConfigError(f"--microbatches {m_count} must divide each replica's batch ({share} = --batch-size "
                          f"{cfg.run.batch_size} / {replicas} replicas): pass a --microbatches that divides {share}")
    asynchronous = cfg.parallel.schedule in ASYNCHRONOUS_SCHEDULES
    if asynchronous and replicas > 1 and not is_asynchronous(cfg.to_flat()):
        sync = f"{s.strategy} {s.consistency}" if s.strategy in ("ps", "tree-ps") else s.strategy
        stale = "up to K-1 steps" if cfg.parallel.schedule == "pipedream" else "one step"
        raise ConfigError(f"--schedule {cfg.parallel.schedule} with {replicas} replicas needs an asynchronous strategy "
                          f"(ps or tree-ps with --consistency asp, ssp or softsync): its gradients are of weights "
                          f"{stale} old, which breaks what synchronous {sync} promises across replicas (each "
                          f"step, every replica's gradient of the same weights); pass --strategy ps --consistency "
                          f"asp, or --workers 1")
    shards = cfg.parallel.tensor_parallel
    if shards > 1 and replicas > 1 and (s.strategy not in ("allreduce", "gossip", "local-sgd")
                                        or is_asynchronous(cfg.to_flat())):
        raise ConfigError(f"--tensor-parallel {shards} with {replicas} replicas runs under a synchronous allreduce, "
                          f"gossip or local-sgd: each shard holds its own copy of the layers it does not split, and "
                          f"{s.strategy}'s replicas would let those copies drift apart; pass --strategy allreduce, "
                          f"or --workers 1")
    for value, flag in ((cfg.run.checkpoint_every, "--checkpoint-every"), (cfg.run.resume, "--resume")):
        if value:
            raise ConfigError(f"{flag} with {cut} is not supported yet (a checkpoint would need every "
                              f"stage's part): drop {flag}")
    if cfg.cluster.kill or cfg.cluster.slow:
        raise ConfigError(f"--kill and --slow name workers, and {cut} runs stages: drop them")
    for g in range(cfg.parallel.per_replica):
        strategy_class(s.strategy).check_config(group_config(cfg, g))


def _servers(cfg: JobConfig, g: int) -> int:
    """Group ``g``'s share of ``--servers`` (0: its strategy's default)."""
    groups, total = cfg.parallel.per_replica, cfg.cluster.servers
    if total == 0 or not applies("servers", cfg.strategy.strategy):
        return total
    if total < groups:
        what = "stage" if cfg.parallel.tensor_parallel == 1 else "stage's shard"
        raise ConfigError(f"--servers {total} under {cfg.parallel.flags}: each {what}'s parameters live on servers "
                          f"of their own, so every {what} needs one: pass --servers {groups} or more (or 0 for "
                          f"one each)")
    return total // groups + (1 if g < total % groups else 0)


def group_config(cfg: JobConfig, g: int) -> JobConfig:
    """Group ``g`` as a job of its own: ``--workers`` R workers, its share of the servers,
    one stage (its model is the stage module, or its shard of it). Under an asynchronous
    schedule with delay compensation, the stage's learning rate is scaled for its delay
    (parallel/stash.py), on its workers and its servers alike, and its momentum SGD, where
    the stage steps it itself, is spike compensated (``OptimConfig.delay_steps``)."""
    p = cfg.parallel
    delay = compensated_delay(p.schedule, p.stages, g // p.tensor_parallel, p.vertical_sync, p.delay_compensation)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, servers=_servers(cfg, g)),
                               optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr * delay_lr_scale(delay),
                                                         delay_steps=delay),
                               parallel=ParallelConfig())


def group_slots(cfg: JobConfig) -> list[GroupSlot]:
    """The groups' processes besides their workers, group 0's first, numbered per role
    across the groups (server 0 .. of stage 0, then stage 1's)."""
    cls = strategy_class(cfg.strategy.strategy)
    slots: list[GroupSlot] = []
    taken: dict[str, int] = {}
    for g in range(cfg.parallel.per_replica):
        for role, count in cls.extra_roles(group_config(cfg, g)):
            for local in range(count):
                slots.append(GroupSlot(role, taken.get(role, 0), g, local))
                taken[role] = taken.get(role, 0) + 1
    return slots


def group_role_counts(cfg: JobConfig) -> list[tuple[str, int]]:
    """(role, count) over every group, in the order of first appearance."""
    counts: dict[str, int] = {}
    for slot in group_slots(cfg):
        counts[slot.role] = counts.get(slot.role, 0) + 1
    return list(counts.items())


def locate(cfg: JobConfig, role: str, rank: int) -> GroupSlot:
    """The group slot of process ``role`` ``rank``."""
    for slot in group_slots(cfg):
        if (slot.role, slot.rank) == (role, rank):
            return slot
    raise ConfigError(f"{role} {rank} is not a process of this job's stage groups")


def group_store(store: dist.Store, g: int) -> dist.Store:
    """Group ``g``'s namespace in the job's store."""
    return dist.PrefixStore(f"stage-group/{g}", store)


def group_records(cfg: JobConfig, records: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each group's records, as its strategy's ``summary_fields`` reads a job's: the
    stage processes' strategy records as its workers', and its own servers' (etc.)."""
    groups: dict[int, dict[str, Any]] = {g: {"worker": {}} for g in range(cfg.parallel.per_replica)}
    for rec in records.get("stage", {}).values():
        groups[rec["group"]]["worker"][rec.get("replica", 0)] = rec.get("sync", {})
    slots = group_slots(cfg)
    for slot in slots:
        rec = records.get(slot.role, {}).get(slot.rank)
        if rec is not None:
            groups[slot.group].setdefault(slot.role, {})[slot.local] = rec
    lost = records.get("lost", {})
    for g in groups:
        groups[g]["lost"] = {role: [s.local for s in slots if s.group == g and s.role == role and s.rank in ranks]
                             for role, ranks in lost.items() if role != "stage"}
    return groups


def server_traffic(cfg: JobConfig, records: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Bytes each stage process sent to each of the job's servers, {"stage i": {"server
    s": bytes}} (servers by their job-wide names): under ps, the rows show that each
    stage talks only to its own group's servers."""
    names = {(slot.group, f"{slot.role} {slot.local}"): f"{slot.role} {slot.rank}" for slot in group_slots(cfg)
             if slot.role == "server"}
    matrix: dict[str, dict[str, int]] = {}
    for i, rec in sorted(records.get("stage", {}).items()):
        row = {names[(rec["group"], peer)]: counts["bytes_sent"]
               for peer, counts in rec.get("sync_traffic", {}).items() if (rec["group"], peer) in names}
        matrix[f"stage {i}"] = dict(sorted(row.items()))
    return matrix
