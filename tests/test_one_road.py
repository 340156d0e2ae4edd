"""One road: every plan kind compiles through one interface, and what the compiled programs
run is what the Plan says, gradient reductions included (once per step in pipelines)."""

import importlib

import jax
import numpy as np
import optax
import pytest
from _reference import example_step, run_steps

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.errors import PlanningError
from alpa_lite.plan import Accumulation, SyncCollective


def _by_kind(collectives) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.nbytes * c.count
    return dict(sorted(out.items()))


SPMD = {
    "dp": al.DataParallel(),
    "dp2_tp4": al.Manual(dp=2, tp=4),
    "auto": al.Auto(pipeline=False),
}


@pytest.mark.parametrize("name", list(SPMD))
def test_single_stage_collectives_are_the_plans(name):
    step_fn, args = example_step("gpt")
    step = al.parallelize(step_fn, method=SPMD[name])
    exe = step.compile(*args)
    plan = exe.plan
    assert _by_kind(exe.collectives(*args)) == _by_kind(plan.collectives())
    # Every gradient has a record, reduced once in the step where it is reduced at all.
    grads = {g.param for g in plan.gradient_sync}
    assert len(grads) == len(jax.tree.leaves(args[0]))
    assert all(g.accumulation is Accumulation.SINGLE for g in plan.gradient_sync)
    if name == "dp":
        assert all(g.axes == ("dp",) and g.collective is SyncCollective.ALL_REDUCE
                   for g in plan.gradient_sync)
    assert "gradient sync" in plan.summary()


def _gpt_batch(batch_size):
    mod = importlib.import_module("gpt")
    cfg = mod.CONFIGS["tiny"]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    batch = mod.make_batch(cfg, batch_size, jax.random.PRNGKey(1))
    return mod.make_train_step(cfg, tx), (params, tx.init(params), batch)


def test_pipeline_reduces_each_gradient_once_per_step():
    # dp=4 x pp=2, 4 micro-batches of 8: each replica's share is 2 examples.
    step_fn, args = _gpt_batch(32)
    ref_p, _, ref_losses = run_steps(jax.jit(step_fn), args, 3)
    step = al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=4))
    exe = step.compile(*args)
    plan = exe.plan
    assert all(st.accumulate_axes == ("dp",) for st in plan.stages)
    assert plan.gradient_sync and all(
        g.accumulation is Accumulation.LOCAL and g.axes == ("dp",) and g.count == 1
        for g in plan.gradient_sync)
    compiled = exe.collectives(*args)
    # The backward programs reduce nothing over dp: no all-reduce at all here (tp = 1).
    assert not [c for c in compiled if "backward" in c.program and c.kind == "all-reduce"]
    for s in range(2):
        reduced = [c for c in compiled if c.program == f"stage {s} gradient reduction"]
        want = sum(g.nbytes for g in plan.gradient_sync if g.stage == s)
        assert sum(c.nbytes * c.count for c in reduced) == want
        assert all(c.kind == "all-reduce" for c in reduced)
    assert _by_kind(compiled) == _by_kind(plan.collectives())
    # The cost model charges what runs: one reduction per stage, once per step.
    assert plan.pipeline.reduce_s > 0
    assert al.Plan.from_json(plan.to_json()) == plan
    p, _, losses = run_steps(step, args, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_compressed_plan_predicts_its_exchange_not_dense_collectives():
    step_fn, args = example_step("mlp")
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.PowerSGD(rank=2))
    exe = step.compile(*args)
    plan = exe.plan
    assert plan.stages[0].collectives == ()
    assert plan.gradient_sync and all(
        g.collective is SyncCollective.COMPRESSED and g.compressor for g in plan.gradient_sync)
    assert plan.comm_s <= plan.step_time_s
    assert exe.collectives(*args)     # the exchange, read from the compiled program


def test_compression_a_pipeline_cannot_run_is_refused_at_planning():
    # Hybrid Manual layouts compress (tests/test_hybrid_compression.py); what they cannot
    # run is refused when planning, never run uncompressed.
    step_fn, args = example_step("gpt")
    step = al.parallelize(step_fn, method=al.Auto(num_micro_batches=2),
                          compression=C.PowerSGD(rank=2))
    with pytest.raises(PlanningError, match="compression"):
        step.plan(*args)
    step = al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=2),
                          compression=C.DelayedAveraging(delay=2))
    with pytest.raises(PlanningError, match="pure data-parallel plans"):
        step.plan(*args)


def test_plan_method_is_a_record():
    step_fn, args = example_step("gpt")
    method = al.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)
    plan = al.parallelize(step_fn, method=method).plan(*args)
    assert plan.method == method
    assert al.Plan.from_json(plan.to_json()).method == method
    assert "Manual(dp=2, tp=2, pp=2, num_micro_batches=2)" in plan.summary()


def test_optimizer_update_and_state_placed_by_the_plan():
    # Adam's moments follow their parameter's sharding through the update's data flow.
    mod = importlib.import_module("gpt")
    cfg = mod.CONFIGS["tiny"]
    tx = optax.adamw(1e-3)
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    args = (params, tx.init(params), mod.make_batch(cfg, cfg.batch_size, jax.random.PRNGKey(1)))
    step = al.parallelize(mod.make_train_step(cfg, tx),
                          method=al.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    plan = step.plan(*args)
    spec = plan.pipeline
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    assert len(spec.inputs) == len(leaves)
    assert len(spec.update_stages) > 0
    where = {jax.tree_util.keystr(path): p for (path, _), p in zip(leaves, spec.inputs)}
    split = [k for k, p in where.items() if k.startswith("[0]") and not p.spec.is_replicated()]
    assert split, "the tp=2 plan splits some parameters"
    for k in split:
        name = k[len("[0]"):]
        moments = [p for q, p in where.items() if q.startswith("[1]") and q.endswith(name)]
        assert len(moments) == 2, (k, moments)          # mu and nu
        assert all(m == where[k] for m in moments), (k, moments, where[k])
    # The runtime places the arguments exactly where the plan says.
    exe = step.compile(*args)
    for (path, _), sh, p in zip(leaves, jax.tree.leaves(exe.input_shardings(*args)),
                                spec.inputs):
        assert sh.mesh.devices.flat[0] is jax.devices()[plan.stages[p.stage].devices[0]]
    assert al.Plan.from_json(plan.to_json()) == plan


def test_a_stage_that_cannot_accumulate_locally_says_why():
    # The MoE's auxiliary loss is one scalar for the whole micro-batch, handed from stage
    # to stage: those stages reduce per micro-batch, and the plan says why.
    step_fn, args = example_step("moe")
    plan = al.parallelize(step_fn, method=al.Manual(dp=2, pp=4, num_micro_batches=2)
                          ).plan(*args)
    notes = [st.accumulate_note for st in plan.stages if not st.accumulate_axes]
    assert notes and all("depends on the batch" in n for n in notes)
    reduced = [g for g in plan.gradient_sync if g.accumulation is Accumulation.REDUCED]
    assert reduced and all(g.count == 2 for g in reduced)
    assert "reduces its gradients in every backward" in plan.summary()
