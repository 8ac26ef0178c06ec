"""The synchroniser's verbs (strategies/base.py) and the feeds behind ``feed``
(train/feed.py): each strategy's rule for where a worker's data comes from, and runners
that drive every strategy through the verbs alone."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plexus.config import JobConfig
from plexus.strategies import STRATEGIES
from plexus.strategies.base import Strategy
from plexus.train.batches import GlobalBatches
from plexus.train.feed import (SAMPLES_KEY, UNBOUNDED, CatchUpFeed, ClaimFeed, GlobalFeed, PartitionFeed, UnitFeed,
                               total_steps)

ROOT = Path(__file__).resolve().parents[1]
# What a runner may call on a strategy: the verbs, and the checkpointer's optional hooks.
VERBS = {"setup", "feed", "step", "snapshot", "agree", "finish", "close"}
CHECKPOINTS = {"checkpoint_state", "checkpoint_servers", "restore_checkpoint"}


def _config(**run) -> JobConfig:
    return JobConfig.from_flat({"dataset": "digits", "batch_size": 32, "seed": 3, **run})


def _strategy_calls(path: Path) -> set[str]:
    """Every attribute read on a name ``strategy`` in ``path``."""
    tree = ast.parse(path.read_text())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "strategy"}


@pytest.mark.parametrize("runner", ["plexus/train/runner.py", "plexus/train/stage_runner.py"])
def test_the_runners_drive_a_strategy_by_its_verbs_alone(runner):
    used = _strategy_calls(ROOT / runner)
    assert "step" in used and "feed" in used and "snapshot" in used
    assert used <= VERBS | CHECKPOINTS, sorted(used - VERBS - CHECKPOINTS)


def test_the_verbs_are_on_every_strategy():
    for cls in STRATEGIES.values():
        for verb in VERBS:
            assert callable(getattr(cls, verb)), (cls.name, verb)
    assert not hasattr(Strategy, "units") and not hasattr(Strategy, "share")  # folded into feed


def test_a_global_feed_gives_each_worker_its_slice_of_the_global_batch():
    cfg = _config(steps=5)
    store = dist.HashStore()
    feeds = [GlobalFeed(cfg, store, r, 4, 200) for r in range(4)]
    batches = GlobalBatches(200, 32, 3)
    for step in range(3):
        got = torch.cat([f.indices(step) for f in feeds])
        assert torch.equal(got, batches.indices(step))
    assert feeds[0].limit == 5 and feeds[0].lockstep and feeds[0].samples(2) == 64


def test_an_elastic_slice_and_a_joining_workers_first_step():
    cfg = _config(steps=5)
    feed = GlobalFeed(cfg, dist.HashStore(), 0, 4, 200, share=lambda step, rank, workers: (1, 3), first=4)
    assert feed.start(0) == 4 and feed.start(7) == 7
    assert torch.equal(feed.indices(0), GlobalBatches(200, 32, 3).worker_indices(0, 1, 3))


def test_asynchronous_workers_share_one_budget_of_updates():
    cfg = _config(steps=3)
    store = dist.HashStore()
    fast, slow = (PartitionFeed(cfg, store, r, 2, 200, shares_budget=True) for r in range(2))
    assert fast.start(0) == 0 and slow.start(0) == 0  # each claims its first update
    steps = 1
    while fast.stepped(steps):  # the fast worker spends what is left of the 6
        steps += 1
    assert steps == 5 and fast.limit == 5
    assert not slow.stepped(1) and slow.limit == 1


def test_without_a_shared_budget_each_worker_makes_its_steps():
    cfg = _config(steps=3)
    feed = PartitionFeed(cfg, dist.HashStore(), 0, 2, 200, shares_budget=False)
    assert feed.start(0) == 0 and feed.budget is None
    assert all(feed.stepped(s) for s in range(1, 4)) and feed.limit == 3


def test_asynchronous_workers_count_the_jobs_samples_together():
    cfg = _config(steps=10)
    store = dist.HashStore()
    a, b = (PartitionFeed(cfg, store, r, 2, 200) for r in range(2))
    assert a.publish(2) == 32 and b.publish(3) == 32 + 48 and a.publish(4) == 32 + 48 + 32
    assert a.seen(4) == int(store.add(SAMPLES_KEY, 0)) == 112


def test_dynamic_units_are_the_budgets_tickets():
    cfg = _config(steps=2)
    store = dist.HashStore()
    a, b = (UnitFeed(cfg, store, r, 2, 200) for r in range(2))
    a.start(0), b.start(0)
    assert (a.budget.ticket, b.budget.ticket) == (0, 1)
    assert torch.equal(b.indices(0), GlobalBatches(200, 32, 3).worker_indices(0, 1, 2))


def test_a_worker_behind_catches_up_to_the_jobs_step():
    cfg = _config(steps=4, strategy="ps", workers=4, backup_workers=1)
    at = {"step": 2}
    feed = CatchUpFeed(cfg, dist.HashStore(), 1, 4, 200, lambda: at["step"])
    assert torch.equal(feed.indices(0), GlobalBatches(200, 32, 3).worker_indices(2, 1, 4))
    assert feed.samples(1) == 2 * 3 * 8  # the job's steps x the slices a step uses x their samples
    at["step"] = 4
    assert feed.indices(3) is None  # the job has made its steps


def test_a_scheduler_ends_the_run_itself():
    class Units:
        unit_samples = 8

        def __init__(self):
            self.left = [torch.arange(8), torch.arange(8, 16)]

        def next(self):
            return self.left.pop(0) if self.left else None

    feed = ClaimFeed(_config(steps=1), dist.HashStore(), 0, 1, Units())
    assert feed.limit == UNBOUNDED
    assert [feed.indices(s) is None for s in range(3)] == [False, False, True]


def test_the_length_of_a_run():
    assert total_steps(_config(steps=7), 22) == 7
    assert total_steps(_config(epochs=2), 22) == 44
    assert total_steps(_config(time_limit=5), 22) == UNBOUNDED
    assert total_steps(_config(), 22) == 300
