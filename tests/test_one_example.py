"""Pipeline stages whose data-parallel replicas hold one example of each micro-batch still
accumulate their gradients per replica and reduce them once per step: the loss traced at
one example (which JAX traces as another program) is aligned to the micro-batch's
(`alpa_lite.ir.one_example`)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import run_steps

import alpa_lite as al
from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import Role
from alpa_lite.ir.one_example import align_one_example
from alpa_lite.ir.replay import replay
from alpa_lite.ir.tracing import trace_flat
from alpa_lite.plan import Accumulation

T, D = 8, 4


def _positional_loss(w, x):
    """A loss written as Hugging Face's Flax models write positions and masks:
    `jnp.broadcast_to` to the batch's shape, which JAX skips at one example."""
    b = x.shape[0]
    positions = jnp.broadcast_to(jnp.arange(T)[None, :], (b, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (b, T, T))
    h = x @ w + positions[..., None].astype(x.dtype)
    scores = jnp.where(mask, jnp.einsum("btd,bsd->bts", h, h), 0.0)
    h = jnp.einsum("bts,bsd->btd", scores, h)
    return jnp.mean(h.reshape(b, T * D) ** 2)


def _traced(fn, batch):
    avals = [jax.ShapeDtypeStruct((D, D), jnp.float32),
             jax.ShapeDtypeStruct((batch, T, D), jnp.float32)]
    return trace_flat(lambda *a: (fn(*a),), avals, [Role.PARAM, Role.BATCH], ["w", "x"])


def test_the_one_example_trace_takes_the_micro_batch_ids_and_computes_the_same():
    micro, local = _traced(_positional_loss, 4), _traced(_positional_loss, 1)
    # JAX really traces one example as another program: it skips the broadcasts.
    assert len(local.graph.nodes) < len(micro.graph.nodes)
    aligned = align_one_example(local, micro)
    g = aligned.graph
    assert [(n.id, n.inputs, n.outputs) for n in g.nodes] == \
        [(n.id, n.inputs, n.outputs) for n in micro.graph.nodes]
    assert g.tensors[g.inputs[1]].shape == (1, T, D)
    w = jax.random.normal(jax.random.key(0), (D, D))
    x = jax.random.normal(jax.random.key(1), (1, T, D))
    env = dict(zip(g.inputs, (w, x)))
    replay(aligned, range(len(g.nodes)), env)
    np.testing.assert_allclose(env[g.outputs[0]], _positional_loss(w, x), rtol=1e-6)


def test_a_loss_that_branches_on_one_example_is_not_aligned():
    def branching(w, x):
        h = x @ w
        if x.shape[0] == 1:      # another program at one example, not a skipped identity
            h = jnp.tanh(h)
        return jnp.mean(h ** 2)
    with pytest.raises(PlanningError, match="they part at"):
        align_one_example(_traced(branching, 1), _traced(branching, 4))


def _assert_accumulates_locally_and_matches_jit(step_fn, args, method, steps=2):
    step = al.parallelize(step_fn, method=method)
    plan = step.plan(*args)
    assert [st.accumulate_axes for st in plan.stages] == [("dp",)] * len(plan.stages), \
        [st.accumulate_note for st in plan.stages]
    assert all(g.accumulation is Accumulation.LOCAL and g.count == 1
               for g in plan.gradient_sync)
    assert al.Plan.from_json(plan.to_json()) == plan
    ref_p, _, ref_losses = run_steps(jax.jit(step_fn), args, steps)
    p, _, losses = run_steps(step, args, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    return plan


def test_gpt_with_one_example_per_replica_reduces_gradients_once_per_step():
    # dp=4 x pp=2, 8 micro-batches of 4: each replica's share is one example.
    mod = importlib.import_module("gpt")
    cfg = mod.CONFIGS["tiny"]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    args = (params, tx.init(params), mod.make_batch(cfg, 32, jax.random.PRNGKey(1)))
    _assert_accumulates_locally_and_matches_jit(
        mod.make_train_step(cfg, tx), args, al.Manual(dp=4, pp=2, num_micro_batches=8))


@pytest.mark.parametrize("model,library", [("hf_llama", "transformers"),
                                           ("eqx_transformer", "equinox")])
def test_library_transformers_with_one_example_per_replica_accumulate_locally(model, library):
    pytest.importorskip(library)
    lm = importlib.import_module("library_models")
    case = getattr(lm, model)(batch_size=8)
    plan = _assert_accumulates_locally_and_matches_jit(
        case.step, case.args, al.Manual(dp=4, pp=2, num_micro_batches=2))
    # The loss's take_along_axis indices have another rank at one example: the last
    # stage's replicas reshape their slice of them (the plan says which and where).
    assert plan.stages[-1].accumulate_reshapes
