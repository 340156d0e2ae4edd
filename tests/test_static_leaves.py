"""Non-array leaves in a step's arguments and results (an Equinox model's activation
functions): held static, as eqx.filter_jit holds them; the step is planned once per set of
static values, runs equal to the step run op by op, and returns the static leaves it was
given; an unhashable one is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al

TX = optax.sgd(0.1)


def _step(model, opt_state, batch):
    params = {"w1": model["w1"], "w2": model["w2"]}

    def loss(p):
        h = model["act"](batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    value, grads = al.value_and_grad(loss)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return {**optax.apply_updates(params, updates), "act": model["act"],
            "name": model["name"]}, opt_state, value


def _args(act):
    k = jax.random.split(jax.random.key(0), 4)
    model = {"w1": jax.random.normal(k[0], (8, 16)), "w2": jax.random.normal(k[1], (16, 4)),
             "act": act, "name": "mlp"}
    batch = {"x": jax.random.normal(k[2], (16, 8)), "y": jax.random.normal(k[3], (16, 4))}
    return model, TX.init({"w1": model["w1"], "w2": model["w2"]}), batch


@pytest.mark.parametrize("method", [al.DataParallel(),
                                    al.Manual(dp=4, pp=2, num_micro_batches=2)],
                         ids=["dp", "dp4_pp2_m2"])
def test_non_array_leaves_are_held_static_and_returned(method):
    step = al.parallelize(_step, method=method)
    for act in (jnp.tanh, jax.nn.relu):
        args = _args(act)
        with jax.disable_jit():
            ref = _step(*args)
        out = step(*args)
        assert out[0]["act"] is act and out[0]["name"] == "mlp"
        np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
        for name in ("w1", "w2"):
            np.testing.assert_allclose(out[0][name], ref[0][name], rtol=1e-4, atol=1e-6)
        # The next step takes the returned model as it is.
        step(*out[:2], args[2])[2].block_until_ready()
    # The shardings come shaped like the arguments, None at the static leaves.
    shardings = step.input_shardings(*args)
    assert shardings[0]["act"] is None and shardings[0]["name"] is None
    assert isinstance(shardings[0]["w1"], jax.sharding.Sharding)
    # One plan per set of static values (the two activations), whatever the calls.
    assert len(step.built_plans) == 2
    assert step.plan(*_args(jnp.tanh)) is step.plan(*_args(jnp.tanh))


def test_an_unhashable_non_array_leaf_is_refused_by_name():
    model, opt_state, batch = _args(jnp.tanh)
    model["act"] = {1, 2}        # a set: a pytree leaf, and not hashable
    with pytest.raises(TypeError, match=r"\['act'\] is a set.*must be hashable"):
        al.parallelize(_step, method=al.DataParallel()).plan(model, opt_state, batch)
