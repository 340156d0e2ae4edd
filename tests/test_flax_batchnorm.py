"""A Flax linen CNN with BatchNorm, written as Flax's docs write it (`mutable=["batch_stats"]`,
the new statistics returned through `has_aux`): single-stage plans equal `jax.jit`, the
running statistics included; micro-batched plans refuse the whole-batch statistics by name,
and with `micro_batch_statistics=True` do what gradient accumulation does (statistics per
micro-batch, running averages updated in micro-batch order) (issue 8)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite.errors import PlanningError


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x).reshape(x.shape[0], -1)
        return nn.Dense(4)(x)


MODEL = _CNN()
# SGD: Adam divides by the gradient's magnitude, so round-off in the (mathematically zero)
# gradient of the convolution's bias under BatchNorm would show as differences.
TX = optax.sgd(0.1)


def _loss(params, stats, x, y):
    logits, new = MODEL.apply({"params": params, "batch_stats": stats}, x, train=True,
                              mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]


def _step(state, batch, per_micro_batch=False):
    params, stats, opt = state
    (loss, stats), g = al.value_and_grad(_loss, has_aux=True,
                                         micro_batch_statistics=per_micro_batch)(
        params, stats, batch["x"], batch["y"])
    u, opt = TX.update(g, opt, params)
    return (optax.apply_updates(params, u), stats, opt), loss


def _accumulating_step(state, batch, m):
    """Gradient accumulation as a Flax user writes it: m micro-batches in turn, each with
    its own batch statistics, the running averages carried from one to the next."""
    params, stats, opt = state
    grads, losses = None, []
    for k in range(m):
        part = jax.tree.map(lambda a: a[k * a.shape[0] // m:(k + 1) * a.shape[0] // m], batch)
        (loss, stats), g = jax.value_and_grad(_loss, has_aux=True)(params, stats, part["x"],
                                                                   part["y"])
        grads = g if grads is None else jax.tree.map(jax.numpy.add, grads, g)
        losses.append(loss)
    grads = jax.tree.map(lambda a: a / m, grads)
    u, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, u), stats, opt), sum(losses) / m


def _args():
    x = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
    y = jax.random.randint(jax.random.key(1), (16,), 0, 4)
    v = MODEL.init(jax.random.key(2), x, train=False)
    return (v["params"], v["batch_stats"], TX.init(v["params"])), {"x": x, "y": y}


@pytest.mark.parametrize("method", [al.DataParallel(), al.Auto(pipeline=False), al.Manual(dp=2, tp=4)],
                         ids=["dp", "auto", "dp2_tp4"])
def test_batch_norm_statistics_match_jit(method):
    state, batch = _args()
    ref = jax.jit(_step)(state, batch)
    out = al.parallelize(_step, method=method)(state, batch)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batched_batch_norm_is_refused_by_name():
    state, batch = _args()
    step = al.parallelize(_step, method=al.Manual(dp=4, num_micro_batches=2))
    with pytest.raises(PlanningError, match="BatchNorm"):
        step.plan(state, batch)


@pytest.mark.parametrize("method", [al.Manual(dp=8, num_micro_batches=2),
                                    al.Manual(dp=4, pp=2, num_micro_batches=4)],
                         ids=["dp8_m2", "dp4_pp2_m4"])
def test_batch_norm_per_micro_batch_is_gradient_accumulation(method):
    state, batch = _args()
    m = method.num_micro_batches
    ref = jax.jit(lambda s, b: _accumulating_step(s, b, m))(state, batch)
    step = al.parallelize(lambda s, b: _step(s, b, per_micro_batch=True), method=method)
    out = step(state, batch)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The plan says the running averages (mean and var, the loss's operands after the six
    # parameter leaves) are threaded through the micro-batches.
    assert {str(a) for a in step.plan(state, batch).pipeline.aux} == {
        "running value of loss operand 6", "running value of loss operand 7"}
