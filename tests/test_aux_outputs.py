"""Aux outputs under micro-batched and pipelined plans (issue "8 ·", point 3): each aux leaf
of `al.value_and_grad(..., has_aux=True)` combines over micro-batches by a rule the
micro-batch proof makes exact and the plan states (same value, mean, sum, or one entry per
example), and the step equals plain jax.jit; an aux leaf no rule reproduces is refused by
name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite.errors import PlanningError
from alpa_lite.plan.plan import AuxCombination, Combine

TX = optax.sgd(0.1)


def _loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"])
    logits = h @ p["w2"]
    per_example = jnp.sum((logits - batch["y"]) ** 2, axis=-1)
    aux = {"accuracy": jnp.mean((logits.argmax(-1) == batch["y"].argmax(-1)).astype(jnp.float32)),
           "sum_sq": jnp.sum(per_example),
           "per_example": per_example,
           "weight_norm": jnp.sum(p["w1"] ** 2)}
    return jnp.mean(per_example), aux


def _step(p, s, batch):
    (loss, aux), g = al.value_and_grad(_loss, has_aux=True)(p, batch)
    u, s = TX.update(g, s, p)
    return optax.apply_updates(p, u), s, loss, aux


def _args():
    k = jax.random.split(jax.random.key(0), 4)
    p = {"w1": 0.3 * jax.random.normal(k[0], (16, 32)), "w2": 0.3 * jax.random.normal(k[1], (32, 8)),
         "w3": 0.3 * jax.random.normal(k[1], (8, 8))}
    batch = {"x": jax.random.normal(k[2], (16, 16)), "y": jax.random.normal(k[3], (16, 8))}
    return p, TX.init(p), batch


@pytest.mark.parametrize("method", [al.Manual(dp=8, num_micro_batches=2),
                                    al.Manual(dp=4, pp=2, num_micro_batches=2)],
                         ids=["dp8_m2", "dp4_pp2_m2"])
def test_aux_outputs_combine_as_jit_computes_them(method):
    args = _args()
    ref = jax.jit(_step)(*args)
    step = al.parallelize(_step, method=method)
    out = step(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name in ref[3]:
        np.testing.assert_allclose(out[3][name], ref[3][name], rtol=1e-5, err_msg=name)
    # The plan states each rule (aux leaves in jax.tree order: sorted keys).
    assert step.plan(*args).pipeline.aux == (
        AuxCombination(Combine.MEAN), AuxCombination(Combine.CONCAT, 0),
        AuxCombination(Combine.SUM), AuxCombination(Combine.SAME))


@pytest.mark.parametrize("aux, match", [
    (lambda per_example: jnp.max(per_example), "reduce_max over the batch"),
    (lambda per_example: per_example / per_example.shape[0], "aux output 1"),
], ids=["max_over_batch", "scaled_by_batch_size"])
def test_an_aux_that_no_combination_reproduces_is_refused_by_name(aux, match):
    def loss(p, batch):
        value, extra = _loss(p, batch)
        return value, aux(extra["per_example"])

    def step(p, s, batch):
        (value, extra), g = al.value_and_grad(loss, has_aux=True)(p, batch)
        return p, s, value, extra

    with pytest.raises(PlanningError, match=match):
        al.parallelize(step, method=al.Manual(dp=8, num_micro_batches=2)).plan(*_args())
