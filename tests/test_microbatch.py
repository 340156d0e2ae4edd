"""The micro-batching guard: the exact scale for means and sums, an error for everything else."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import Role
from alpa_lite.ir.microbatch import check_microbatching
from alpa_lite.ir.tracing import trace_flat

B, D, H = 16, 8, 4          # full batch, input features, outputs
W = jax.ShapeDtypeStruct((D, H), jnp.float32)


def traced(loss, avals, roles):
    return trace_flat(lambda *xs: (loss(*xs),), avals, roles, [f"in{i}" for i in range(len(avals))])


def check(loss, m=4, extra=(), b_full=B):
    """check_microbatching for loss(w, x, *extra_batch_leaves) with w a param, x a batch."""
    def avals(b):
        return [W, jax.ShapeDtypeStruct((b, D), jnp.float32)] + [
            jax.ShapeDtypeStruct((b,) + tuple(s), jnp.float32) for s in extra]
    roles = [Role.PARAM] + [Role.BATCH] * (1 + len(extra))
    return check_microbatching(traced(loss, avals(b_full // m), roles),
                               traced(loss, avals(b_full), roles), m)


def per_example(w, x):
    return jnp.square(jnp.tanh(x @ w)).sum(-1)                     # (b,)


# -- means and sums ------------------------------------------------------------------------

@pytest.mark.parametrize("m", [2, 4])
def test_mean_is_one_over_m(m):
    assert check(lambda w, x: per_example(w, x).mean(), m) == pytest.approx(1 / m, rel=1e-12)


def test_sum_is_one():
    assert check(lambda w, x: per_example(w, x).sum()) == 1.0


def test_mean_written_as_sum_of_scaled_examples():
    assert check(lambda w, x: jnp.sum(per_example(w, x) / x.shape[0])) == 0.25


def test_mean_by_a_rounded_reciprocal():
    # float32(1/21) / float32(1/7) is 3 only up to float32 rounding
    assert check(lambda w, x: jnp.sum(per_example(w, x) * (1.0 / x.shape[0])),
                 m=3, b_full=21) == 1 / 3


def test_mean_plus_weight_penalty():
    assert check(lambda w, x: per_example(w, x).mean() + 1e-3 * jnp.sum(w * w)) == 0.25


def test_sum_accumulated_from_zeros():
    assert check(lambda w, x: jnp.zeros(()) + 2.0 * per_example(w, x).sum()) == 1.0


def test_nan_literal_is_the_same_in_both_traces():
    # jnp.var fills an empty sample with a literal NaN (jnp.where(n > 0, var, nan)): the
    # same constant at every batch size, as Equinox's LayerNorm under vmap uses it.
    def normalised(w, x):
        h = x @ w
        var = jnp.var(h, -1, keepdims=True)
        return jnp.mean((h - h.mean(-1, keepdims=True)) / jnp.sqrt(var + 1e-5))

    def filled(w, x):
        e = per_example(w, x)
        return jnp.where(e > 0, e, jnp.nan).mean()

    assert check(normalised) == 0.25
    assert check(filled) == 0.25


def test_one_micro_batch_is_the_batch():
    assert check(lambda w, x: per_example(w, x).max(), m=1) == 1.0


# -- what micro-batching would change --------------------------------------------------------

def _batch_norm(x):
    mean = x.mean(0)
    var = jnp.square(x - mean).mean(0)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5)


@pytest.mark.parametrize("loss, match", [
    (lambda w, x: per_example(w, x).sum() + 1e-3 * jnp.sum(w * w), "count that term 4 times"),
    (lambda w, x: per_example(w, x).mean() + per_example(w, x).sum(), "mean over examples"),
    (lambda w, x: jnp.square(_batch_norm(x) @ w).mean(), "batch statistics"),
    (lambda w, x: per_example(w, x).max(), "reduce_max over the batch"),
    (lambda w, x: jnp.sqrt(per_example(w, x).mean()), "not linear"),
    (lambda w, x: jnp.cumsum(per_example(w, x)).mean(), "along the batch dimension"),
    (lambda w, x: per_example(w, x)[:2].mean(), "along the batch dimension"),
    (lambda w, x: (per_example(w, x) * jnp.arange(x.shape[0])).mean(), "depends on the batch size"),
    (lambda w, x: per_example(w, x).reshape(4, -1).max(0).mean(), "does not grow"),
    (lambda w, x: jnp.outer(per_example(w, x), per_example(w, x)).mean(), "pairs examples"),
    (lambda w, x: jnp.sum(w), "does not depend on the batch"),
])
def test_raises(loss, match):
    with pytest.raises(PlanningError, match=match):
        check(loss)


def test_masked_mean_raises():
    def loss(w, x, mask):
        return jnp.sum(per_example(w, x) * mask) / jnp.sum(mask)
    with pytest.raises(PlanningError, match=r"div_\d+, which is not linear"):
        check(loss, extra=[()])


def test_error_names_operator_and_fix():
    def loss(w, x):
        with jax.named_scope("norm"):
            x = _batch_norm(x)
        return jnp.square(x @ w).mean()
    with pytest.raises(PlanningError) as e:
        check(loss)
    msg = str(e.value)
    assert "operator sub_" in msg and "(in norm)" in msg
    assert "num_micro_batches=1" in msg and "fixed-size group" in msg


def test_structure_must_match():
    def loss(w, x):                                                # branches on the batch size
        return per_example(w, x).mean() if x.shape[0] == B else per_example(w, x).sum() * 2
    with pytest.raises(PlanningError, match="operators depend on the batch size"):
        check(loss)


# -- numerically: scale * sum over micro-batches == full batch ---------------------------

def test_scaled_micro_batch_sum_reproduces_full_batch():
    def loss(params, x, y):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean(jnp.square(h @ params["w2"] - y)) + 1e-2 * jnp.sum(params["w1"] ** 2)

    m = 4
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (D, 16)), "b1": jnp.zeros(16),
              "w2": jax.random.normal(k2, (16, H))}
    x, y = jax.random.normal(k3, (B, D)), jax.random.normal(k4, (B, H))
    leaves, tree = jax.tree_util.tree_flatten(params)

    def flat(*xs):
        return loss(jax.tree_util.tree_unflatten(tree, xs[:-2]), *xs[-2:])

    def trace_at(b):
        avals = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in leaves] + [
            jax.ShapeDtypeStruct((b, D), x.dtype), jax.ShapeDtypeStruct((b, H), y.dtype)]
        return traced(flat, avals, [Role.PARAM] * len(leaves) + [Role.BATCH] * 2)

    scale = check_microbatching(trace_at(B // m), trace_at(B), m)
    assert scale == 1 / m
    with jax.default_matmul_precision("highest"):
        full_v, full_g = jax.value_and_grad(loss)(params, x, y)
        parts = [jax.value_and_grad(loss)(params, xs, ys)
                 for xs, ys in zip(jnp.split(x, m), jnp.split(y, m))]
    v = scale * sum(p[0] for p in parts)
    g = jax.tree_util.tree_map(lambda *gs: scale * sum(gs), *[p[1] for p in parts])
    np.testing.assert_allclose(v, full_v, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(full_g)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# -- the examples ------------------------------------------------------------------------

def trace_example(mod, cfg, batch_size):
    params, batch = mod.abstract_params(cfg), mod.abstract_batch(cfg, batch_size)
    leaves, tree = jax.tree_util.tree_flatten((params, batch))
    n_params = len(jax.tree_util.tree_leaves(params))

    def loss(*xs):
        p, b = jax.tree_util.tree_unflatten(tree, xs)
        return mod.loss_fn(p, b, cfg)
    return traced(loss, leaves, [Role.PARAM] * n_params + [Role.BATCH] * (len(leaves) - n_params))


def check_example(name, m, batch_size=16):
    mod = importlib.import_module(name)
    cfg = mod.CONFIGS["tiny"]
    return check_microbatching(trace_example(mod, cfg, batch_size // m),
                               trace_example(mod, cfg, batch_size), m)


@pytest.mark.parametrize("name", ["mlp", "flax_mlp", "gpt", "moe", "wide_resnet"])
@pytest.mark.parametrize("m", [2, 4])
def test_examples_are_means(name, m):
    assert check_example(name, m) == pytest.approx(1 / m, rel=1e-12)


def test_wide_resnet_with_whole_batch_norm_raises(monkeypatch):
    """Batch norm over the whole batch (wide_resnet before ghost batch norm) must not be
    micro-batched: each micro-batch would normalise by its own statistics."""
    # The model's module, where its blocks look `norm` up (examples/wide_resnet.py
    # re-exports it).
    from alpa_lite.tools.models import wide_resnet

    def whole_batch_norm(p, x, eps, *_):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=(0, 1, 2))
        var = jnp.square(x32 - mean).mean(axis=(0, 1, 2))
        y = (x32 - mean) * jax.lax.rsqrt(var + eps)
        return y.astype(x.dtype) * p["scale"] + p["bias"]

    monkeypatch.setattr(wide_resnet, "norm", whole_batch_norm)
    with pytest.raises(PlanningError, match="batch statistics"):
        check_example("wide_resnet", 2)


def test_micro_batches_of_one_example_run_as_jit_does():
    """At one example per micro-batch JAX traces size-1 dimensions its own way (the GPT's
    reshapes); the proof is made at two examples and the plan runs at one."""
    import optax

    import alpa_lite as al
    mod = importlib.import_module("gpt")
    cfg = mod.CONFIGS["tiny"]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    batch = mod.make_batch(cfg, 8, jax.random.PRNGKey(1))
    step_fn = mod.make_train_step(cfg, tx)
    args = (params, tx.init(params), batch)
    # The trace at one example really differs from the full batch's.
    with pytest.raises(PlanningError, match="differs from the full-batch one"):
        check_example("gpt", 8, batch_size=8)
    ref = jax.jit(step_fn)(*args)
    out = al.parallelize(step_fn, method=al.Manual(tp=4, pp=2, num_micro_batches=8))(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
