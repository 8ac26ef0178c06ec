"""Issue 12's defaults matrix: every strategy and variant, trained with only the flags
that select it plus --workers 4, reaches at least 0.9x the accuracy of allreduce at the
same steps and seed, on digits and on mnist1d (``plexus bench defaults`` prints the same
matrix as a table).

Steps: 300 on digits, which passes 90 % within a few hundred; 800 on mnist1d, where at 300
steps every run is still on the steep part of its curve and asynchronous runs of the same
command differ by +-5 points from one run to the next (measured). A row below 0.9x at
seed 0 is measured again, with the reference, at seeds 1, 2 and 3, and must reach 0.9x on
the mean of the four: one run of an asynchronous strategy is a sample, not a verdict, and
two are not enough for a row whose mean is a few points above the bar (easgd on mnist1d:
0.92-0.95x, one run of a seed 2-3 points either side of it; docs/results/defaults-sweep.md,
"easgd"). A row
flagged unhealthy at seed 0 is measured at seed 1 instead, which must be healthy and
reach 0.9x of the reference at seed 1. ``make test`` runs the rows three at a time.
"""
from __future__ import annotations

import pytest

from plexus.bench.defaults import DEFAULT_STEPS, MATRIX, REFERENCE, train_one

STEPS = DEFAULT_STEPS
# The seeds a row below the bar at seed 0 is measured at again.
AGAIN = (1, 2, 3)


@pytest.fixture(scope="module")
def reference(once):
    """Accuracy of allreduce per (dataset, seed), trained on first use: once for the whole
    session, also under pytest-xdist."""
    def accuracy(dataset: str, seed: int) -> float:
        return once(f"defaults-reference-{dataset}-{seed}",
                    lambda out: train_one(dataset, REFERENCE, str(out), steps=STEPS[dataset],
                                          seed=seed)["final_test_accuracy"], timeout=600)
    return accuracy


# The all-reduce algorithms compute the reference's sum (tests/test_collectives.py checks it
# exactly), with the same defaults: they differ from the reference only by rounding, which
# 800 steps amplify (65-68 % on mnist1d against its 66 %, docs/results/defaults-matrix.md).
# Their rows are in `plexus bench defaults`, not here.
LABELS = [label for label in MATRIX if MATRIX[label]["strategy"] != "allreduce"]
# tree-ps adv-star under asp (7 processes, and staleness that grows with CPU contention)
# once ended at 0.84x on mnist1d, mean of both seeds, when CI ran it beside two other rows
# of 7 processes each on 2 cores (44 s for what takes 8 s alone); without them, three
# seeds run beside each other reached 65.6-67.6 %, against allreduce's 67.8 % (mean of
# seeds 0 and 1). adv-star under softsync did the same in a later CI run (0.88x, where
# two seeds beside another job reached 61.4 % and 65.0 %, all 3,200 pushes applied).
# AD-PSGD (gossip --topology torus --async, 4 workers) once ended at 0.537 on mnist1d,
# mean of both seeds, in CI's parallel stage (2026-11-26), where beside two copies of
# itself it reached 0.66 to 0.67 and beside four CPU-bound processes 0.69 to 0.70.
# easgd (asynchronous exchanges with its centre, 5 processes) ended at 0.607 on mnist1d,
# mean of both seeds, in CI's parallel stage (2026-11-26 13:07), against a bar of 0.610;
# alone on the machine the same seeds reached 0.652 and 0.648; in the serial stage too
# (2026-11-26 22:00, 0.599 against 0.610): its mean is 0.92-0.95x, and the mean of two runs
# falls below 0.9x about one time in ten, hence the four seeds above.
# adv-star under bsp (asynchronous by the variant: its learners read the weights on their
# own clock) ended at 0.600 against a bar of 0.615 on mnist1d in CI's parallel stage
# (2026-11-27 04:35, seeds 0-3: 0.523, 0.625, 0.611, 0.641) under the asynchronous default
# Adam, where alone two seeds twice each reached 0.635 (0.94x, as Adagrad's 0.636).
# They run in the serial stage of ``make test``, where what they measure is their
# defaults, not the machine's load. There too adv-star under softsync ended at 0.613 and
# 0.607 against a bar of 0.615 (2026-11-27 12:45 and 13:58, seeds 0-3: 0.598, 0.613, 0.606,
# 0.637 and 0.567, 0.592, 0.633, 0.637) under Adam at 0.003, which measured 0.90x at the
# four seeds: its updates average 4 gradients, and Adam's rate now grows as the root of
# that (0.006 here; defaults-sweep.md, "Updates of several gradients"), which measured
# 0.96x in eight runs, the lowest at 63.4 %.
SERIAL = {"tree-ps --variant adv-star --consistency asp", "tree-ps --variant adv-star --consistency softsync",
          "tree-ps --variant adv-star --consistency bsp", "gossip --topology torus --async", "easgd"}


# A row below its bar at seed 0 trains three more seeds and the reference at each (eight
# jobs): in CI on 2026-11-27, with the machine running slower than usual, ps asp adagrad on
# mnist1d took that path and ran past pytest's 300 s while its third reference trained.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dataset", list(STEPS))
@pytest.mark.parametrize("label", [pytest.param(label, marks=() if label in SERIAL else pytest.mark.parallel)
                                   for label in LABELS])
def test_learns_with_its_defaults(label, dataset, reference, tmp_path):
    seed = 0
    summary = train_one(dataset, label, str(tmp_path / "0"), steps=STEPS[dataset])
    if summary["health"] != "ok":
        # A sample too: in CI, tree-ps adv-star asp on digits (mean staleness 3.2 on the
        # loaded machine) once passed 10x its first loss for a moment and still ended at
        # 91.6 %. Seed 1 is measured instead, and must be healthy.
        unhealthy, seed = summary["health_hint"], 1
        summary = train_one(dataset, label, str(tmp_path / "1"), steps=STEPS[dataset], seed=1)
        assert summary["health"] == "ok", f"seed 0: {unhealthy}; seed 1: {summary['health_hint']}"
    seeds, accuracies = [seed], [summary["final_test_accuracy"]]
    if accuracies[0] < 0.9 * reference(dataset, seed) and seed == 0:
        seeds += AGAIN
        accuracies += [train_one(dataset, label, str(tmp_path / f"again-{s}"), steps=STEPS[dataset],
                                 seed=s)["final_test_accuracy"] for s in AGAIN]
    accuracy = sum(accuracies) / len(accuracies)
    ref = sum(reference(dataset, s) for s in seeds) / len(seeds)
    assert accuracy >= 0.9 * ref, (
        f"{label} on {dataset}: {accuracy:.3f} against allreduce {ref:.3f} (mean of seeds {seeds}: "
        f"{', '.join(f'{a:.3f}' for a in accuracies)}); settings "
        f"{({k: v for k, v in summary['settings'].items() if v['source'] != 'default'})}")


@pytest.mark.slow
def test_the_asp_kill_example_learns_with_its_defaults(tmp_path):
    """README's fault example, as a new user runs it: no flag but the ones that select it."""
    import plexus
    summary = plexus.run({"strategy": "ps", "consistency": "asp", "servers": 2, "workers": 4,
                          "kill": "worker:1@step=30", "out": str(tmp_path)})
    assert summary["lost_workers"] == [1]
    assert summary["final_test_accuracy"] >= 0.9 and summary["health"] == "ok"


@pytest.mark.slow
def test_a_straggler_under_asp_learns_with_its_defaults(tmp_path):
    import plexus
    summary = plexus.run({"strategy": "ps", "consistency": "asp", "workers": 4, "slow": "worker:0=4",
                          "out": str(tmp_path)})
    assert summary["final_test_accuracy"] >= 0.9 and summary["health"] == "ok"
    # The slow worker makes as many steps as the others (fixed partitions), so it ends last;
    # its updates are stale, which asp with the default server Adam absorbs.
    assert summary["staleness_max"] >= 3
