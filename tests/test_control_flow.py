"""Control flow (issue "8 ·", point 2): a stack of layers written with `lax.scan` is
unrolled, sharded on its non-layer axes and cut into pipeline stages; a loop kept whole
(a long scan, `while`, `cond`) splits along the dimensions its body keeps apart; every plan
equals plain jax.jit and says what tracing decided."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite.ir import tracing
from alpa_lite.ir.op_rules import dim_labels

TX = optax.sgd(0.1)
LAYERS, D = 4, 64


def _stack_loss(p, batch):
    def layer(h, w):
        return h + jnp.tanh(h @ w["up"]) @ w["down"], None

    h, _ = jax.lax.scan(layer, batch["x"] @ p["embed"], p["layers"])
    return jnp.mean((h - batch["y"]) ** 2)


def _rnn_loss(p, batch):
    def cell(h, x):
        h = jnp.tanh(h @ p["wh"] + x @ p["wx"])
        return h, jnp.sum(h, axis=-1)

    xs = jnp.swapaxes(batch["x"], 0, 1)                 # [time, batch, features]
    h, per_step = jax.lax.scan(cell, jnp.zeros((xs.shape[1], D)), xs)
    # A loop of unknown trip count (on values that take no gradient) and a branch.
    _, damped = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, 0.5 * c[1]),
                                   (0, jax.lax.stop_gradient(h)))
    h = jax.lax.cond(p["gain"] > 0, lambda a: 2.0 * a, lambda a: a + 1.0, h + damped)
    return jnp.mean(h ** 2) + 1e-2 * jnp.mean(per_step)


def _make_step(loss):
    def step(p, s, batch):
        value, g = al.value_and_grad(loss)(p, batch)
        u, s = TX.update(g, s, p)
        return optax.apply_updates(p, u), s, value
    return step


def _stack_args(batch=8):
    k = jax.random.split(jax.random.key(0), 5)
    p = {"embed": 0.3 * jax.random.normal(k[0], (16, D)),
         "layers": {"up": 0.1 * jax.random.normal(k[1], (LAYERS, D, 4 * D)),
                    "down": 0.1 * jax.random.normal(k[2], (LAYERS, 4 * D, D))}}
    data = {"x": jax.random.normal(k[3], (batch, 16)), "y": jax.random.normal(k[4], (batch, D))}
    return p, TX.init(p), data


def _rnn_args():
    k = jax.random.split(jax.random.key(1), 3)
    p = {"wh": 0.3 * jax.random.normal(k[0], (D, D)),
         "wx": 0.3 * jax.random.normal(k[1], (8, D)), "gain": jnp.float32(1.0)}
    return p, TX.init(p), {"x": jax.random.normal(k[2], (16, 12, 8))}


def _assert_same(out, ref):
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", [al.DataParallel(), al.Manual(dp=2, tp=4),
                                    al.Manual(dp=4, pp=2, num_micro_batches=2)],
                         ids=["dp", "dp2_tp4", "dp4_pp2_m2"])
def test_scanned_layer_stack_runs_as_jit(method):
    step, args = _make_step(_stack_loss), _stack_args()
    ref = jax.jit(step)(*args)
    pstep = al.parallelize(step, method=method)
    _assert_same(pstep(*args), ref)
    plan = pstep.plan(*args)
    assert any("unrolled into 4 iterations" in n for n in plan.notes)
    if getattr(method, "pp", 1) > 1:
        # The stack is cut between its layers: both stages run some of them.
        assert len(plan.stages) == 2


def test_stacked_weights_shard_on_their_layer_free_axes():
    # Two examples against 64 x 256 weights: splitting the weights beats the batch.
    step, args = _make_step(_stack_loss), _stack_args(batch=2)
    plan = al.parallelize(step, method=al.Manual(dp=1, tp=8)).plan(*args)
    for name in ("p/layers/up", "p/layers/down"):
        spec = plan.stages[0].sharding_of(name)
        assert spec.dims[0] == (), f"{name}: the layer axis must stay whole, got {spec}"
        assert any(spec.dims[1:]), f"{name} is not sharded: {spec}"


@pytest.fixture
def short_unroll_limit(monkeypatch):
    """Loops up to 4 iterations unroll: the 12-step recurrence stays a loop."""
    monkeypatch.setattr(tracing, "MAX_UNROLLED_ITERATIONS", 4)


def test_a_loop_kept_whole_splits_along_the_batch(short_unroll_limit):
    step, args = _make_step(_rnn_loss), _rnn_args()
    ref = jax.jit(step)(*args)
    pstep = al.parallelize(step, method=al.Manual(dp=8))
    _assert_same(pstep(*args), ref)
    traced = pstep.trace(*args)
    scans = [n for n in traced.graph.nodes if n.primitive == "scan"]
    assert scans
    plan = pstep.plan(*args)
    assert any("while loop" in n and "one iteration" in n for n in plan.notes)
    assert not plan.unsharded_primitives
    # The forward scan's carry [batch, D]: the batch splits, the features (contracted by
    # the recurrence) stay whole.
    g = traced.graph
    fwd = scans[0]
    labels = dim_labels("scan", fwd.params,
                        [None if t is None else g.tensors[t].shape for t in fwd.inputs],
                        [g.tensors[t].shape for t in fwd.outputs])
    carry = labels.outputs[0]
    assert carry[0] not in labels.fixed and carry[1] in labels.fixed


def test_micro_batches_see_through_a_loop_kept_whole(short_unroll_limit):
    step, args = _make_step(_rnn_loss), _rnn_args()
    ref = jax.jit(step)(*args)
    _assert_same(al.parallelize(step, method=al.Manual(dp=8, num_micro_batches=2))(*args), ref)


def test_auto_shards_large_stacked_weights_where_that_pays():
    # Four 2048 x 8192 layers and a batch of 8 on 8 H100s (planned from shapes): the
    # weights' gradient all-reduce would dwarf the compute, so Auto splits them.
    from alpa_lite.cost_models.cluster import Cluster
    d = 2048
    p = {"embed": jax.ShapeDtypeStruct((16, d), jnp.float32),
         "layers": {"up": jax.ShapeDtypeStruct((LAYERS, d, 4 * d), jnp.float32),
                    "down": jax.ShapeDtypeStruct((LAYERS, 4 * d, d), jnp.float32)}}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32),
             "y": jax.ShapeDtypeStruct((8, d), jnp.float32)}
    args = (p, jax.eval_shape(TX.init, p), batch)
    step = _make_step(_stack_loss)
    cluster = Cluster.of_gpus("H100", 1, 8)
    plan = al.parallelize(step, method=al.Auto(pipeline=False)).plan(*args, cluster=cluster)
    for name in ("p/layers/up", "p/layers/down"):
        spec = plan.stages[0].sharding_of(name)
        assert spec.dims[0] == () and any(spec.dims[1:]), (name, spec)
    dp = al.parallelize(step, method=al.DataParallel()).plan(*args, cluster=cluster)
    assert plan.step_time_s < dp.step_time_s
