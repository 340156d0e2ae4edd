"""Tests for alpa_lite.cost_models.pipeline_schedule: GPipe and 1F1B step simulation.

Expected values are written out as arithmetic against the closed forms in the module
docstring of ``cost_models/pipeline_schedule.py``. ``p`` stages, ``m`` micro-batches,
``f``/``b`` forward/backward seconds per micro-batch, ``c`` seconds per transfer.
"""

import math
import random

import pytest

from alpa_lite.cost_models.pipeline_schedule import (
    Schedule,
    ScheduleResult,
    StageTiming,
    Task,
    TaskKind,
    schedule_from_name,
    simulate,
)

BOTH = list(Schedule)
# (p, m) with m < p, m = p and m > p, plus the p = 1 and m = 1 edges.
SHAPES = [(1, 1), (1, 5), (2, 1), (4, 2), (4, 3), (3, 3), (4, 4), (2, 5), (4, 8), (5, 16)]


def uniform(p, f=1.0, b=1.0, c=0.0, remat=False):
    return [StageTiming(f, b, c, c, remat) for _ in range(p)]


def by_key(result: ScheduleResult) -> dict[tuple[str, int, int], Task]:
    return {(t.kind.value, t.stage, t.micro_batch): t for t in result.tasks}


# --------------------------------------------------------------------------------------
# Uniform stages: the textbook closed forms.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", BOTH)
@pytest.mark.parametrize("p,m", SHAPES)
def test_uniform_step_and_bubble(schedule, p, m):
    r = simulate(uniform(p), m, schedule)
    # f = b = 1: step = (m + p - 1) * (1 + 1); bubble = (p - 1) / (m + p - 1).
    assert r.step_time_s == pytest.approx((m + p - 1) * 2.0)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.busy_s == pytest.approx((m * 2.0,) * p)  # m * (f + b) on every stage
    assert len(r.tasks) == 2 * p * m


@pytest.mark.parametrize("schedule", BOTH)
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (2.0, 1.0), (0.5, 3.0)])
def test_uniform_step_holds_for_unequal_forward_backward(schedule, f, b):
    p, m = 4, 6
    r = simulate(uniform(p, f, b), m, schedule)
    assert r.step_time_s == pytest.approx((6 + 4 - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx(3 / 9)


@pytest.mark.parametrize("schedule", BOTH)
def test_one_stage_is_no_pipeline(schedule):
    r = simulate([StageTiming(0.3, 0.5)], 7, schedule)
    assert r.step_time_s == pytest.approx(7 * (0.3 + 0.5))
    assert r.bubble_fraction == pytest.approx(0.0)
    assert r.peak_in_flight == ((7,) if schedule is Schedule.GPIPE else (1,))


def test_docstring_example():
    r = simulate([StageTiming(1.0, 1.0)] * 4, 8, Schedule.ONE_F_ONE_B)
    assert r.step_time_s == 22.0  # (8 + 4 - 1) * 2
    assert round(r.bubble_fraction, 4) == 0.2727  # 3 / 11


@pytest.mark.parametrize("schedule", BOTH)
def test_all_zero_times(schedule):
    r = simulate(uniform(3, 0.0, 0.0), 4, schedule)
    assert r.step_time_s == 0.0
    assert r.bubble_fraction == 0.0


# --------------------------------------------------------------------------------------
# Transfers.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("serialize", [True, False])
@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_transfers_add_one_round_trip(p, m, serialize):
    # f = b = 1, c = 0.25: forwards cross p-1 links, backwards p-1 links, each once:
    # step = (m + p - 1) * 2 + 2 * (p - 1) * 0.25.
    r = simulate(uniform(p, c=0.25), m, Schedule.GPIPE, serialize_links=serialize)
    assert r.step_time_s == pytest.approx((m + p - 1) * 2.0 + 2 * (p - 1) * 0.25)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2])
def test_1f1b_transfers_add_one_round_trip_for_two_micro_batches(p, m):
    # m <= 2: stage 0 never hits its cap of p in flight, so the path crosses each link
    # twice, as in GPipe: step = (m + p - 1) * 2 + 2 * (p - 1) * c.
    c = 0.25
    r = simulate(uniform(p, c=c), m, Schedule.ONE_F_ONE_B)
    assert r.step_time_s == pytest.approx((m + p - 1) * 2.0 + 2 * (p - 1) * c)


def test_1f1b_transfers_two_stages_by_hand():
    # p = 2, m = 3, f = b = 1, c = 0.25 (t = task [start, end], -> = transfer of c).
    # stage 0 (F0 F1 B0 F2 B1 B2)      stage 1 (F0 B0 F1 B1 F2 B2)
    # F0 [0, 1]   -> 1.25               F0 [1.25, 2.25]  B0 [2.25, 3.25] -> 3.5
    # F1 [1, 2]   -> 2.25               F1 [3.25, 4.25]  B1 [4.25, 5.25] -> 5.5
    # B0 [3.5, 4.5]  F2 [4.5, 5.5] -> 5.75
    # B1 [5.5, 6.5]                     F2 [5.75, 6.75]  B2 [6.75, 7.75] -> 8.0
    # B2 [8.0, 9.0]
    # step 9.0 = (3 + 2 - 1) * 2 + 4 * c: two round trips (2c * ceil(m / 2) = 2c * 2).
    r = simulate(uniform(2, c=0.25), 3, Schedule.ONE_F_ONE_B)
    t = by_key(r)
    assert (t["forward", 1, 2].start_s, t["backward", 0, 0].start_s) == (5.75, 3.5)
    assert r.step_time_s == pytest.approx(9.0)
    assert r.step_time_s == pytest.approx((3 + 2 - 1) * 2 + 2 * 0.25 * math.ceil(3 / 2))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [3, 4, 7, 12])
def test_1f1b_transfers_empirical_closed_form(p, m):
    # [Empirical] step = (m + p - 1)(f + b) + 2c [(p - 1) + ceil((m - 2)(p - 1) / p)]
    # (module docstring), here f = 1, b = 2, c = 0.5.
    f, b, c = 1.0, 2.0, 0.5
    r = simulate(uniform(p, f, b, c), m, Schedule.ONE_F_ONE_B)
    expected = (m + p - 1) * (f + b) + 2 * c * ((p - 1) + math.ceil((m - 2) * (p - 1) / p))
    assert r.step_time_s == pytest.approx(expected)


def test_serialised_link_waits_for_the_previous_transfer():
    # p = 2, m = 3, GPipe, f = 1, b = 1, activation send 3 s (longer than f):
    # serialised: sends F0 [1, 4], F1 [4, 7], F2 [7, 10]; stage 1 F2 [10, 11], then
    #   B2 B1 B0 [11, 14]; gradients (0 s) arrive at 12, 13, 14; stage 0 B0 ends 15.
    # delay:      arrivals 4, 5, 6; stage 1 F0 F1 F2 [4, 7], B2 B1 B0 [7, 10];
    #   stage 0 B0 ends 11 = (3 + 2 - 1) * 2 + 3.
    stages = [StageTiming(1.0, 1.0, send_activation_s=3.0), StageTiming(1.0, 1.0)]
    assert simulate(stages, 3, Schedule.GPIPE).step_time_s == pytest.approx(15.0)
    r = simulate(stages, 3, Schedule.GPIPE, serialize_links=False)
    assert r.step_time_s == pytest.approx(11.0)


def test_sends_off_the_ends_are_ignored():
    # The last stage's activation send and the first stage's gradient send go nowhere.
    plain = simulate(uniform(3), 4, Schedule.ONE_F_ONE_B)
    stages = [
        StageTiming(1.0, 1.0, send_gradient_s=100.0),
        StageTiming(1.0, 1.0),
        StageTiming(1.0, 1.0, send_activation_s=100.0),
    ]
    assert simulate(stages, 4, Schedule.ONE_F_ONE_B).step_time_s == plain.step_time_s


# --------------------------------------------------------------------------------------
# Memory: micro-batches in flight.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", SHAPES)
def test_peak_in_flight(p, m):
    one_f_one_b = simulate(uniform(p), m, Schedule.ONE_F_ONE_B)
    assert one_f_one_b.peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert simulate(uniform(p), m, Schedule.GPIPE).peak_in_flight == (m,) * p


# --------------------------------------------------------------------------------------
# Non-uniform stages.
# --------------------------------------------------------------------------------------

# p = 2, m = 3. Stage 0: f = 1, b = 2, activation send 0.5. Stage 1: f = 3, b = 4,
# gradient send 0.25. Stage 1 is the slowest: m (f + b) = 3 * 7 = 21.
HAND = [StageTiming(1.0, 2.0, send_activation_s=0.5), StageTiming(3.0, 4.0, send_gradient_s=0.25)]


def test_hand_simulated_gpipe():
    # stage 0: F0 [0, 1] F1 [1, 2] F2 [2, 3]; activations arrive 1.5, 2.5, 3.5.
    # stage 1: F0 [1.5, 4.5] F1 [4.5, 7.5] F2 [7.5, 10.5]
    #          B2 [10.5, 14.5] B1 [14.5, 18.5] B0 [18.5, 22.5]; gradients +0.25.
    # stage 0: B2 [14.75, 16.75] B1 [18.75, 20.75] B0 [22.75, 24.75].
    r = simulate(HAND, 3, Schedule.GPIPE)
    t = by_key(r)
    assert (t["forward", 1, 0].start_s, t["backward", 1, 0].end_s) == (1.5, 22.5)
    assert (t["backward", 0, 2].start_s, t["backward", 0, 0].start_s) == (14.75, 22.75)
    # step = f0 + a0 + m (f1 + b1) + g1 + b0 = 1 + 0.5 + 21 + 0.25 + 2 (the lower bound).
    assert r.step_time_s == pytest.approx(1 + 0.5 + 21 + 0.25 + 2)
    assert r.busy_s == pytest.approx((3 * (1 + 2), 3 * (3 + 4)))
    assert r.bubble_fraction == pytest.approx(1 - (9 + 21) / (2 * 24.75))


def test_hand_simulated_1f1b():
    # stage 0 (F0 F1 B0 F2 B1 B2): F0 [0, 1] -> 1.5, F1 [1, 2] -> 2.5
    # stage 1 (F0 B0 F1 B1 F2 B2): F0 [1.5, 4.5] B0 [4.5, 8.5] -> 8.75
    #                              F1 [8.5, 11.5] B1 [11.5, 15.5] -> 15.75
    # stage 0: B0 [8.75, 10.75] F2 [10.75, 11.75] -> 12.25  B1 [15.75, 17.75]
    # stage 1: F2 [15.5, 18.5] (waits for B1, not for the activation) B2 [18.5, 22.5] -> 22.75
    # stage 0: B2 [22.75, 24.75]
    r = simulate(HAND, 3, Schedule.ONE_F_ONE_B)
    t = by_key(r)
    assert (t["backward", 0, 0].start_s, t["forward", 0, 2].end_s) == (8.75, 11.75)
    assert (t["forward", 1, 2].start_s, t["backward", 0, 1].start_s) == (15.5, 15.75)
    assert r.step_time_s == pytest.approx(24.75)
    assert r.peak_in_flight == (2, 1)


@pytest.mark.parametrize("schedule", BOTH)
def test_slowest_stage_dominates(schedule):
    # Stage 2 takes f + b = 3 + 5 = 8 per micro-batch, the others 2: step >= m * 8, and
    # with the fill/drain of the bound: 1 + 1 + 8m + 1 + 1 (stages 0, 1 before and after).
    m = 6
    stages = [StageTiming(1.0, 1.0), StageTiming(1.0, 1.0), StageTiming(3.0, 5.0)]
    r = simulate(stages, m, schedule)
    assert r.step_time_s >= m * (3.0 + 5.0)
    assert r.step_time_s == pytest.approx(2 * 1.0 + m * 8.0 + 2 * 1.0)


def test_max_forward_plus_max_backward_is_not_a_bound():
    # f_max and b_max on different stages: stage 0 f = 10, b = 0; stage 1 f = 0, b = 10.
    # m (f_max + b_max) = 4 * 20 = 80, which GPipe reaches (stage 1's first backward waits
    # for all of stage 0's forwards), but 1F1B interleaves the two stages:
    # stage 0 F0 [0, 10] F1 [10, 20] B0 [20] F2 [20, 30] B1 [30] F3 [30, 40] B2 [40] B3 [50]
    # stage 1 F0 B0 [10, 20] F1 B1 [20, 30] F2 B2 [30, 40] F3 B3 [40, 50]  -> 10 (m + 1) = 50.
    stages = [StageTiming(10.0, 0.0), StageTiming(0.0, 10.0)]
    assert simulate(stages, 4, Schedule.GPIPE).step_time_s == pytest.approx(80.0)
    assert simulate(stages, 4, Schedule.ONE_F_ONE_B).step_time_s == pytest.approx(50.0)


# --------------------------------------------------------------------------------------
# Recomputation.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", BOTH)
@pytest.mark.parametrize("p,m", [(1, 3), (3, 2), (4, 8)])
def test_remat_adds_forward_to_each_backward(schedule, p, m):
    # Every backward becomes f + b = 1 + 2: step = (m + p - 1) * (f + (f + b)).
    f, b = 1.0, 2.0
    r = simulate(uniform(p, f, b, remat=True), m, schedule)
    assert r.step_time_s == pytest.approx((m + p - 1) * (f + f + b))
    assert r.busy_s == pytest.approx((m * (2 * f + b),) * p)
    t = by_key(r)
    for s in range(p):
        for i in range(m):
            rec, bwd = t["recompute", s, i], t["backward", s, i]
            assert rec.duration_s == pytest.approx(f) and rec.end_s == bwd.start_s


def test_remat_on_one_stage_by_hand():
    # HAND with remat on stage 0, GPipe: stage 0's backwards become recompute + backward
    # of 1 + 2 = 3; they start when the gradients arrive (14.75, 18.75, 22.75), so the
    # last ends at 22.75 + 3 = 25.75 (one f later than without remat).
    stages = [StageTiming(1.0, 2.0, send_activation_s=0.5, remat=True), HAND[1]]
    r = simulate(stages, 3, Schedule.GPIPE)
    assert r.step_time_s == pytest.approx(22.75 + 1 + 2)
    kinds = [t.kind for t in r.tasks if t.stage == 0]
    assert kinds == ["forward"] * 3 + ["recompute", "backward"] * 3


# --------------------------------------------------------------------------------------
# Every dependency holds, and every task starts as early as they allow.
# --------------------------------------------------------------------------------------


def reference_order(schedule, s, p, m):
    """The stage orders of the module docstring, written out again."""
    if schedule is Schedule.GPIPE:
        return [("forward", i) for i in range(m)] + [("backward", i) for i in range(m - 1, -1, -1)]
    w = min(p - s - 1, m)
    order = [("forward", i) for i in range(w)]
    for k in range(m - w):
        order += [("forward", w + k), ("backward", k)]
    return order + [("backward", i) for i in range(m - w, m)]


def check_timeline(stages, m, schedule, serialize, r):
    p = len(stages)
    t = by_key(r)
    assert len(r.tasks) == sum(m * (3 if st.remat else 2) for st in stages)
    # Links, replayed first in first out: arrival[(kind, sender, i)].
    arrival = {}
    for s in range(p):
        for kind, cost, exists in (
            ("forward", stages[s].send_activation_s, s < p - 1),
            ("backward", stages[s].send_gradient_s, s > 0),
        ):
            if not exists:
                continue
            free = 0.0
            sent = [x for x in r.tasks if x.stage == s and x.kind == kind]  # stage order
            for task in sent:
                start = max(task.end_s, free) if serialize else task.end_s
                free = arrival[kind, s, task.micro_batch] = start + cost
    for s, st in enumerate(stages):
        prev_end = 0.0
        order = reference_order(schedule, s, p, m)
        tasks = [x for x in r.tasks if x.stage == s]
        expanded = []
        for kind, i in order:
            if kind == "backward" and st.remat:
                expanded.append(("recompute", i))
            expanded.append((kind, i))
        assert [(x.kind.value, x.micro_batch) for x in tasks] == expanded
        for kind, i in order:
            if kind == "forward":
                first = task = t["forward", s, i]
                ready = 0.0 if s == 0 else arrival["forward", s - 1, i]
                assert task.duration_s == pytest.approx(st.forward_s)
            else:
                task = t["backward", s, i]
                first = t["recompute", s, i] if st.remat else task
                ready = t["forward", s, i].end_s
                if s < p - 1:
                    ready = max(ready, arrival["backward", s + 1, i])
                assert task.duration_s == pytest.approx(st.backward_s)
                if st.remat:
                    assert first.duration_s == pytest.approx(st.forward_s)
                    assert first.end_s == task.start_s
            assert first.start_s >= prev_end and first.start_s >= ready  # dependencies hold
            assert first.start_s == pytest.approx(max(prev_end, ready))  # and are tight
            prev_end = task.end_s
    assert r.step_time_s == pytest.approx(max(x.end_s for x in r.tasks))
    # finish_s: when each stage's last backward ends (what the planner reads instead of
    # the task records).
    assert r.finish_s == tuple(max(x.end_s for x in r.tasks if x.stage == s and x.kind == "backward")
                               for s in range(p))
    assert r.busy_s == pytest.approx(
        tuple(m * (st.forward_s * (2 if st.remat else 1) + st.backward_s) for st in stages)
    )


def lower_bound(stages, m):
    """Module docstring: fill to stage s, its busy time, drain of its last backward."""
    p = len(stages)
    back = [st.backward_s + (st.forward_s if st.remat else 0.0) for st in stages]
    best = 0.0
    for s in range(p):
        fill = sum(stages[t].forward_s + stages[t].send_activation_s for t in range(s))
        drain = sum(back[t] + stages[t + 1].send_gradient_s for t in range(s))
        best = max(best, fill + m * (stages[s].forward_s + back[s]) + drain)
    return best


def random_stages(rng, p):
    def draw():  # seconds; one in ten is exactly 0.0
        return 0.0 if rng.random() < 0.1 else rng.uniform(0.05, 3.0)

    return [StageTiming(draw(), draw(), draw(), draw(), rng.random() < 0.3) for _ in range(p)]


@pytest.mark.parametrize("schedule", BOTH)
@pytest.mark.parametrize("serialize", [True, False])
def test_random_instances_respect_dependencies(schedule, serialize):
    rng = random.Random(1234)
    for _ in range(60):
        p, m = rng.randint(1, 5), rng.randint(1, 8)
        stages = random_stages(rng, p)
        r = simulate(stages, m, schedule, serialize_links=serialize)
        check_timeline(stages, m, schedule, serialize, r)
        assert r.step_time_s >= lower_bound(stages, m) * (1 - 1e-12)
        slowest = max(m * (s.forward_s + s.backward_s) for s in stages)
        assert r.step_time_s >= slowest * (1 - 1e-12)  # the slowest stage bounds the step
        assert 0.0 <= r.bubble_fraction < 1.0


# --------------------------------------------------------------------------------------
# Names and validation.
# --------------------------------------------------------------------------------------


def test_schedule_from_name():
    assert schedule_from_name("gpipe") is Schedule.GPIPE
    assert schedule_from_name(" 1F1B ") is Schedule.ONE_F_ONE_B
    with pytest.raises(ValueError, match=r"'pipedream'.*\['gpipe', '1f1b'\]"):
        schedule_from_name("pipedream")


def test_task_kind_compares_as_string():
    assert TaskKind.FORWARD == "forward" and TaskKind("recompute") is TaskKind.RECOMPUTE


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(forward_s=-1.0, backward_s=1.0), "forward_s"),
        (dict(forward_s=1.0, backward_s=math.nan), "backward_s"),
        (dict(forward_s=1.0, backward_s=1.0, send_activation_s=math.inf), "send_activation_s"),
        (dict(forward_s=1.0, backward_s=1.0, send_gradient_s="1"), "send_gradient_s"),
        (dict(forward_s=1.0, backward_s=1.0, remat=1), "remat"),
    ],
)
def test_stage_timing_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"StageTiming: {field}"):
        StageTiming(**kwargs)


def test_simulate_validation():
    ok = [StageTiming(1.0, 1.0)]
    with pytest.raises(ValueError, match="stages is empty"):
        simulate([], 2, Schedule.GPIPE)
    with pytest.raises(ValueError, match=r"stages\[1\] must be a StageTiming"):
        simulate([ok[0], (1.0, 1.0)], 2, Schedule.GPIPE)
    with pytest.raises(ValueError, match="wrap a single stage"):
        simulate(ok[0], 2, Schedule.GPIPE)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1, got 0"):
        simulate(ok, 0, Schedule.GPIPE)
    with pytest.raises(ValueError, match="num_micro_batches must be an integer"):
        simulate(ok, 2.0, Schedule.GPIPE)
    with pytest.raises(ValueError, match="schedule_from_name"):
        simulate(ok, 2, "1f1b")
