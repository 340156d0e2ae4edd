"""Tests for alpa_lite.solvers.stage_dp: exactness against brute force and an independent
reference, hand-checked optima, memory behaviour, errors."""

import functools
import math

import numpy as np
import pytest

from alpa_lite.solvers.stage_dp import (
    NoFeasiblePipelineError,
    OptionColumns,
    PipelinePlan,
    StageAssignment,
    StageOption,
    StageOptionGrid,
    SubmeshShape,
    brute_force_stage_plan,
    range_pairs,
    solve_stage_dp,
    submesh_shapes,
)

CLUSTERS = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4)]


def random_options(rng, num_layers, num_nodes, devices_per_node):
    """A table of 0–3 options per (start, end, submesh), some empty.

    Half the instances draw small integers, so latencies tie and the memory limit (drawn
    by the caller from the same range) binds for some in-flight counts and not others.
    """
    coarse = rng.random() < 0.5
    table = {}
    for start in range(num_layers):
        for end in range(start, num_layers):
            for shape in submesh_shapes(num_nodes, devices_per_node):
                if rng.random() < 0.15:
                    table[start, end, shape] = []
                    continue
                layers, devices = end - start + 1, shape.num_devices
                table[start, end, shape] = [
                    StageOption(
                        float(rng.integers(1, 6)) if coarse
                        else float(rng.random() * 4 * layers / devices + 0.01),
                        float(rng.integers(0, 5)), float(rng.integers(0, 4)), f"o{n}")
                    for n in range(int(rng.integers(1, 4)))
                ]
    return lambda start, end, shape: table[start, end, shape]


def check_plan(plan, num_layers, num_nodes, devices_per_node, memory, stage_options):
    """Contiguous, covering, exactly N·M devices, fitting memory, latency = T formula."""
    stages = plan.stages
    assert stages[0].start == 0 and stages[-1].end == num_layers - 1
    assert all(a.end + 1 == b.start for a, b in zip(stages, stages[1:]))
    assert sum(st.submesh.num_devices for st in stages) == num_nodes * devices_per_node
    n = len(stages)
    for s, st in enumerate(stages):
        assert st.option in stage_options(st.start, st.end, st.submesh)
        assert st.option.param_bytes + st.option.act_bytes * (n - s) <= memory
    latencies = [st.option.latency_s for st in stages]
    t = sum(latencies) + (plan.num_micro_batches - 1) * max(latencies)
    assert plan.latency_s == pytest.approx(t, rel=1e-12)


def test_submesh_shapes():
    shapes = submesh_shapes(2, 8)
    assert [(s.num_nodes, s.devices_per_node) for s in shapes] == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
    assert [s.num_devices for s in submesh_shapes(3, 6)] == [1, 2, 4, 6, 12, 18]
    assert submesh_shapes(1, 1) == (SubmeshShape(1, 1),)


def test_random_small_instances_match_brute_force():
    rng = np.random.default_rng(20240531)
    feasible = 0
    for _ in range(250):
        num_layers = int(rng.integers(1, 7))
        num_nodes, devices_per_node = CLUSTERS[int(rng.integers(len(CLUSTERS)))]
        micro_batches = int(rng.integers(1, 9))
        options = random_options(rng, num_layers, num_nodes, devices_per_node)
        memory = float(rng.integers(3, 16))
        max_stages = None if rng.random() < 0.8 else int(rng.integers(1, 4))
        args = (num_layers, num_nodes, devices_per_node, micro_batches, options, memory,
                max_stages)
        try:
            reference = brute_force_stage_plan(*args)
        except NoFeasiblePipelineError:
            with pytest.raises(NoFeasiblePipelineError):
                solve_stage_dp(*args)
            continue
        plan, stats = solve_stage_dp(*args)
        assert plan.latency_s == pytest.approx(reference.latency_s, rel=1e-9), args
        check_plan(plan, num_layers, num_nodes, devices_per_node, memory, options)
        if max_stages is not None:
            assert len(plan.stages) <= max_stages
        assert 1 <= stats.t_max_tried <= stats.t_max_total
        feasible += 1
    assert feasible > 150  # the memory limit must not make most instances infeasible


def reference_latency(num_layers, num_nodes, devices_per_node, micro_batches, stage_options,
                      memory):
    """Independent of t_max: per (stages left, first layer, devices left), the Pareto set of
    (Σ t, max t) over suffix plans; T* = min Σ + (B − 1)·max over complete plans."""
    shapes = submesh_shapes(num_nodes, devices_per_node)
    total = num_nodes * devices_per_node

    def fastest(start, end, shape, in_flight):
        fit = [o.latency_s for o in stage_options(start, end, shape)
               if o.param_bytes + o.act_bytes * in_flight <= memory]
        return min(fit, default=None)

    @functools.lru_cache(maxsize=None)
    def labels(stages, first, devices):
        if stages == 0:
            return ((0.0, 0.0),) if first == num_layers and devices == 0 else ()
        found = []
        for end in range(first, num_layers):
            for shape in shapes:
                if shape.num_devices <= devices:
                    t = fastest(first, end, shape, stages)
                    if t is not None:
                        found += [(t + rest, max(t, worst)) for rest, worst in
                                  labels(stages - 1, end + 1, devices - shape.num_devices)]
        pareto, lowest = [], math.inf
        for total_t, worst in sorted(found):
            if worst < lowest:
                pareto.append((total_t, worst))
                lowest = worst
        return tuple(pareto)

    return min((t + (micro_batches - 1) * worst
                for stages in range(1, min(num_layers, total) + 1)
                for t, worst in labels(stages, 0, total)), default=math.inf)


def test_larger_instances_match_reference():
    """Up to 12 layers and 32 devices, where the bounds and the t_max search prune a lot."""
    rng = np.random.default_rng(7)
    stage_counts = []
    for n in range(40):
        num_layers = int(rng.integers(5, 13))
        num_nodes, devices_per_node = [(2, 4), (4, 2), (3, 4), (4, 8)][int(rng.integers(4))]
        micro_batches = int(rng.choice([1, 4, 16, 64]))
        total = num_nodes * devices_per_node
        if n % 4 == 3:  # arbitrary costs
            options = random_options(rng, num_layers, num_nodes, devices_per_node)
            memory = float(rng.integers(4, 16))
        else:  # GPT-like: a stage spanning nodes pays for it; remat trades time for memory
            cross = float(rng.choice([0.3, 1.0]))

            @functools.lru_cache(maxsize=None)
            def options(start, end, shape, cross=cross):
                layers, devices = end - start + 1, shape.num_devices
                slowdown = 1 + 0.03 * math.log2(devices) + cross * math.log2(shape.num_nodes)
                t = layers / devices * slowdown + 0.02
                return (StageOption(t, layers / devices, 0.5 * layers / devices, "plain"),
                        StageOption(1.3 * t, layers / devices, 0.05 * layers / devices,
                                    "remat"))

            memory = float(rng.uniform(0.3, 2.0)) * num_layers / total
        expected = reference_latency(num_layers, num_nodes, devices_per_node, micro_batches,
                                     options, memory)
        if math.isinf(expected):
            with pytest.raises(NoFeasiblePipelineError):
                solve_stage_dp(num_layers, num_nodes, devices_per_node, micro_batches,
                               options, memory)
            continue
        plan, _ = solve_stage_dp(num_layers, num_nodes, devices_per_node, micro_batches,
                                 options, memory)
        assert plan.latency_s == pytest.approx(expected, rel=1e-9)
        check_plan(plan, num_layers, num_nodes, devices_per_node, memory, options)
        stage_counts.append(len(plan.stages))
    assert max(stage_counts) >= 3  # the instances exercise real pipelines


def test_hand_checked_two_devices():
    # 4 layers, one node of 2 devices, B = 4 micro-batches, memory never binds.
    # A layer takes 1.0 s on (1, 1) and 0.8 s on (1, 2) (poor intra-op scaling).
    def options(start, end, shape):
        per_layer = 1.0 if shape.num_devices == 1 else 0.8
        return [StageOption((end - start + 1) * per_layer, 0.0, 0.0)]

    plan, _ = solve_stage_dp(4, 1, 2, 4, options, 1.0)
    # One stage on (1, 2):           t = 4·0.8 = 3.2;  T = 3.2 + 3·3.2       = 12.8
    # Two stages of 2 layers, (1, 1) each: t = 2, 2;   T = (2 + 2) + 3·2     = 10.0
    # Two stages of 1 + 3 layers:    t = 1, 3;         T = (1 + 3) + 3·3     = 13.0
    assert plan.latency_s == pytest.approx(10.0)
    assert [(st.start, st.end, st.submesh) for st in plan.stages] == [
        (0, 1, SubmeshShape(1, 1)), (2, 3, SubmeshShape(1, 1))]
    assert plan.max_stage_latency_s == pytest.approx(2.0)
    # With B = 1 there is no bubble to hide: T = Σ t, and one stage (3.2) beats two (4.0).
    plan, _ = solve_stage_dp(4, 1, 2, 1, options, 1.0)
    assert plan.latency_s == pytest.approx(3.2)
    assert len(plan.stages) == 1 and plan.stages[0].submesh == SubmeshShape(1, 2)


def uniform_options(start, end, shape):
    # 8 identical layers; a layer takes 1/devices s and keeps its 1-byte weights on every
    # device of its stage (no sharding), so only a shorter stage needs less memory.
    layers = end - start + 1
    return [StageOption(layers / shape.num_devices, float(layers), 0.0)]


def test_memory_forces_pipelining():
    # Memory 4 B: at most 4 layers per stage, so no single stage fits 8 layers.
    # Two stages of 4 layers on (1, 2):       t = 2, 2;     T = 4 + 3·2 = 10
    # Three stages, e.g. 4 + 2 + 2 layers on (1, 2), (1, 1), (1, 1): T = 6 + 3·2 = 12
    # Four stages of 2 layers on (1, 1):      t = 2 each;   T = 8 + 3·2 = 14
    plan, _ = solve_stage_dp(8, 1, 4, 4, uniform_options, 4.0)
    assert plan.latency_s == pytest.approx(10.0)
    assert [(st.start, st.end, st.submesh.num_devices) for st in plan.stages] == [
        (0, 3, 2), (4, 7, 2)]
    assert plan == brute_force_stage_plan(8, 1, 4, 4, uniform_options, 4.0)


def test_single_stage_wins_with_ample_memory():
    # The whole model on (1, 4): t = 8/4 = 2; T = 2 + 3·2 = 8 < 10 for two stages.
    plan, stats = solve_stage_dp(8, 1, 4, 4, uniform_options, math.inf)
    assert plan.latency_s == pytest.approx(8.0)
    assert len(plan.stages) == 1 and plan.stages[0].submesh == SubmeshShape(1, 4)
    assert stats.cost_queries == 36 * 3  # 8·9/2 layer ranges × 3 submesh shapes


def test_ties_prefer_fewer_stages_and_are_deterministic():
    # A layer takes 1 s on any submesh. 2 layers on 1 × 2, B = 1: one stage on (1, 2)
    # (t = 2) and two stages on (1, 1) (t = 1 + 1) both give T = 2; the single stage wins.
    def options(start, end, shape):
        return [StageOption(float(end - start + 1), 0.0, 0.0)]

    plan, _ = solve_stage_dp(2, 1, 2, 1, options, 1.0)
    assert len(plan.stages) == 1
    again, _ = solve_stage_dp(2, 1, 2, 1, options, 1.0)
    assert again == plan


def test_each_range_and_submesh_is_queried_once():
    calls = []

    def options(start, end, shape):
        calls.append((start, end, shape))
        return uniform_options(start, end, shape)

    _, stats = solve_stage_dp(8, 2, 2, 8, options, 4.0)
    assert len(calls) == len(set(calls)) == stats.cost_queries == 36 * 3
    assert stats.solve_time_s > 0


def test_infeasible_memory_says_why_and_what_to_do():
    def options(start, end, shape):
        return [StageOption(1.0, 10.0, 2.0)]  # needs 12 B with one micro-batch in flight

    with pytest.raises(NoFeasiblePipelineError) as err:
        solve_stage_dp(3, 1, 2, 4, options, 8.0)
    message = str(err.value)
    assert "smallest per-device need" in message and "12 B" in message and "8 B" in message
    assert "micro-batches" in message and "rematerialisation" in message
    assert "more devices" in message


def test_infeasible_uncovered_layer_is_named():
    def options(start, end, shape):
        return [] if start <= 2 <= end else [StageOption(1.0, 0.0, 0.0)]

    with pytest.raises(NoFeasiblePipelineError, match=r"covers layer\(s\) 2"):
        solve_stage_dp(4, 1, 2, 2, options, 1.0)


def test_infeasible_device_count_explained():
    # Only (1, 1) can run anything: two layers cannot use all 4 devices.
    def options(start, end, shape):
        return [StageOption(1.0, 0.0, 0.0)] if shape.num_devices == 1 else []

    with pytest.raises(NoFeasiblePipelineError, match="exactly 4 devices"):
        solve_stage_dp(2, 1, 4, 2, options, 1.0)
    with pytest.raises(NoFeasiblePipelineError, match="exactly 4 devices"):
        brute_force_stage_plan(2, 1, 4, 2, options, 1.0)


def test_infeasible_in_flight_memory_explained():
    # One micro-batch needs 3 B of 5 B, two need 6 B: only one stage fits, and no single
    # stage can use all 4 devices because (1, 4) has no option.
    def options(start, end, shape):
        return [StageOption(1.0, 0.0, 3.0)] if shape.num_devices < 4 else []

    with pytest.raises(NoFeasiblePipelineError, match="micro-batches in flight"):
        solve_stage_dp(3, 1, 4, 4, options, 5.0)


def test_in_flight_memory_limits_the_number_of_stages():
    # Each stage keeps 1 B per micro-batch in flight and memory is 2 B: the first of S
    # stages holds S micro-batches, so at most 2 stages fit although 4 would be faster.
    def options(start, end, shape):
        return [StageOption(float(end - start + 1) / shape.num_devices ** 0.5, 0.0, 1.0)]

    plan, _ = solve_stage_dp(4, 1, 4, 16, options, 2.0)
    assert len(plan.stages) <= 2
    assert plan == brute_force_stage_plan(4, 1, 4, 16, options, 2.0)
    unlimited, _ = solve_stage_dp(4, 1, 4, 16, options, math.inf)
    assert len(unlimited.stages) == 4 and unlimited.latency_s < plan.latency_s


@pytest.mark.parametrize("name, value", [
    ("num_layers", 0), ("num_layers", 2.5), ("num_layers", True), ("num_nodes", 0),
    ("devices_per_node", -1), ("num_micro_batches", 0), ("device_memory_bytes", 0.0),
    ("device_memory_bytes", -1.0), ("device_memory_bytes", math.nan), ("max_stages", 0),
    ("stage_options", "not callable"),
])
def test_bad_arguments_name_the_argument(name, value):
    args = dict(num_layers=2, num_nodes=1, devices_per_node=2, num_micro_batches=2,
                stage_options=uniform_options, device_memory_bytes=8.0, max_stages=None)
    args[name] = value
    for solver in (solve_stage_dp, brute_force_stage_plan):
        with pytest.raises(ValueError, match=name):
            solver(**args)


def test_bad_stage_options_are_reported():
    with pytest.raises(ValueError, match=r"stage_options\(0, 0, \(1, 1\)\) returned a float"):
        solve_stage_dp(1, 1, 1, 1, lambda s, e, m: [1.0], 1.0)
    with pytest.raises(ValueError, match="not a sequence"):
        solve_stage_dp(1, 1, 1, 1, lambda s, e, m: None, 1.0)
    with pytest.raises(ValueError, match="latency_s"):
        StageOption(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="param_bytes"):
        StageOption(1.0, math.inf, 0.0)


def test_brute_force_refuses_large_instances():
    with pytest.raises(ValueError, match="solve_stage_dp"):
        brute_force_stage_plan(24, 4, 8, 2, uniform_options, math.inf)


def test_plan_records_validate_and_describe():
    option = StageOption(1.0, 2.0, 0.5, "(1, 2) remat")
    shape = SubmeshShape(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        PipelinePlan((StageAssignment(0, 1, shape, option), StageAssignment(3, 4, shape, option)),
                     4, 5.0)
    with pytest.raises(ValueError, match="start <= end"):
        StageAssignment(2, 1, shape, option)
    plan, _ = solve_stage_dp(8, 1, 4, 4, uniform_options, 4.0)
    text = plan.describe()
    assert "2 stage(s)" in text and "layers 0..3 on (1, 2)" in text


def as_grid(stage_options, num_layers, width=3):
    """The callable's options as a StageOptionGrid: column n holds option n of each range
    (labels o0, o1, ...), NaN where a range has fewer."""
    starts, ends = range_pairs(num_layers)

    def columns(shape):
        cube = np.full((3, len(starts), width), np.nan)
        for r, (a, b) in enumerate(zip(starts, ends)):
            for n, o in enumerate(stage_options(int(a), int(b), shape)):
                cube[:, r, n] = o.latency_s, o.param_bytes, o.act_bytes
        return OptionColumns(*cube, tuple(f"o{n}" for n in range(width)))

    return StageOptionGrid(num_layers, columns)


def test_an_option_grid_plans_what_the_callable_plans():
    rng = np.random.default_rng(7)
    compared = refused = 0
    for _ in range(120):
        num_layers = int(rng.integers(1, 7))
        num_nodes, devices_per_node = CLUSTERS[int(rng.integers(len(CLUSTERS)))]
        micro_batches = int(rng.integers(1, 9))
        options = random_options(rng, num_layers, num_nodes, devices_per_node)
        grid = as_grid(options, num_layers)
        shapes = submesh_shapes(num_nodes, devices_per_node)
        # The grid answers per range as the callable does: same options, same order.
        for a, b in zip(*range_pairs(num_layers)):
            for shape in shapes:
                assert grid(int(a), int(b), shape) == list(options(int(a), int(b), shape))
        memory = float(rng.integers(3, 16))
        args = (num_layers, num_nodes, devices_per_node, micro_batches)
        try:
            want = solve_stage_dp(*args, options, memory)
        except NoFeasiblePipelineError as e:
            with pytest.raises(NoFeasiblePipelineError) as got:
                solve_stage_dp(*args, grid, memory)
            assert str(got.value) == str(e)
            refused += 1
            continue
        got = solve_stage_dp(*args, grid, memory)
        assert got[0] == want[0]          # stages, cuts, submeshes, options and labels
        assert got[1].cost_queries == want[1].cost_queries
        compared += 1
    assert compared > 60 and refused > 5


def test_a_bad_option_grid_is_named():
    def columns(shape):
        lat = np.ones((3, 1))
        lat[1, 0] = -1.0
        return OptionColumns(lat, np.zeros((3, 1)), np.zeros((3, 1)), ("mesh (1, 2)",))
    with pytest.raises(ValueError, match=r"latency_s for layers 0..1 \('mesh \(1, 2\)'\) "
                                         r"is -1.0: it must be finite and >= 0"):
        solve_stage_dp(2, 1, 2, 4, StageOptionGrid(2, columns), 1e9)
    with pytest.raises(ValueError, match=r"has shape \(2, 1\), not \(3, 1\)"):
        solve_stage_dp(2, 1, 2, 4, StageOptionGrid(2, lambda shape: OptionColumns(
            np.ones((2, 1)), np.zeros((2, 1)), np.zeros((2, 1)), ("x",))), 1e9)
    with pytest.raises(ValueError, match="is for 3 layers, the DP for 2"):
        solve_stage_dp(2, 1, 2, 4, StageOptionGrid(3, columns), 1e9)
