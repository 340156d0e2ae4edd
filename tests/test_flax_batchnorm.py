"""A Flax linen CNN with BatchNorm, written as Flax's docs write it (`mutable=["batch_stats"]`,
the new statistics returned through `has_aux`): single-stage plans equal `jax.jit`, the
running statistics included; micro-batched plans refuse `has_aux` by name (issue 8)."""

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


def _step(state, batch):
    params, stats, opt = state
    (loss, stats), g = al.value_and_grad(_loss, has_aux=True)(params, stats, batch["x"],
                                                               batch["y"])
    u, opt = TX.update(g, opt, params)
    return (optax.apply_updates(params, u), stats, opt), loss


def _args():
    x = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
    y = jax.random.randint(jax.random.key(1), (16,), 0, 4)
    v = MODEL.init(jax.random.key(2), x, train=False)
    return (v["params"], v["batch_stats"], TX.init(v["params"])), {"x": x, "y": y}


@pytest.mark.parametrize("method", [al.DataParallel(), al.Auto(), al.Manual(dp=2, tp=4)],
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
