"""Random keys are values like any other: typed (`jax.random.key`) and raw uint32
(`jax.random.PRNGKey`) keys in the batch or beside it trace, plan and run, are never split
along the batch, and draw exactly what the undecorated step draws, micro-batched plans
included (each micro-batch draws its rows of the whole batch's mask); compressed data
parallelism, which cannot, refuses by name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import Role

TX = optax.sgd(0.1)


def _dropout_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"])
    keep = jax.random.bernoulli(batch["key"], 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0.0)
    return jnp.mean((h @ p["w2"]) ** 2)


def _step(p, s, batch):
    loss, g = al.value_and_grad(_dropout_loss)(p, batch)
    u, s = TX.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


def _args(key):
    p = {"w1": jax.random.normal(jax.random.key(1), (16, 32)),
         "w2": jax.random.normal(jax.random.key(2), (32, 8))}
    batch = {"x": jax.random.normal(jax.random.key(3), (32, 16)), "key": key}
    return p, TX.init(p), batch


def _assert_same(out, ref):
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


KEYS = {"typed": lambda: jax.random.key(7), "raw": lambda: jax.random.PRNGKey(7)}
PLANS = {"dp": al.DataParallel(), "auto": al.Auto(pipeline=False), "dp2_tp4": al.Manual(dp=2, tp=4)}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", list(KEYS))
def test_dropout_key_in_the_batch_draws_as_jit_does(kind, plan):
    args = _args(KEYS[kind]())
    ref = jax.jit(_step)(*args)
    step = al.parallelize(_step, method=PLANS[plan])
    _assert_same(step(*args), ref)
    # The key is not batch data: it keeps its whole shape on every device.
    graph = step.trace(*args).graph
    key = next(graph.tensors[t] for t in graph.inputs if graph.tensors[t].name.endswith("key"))
    assert key.role is Role.OPT_STATE


MICRO_BATCHED = {"dp4_pp2_m2": al.Manual(dp=4, pp=2, num_micro_batches=2),
                 "dp8_m4": al.Manual(dp=8, num_micro_batches=4)}


@pytest.mark.parametrize("plan", list(MICRO_BATCHED))
@pytest.mark.parametrize("kind", list(KEYS))
def test_micro_batches_draw_their_rows_of_the_whole_batch_mask(kind, plan):
    """Each micro-batch draws its rows of the dropout mask jax.jit draws for the batch,
    and the plan says so."""
    args = _args(KEYS[kind]())
    ref = jax.jit(_step)(*args)
    step = al.parallelize(_step, method=MICRO_BATCHED[plan])
    _assert_same(step(*args), ref)
    assert step.plan(*args).pipeline.batch_draws == 1


def test_compression_refuses_batch_shaped_randomness_by_name():
    args = _args(jax.random.key(7))
    step = al.parallelize(_step, method=al.DataParallel(),
                          compression=al.compression.PowerSGD(rank=2))
    with pytest.raises(PlanningError, match="draws random numbers along the batch"):
        step.plan(*args)


class _DropoutCNN(nn.Module):
    """A Flax CNN written as its docs write one: `nn.Dropout` fed by an `rngs` key."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(4)(x)


def test_flax_dropout_with_an_rngs_key_matches_jit():
    model = _DropoutCNN()
    x = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
    y = jax.random.randint(jax.random.key(1), (16,), 0, 4)
    params = model.init(jax.random.key(2), x, train=False)["params"]
    tx = optax.adam(1e-2)

    def loss_fn(params, x, y, key):
        logits = model.apply({"params": params}, x, train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, batch):
        loss, g = al.value_and_grad(loss_fn)(params, batch["x"], batch["y"], batch["key"])
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    for key, method in ((jax.random.key(5), al.DataParallel()),
                        (jax.random.PRNGKey(5), al.Manual(dp=4, pp=2, num_micro_batches=2))):
        args = (params, tx.init(params), {"x": x, "y": y, "key": key})
        ref = jax.jit(step)(*args)
        _assert_same(al.parallelize(step, method=method)(*args), ref)


def _key_loss(p, x, key):
    h = jnp.tanh(x @ p["w1"])
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    return jnp.mean((jnp.where(keep, h / 0.9, 0.0) @ p["w2"]) ** 2)


def _key_step(p, s, x, key):
    # The training-loop pattern: split the step's key, use one half, hand the other back.
    key, sub = jax.random.split(key)
    loss, g = al.value_and_grad(_key_loss)(p, x, sub)
    u, s = TX.update(g, s, p)
    return optax.apply_updates(p, u), s, loss, key


@pytest.mark.parametrize("kind", list(KEYS))
def test_a_key_split_in_the_step_and_returned_carries_over_steps(kind):
    p, s, batch = _args(KEYS[kind]())
    key = batch["key"]
    step = al.parallelize(_key_step, method=al.Auto(pipeline=False), batch_argnums=(2,))
    out, ref = (p, s, None, key), (p, s, None, key)
    for _ in range(2):
        out = step(out[0], out[1], batch["x"], out[3])
        ref = jax.jit(_key_step)(ref[0], ref[1], batch["x"], ref[3])
        np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    data = jax.random.key_data if kind == "typed" else np.asarray
    np.testing.assert_array_equal(data(out[3]), data(ref[3]))


def test_a_raw_key_of_the_wrong_shape_is_named():
    p, s, batch = _args(jax.random.PRNGKey(7))
    batch["key"] = jnp.zeros((3,), jnp.uint32)
    with pytest.raises(TypeError, match=r"batch/key \[3\]"):
        al.parallelize(_step, method=al.DataParallel())(p, s, batch)


@pytest.mark.parametrize("method", [al.DataParallel(), al.Manual(dp=8, num_micro_batches=2)],
                         ids=["dp", "dp8_m2"])
def test_batch_leaves_that_disagree_on_the_batch_size_are_named(method):
    p, s, batch = _args(jax.random.key(7))
    batch["mask"] = jnp.ones((3, 16))
    with pytest.raises(PlanningError, match=r"batch/mask with 3"):
        al.parallelize(_step, method=method).plan(p, s, batch)
