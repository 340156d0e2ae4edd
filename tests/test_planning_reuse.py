"""What makes a search cheap without changing its answer: memory floors that refuse a plan
before its ILP is built (and never refuse one that fits), stage programs traced once per
structure, and candidates of one micro-batch count sharing their planner."""

import dataclasses
import warnings

import gpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite import api
from alpa_lite.ir.replay import replay
from alpa_lite.ir.step_parts import local_forward, stage_program
from alpa_lite.plan.sharding import LogicalMesh
from alpa_lite.planning import intra_op, pipeline
from alpa_lite.planning.auto_search import SearchSpace, search_auto
from alpa_lite.planning.layers import forward_layers
from alpa_lite.planning.memory import memory_floor
from alpa_lite.solvers.sharding_ilp import Solver
from alpa_lite.solvers.stage_dp import submesh_shapes
from alpa_lite.planning.pipeline import (
    PlannerPool,
    layer_node_ranges,
    make_pipeline_plan,
    manual_memory_floor,
    most_split_params,
)

TX = optax.adamw(1e-3)
CFG = gpt.CONFIGS["tiny"]
FOUR_H100 = al.Cluster.of_gpus("H100", num_nodes=1, devices_per_node=4)


def _step(method):
    return al.parallelize(gpt.make_train_step(CFG, TX), method=method)


def _args(batch=8):
    return gpt.abstract_args(CFG, batch, TX)


@pytest.mark.parametrize("shape", [(4, 1), (2, 2), (1, 4)])
def test_the_memory_floor_is_below_every_plan_and_refuses_before_any_ilp(shape, monkeypatch):
    step = _step(al.Auto(pipeline=False, mesh_shapes=(shape,)))
    args = _args()
    traced = step.trace(*args)
    floor = memory_floor(traced.graph, 4).total
    plan = step.plan(*args, cluster=FOUR_H100)
    assert 0 < floor <= plan.peak_memory_bytes

    # Below the floor nothing can fit: refused with the floor as the smallest peak, and no
    # intra-op problem is built.
    built = []
    monkeypatch.setattr(intra_op, "build_stage", lambda *a, **k: built.append(1))
    tight = _step(al.Auto(pipeline=False, memory_budget_bytes=floor * 0.99))
    with pytest.raises(al.MemoryBudgetError, match="every tensor split over all 4 devices") as e:
        tight.plan(*args, cluster=FOUR_H100)
    assert e.value.peak_bytes == pytest.approx(floor) and not built


@pytest.mark.parametrize("layout", [
    dict(dp=2, tp=1, pp=2, remat=False), dict(dp=1, tp=2, pp=2, remat=True),
    dict(dp=1, tp=1, pp=4, remat=False)])
def test_a_manual_layouts_floor_is_below_its_stages_peaks(layout):
    method = al.Manual(num_micro_batches=4, **layout)
    step = _step(method)
    args = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = step.plan(*args, cluster=FOUR_H100)
    floor = manual_memory_floor(step.parts(*args), method, FOUR_H100)
    assert 0 < floor <= plan.peak_memory_bytes * (1 + 1e-9)
    # Not a trivial bound: the fullest stage's parameters, gradients and optimizer state
    # split tp ways are in it.
    assert floor > 0.2 * plan.peak_memory_bytes
    # Asked only whether it is over a budget, the walk may end early, but never below it.
    over = manual_memory_floor(step.parts(*args), method, FOUR_H100, stop_above=floor / 2)
    assert floor / 2 < over <= floor


def test_the_search_plans_no_textbook_layout_whose_floor_is_over_budget():
    # A two-stage pipeline as the stage DP's: layouts of 2 and 4 stages are weighed.
    pipelined = _step(al.Manual(dp=2, tp=1, pp=2, num_micro_batches=2)).plan(
        *_args(), cluster=FOUR_H100)
    budget = FOUR_H100.device.memory_bytes
    planned = []

    def floor(layout: al.Manual) -> float:
        # Over budget without remat where tp = 1; over either way where pp = 4.
        if layout.pp == 4 or (layout.tp == 1 and not layout.remat):
            return 2 * budget
        return 0.0

    def textbook(layout: al.Manual):
        planned.append(layout)
        return pipelined

    space = SearchSpace(plan_single=lambda: pipelined, plan_pipelined=lambda m: pipelined,
                        plan_textbook=textbook, textbook_floor=floor, num_devices=4,
                        devices_per_node=4, budget_bytes=budget)
    plan = search_auto(al.Auto(num_micro_batches=2), 8, space)
    assert planned and all(floor(layout) <= budget for layout in planned)
    assert any(layout.tp == 1 and layout.remat for layout in planned)   # remat tried next
    refused = [a for a in plan.explanation.alternatives
               if a.kind == "plan" and a.label.startswith("Megatron") and not a.fits]
    assert {a.label for a in refused} >= {"Megatron dp=2 tp=1 pp=2, 2 micro-batches",
                                          "Megatron dp=1 tp=1 pp=4, 2 micro-batches, remat"}


def test_ranges_of_one_structure_share_one_traced_program():
    cfg = dataclasses.replace(CFG, num_layers=6)
    step = al.parallelize(gpt.make_train_step(cfg, TX), method=al.Auto(num_micro_batches=2))
    fwd = step.parts(*gpt.abstract_args(cfg, 8, TX)).forward
    starts = forward_layers(fwd, num_layers=6)
    bounds = layer_node_ranges(starts, len(fwd.graph.nodes))
    progs = [stage_program(fwd, a, b) for a, b in bounds]
    first = {}
    for p in progs:
        first.setdefault(p.structure, p)
    blocks = [p for p in progs if p.structure == progs[1].structure]
    assert len(blocks) >= 2          # the repeated transformer blocks
    assert all(p.fb is first[p.structure].fb for p in progs)
    assert len({id(p.fb) for p in progs}) == len(first)
    # Each keeps its own range and tensors.
    assert len({(p.start, p.stop) for p in blocks}) == len(blocks)
    assert len({p.params for p in blocks}) == len(blocks)
    # Remembered per forward graph: the layer cut is too.
    assert forward_layers(fwd, num_layers=6) is starts


def _fb_values(prog, key):
    """The stage program's fb graph replayed on random inputs (the same for equal avals)."""
    g = prog.fb.graph
    env = {}
    for k, t in zip(jax.random.split(key, len(g.inputs)), g.inputs):
        tt = g.tensors[t]
        dtype = jnp.dtype(tt.dtype)
        env[t] = (0.1 * jax.random.normal(k, tt.shape, dtype)
                  if jnp.issubdtype(dtype, jnp.floating)
                  else jax.random.randint(k, tt.shape, 0, CFG.vocab_size).astype(dtype))
    replay(prog.fb, range(len(g.nodes)), env)
    return [np.asarray(env[t], np.float64) for t in g.outputs]


@pytest.mark.parametrize("first, last", [(1, 4), (0, 6)])   # blocks; the whole model
def test_a_stage_chained_from_its_layers_is_the_vjp_of_the_whole_range(first, last):
    """`stage_program` with cuts chains its layers' programs; `jax.vjp` of the whole range
    (each made on its own trace of the step, so neither reads the other's from memory)
    gives the same values, forward and backward, and keeps the same residuals. The whole
    model reads the tied token embedding in its first and last layers: its gradient is
    the sum of both."""
    cfg = dataclasses.replace(CFG, num_layers=4)
    progs = []
    for chained in (False, True):
        step = al.parallelize(gpt.make_train_step(cfg, TX), method=al.Auto())
        parts = step.parts(*gpt.abstract_args(cfg, 8, TX), num_micro_batches=2)
        fwd = parts.forward
        bounds = layer_node_ranges(forward_layers(fwd, num_layers=6), len(fwd.graph.nodes))
        assert len(bounds) == 6
        cuts = pipeline.layer_cuts(bounds, first, last - 1) if chained else ()
        progs.append(stage_program(fwd, bounds[first][0], bounds[last - 1][1], cuts))
    whole, chain = progs
    assert chain.cuts == tuple(b[0] for b in bounds[first + 1:last]) and not whole.cuts
    assert len(chain.fb.graph.inputs) == len(whole.fb.graph.inputs)
    assert [chain.fb.graph.tensors[t].nbytes for t in chain.residuals] == \
        [whole.fb.graph.tensors[t].nbytes for t in whole.residuals]
    assert len(chain.fwd_nodes) == len(whole.fwd_nodes)
    for a, b in zip(_fb_values(whole, jax.random.key(0)), _fb_values(chain, jax.random.key(0))):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    # Asked uncut, the range is its own vjp (the two graphs differ); a replica's program,
    # made with the stage's cuts, is the stage's node for node.
    uncut = stage_program(fwd, chain.start, chain.stop)
    assert uncut.fb is not chain.fb and not uncut.cuts
    local = stage_program(local_forward(parts, 2)[0], chain.start, chain.stop, chain.cuts)
    assert [n.primitive for n in local.fb.graph.nodes] == \
        [n.primitive for n in chain.fb.graph.nodes]


def test_a_replicas_share_of_a_micro_batch_is_the_micro_batch_of_a_larger_count():
    step = _step(al.Auto())
    args = _args()
    two, four = (step.parts(*args, num_micro_batches=m) for m in (2, 4))
    local, scale = local_forward(two, 2)
    # One trace of the loss at 2 examples: one forward graph, so one set of stage programs.
    assert local is four.forward and scale == 0.5
    n = len(four.forward.graph.nodes)
    assert stage_program(local, 0, n).fb is stage_program(four.forward, 0, n).fb


def test_a_refused_replica_share_is_traced_once(monkeypatch):
    """Every stage of every candidate asks for the loss per replica; a share the loss
    refuses is refused again from memory, with the same message, and not traced again.
    Each refusal is a fresh error: one kept and raised again would keep the frames of
    the last caller it passed through."""
    from alpa_lite.ir import step_parts
    parts = _step(al.Auto()).parts(*_args(), num_micro_batches=2)
    calls = []

    def refusing(*args, **kwargs):
        calls.append(args)
        raise ValueError("this model refuses 2 examples")

    monkeypatch.setattr(step_parts, "loss_trace", refusing)
    errors = []
    for _ in range(3):
        with pytest.raises(al.PlanningError, match="refuses 2 examples") as e:
            local_forward(parts, 2)
        errors.append(e.value)
    assert len(calls) == 1 and len({str(e) for e in errors}) == 1
    assert len({id(e) for e in errors}) == 3
    # A share that does not divide the micro-batch is refused before any trace.
    with pytest.raises(al.PlanningError, match="do not split over 8 replicas"):
        local_forward(parts, 8)
    assert len(calls) == 1


def test_candidates_sharing_a_pool_plan_as_alone_and_count_only_new_work():
    step = _step(al.Auto(num_micro_batches=2))
    args = _args()
    parts = step.parts(*args)
    outer = parts.outer

    def plan(method, pool):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_pipeline_plan(parts, method, FOUR_H100, outer.fingerprint,
                                      outer.input_avals, pool=pool)

    auto = al.Auto(num_micro_batches=2, schedule="1f1b")
    manual = al.Manual(dp=2, tp=1, pp=2, num_micro_batches=2)
    pool = PlannerPool()
    first = plan(auto, pool)
    again = plan(auto, pool)
    assert again.step_time_s == first.step_time_s and again.stages == first.stages
    assert first.stats.layer_ilps > 0 and again.stats.layer_ilps == 0
    assert plan(manual, pool).stages == plan(manual, None).stages


def test_the_stage_dp_counts_what_a_recomputing_stage_rebuilds_and_stays_a_relaxation():
    """A recomputing stage holds one micro-batch's residuals again in its backward: the DP
    counts at least their bytes split over the submesh, so a count no pipeline can fit is
    refused by its first stage search, and a plan the DP picks is still fitted whole."""
    args = _args()
    parts = _step(al.Auto(num_micro_batches=4)).parts(*args)

    def dp_plan(budget=None):
        method = al.Auto(num_micro_batches=4, schedule="1f1b", memory_budget_bytes=budget)
        return make_pipeline_plan(parts, method, FOUR_H100, parts.outer.fingerprint,
                                  parts.outer.input_avals)

    peak = dp_plan().peak_memory_bytes
    compared = 0
    for fraction in (0.5, 0.45):
        plan = dp_plan(fraction * peak)
        chosen = {a.stage: a for a in plan.explanation.alternatives
                  if a.kind == "option" and a.chosen}
        for s, st in enumerate(plan.stages):
            if st.remat and "remat" in chosen[s].label:
                # The DP's model of the option it chose never exceeds the whole-stage
                # estimate of that option planned whole.
                assert 0 < chosen[s].memory_bytes <= st.peak_memory_bytes
                compared += 1
    assert compared
    with pytest.raises(al.MemoryBudgetError, match=r"after 1 stage search\(es\)"):
        dp_plan(0.3 * peak)


def test_polish_plans_whole_only_what_the_stage_search_could_take():
    """Polish re-plans a stage whole on its submesh's meshes, but not a mesh and plan kind
    whose layers already need more than the stage search's budget: those are listed, with
    that need, and never chosen. The exhaustive mode plans them whole too, and its pipeline
    is not 1% faster."""
    args = _args()
    parts = _step(al.Auto(num_micro_batches=4)).parts(*args)

    def plan(budget=None, exhaustive=False):
        method = al.Auto(num_micro_batches=4, schedule="1f1b", memory_budget_bytes=budget,
                         exhaustive=exhaustive)
        return make_pipeline_plan(parts, method, FOUR_H100, parts.outer.fingerprint,
                                  parts.outer.input_avals)

    peak = plan().peak_memory_bytes
    listed = 0
    for fraction in (0.7, 0.5):
        budget = fraction * peak
        fast = plan(budget)
        meshes = [a for a in fast.explanation.alternatives if a.kind == "mesh"]
        skipped = [a for a in meshes if a.label.endswith("not planned whole")]
        for a in skipped:
            assert not a.fits and not a.chosen and a.memory_bytes > 0
        listed += len(skipped)
        every = plan(budget, exhaustive=True)
        assert not any(a.label.endswith("not planned whole")
                       for a in every.explanation.alternatives if a.kind == "mesh")
        assert fast.pipeline.step_time_s <= every.pipeline.step_time_s * 1.01
        assert fast.peak_memory_bytes <= budget
    assert listed


def _layer_planner():
    """A pipeline planner of the tiny GPT at 2 micro-batches on 4 H100s, and its layers'
    node ranges."""
    parts = _step(al.Auto(num_micro_batches=2)).parts(*_args())
    planner = PlannerPool().planner(parts, FOUR_H100, Solver.HIGHS, 60.0, {}, None,
                                    False, False)
    fwd = parts.forward
    return planner, layer_node_ranges(forward_layers(fwd), len(fwd.graph.nodes))


def test_the_stage_searchs_layer_memory_uses_the_whole_stage_estimates_terms():
    """The stage search sums its layers' memory from the same terms the whole-stage
    estimate counts for the same plan: parameters and optimizer state as the parameters
    are split, each gradient accumulator as the plan places its gradient (which may be
    split finer or coarser than its parameter), and the stash. Counted as a copy of the
    parameters, WRN-2B's layers on 8 V100s needed 7% more than their whole stage, which
    kept the search from the plan the exhaustive mode found."""
    planner, bounds = _layer_planner()
    mesh = LogicalMesh((2, 2), ("x", "y"))
    unlike = 0
    for a, b in bounds:
        prog = planner.program(a, b)
        for lean in (False, True):
            cost = planner.cost(prog, mesh, None, lean)
            est = pipeline.stage_estimate(planner, prog, cost, mesh, 1, False)
            assert cost.param_bytes == pytest.approx(
                est.params + est.grads + est.optimizer_state)
            assert cost.weight_bytes == pytest.approx(est.params)
            assert cost.act_bytes == pytest.approx(est.activations)
            unlike += not np.isclose(est.grads, est.params)
    assert unlike      # some gradient is split unlike its parameter: the case that matters


def test_lean_plans_pruned_at_one_budget_are_planned_at_a_lower_one():
    """A mesh whose memory-lean layer plans cannot help at one budget (every layer's
    fastest plan fits, all in one stage) is pruned at that budget only: a stage search
    again at a lowered budget (`settle_stages`) gets the mesh's lean plans, and its layer
    options say lean where the fastest plan no longer fits."""
    planner, bounds = _layer_planner()
    progs = [planner.program(a, b) for a, b in bounds]
    meshes = [LogicalMesh(shape, ("x", "y")) for shape in [(1, 1), (2, 2), (1, 4)]]

    def lean_known(mesh):
        return {k for k in planner.costs if k[1] == mesh.shape and k[-1] is True}

    planner.prefetch_layers(progs, meshes, 2, 1e15)
    assert {m.shape for m in meshes} == {k[0] for k in planner.lean_pruned}
    assert all(not lean_known(m) for m in meshes)
    # Below every mesh's need, no mesh is pruned: the lean plans are planned now.
    low = min(planner.lean_pruned.values()) * 0.5
    assert not any(planner.lean_pruned_at(m, low) for m in meshes)
    planner.prefetch_layers(progs, meshes, 2, low)
    assert all(lean_known(m) for m in meshes)
    # The stage search's options at each budget: fastest twice where pruned, lean apart.
    mesh = LogicalMesh((1, 4), ("x", "y"))
    differs = 0
    for prog in progs:
        fast, lean = pipeline._layer_options(planner, prog, mesh, 1e15)
        assert lean is fast
        fast_low, lean_low = pipeline._layer_options(planner, prog, mesh, low)
        assert (fast_low.forward_s, fast_low.param_bytes) == (fast.forward_s, fast.param_bytes)
        differs += lean_low.param_bytes < fast.param_bytes
    assert differs


def test_the_memory_lean_problem_is_the_fastest_one_restricted():
    """A layer's memory-lean problem (every parameter split finest) is derived from its
    fastest one with no second build; it solves to what building it with the pin gives."""
    step = _step(al.Auto(num_micro_batches=2))
    parts = step.parts(*_args())
    planner = PlannerPool().planner(parts, FOUR_H100, Solver.HIGHS, 60.0, {}, None,
                                    False, False)
    fwd = parts.forward
    bounds = layer_node_ranges(forward_layers(fwd), len(fwd.graph.nodes))
    progs = list({p.structure: p for p in (planner.program(a, b) for a, b in bounds)}.values())
    compared = 0
    for prog in progs:
        for shape in [(2, 2), (4, 1), (1, 4)]:
            mesh = LogicalMesh(shape, ("x", "y"))
            fast = planner.build(prog, mesh, None, False)
            lean = planner.build(prog, mesh, None, True, fast)
            pin = most_split_params(prog.fb.graph, mesh)
            options = intra_op.StageOptions(pin=pin, param_memory_factor=2.0 + planner.opt_ratio)
            pinned = intra_op.build_stage(prog.fb.graph, mesh, FOUR_H100, options)
            got, want = lean.solve(), pinned.solve()
            assert got.objective_s == pytest.approx(want.objective_s, rel=1e-9)
            assert got.objective_s >= fast.solve().objective_s * (1 - 1e-9)
            spec = dict(zip(prog.fb.graph.inputs, got.stage.input_specs))
            assert all(pin(prog.fb.graph.tensors[t], spec[t]) for t in prog.fb_params)
            compared += len(fast.problem.nodes) > len(lean.problem.nodes) or \
                sum(n.num_strategies for n in fast.problem.nodes) > \
                sum(n.num_strategies for n in lean.problem.nodes)
    assert compared      # somewhere the restriction removed strategies


def test_a_stage_fitted_again_is_answered_from_the_first_fit(monkeypatch):
    """A stage search that re-plans after a stage overshot often picks some of the same
    stages again: fitting a range of the same structure on the same mesh shape, micro-batches
    and budget again builds nothing and gives the first answer, a failure included, with
    the range's own tensor names and devices. Stages that hold other micro-batch counts
    (a pipeline's stages of one structure) fit the same problem: one build for them all."""
    cfg = dataclasses.replace(CFG, num_layers=6)
    step = al.parallelize(gpt.make_train_step(cfg, TX), method=al.Auto(num_micro_batches=4))
    parts = step.parts(*gpt.abstract_args(cfg, 8, TX))
    fwd = parts.forward
    names = {t.id: f"tensor {t.id}" for t in fwd.graph.tensors}    # each layer's its own
    planner = PlannerPool().planner(parts, FOUR_H100, Solver.HIGHS, 60.0, names, None,
                                    False, False)
    bounds = layer_node_ranges(forward_layers(fwd, num_layers=6), len(fwd.graph.nodes))
    progs = [planner.program(a, b) for a, b in bounds]
    twins = next((p, q) for i, p in enumerate(progs) for q in progs[i + 1:]
                 if p.structure == q.structure)
    mesh = LogicalMesh((2, 1), ("x", "y"))
    moved = LogicalMesh((2, 1), ("x", "y"), device_offset=2)
    peak = pipeline.stage_estimate(planner, twins[0], planner.cost(twins[0], mesh, None),
                                   mesh, 4, False).total
    builds = []
    real_build = planner.build
    monkeypatch.setattr(planner, "build", lambda *a, **k: builds.append(a) or real_build(*a, **k))
    for budget, fits in ((0.9 * peak, True), (0.01 * peak, False)):
        answers = []
        for prog, at in zip(twins, (mesh, moved)):
            try:
                answers.append(planner.fit_within(prog, at, None, False, 4, False, budget))
            except al.PlanningError as e:
                answers.append(e)
        if fits:
            (first, est), (second, again) = answers
            assert est == again and est.total <= budget
            assert first.forward_s == second.forward_s
            assert second.result.stage.devices == (2, 3)
            own = set(planner.input_names(twins[1]).values())
            assert own != set(planner.input_names(twins[0]).values())
            assert own <= set(dict(second.result.stage.shardings))
        else:
            assert all(isinstance(a, al.MemoryBudgetError) for a in answers)
            assert str(answers[0]) == str(answers[1])
    # Holding 2 micro-batches instead of 4: the same problem, a smaller estimate.
    cost, est = planner.fit_within(twins[1], moved, None, False, 2, False, 0.9 * peak)
    assert est.micro_batches_held == 2 and est.total < peak
    assert len(builds) == 1
    # A fresh planner, which builds its own, finds the same plan.
    fresh = PlannerPool().planner(parts, FOUR_H100, Solver.HIGHS, 60.0, names, None,
                                  False, False)
    alone, alone_est = fresh.fit_within(fresh.program(twins[1].start, twins[1].stop), moved,
                                        None, False, 2, False, 0.9 * peak)
    assert alone_est == est and alone.result.stage == cost.result.stage


def test_a_count_whose_memory_floors_fit_no_pipeline_is_refused_before_any_ilp(monkeypatch):
    """The stage DP on each layer's memory floor (everything split over its stage's
    devices) is a relaxation of the DP on its plans: where it finds no pipeline, the count
    is refused with no intra-op problem built; the floor options never hold more than the
    plans' options of the same layers and submesh."""
    parts = _step(al.Auto(num_micro_batches=4)).parts(*_args())
    calls = []
    real_dp = pipeline.solve_stage_dp

    def recording_dp(L, N, M, m, options, budget, max_stages=None):
        calls.append(options)
        return real_dp(L, N, M, m, options, budget, max_stages=max_stages)

    monkeypatch.setattr(pipeline, "solve_stage_dp", recording_dp)

    def plan(budget):
        method = al.Auto(num_micro_batches=4, schedule="1f1b", memory_budget_bytes=budget)
        return make_pipeline_plan(parts, method, FOUR_H100, parts.outer.fingerprint,
                                  parts.outer.input_avals)

    peak = plan(None).peak_memory_bytes
    floor_options, dp_options = calls[0], calls[1]
    L = len(forward_layers(parts.forward))
    for sub in submesh_shapes(1, 4):
        for a in range(L):
            for b in range(a, L):
                for held in (1, 2, 4):
                    least = min(o.param_bytes + o.act_bytes * held
                                for o in dp_options(a, b, sub))
                    floor = min(o.param_bytes + o.act_bytes * held
                                for o in floor_options(a, b, sub))
                    assert floor <= least * (1 + 1e-12)
    built = []
    monkeypatch.setattr(intra_op, "build_stage", lambda *a, **k: built.append(1))
    with pytest.raises(al.MemoryBudgetError, match="no intra-op problem was solved"):
        plan(0.01 * peak)
    assert not built


def _fake_count_search(real, outcome, num_devices: int, forgotten=None):
    """A search space whose pipeline of m micro-batches is `real` with the step time and
    stages `outcome(m)` gives, or the exception it returns raised (the single stage and
    the textbook layouts never fit); and the list of the counts it planned, in order.
    `forgotten`, if given, collects the counts the search lets go of."""
    planned = []

    def plan_pipelined(m):
        planned.append(m)
        got = outcome(m)
        if isinstance(got, Exception):
            raise got
        t, stages = got
        return dataclasses.replace(
            real, step_time=dataclasses.replace(
                real.step_time, lines=(dataclasses.replace(real.step_time.lines[0], seconds=t),)),
            stages=stages, pipeline=dataclasses.replace(real.pipeline, num_micro_batches=m))

    def refuse(*_):
        raise al.MemoryBudgetError("does not fit", 2.0)

    space = SearchSpace(plan_single=refuse, plan_pipelined=plan_pipelined,
                        plan_textbook=refuse, textbook_floor=lambda layout: 2.0,
                        num_devices=num_devices, devices_per_node=num_devices,
                        budget_bytes=1.0,
                        forget=(forgotten.append if forgotten is not None else lambda m: None))
    return space, planned


def test_the_count_walk_goes_past_a_local_optimum_that_recomputes():
    """Step time over micro-batch counts is not unimodal where memory forces remat (GPT-6.7B
    on 16 V100s: m=128 with remat, then 256 slower, then 512 without remat the fastest):
    the walk goes on to larger counts while its best plan recomputes, and stops at the
    first plan that recomputes nowhere. From a pipeline the walk tries the larger
    neighbour first and plans the smaller one only where the larger is not faster."""
    real = _step(al.Manual(dp=2, tp=1, pp=2, num_micro_batches=2)).plan(
        *_args(), cluster=FOUR_H100)
    # m -> (step time, remat); missing: the memory budget refuses the count. The middle
    # count (32) does not fit; the bisection finds 256, a local optimum that recomputes.
    table = {128: (58.00, True), 256: (57.08, True), 512: (58.81, True),
             1024: (56.23, False)}

    def outcome(m):
        if m not in table:
            return al.MemoryBudgetError(f"{m} micro-batches do not fit", 2.0)
        t, remat = table[m]
        return t, tuple(dataclasses.replace(st, remat=remat) for st in real.stages)

    forgotten = []
    space, planned = _fake_count_search(real, outcome, num_devices=4, forgotten=forgotten)
    plan = search_auto(al.Auto(), 1024, space)
    assert plan.pipeline.num_micro_batches == 1024
    assert plan.step_time_s == 56.23
    assert planned == [32, 256, 512, 128, 1024]
    # Each count's planning work is let go of once it is planned and not the fastest so
    # far: every count planned but the best, once; the best never.
    assert sorted(forgotten) == sorted(set(planned) - {1024})
    assert len(forgotten) == len(set(forgotten))
    # Without remat at 256 the walk stops there.
    table.update({128: (58.00, False), 256: (57.08, False), 512: (58.81, False)})
    planned.clear()
    assert search_auto(al.Auto(), 1024, space).pipeline.num_micro_batches == 256
    assert 1024 not in planned
    # Where the larger neighbour is faster, the smaller one is not planned.
    table.update({512: (56.50, False), 1024: (57.50, False)})
    planned.clear()
    assert search_auto(al.Auto(), 1024, space).pipeline.num_micro_batches == 512
    assert planned == [32, 256, 512, 1024]


def test_the_count_walk_tries_the_likelier_side_first():
    """From a pipeline of several stages the walk plans the larger neighbour first (the
    bubble falls as m grows), from one stage the smaller (larger micro-batches run more
    efficiently): MoE-690M on 2 V100s, its middle count over budget, plans 256, 128 and
    64 (over budget), not 512 as well."""
    real = _step(al.Manual(dp=2, tp=1, pp=2, num_micro_batches=2)).plan(
        *_args(), cluster=FOUR_H100)
    table = {128: 13.06, 256: 13.856, 512: 15.315, 1024: 16.0}
    stages = real.stages[:1]

    def outcome(m):
        if m not in table:
            return al.MemoryBudgetError(f"{m} micro-batches do not fit", 2.0)
        return table[m], stages

    space, planned = _fake_count_search(real, outcome, num_devices=4)
    assert search_auto(al.Auto(), 1024, space).pipeline.num_micro_batches == 128
    assert planned == [32, 256, 128, 64]
    # The same times from two stages: the larger side first.
    stages = real.stages
    planned.clear()
    assert search_auto(al.Auto(), 1024, space).pipeline.num_micro_batches == 128
    assert planned == [32, 256, 512, 128, 64]


def test_after_a_search_the_step_holds_the_split_of_its_best_count_only(monkeypatch):
    """Memory holds two counts' planning work during a search, not every count's
    (`SearchSpace.forget`): after Auto() plans, the step keeps the split of its fastest
    pipelined count only, and asking for another count's split traces it again."""
    step = _step(al.Auto())
    made = step.plan(*_args(), cluster=FOUR_H100)
    pipes = {int(a.label.split()[1]): a.time_s for a in made.explanation.alternatives
             if a.kind == "plan" and a.label.startswith("pipeline,") and a.fits}
    assert len(pipes) > 1
    best = min(pipes, key=pipes.get)
    splits = []
    real_split = api.split_step
    monkeypatch.setattr(api, "split_step", lambda *a, **k: splits.append(a[3]) or
                        real_split(*a, **k))
    for m in pipes:
        step.parts(*_args(), num_micro_batches=m)
    assert sorted(splits) == sorted(set(pipes) - {best})


def test_the_count_walk_steps_over_refused_counts_and_plans_every_larger_micro_batch():
    """Kernel efficiency is not monotone in the micro-batch size (Wide-ResNet-2B on 8
    V100s: 6.67 s at m=24, 8.42 s at 32, 7.53 s at 48, and 64 refused by its group norm):
    the walk steps over a count the model refuses, and where its optimum is one stage it
    plans every count with larger micro-batches down to the first one over the budget."""
    real = _step(al.Manual(dp=2, tp=1, pp=2, num_micro_batches=2)).plan(
        *_args(), cluster=FOUR_H100)
    # m -> step time; "refused": the model refuses the micro-batch size; missing: over
    # the memory budget. Batch 1536, micro-batches of a multiple of 16 images.
    stages = real.stages[:1]      # one stage: gradient accumulation, no bubble
    table = {24: 6.67, 32: 8.42, 48: 7.53, 96: 7.9, 64: "refused", 128: "refused",
             192: "refused", 256: "refused", 384: "refused", 512: "refused",
             768: "refused", 1536: "refused"}

    def outcome(m):
        if m not in table:
            return al.MemoryBudgetError(f"{m} micro-batches do not fit", 2.0)
        if table[m] == "refused":
            return ValueError(f"a micro-batch of {1536 // m} is not a multiple of 16")
        return table[m], stages

    space, planned = _fake_count_search(real, outcome, num_devices=8)
    plan = search_auto(al.Auto(), 1536, space)
    assert plan.pipeline.num_micro_batches == 24 and plan.step_time_s == 6.67
    assert 96 in planned          # past the refused 64, the walk sees the other side
    assert 16 in planned and 12 not in planned     # down to the first count over budget
    # Wide-ResNet-250M on one V100: the middle count (48) is over budget and the bisection
    # for a count that fits meets refused counts (256, 512, ...): 96 is found.
    table.clear()
    table.update({96: 8.88} | {m: "refused" for m in (64, 128, 192, 256, 384, 512, 768,
                                                      1536)})
    planned.clear()
    plan = search_auto(al.Auto(), 1536, space)
    assert plan.pipeline.num_micro_batches == 96
    # With two stages, fewer micro-batches add bubble: the walk's optimum stands.
    table.clear()
    table.update({24: 6.67, 32: 8.42, 48: 7.53, 96: 7.9, 64: "refused"})
    planned.clear()
    stages = real.stages
    assert search_auto(al.Auto(), 1536, space).pipeline.num_micro_batches == 48
    assert 24 not in planned


def test_a_mesh_axis_that_divides_nothing_plans_as_the_mesh_without_it(monkeypatch):
    """No dimension of tiny GPT's tensors is a multiple of 5 (they are 1, 3, 4, 8, 16, 64,
    192 and 256), so on five nodes nothing can split over an outer axis of 5, 10 or 20
    devices: each layer's plan there is its plan on the inner axis alone, number for
    number (solved both ways here), and the search reads it from there instead of
    planning it again: the same plan from fewer intra-op problems. An axis of 3 divides
    the fused attention projection's 192, and is planned."""
    cluster = al.Cluster.of_gpus("H100", num_nodes=5, devices_per_node=4)
    parts = _step(al.Auto(num_micro_batches=2)).parts(*_args())
    every = PlannerPool().planner(parts, cluster, Solver.HIGHS, 60.0, {}, None, True, False)
    fwd = parts.forward
    bounds = layer_node_ranges(forward_layers(fwd), len(fwd.graph.nodes))
    fields = ("forward_s", "backward_s", "param_bytes", "act_bytes", "input_bytes",
              "output_bytes", "grad_sync_s", "reduce_once_s")
    for a, b in bounds:
        prog = every.program(a, b)
        for outer, inner in [((5, 4), (1, 4)), ((10, 2), (1, 2)), ((20, 1), (1, 1))]:
            for lean in (False, True):
                got = every.cost(prog, LogicalMesh(outer, ("x", "y")), None, lean)
                want = every.cost(prog, LogicalMesh(inner, ("x", "y")), None, lean)
                for f in fields:
                    assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-12), f
                assert got.result.memory_bytes == pytest.approx(want.result.memory_bytes)
    fast = PlannerPool().planner(parts, cluster, Solver.HIGHS, 60.0, {}, None, False, False)
    prog = fast.program(*bounds[0])
    assert fast.layer_mesh(prog, LogicalMesh((5, 4), ("x", "y"))).shape == (1, 4)
    assert fast.layer_mesh(prog, LogicalMesh((3, 4), ("x", "y"))).shape == (3, 4)
    assert fast.layer_mesh(prog, LogicalMesh((2, 2), ("x", "y"))).shape == (2, 2)

    def plan():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_pipeline_plan(parts, al.Auto(num_micro_batches=2), cluster,
                                      parts.outer.fingerprint, parts.outer.input_avals)

    mapped = plan()
    monkeypatch.setattr(pipeline.PipelinePlanner, "layer_mesh", lambda self, prog, mesh: mesh)
    alone = plan()
    assert mapped.step_time_s == alone.step_time_s and mapped.stages == alone.stages
    assert mapped.stats.layer_ilps < alone.stats.layer_ilps
