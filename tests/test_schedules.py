"""Pipeline schedules (plexus/parallel/schedules.py): pure, no processes.

Each schedule's per-stage order for small K and M is written out by hand from its paper
(micro-batches and stages 0-based here, 1-based in the papers; ``F3.1`` is the forward of
micro-batch 3 on model chunk 1). Every schedule's lists pass the dependency check, hold
the activations their papers promise, and simulate to their closed-form bubble.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from plexus.errors import ConfigError
from plexus.parallel.schedules import (SCHEDULES, GPipe, Interleaved, OneFOneB, Op, PipeDream, PipeDream2BW, Schedule,
                                       ScheduleError, ZeroBubbleH1, compensated_delay, make_schedule, simulate)


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, schedule.ops(s))) for s in range(schedule.stages)]


def valid_schedules():
    """Every schedule for K in 2..4 and M in 1, 2, 4, 8 where the pair is valid."""
    for name, k, m in itertools.product(SCHEDULES, (2, 3, 4), (1, 2, 4, 8)):
        for v in ((2, 3) if name == "interleaved" else (1,)):
            try:
                yield make_schedule(name, k, m, chunks=v)
            except ConfigError:
                assert (name == "interleaved" and m % k) or (name == "pipedream-2bw" and m < k)


def test_gpipe_order_matches_figure_2():
    # Huang et al. 2019, fig. 2(c), K=4, M=4: every forward, then the backwards last
    # micro-batch first (the figure's B_{k,3} .. B_{k,0}), on every stage alike.
    assert rows(GPipe(stages=4, microbatches=4)) == ["F0 F1 F2 F3 B3 B2 B1 B0"] * 4


def test_1f1b_order_matches_figure_4_top():
    # Narayanan et al. 2021, fig. 4 top, K=4, M=8: K-s-1 warm-up forwards, then 1F1B.
    assert rows(OneFOneB(stages=4, microbatches=8)) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]


def test_interleaved_order_matches_figure_4_bottom():
    # Narayanan et al. 2021, fig. 4 bottom, K=4, v=2, M=8, in Megatron-LM's order (the
    # figure draws times; this is the order each device issues): rounds of 4 micro-batches
    # per chunk, 2(K-s-1) + (v-1)K warm-up forwards, backwards with the chunks reversed.
    assert rows(Interleaved(stages=4, microbatches=8, chunks=2)) == [
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 F6 B0.1 F7 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0 F7.1 B1 B2 B3 "
        "B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 B0.1 F5 B1.1 F6 B2.1 F7 B3.1 F4.1 B0 F5.1 B1 F6.1 B2 F7.1 B3 "
        "B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4 B2.1 F5 B3.1 F6 B0 F7 B1 F4.1 B2 F5.1 B3 F6.1 B4.1 "
        "F7.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4 B0 F5 B1 F6 B2 F7 B3 F4.1 B4.1 F5.1 B5.1 "
        "F6.1 B6.1 F7.1 B7.1 B4 B5 B6 B7",
    ]


def test_zb_h1_order_and_defining_properties():
    # Qi et al. 2023, fig. 3 (ZB-H1), K=4, M=8, reconstructed from the paper's rule rather
    # than read off the figure's pixels: stage s runs W of micro-batch i after B of i+s.
    # The last row, F1 B1 .. F4 B4 W1 F5 B5 W2 .., and the first, F1..F4 B1 W1 F5 B2 W2 ..,
    # are the figure's; the properties below are what the paper states of ZB-H1.
    zb = ZeroBubbleH1(stages=4, microbatches=8)
    assert rows(zb) == [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ]
    for k, m in itertools.product((2, 3, 4, 5), (1, 2, 4, 8)):
        zb, one_f_one_b = ZeroBubbleH1(stages=k, microbatches=m), OneFOneB(stages=k, microbatches=m)
        for s in range(k):
            # Without its W's it is 1F1B.
            assert [str(op) for op in zb.ops(s) if op.kind != "W"] == [str(op) for op in one_f_one_b.ops(s)]
        # Peak memory (activations live until W) is 1F1B's: K micro-batches.
        assert max(zb.max_in_flight(s) for s in range(k)) == max(one_f_one_b.max_in_flight(s) for s in range(k))
    # The bubble is a third of 1F1B's when the whole backward (2) splits into B = W = 1.
    k, m = 4, 8
    zb_idle = simulate(ZeroBubbleH1(stages=k, microbatches=m), forward=1, backward=1, weight=1).idle
    one_idle = simulate(OneFOneB(stages=k, microbatches=m), forward=1, backward=2).idle
    assert zb_idle == pytest.approx([i / 3 for i in one_idle])


def test_pipedream_is_1f1b_without_flush_and_stashes_weights():
    # PipeDream (Narayanan et al. 2019, fig. 8): 1F1B in steady state, each input its own
    # mini-batch, every stage steps after every backward.
    k, m = 4, 8
    pd, pd_vs = PipeDream(stages=k, microbatches=m), PipeDream(stages=k, microbatches=m, vertical_sync=True)
    assert not pd.synchronous and pd.chunks == 1
    for s in range(k):
        ops = pd.ops(s)
        assert [(op.kind, op.microbatch) for op in ops] == [(op.kind, op.microbatch) for op in OneFOneB(
            stages=k, microbatches=m).ops(s)]
        assert all(op.step == (op.kind == "B") for op in ops)
        # Weight stashing: each backward uses the version its forward used.
        assert {op.microbatch: op.version for op in ops if op.kind == "F"} == {
            op.microbatch: op.version for op in ops if op.kind == "B"}
    # Forward versions: the newest on each stage (m - (K-s-1) steps), or stage 0's under
    # vertical sync, so one input sees one consistent model.
    assert [[op.version for op in pd.ops(s) if op.kind == "F"] for s in range(k)] == [
        [0, 0, 0, 0, 1, 2, 3, 4],
        [0, 0, 0, 1, 2, 3, 4, 5],
        [0, 0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5, 6, 7],
    ]
    assert [[op.version for op in pd_vs.ops(s) if op.kind == "F"] for s in range(k)] == [[0, 0, 0, 0, 1, 2, 3, 4]] * 4
    # Stage s stashes K-s versions; under vertical sync every stage keeps K.
    assert [pd.max_versions(s) for s in range(k)] == [4, 3, 2, 1]
    assert [pd_vs.max_versions(s) for s in range(k)] == [4, 4, 4, 4]


def test_pipedream_2bw_keeps_two_versions_with_one_stale_gradients():
    # Narayanan et al. 2021 (PipeDream-2BW): mini-batches of M micro-batches back to back,
    # a step after each mini-batch's last backward, mini-batch g computing with version
    # g-1: W(t+1) = W(t) - lr * grad f(W(t-1)), and never more than two versions.
    k, m = 4, 4
    bw = PipeDream2BW(stages=k, microbatches=m, minibatches=4)
    assert not bw.synchronous and bw.inputs == 16
    for s in range(k):
        ops = bw.ops(s)
        assert [(op.kind, op.microbatch) for op in ops] == [(op.kind, op.microbatch) for op in OneFOneB(
            stages=k, microbatches=16).ops(s)]
        assert [op.microbatch for op in ops if op.step] == [3, 7, 11, 15]
        assert all(op.kind == "B" for op in ops if op.step)
        assert [op.version for op in ops if op.kind == "F"] == [0] * 8 + [1] * 4 + [2] * 4
        assert bw.max_versions(s) == 2
    for k, m in itertools.product((2, 3, 4), (4, 5, 8)):
        bw = PipeDream2BW(stages=k, microbatches=m, minibatches=5)
        bw.check()
        assert max(bw.max_versions(s) for s in range(k)) == 2


@pytest.mark.parametrize("schedule", list(valid_schedules()), ids=lambda s: f"{s.name}-K{s.stages}-M{s.microbatches}"
                         f"-v{s.chunks}")
def test_delay_is_the_steps_between_a_gradients_weights_and_its_step(schedule):
    """``Schedule.delay``: once the pipeline is full, the steps a stage has applied when a
    backward runs, less the version its forward used (0 for the synchronous schedules);
    never more while it fills."""

    def gaps(schedule: Schedule, s: int) -> list[int]:
        steps, out = 0, []
        for op in schedule.ops(s):
            if op.kind == "B":
                out.append(steps - op.version)
            steps += op.step
        return out

    for s in range(schedule.stages):
        assert max(gaps(schedule, s)) <= schedule.delay(s)
    for full in (PipeDream(stages=4, microbatches=8), PipeDream(stages=4, microbatches=8, vertical_sync=True),
                 PipeDream2BW(stages=4, microbatches=4, minibatches=4)):
        assert [gaps(full, s)[-1] for s in range(4)] == [full.delay(s) for s in range(4)]
    assert compensated_delay("pipedream", 4, 1) == 2 and compensated_delay("pipedream", 4, 1, vertical_sync=True) == 3
    assert compensated_delay("pipedream-2bw", 4, 3) == 1 and compensated_delay("1f1b", 4, 0) == 0
    assert compensated_delay("pipedream", 4, 0, compensation=False) == 0


@pytest.mark.parametrize("schedule", list(valid_schedules()), ids=lambda s: f"{s.name}-K{s.stages}-M{s.microbatches}"
                         f"-v{s.chunks}")
def test_every_schedule_passes_its_dependency_check(schedule):
    schedule.check()
    if schedule.synchronous:
        # One optimizer step per mini-batch, after the stage's last op.
        for s in range(schedule.stages):
            assert [i for i, op in enumerate(schedule.ops(s)) if op.step] == [len(schedule.ops(s)) - 1]
            assert schedule.max_versions(s) == 1


def test_check_finds_broken_lists():
    @dataclass(kw_only=True, frozen=True)
    class Lists(Schedule):
        name = "test"
        lists: list

        def _ops(self, stage):
            return [Op(*op) for op in self.lists[stage]]

    def broken(lists):
        with pytest.raises(ScheduleError):
            Lists(stages=2, microbatches=2, lists=lists).check()

    good = [[("F", 0), ("F", 1), ("B", 0), ("B", 1)], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]
    Lists(stages=2, microbatches=2, lists=good).check()
    # Stage 0 waits for B1 before it sends F1: a deadlock.
    broken([[("F", 0), ("B", 0), ("B", 1), ("F", 1)], good[1]])
    broken([[("F", 0), ("F", 1), ("B", 0)], good[1]])  # B1 missing
    broken([[("F", 0), ("F", 1), ("B", 0), ("B", 1), ("B", 1)], good[1]])  # B1 twice
    broken([good[0], [("B", 0), ("F", 0), ("F", 1), ("B", 1)]])  # backward before its forward
    broken([[("F", 0, 0, 1), ("F", 1), ("B", 0, 0, 1), ("B", 1)], good[1]])  # a version not made yet


@pytest.mark.parametrize("k,m", list(itertools.product((1, 2, 3, 4), (1, 2, 4, 8))))
def test_max_in_flight(k, m):
    gpipe, one = GPipe(stages=k, microbatches=m), OneFOneB(stages=k, microbatches=m)
    for s in range(k):
        assert gpipe.max_in_flight(s) == m
        assert one.max_in_flight(s) == min(k - s, m) <= k - s
        assert PipeDream(stages=k, microbatches=m).max_in_flight(s) == min(k - s, m)
        assert ZeroBubbleH1(stages=k, microbatches=m).max_in_flight(s) <= min(k, m)


def test_max_in_flight_of_one_chunk():
    """Counted per chunk (a pipeline plan's memory per model chunk): on the last stage of
    fig. 4 bottom, chunk 0 holds F0-F4 before B0 frees one, chunk 1 one at a time, and the
    process at most 5 together; on the first, chunk 0 all eight before its first
    backward. With one chunk, chunk 0 is the whole count."""
    fig = Interleaved(stages=4, microbatches=8, chunks=2)
    assert (fig.max_in_flight(3, chunk=0), fig.max_in_flight(3, chunk=1), fig.max_in_flight(3)) == (5, 1, 5)
    assert (fig.max_in_flight(0, chunk=0), fig.max_in_flight(0)) == (8, 11)  # F0-F7 and F0.1-F3.1 less B0.1
    for s in range(4):
        assert max(fig.max_in_flight(s, c) for c in (0, 1)) <= fig.max_in_flight(s) <= sum(
            fig.max_in_flight(s, c) for c in (0, 1))
        one = OneFOneB(stages=4, microbatches=8)
        assert one.max_in_flight(s, chunk=0) == one.max_in_flight(s)


@pytest.mark.parametrize("forward,backward", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0), (2.0, 1.0)])
def test_simulated_bubble_equals_closed_form(forward, backward):
    # GPipe and 1F1B idle (K-1)(f+b) of (M+K-1)(f+b) on every stage: the closed form
    # (K-1)/(M+K-1) holds exactly whatever b/f is, not only for b = 2f.
    for k, m in itertools.product((2, 3, 4), (1, 2, 4, 8)):
        closed = (k - 1) / (m + k - 1)
        for schedule in (GPipe(stages=k, microbatches=m), OneFOneB(stages=k, microbatches=m),
                         PipeDream(stages=k, microbatches=m)):
            timeline = simulate(schedule, forward, backward)
            assert schedule.predicted_bubble() == pytest.approx(closed)
            assert timeline.bubble == pytest.approx(closed)
            assert timeline.idle == pytest.approx([(k - 1) * (forward + backward)] * k)
            assert timeline.busy == pytest.approx([m * (forward + backward)] * k)
    # Interleaved: chunk ops cost 1/v, so the fill and drain shrink v times.
    for k, v in itertools.product((2, 3, 4), (2, 3)):
        for m in (k, 2 * k):
            schedule = Interleaved(stages=k, microbatches=m, chunks=v)
            assert schedule.predicted_bubble() == pytest.approx((k - 1) / (v * m + k - 1))
            assert simulate(schedule, forward, backward).bubble == pytest.approx(schedule.predicted_bubble())
    bw = PipeDream2BW(stages=4, microbatches=4, minibatches=3)
    assert simulate(bw, forward, backward).bubble == pytest.approx(bw.predicted_bubble()) == pytest.approx(3 / 15)


def test_zb_h1_bubble():
    # Qi et al. 2023: (K-1)(f+b-w) idle per stage, (K-1)/(3M+K-1) with f = b = w, once
    # M >= K; exact while w <= f and w <= b (a bigger W no longer fits the hole it fills).
    for k in (2, 3, 4, 5):
        for m in (k, k + 1, 2 * k, 8):
            schedule = ZeroBubbleH1(stages=k, microbatches=m)
            assert simulate(schedule, 1, 1, 1).bubble == pytest.approx(schedule.predicted_bubble())
            assert simulate(schedule, forward=1, backward=2).bubble == pytest.approx(schedule.predicted_bubble())
            for f, b, w in [(1, 1, 0.5), (2, 1, 1), (1, 2, 1), (3, 2, 1), (1.5, 1, 1)]:
                assert simulate(schedule, f, b, w).idle == pytest.approx([(k - 1) * (f + b - w)] * k)
            assert schedule.predicted_bubble() < (k - 1) / (3 * m) + 1e-12


def test_bad_input_is_one_config_error_line():
    cases = [
        (("gpipe", 4, 8), {"chunks": 2}, "--chunks"),
        (("1f1b", 4, 8), {"chunks": 2}, "--chunks"),
        (("zb-h1", 4, 8), {"chunks": 3}, "--chunks"),
        (("interleaved", 4, 6), {"chunks": 2}, "multiple of --stages"),
        (("interleaved", 4, 2), {"chunks": 2}, "multiple of --stages"),
        (("interleaved", 4, 8), {"chunks": 1}, "--chunks v >= 2"),
        (("pipedream-2bw", 4, 3), {}, "M >= --stages K"),
        (("1f1b", 4, 8), {"vertical_sync": True}, "--vertical-sync"),
        (("bogus", 4, 8), {}, "--schedule must be one of"),
        (("gpipe", 0, 8), {}, "stages"),
        (("gpipe", 4, 0), {}, "microbatches"),
    ]
    for args, kwargs, fragment in cases:
        with pytest.raises(ConfigError, match=fragment) as caught:
            make_schedule(*args, **kwargs)
        assert "\n" not in str(caught.value)
    for name in SCHEDULES:
        assert make_schedule(name, 4, 8, chunks=2 if name == "interleaved" else 1).name == name


def test_simulate_takes_each_stage_its_own_costs():
    """Measured costs differ per stage: equal ones give the scalar run's timeline, and a
    slower stage leaves the others idle beyond the closed form."""
    schedule = make_schedule("1f1b", 3, 4)
    assert simulate(schedule, [1.0] * 3, [2.0] * 3) == simulate(schedule, 1.0, 2.0)
    uneven = simulate(schedule, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0])
    assert uneven.bubble > schedule.predicted_bubble() + 0.05
    assert uneven.busy == (12.0, 24.0, 12.0)
    with pytest.raises(ConfigError, match="3 stages need 3 forward and backward costs"):
        simulate(schedule, [1.0, 1.0], 2.0)


def test_simulate_takes_a_weight_cost_per_stage():
    """The summary simulates zb-h1 with each stage's measured W: a W that grows on one
    stage only lengthens the run, and equal per-stage costs are the scalar's timeline."""
    from plexus.parallel.schedules import ZeroBubbleH1, simulate
    zb = ZeroBubbleH1(stages=3, microbatches=4)
    assert simulate(zb, 1.0, 1.0, [1.0, 1.0, 1.0]).makespan == simulate(zb, 1.0, 1.0, 1.0).makespan
    assert simulate(zb, 1.0, 1.0, [1.0, 1.0, 3.0]).makespan > simulate(zb, 1.0, 1.0, 1.0).makespan


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_backward_that_sends_before_its_additions_shortens_the_bubble(name):
    """The executor sends a backward's input gradients before it adds the parameters'
    gradients: with that tail simulated the previous stage waits less, and the bubble
    falls below the closed form, which assumes an atomic backward; with no tail it is
    the closed form, the busy seconds the same either way."""
    schedule = make_schedule(name, 2, 4)
    atomic, tailed = simulate(schedule, 1.0, 2.0), simulate(schedule, 1.0, 2.0, after_send=1.0)
    assert atomic.bubble == pytest.approx(schedule.predicted_bubble())
    assert simulate(schedule, 1.0, 2.0, after_send=[0.0, 0.0]) == atomic
    assert tailed.busy == atomic.busy and tailed.bubble < atomic.bubble - 0.05
    with pytest.raises(ConfigError, match="2 stages need 2 after-send costs"):
        simulate(schedule, 1.0, 2.0, after_send=[1.0])


@pytest.mark.parametrize("name, chunks", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_replay_with_each_ops_own_duration(name, chunks):
    """The summary replays a run's last steps with each op's measured duration: with every
    op at its kind's cost the replay is the simulation; one op made slower lengthens the
    run; durations that do not match the op lists are one line."""
    from plexus.parallel.schedules import replay
    schedule = make_schedule(name, 3, 6, chunks=chunks)
    cost = {"F": 1.0 / chunks, "B": (1.0 if schedule.splits_backward else 2.0) / chunks, "W": 1.0}
    durations = [[cost[op.kind] for op in schedule.ops(s)] for s in range(3)]
    tails = [[0.5 / chunks if op.kind == "B" else 0.0 for op in schedule.ops(s)] for s in range(3)]
    weight = 1.0 if schedule.splits_backward else None
    assert replay(schedule, durations) == simulate(schedule, 1.0, 2.0 if weight is None else 1.0, weight)
    assert replay(schedule, durations, tails) == simulate(schedule, 1.0, 2.0 if weight is None else 1.0, weight,
                                                          after_send=0.5)
    durations[1][2] += 3.0
    assert replay(schedule, durations).makespan > replay(schedule, durations[:1] + [
        [cost[op.kind] for op in schedule.ops(s)] for s in (1, 2)]).makespan
    with pytest.raises(ConfigError, match="replay: .* ops, got durations for"):
        replay(schedule, [row[:-1] for row in durations])


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_asynchronous_ops_come_one_at_a_time(name):
    """iter_ops gives ops()'s list, and makes a run as long as --time-limit's 2**62 steps
    without building it (the executor reads the ops of a whole run this way)."""
    import itertools
    schedule = make_schedule(name, 3, 1 if name == "pipedream" else 3, minibatches=5)
    for s in range(3):
        assert tuple(schedule.iter_ops(s)) == schedule.ops(s)
    endless = make_schedule(name, 3, 1 if name == "pipedream" else 3, minibatches=2**62)
    assert list(itertools.islice(endless.iter_ops(0), 6)) == list(schedule.ops(0)[:6])
