"""Pipelined plans executed on 8 virtual CPU devices: the same numbers as plain jax.jit.

Every hybrid layout (data x tensor x pipeline parallel) of the GPT, MoE and Wide-ResNet
examples runs five SGD-momentum steps, with GPipe and with 1F1B and with a micro-batch count
other than the stage count, and must reproduce the undecorated step's losses and
parameters. Then: bad input gets clear errors, and plans say what they are.
"""

import jax
import numpy as np
import optax
import pytest
from _reference import reference_run, run_steps  # tests/_reference.py

import alpa_lite as al
from alpa_lite.errors import PlanningError

# Wide-ResNet's batch norm turns float32 reduction-order differences of ~1e-7 into ~2e-5
# over five steps (see test_execution.py), hence its looser tolerance.
RTOL = {"wide_resnet": 1e-4}

LAYOUTS = {
    "pp2_dp2_tp2_m4_1f1b": al.Manual(dp=2, tp=2, pp=2, num_micro_batches=4, schedule="1f1b"),
    "pp4_dp2_m2_gpipe": al.Manual(dp=2, pp=4, num_micro_batches=2, schedule="gpipe"),
    "pp8_m4_1f1b": al.Manual(pp=8, num_micro_batches=4, schedule="1f1b"),
    "pp2_dp4_m2_gpipe_remat": al.Manual(dp=4, pp=2, num_micro_batches=2, schedule="gpipe",
                                        remat=True),
}
# Every layout on the GPT, and each on one more model (the runtime is the same for every
# model; the models differ in what the layouts cut: experts, convolutions, batch norm).
CASES = [("gpt", name) for name in LAYOUTS] + \
    [("moe", "pp2_dp2_tp2_m4_1f1b"), ("moe", "pp2_dp4_m2_gpipe_remat"),
     ("wide_resnet", "pp4_dp2_m2_gpipe"), ("wide_resnet", "pp8_m4_1f1b")]


@pytest.mark.parametrize("example,layout", CASES)
def test_hybrid_plan_matches_jit(example, layout):
    step_fn, (params, opt_state, batch), ref_losses, ref_params = reference_run(example)
    method = LAYOUTS[layout]
    step = al.parallelize(step_fn, method=method)
    plan = step.plan(params, opt_state, batch)
    assert len(plan.stages) == method.pp
    assert plan.pipeline.num_micro_batches == method.num_micro_batches
    assert plan.pipeline.schedule == method.schedule
    covered = [l for st in plan.stages for l in range(st.layers[0], st.layers[1] + 1)]
    assert covered == list(range(len(plan.pipeline.layer_starts)))
    devices = [d for st in plan.stages for d in st.devices]
    assert sorted(devices) == list(range(8))
    assert all(st.remat == method.remat for st in plan.stages)
    p, s, losses = run_steps(step, (params, opt_state, batch))
    rtol = RTOL.get(example, 1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                                   atol=rtol * float(np.max(np.abs(np.asarray(b)))))
    # Parameters stay on the stage that owns them (no gather to one device).
    for leaf in jax.tree_util.tree_leaves(p):
        assert len(leaf.sharding.device_set) <= 8 // method.pp


def test_auto_pipeline_runs_and_matches_jit():
    step_fn, (params, opt_state, batch), ref_losses, ref_params = reference_run("gpt")
    step = al.parallelize(step_fn, method=al.Auto(num_micro_batches=2))
    p, s, losses = run_steps(step, (params, opt_state, batch))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    plan = step.plan(params, opt_state, batch)
    assert plan.pipeline.num_micro_batches == 2
    assert "stage" in plan.summary()


def _marked_step(activation=None):
    """A 4-layer MLP whose layers are marked by hand (tanh unless `activation`), with its
    arguments."""
    import jax.numpy as jnp
    act = activation or jnp.tanh

    def loss_fn(params, batch):
        x = batch["x"]
        for w in params[:-1]:
            x = al.mark_layer_boundary(act(x @ w))
        return jnp.mean((act(x @ params[-1]) - batch["y"]) ** 2)   # layer 3: last + loss

    def step(params, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        return [w - 0.1 * g for w, g in zip(params, grads)], loss

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = [jax.random.normal(k[i], (16, 16)) / 4 for i in range(4)]
    batch = {"x": jax.random.normal(k[4], (32, 16)), "y": jnp.zeros((32, 16))}
    return step, params, batch


def test_mark_layer_boundary_sets_layers():
    step, params, batch = _marked_step()
    # The marker is the identity under plain JAX, forward and backward.
    plain = jax.jit(step)(params, batch)
    par = al.parallelize(step, method=al.Manual(dp=2, pp=4, num_micro_batches=4))
    plan = par.plan(params, batch)
    assert len(plan.pipeline.layer_starts) == 4
    assert [st.layers for st in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    out = par(params, batch)
    np.testing.assert_allclose(float(out[1]), float(plain[1]), rtol=1e-6)
    for a, b in zip(out[0], plain[0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_disk_cache_tells_pipelined_steps_apart_by_their_loss(tmp_path, monkeypatch):
    # Two steps alike but for the loss's activation: the same step around the gradient
    # call, different programs inside it. Each gets its own plan from the disk cache (the
    # second used to be handed the first's, which its run refused).
    monkeypatch.setenv("ALPA_LITE_CACHE", "on")
    monkeypatch.setenv("ALPA_LITE_CACHE_DIR", str(tmp_path))
    method = al.Manual(dp=2, pp=4, num_micro_batches=4)
    for activation in (jax.numpy.tanh, jax.numpy.sin):
        step, params, batch = _marked_step(activation)
        par = al.parallelize(step, method=method)
        assert not par.plan(params, batch).stats.plan_cache_hit
        out, plain = par(params, batch), jax.jit(step)(params, batch)
        np.testing.assert_allclose(float(out[1]), float(plain[1]), rtol=1e-6)
    again = al.parallelize(step, method=method)
    assert again.plan(params, batch).stats.plan_cache_hit


def test_manual_layer_ranges():
    step_fn, (params, opt_state, batch), ref_losses, _ = reference_run("gpt")
    step = al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=2))
    L = len(step.plan(params, opt_state, batch).pipeline.layer_starts)
    ranges = ((0, 0), (1, L - 1))
    step = al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=2,
                                                    layer_ranges=ranges))
    plan = step.plan(params, opt_state, batch)
    assert [st.layers for st in plan.stages] == list(ranges)
    _, _, loss = step(params, opt_state, batch)
    np.testing.assert_allclose(float(loss), ref_losses[0], rtol=1e-5)


def test_bad_pipeline_input():
    step_fn, (params, opt_state, batch), _, _ = reference_run("gpt")
    with pytest.raises(PlanningError, match="not divisible by num_micro_batches=3"):
        al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=3)).plan(
            params, opt_state, batch)
    marked, m_params, m_batch = _marked_step()
    with pytest.raises(PlanningError, match="cover them all"):
        al.parallelize(marked, method=al.Manual(pp=2, dp=4, layer_ranges=((0, 0), (1, 2)))
                       ).plan(m_params, m_batch)        # the model has layers 0..3
    with pytest.raises(ValueError, match="each exactly once"):
        al.Manual(pp=2, dp=4, layer_ranges=((0, 1), (1, 3)))      # repeats layer 1
    with pytest.raises(ValueError, match="each exactly once"):
        al.Manual(pp=2, dp=4, layer_ranges=((0, 1), (3, 4)))      # skips layer 2
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        al.Manual(pp=2, dp=4, schedule="interleaved")
    with pytest.raises(ValueError, match="dp x tp x pp"):
        al.parallelize(step_fn, method=al.Manual(pp=2, dp=2)).plan(params, opt_state, batch)


def test_more_stages_than_layers_is_refused():
    import jax.numpy as jnp

    def loss_fn(w, batch):
        return jnp.mean(al.mark_layer_boundary(batch["x"] @ w[0]) @ w[1])

    def step(w, batch):
        loss, g = al.value_and_grad(loss_fn)(w, batch)
        return [a - b for a, b in zip(w, g)], loss

    w = [jnp.ones((8, 8)), jnp.ones((8, 1))]
    batch = {"x": jnp.ones((16, 8))}
    with pytest.raises(PlanningError, match="only 2 layers"):
        al.parallelize(step, method=al.Manual(pp=4, dp=2)).plan(w, batch)


def test_pipelined_plan_json_round_trip_runs():
    step_fn, (params, opt_state, batch), ref_losses, _ = reference_run("moe")
    step = al.parallelize(step_fn, method=al.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    plan = step.plan(params, opt_state, batch)
    again = al.Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert again.stages == plan.stages and again.pipeline == plan.pipeline
    _, _, loss = step.with_plan(again)(params, opt_state, batch)
    np.testing.assert_allclose(float(loss), ref_losses[0], rtol=1e-5)


def _small_gpt(batch: int = 16):
    import gpt
    cfg = gpt.Config(vocab_size=512, seq_len=64, hidden=128, num_layers=4, num_heads=4,
                     dtype="float32", batch_size=batch)
    tx = optax.adam(1e-3)
    return gpt.make_train_step(cfg, tx), gpt.abstract_args(cfg, batch, tx)


def test_auto_uses_one_stage_when_memory_is_ample():
    # Large enough a batch that compute, not gradient all-reduce latency, dominates: then a
    # pipeline only adds its bubble. (At batch 64 the same model pipelines: two stages
    # all-reduce half the gradients each, side by side, which the cost model rightly prefers.)
    step, args = _small_gpt(batch=1024)
    cluster = al.Cluster.preset("8xH100")
    plan = al.parallelize(step, method=al.Auto(num_micro_batches=2)).plan(*args, cluster=cluster)
    assert len(plan.stages) == 1
    assert plan.peak_memory_bytes <= cluster.device.memory_bytes


def test_auto_fits_when_one_device_cannot_hold_the_model():
    import dataclasses
    step, args = _small_gpt()
    state_bytes = sum(np.prod(x.shape) * x.dtype.itemsize
                      for x in jax.tree_util.tree_leaves(args[:2]))
    base = al.Cluster.preset("8xH100")
    # Parameters, gradients and Adam's two moments (4x the parameters, 4/3 of the state
    # passed in) do not fit one device; split over the devices they do.
    memory = state_bytes
    cluster = dataclasses.replace(base, name="8xH100-small",
                                  device=dataclasses.replace(base.device, memory_bytes=memory))
    with pytest.raises(PlanningError):
        _raise_if_fits(step, args, cluster)
    plan = al.parallelize(step, method=al.Auto(num_micro_batches=2)).plan(*args, cluster=cluster)
    assert plan.peak_memory_bytes <= memory
    # Splitting the model is what makes it fit: no stage holds every parameter whole.
    assert len(plan.stages) > 1 or any(st.mesh_shape[1] > 1 for st in plan.stages)


def _raise_if_fits(step, args, cluster):
    """A replicated single-stage plan does not fit: the test's premise."""
    plan = al.parallelize(step, method=al.Manual(dp=8, num_micro_batches=2)).plan(
        *args, cluster=cluster)
    if plan.peak_memory_bytes > cluster.device.memory_bytes:
        raise PlanningError("does not fit")


def test_optimizer_with_global_norm_and_step_count_runs_across_stages():
    """Adam's step counter and a global gradient-norm clip couple every stage's update: the
    apply part moves those scalars between stages and keeps the big tensors in place."""
    import gpt
    cfg = gpt.CONFIGS["tiny"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    params = gpt.init_params(cfg, jax.random.PRNGKey(0))
    batch = gpt.make_batch(cfg, cfg.batch_size, jax.random.PRNGKey(1))
    step_fn = gpt.make_train_step(cfg, tx)
    ref, par = jax.jit(step_fn), al.parallelize(
        step_fn, method=al.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    a = b = (params, tx.init(params))
    for _ in range(3):
        *a, loss_ref = ref(*a, batch)
        *b, loss = par(*b, batch)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
    # Adam turns float32 rounding in near-zero gradients into O(lr) steps (test_execution.py).
    for x, y in zip(jax.tree_util.tree_leaves(b[0]), jax.tree_util.tree_leaves(a[0])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=3e-3)
    for leaf in jax.tree_util.tree_leaves(b):
        assert len(leaf.sharding.device_set) <= 4


def test_one_update_operator_for_every_stage_runs_and_keeps_state_at_home():
    """optax.MultiSteps (gradient accumulation in the optimizer) writes the whole update as
    one `lax.cond`: one operator making new parameters and optimizer state for both
    stages. It runs on one stage and its results go home, where the next step reads them."""
    import gpt
    cfg = gpt.CONFIGS["tiny"]
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    params = gpt.init_params(cfg, jax.random.PRNGKey(0))
    batch = gpt.make_batch(cfg, cfg.batch_size, jax.random.PRNGKey(1))
    step_fn = gpt.make_train_step(cfg, tx)
    ref, par = jax.jit(step_fn), al.parallelize(
        step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=2))
    a = b = (params, tx.init(params))
    homes = None
    for _ in range(3):      # an accumulating step, an applying one, an accumulating one
        *a, loss_ref = ref(*a, batch)
        *b, loss = par(*b, batch)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
        where = [leaf.sharding for leaf in jax.tree_util.tree_leaves(b)]
        assert homes is None or where == homes
        homes = where
    for x, y in zip(jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(a)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert {len(s.device_set) for s in homes} == {4}
    assert len({frozenset(s.device_set) for s in homes}) == 2


def test_stage_tables_name_their_own_parameters():
    """Stages of identical structure share one intra-op solve; each table still names the
    parameters that stage holds."""
    step, params, batch = _marked_step()
    plan = al.parallelize(step, method=al.Manual(dp=2, pp=4, num_micro_batches=2)).plan(
        params, batch)
    for s, st in enumerate(plan.stages):
        names = [n for n, _ in st.shardings if n.startswith("params/")]
        assert names == [f"params/{s}"], (s, names)
    assert "layers" in plan.summary() and "1f1b x 2 micro-batches" in plan.summary()
