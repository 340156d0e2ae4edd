"""Models written the way their libraries' own docs write them (flax.nnx split/merge,
Equinox partition/combine and a per-example Equinox transformer, Hugging Face Flax GPT-2,
BERT and ResNet from a config, an optax chain with a schedule and a decay mask, bf16 mixed
precision, a Flax linen transformer whose blocks run under nn.scan(nn.remat(...)) with
dropout on, a Flax BatchNorm CNN whose statistics come back through has_aux) run through
alpa_lite under DataParallel, Auto, Manual(dp=2, tp=4) and a dp=4 x pp=2 pipeline, and
equal the undecorated step under `jax.jit` after one step (issue "8 ·", point 5). The
models live in examples/library_models.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al

import library_models as lm

PLANS = {
    "dp": al.DataParallel(),
    "auto": al.Auto(pipeline=False),
    "dp2_tp4": al.Manual(dp=2, tp=4),
    "dp4_pp2_m2": al.Manual(dp=4, pp=2, num_micro_batches=2),
}

MODELS = ["nnx_mlp", "eqx_mlp", "eqx_transformer", "hf_gpt2", "hf_bert", "hf_resnet",
          "optax_chain", "flax_scan_transformer", "flax_bn_cnn"]

# Micro-batched plans refuse BatchNorm by name (a batch statistic is not a sum over
# micro-batches); tests/test_flax_batchnorm.py checks the refusal.
NOT_MICRO_BATCHED = {"flax_bn_cnn"}


@functools.lru_cache(maxsize=None)
def _built(name):
    """The model's Case, built once per model."""
    return lm.BUILDERS[name][1]()


@functools.lru_cache(maxsize=None)
def _reference(name):
    """The undecorated step's result under jax.jit, once per model."""
    case = _built(name)
    return case.reference_jit(case.step)(*case.args)


def _case(name):
    pytest.importorskip(lm.BUILDERS[name][0])
    return _built(name)


def _assert_auto_at_least_as_fast(step, case):
    """Auto's plan is estimated no slower than the textbook plans (DataParallel and
    Megatron 2x4). At these tiny sizes that is often data parallelism itself; that Auto
    shards large weights where it pays is tests/test_control_flow.py's check."""
    auto = step.plan(*case.args).step_time_s
    for method in (al.DataParallel(), al.Manual(dp=2, tp=4)):
        other = al.parallelize(case.step, method=method).plan(*case.args).step_time_s
        assert auto <= other * (1 + 1e-9), (method, auto, other)


@pytest.mark.parametrize("model,plan", [
    (model, plan) for model in MODELS for plan in PLANS
    if not (model in NOT_MICRO_BATCHED and plan == "dp4_pp2_m2")])
def test_library_model_matches_jit(model, plan):
    case = _case(model)
    step = al.parallelize(case.step, method=PLANS[plan])
    out = step(*case.args)
    ref = _reference(model)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    assert jax.tree.structure(out[0]) == jax.tree.structure(ref[0])
    assert lm.other_leaves(out[0]) == lm.other_leaves(ref[0])
    for a, b in zip(lm.array_leaves(out[0]), lm.array_leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if plan == "auto":
        _assert_auto_at_least_as_fast(step, case)


# ---- mixed precision: fp32 master weights, bf16 compute ----------------------
#
# bf16 keeps 8 significant bits (eps 2^-8 ~ 4e-3; fp16 has 11). A sharded plan sums the same
# products in another order and rounds partial sums (and the gradient all-reduce) to the
# compute dtype, so gradients differ from jit's by a few ulps of their magnitude (2^-5 of
# each leaf's largest value allows 8 bf16 ulps). The loss is computed in fp32 from bf16
# activations: a relative 2^-7. After one AdamW step a parameter moves by at most
# lr * (1 + weight_decay * |p|) either way, and a gradient near zero may change sign with
# rounding, so parameters may differ by up to twice that step (lr = the schedule's first
# value, 1e-3); the gradients themselves are compared through AdamW's first moment
# (mu = 0.1 * the clipped gradient after one step), which is the sharp check.

def _assert_mixed_close(out, ref):
    np.testing.assert_allclose(out[2], ref[2], rtol=2 ** -7)
    mu_out, mu_ref = out[1][1][0].mu, ref[1][1][0].mu
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(mu_out)[0],
                            jax.tree.leaves(mu_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2 ** -5 * float(np.max(np.abs(b))),
                                   err_msg=f"gradient (AdamW mu) of {jax.tree_util.keystr(path)}")
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=0, atol=2 * 1e-3 * (1 + 0.01 * np.abs(b).max())
                                   + 1e-6)


def _run_mixed(model, plan):
    case = _case(model)
    out = al.parallelize(case.step, method=PLANS[plan])(*case.args)
    _assert_mixed_close(out, _reference(model))


@pytest.mark.parametrize("plan", ["dp", "auto", "dp2_tp4"])
def test_bf16_mixed_precision_matches_jit(plan):
    _run_mixed("optax_chain_bf16", plan)


# The loss casts every parameter first: the pipeline must neither ship the second stage's
# low-precision weight copies from the first stage with a gradient counted once per
# replica (it was dp times too large) nor all-reduce in bfloat16 inside a partly manual
# shard_map (XLA:CPU aborts).
def test_bf16_mixed_precision_pipeline_matches_jit():
    _run_mixed("optax_chain_bf16", "dp4_pp2_m2")


def test_hf_gpt2_with_dropout_in_a_pipeline_matches_jit():
    """Hugging Face's training call (`train=True, dropout_rng=...`), the key folded in the
    step: the pipeline draws each micro-batch's rows of jax.jit's dropout masks."""
    pytest.importorskip("transformers")
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=lm.VOCAB, n_positions=32)
    model, params = lm.hf_model(FlaxGPT2LMHeadModel, config)
    tx = lm.SGD

    def loss_fn(params, ids, labels, key):
        logits = model(ids, params=params, train=True, dropout_rng=key).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params, opt_state, batch):
        key = jax.random.fold_in(batch["key"], 1)
        loss, g = al.value_and_grad(loss_fn)(params, batch["input_ids"], batch["labels"], key)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    args = (params, tx.init(params), dict(lm.token_batch(8), key=jax.random.PRNGKey(3)))
    ref = jax.jit(step)(*args)
    pipelined = al.parallelize(step, method=PLANS["dp4_pp2_m2"])
    out = pipelined(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    # Each replica holds one example and draws its own rows' masks: the last stage still
    # accumulates per replica (`ir.one_example`; the first holds the tied embedding's
    # cotangent, which has no batch dimension).
    assert pipelined.plan(*args).stages[1].accumulate_axes == ("dp",)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_flax_train_state_runs_under_every_plan_kind_and_plans_once():
    """Flax's TrainState, as its docs write the step: `state.apply_gradients(grads=...)`.
    `TrainState.create` starts `step` at the Python int 0 (an argument leaf that is no
    array); after a step it is an int32 array, and the step is not planned again."""
    pytest.importorskip("flax.linen")
    import flax.linen as nn
    from flax.training import train_state

    from alpa_lite import compression as C

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))

    model, tx = MLP(), optax.adam(1e-3)
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(k[0], (16, 16)), "y": jax.random.normal(k[1], (16, 8))}
    params = jax.jit(model.init)(k[2], batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    assert state.step == 0 and isinstance(state.step, int)

    def loss_fn(params, x, y):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads=grads), loss

    ref = [jax.jit(train_step)(state, batch)]
    ref.append(jax.jit(train_step)(ref[0][0], batch))
    for kind in [dict(method=al.DataParallel()), dict(method=al.Auto(pipeline=False)),
                 dict(method=al.Manual(dp=2, tp=4)),
                 dict(method=al.Manual(dp=4, pp=2, num_micro_batches=2)),
                 dict(method=al.DataParallel(), compression=C.Dense())]:
        step = al.parallelize(train_step, **kind)
        s = state
        for want in ref:
            s, loss = step(s, batch)
            np.testing.assert_allclose(loss, want[1], rtol=1e-5)
            assert int(s.step) == int(want[0].step)
            for a, b in zip(jax.tree.leaves(s.params), jax.tree.leaves(want[0].params)):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert len(step.built_plans) == 1, kind


def test_flax_partitioned_params_under_the_users_mesh_pipeline_equal_to_jit():
    """As Flax's guide to sharding writes a model: kernels boxed by `nn.with_partitioning`,
    an activation pinned with a bare PartitionSpec, the step called under
    `jax.set_mesh(mesh)`. The pins trace against the user's mesh and the shardings they
    give later operators there are dropped (the plan chooses its own): a pipeline with
    per-replica backward passes runs equal to jax.jit."""
    nn = pytest.importorskip("flax.linen")
    P = jax.sharding.PartitionSpec

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            x = nn.Dense(32, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
            x = nn.relu(jax.lax.with_sharding_constraint(x, P("data", "model")))
            return nn.Dense(4, kernel_init=nn.with_partitioning(init, ("model", None)))(x)

    model, tx = MLP(), optax.sgd(0.1)
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(k[0], (16, 8)), "y": jax.random.normal(k[1], (16, 4))}
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = al.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
        params = jax.jit(model.init)(k[2], batch["x"])["params"]
        args = (params, tx.init(params), batch)
        ref = jax.jit(train_step)(*args)
        out = al.parallelize(train_step, method=al.Manual(dp=4, pp=2, num_micro_batches=2))(
            *args)
    np.testing.assert_allclose(np.asarray(out[2]), np.asarray(ref[2]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
