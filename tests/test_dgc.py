"""DGC inside a parallelized step: the optimizer's momentum is refused, and DGC's own momentum
is momentum SGD's (learning rate and loss scale applied once).

DGC's arithmetic is tested in test_compressors.py; here it runs through `al.parallelize` on
the 8 virtual CPU devices (8 data-parallel workers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.compression.momentum import dgc_with_momentum, momentum_states
from alpa_lite.errors import PlanningError


def tiny_case(tx):
    """A 16-8-4 tanh MLP step with optimizer `tx`, and its arguments (batch 32)."""
    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def step(p, s, batch):
        loss, g = al.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k1, (16, 8)) * 0.3, "b1": jnp.zeros(8),
         "w2": jax.random.normal(k2, (8, 4)) * 0.3}
    batch = (jax.random.normal(k3, (32, 16)), jax.random.normal(k4, (32, 4)))
    return step, (p, tx.init(p), batch)


def plan(tx, compression):
    step, args = tiny_case(tx)
    return al.parallelize(step, method=al.DataParallel(), compression=compression).plan(*args)


@pytest.mark.parametrize("tx,field", [(optax.sgd(0.1, momentum=0.9), "trace"),
                                      (optax.sgd(0.1, momentum=0.9, nesterov=True), "trace"),
                                      (optax.adam(1e-3), "mu")],
                         ids=["sgd_momentum", "nesterov", "adam"])
def test_dgc_momentum_with_a_momentum_optimizer_is_refused(tx, field):
    with pytest.raises(PlanningError, match=rf"momentum 0\.9 itself.*s/0/{field}/w1.*applied "
                                            r"twice.*optax\.sgd\(learning_rate\) without "
                                            r"momentum.*DGC\(\.\.\., momentum=0\.0\)"):
        plan(tx, C.DGC(sparsity=0.9))
    # Wrapped, or offered to the automatic choice: refused as well.
    with pytest.raises(PlanningError, match="applied twice"):
        plan(tx, C.DelayedAveraging(delay=2, compressor=C.DGC(sparsity=0.9)))
    with pytest.raises(PlanningError, match="applied twice"):
        plan(tx, C.AutoCompression(allow=(C.PowerSGD(rank=2), C.DGC(sparsity=0.9))))


def test_dgc_plans_with_plain_sgd_and_without_its_momentum_beside_the_optimizers():
    assert plan(optax.sgd(0.1), C.DGC(sparsity=0.9)).compression is not None
    assert plan(optax.sgd(optax.cosine_decay_schedule(0.1, 10)),
                C.DGC(sparsity=0.9)).compression is not None
    no_momentum = C.DGC(sparsity=0.9, momentum=0.0)
    assert plan(optax.sgd(0.1, momentum=0.9), no_momentum).compression is not None
    assert plan(optax.adam(1e-3), no_momentum).compression is not None
    assert plan(optax.adam(1e-3), C.TopK(0.1)).compression is not None


def test_momentum_states_are_found_by_field_and_parameter_shape():
    shapes = [(16, 8), (8,)]
    found = momentum_states([("s/0/trace/w1", (16, 8)), ("s/0/count", ()),
                             ("s/0/nu/w1", (16, 8)),     # Adam's second moment: no momentum
                             ("s/0/nu/mu", (8,)),        # a parameter named "mu" inside nu
                             ("s/0/mu/b1", (8,)), ("opt.ema.w", (16, 8)),
                             ("s/0/trace/other", (3, 3))], shapes)   # not a parameter's shape
    assert [(s.name, s.field) for s in found] == [("s/0/trace/w1", "trace"),
                                                  ("s/0/mu/b1", "mu"), ("opt.ema.w", "ema")]
    assert "SGD momentum" in found[0].kind
    assert dgc_with_momentum(C.DGC(momentum=0.0)) == ()
    assert dgc_with_momentum(C.DelayedAveraging(delay=2, compressor=C.DGC())) == (C.DGC(),)


def test_dgc_sending_every_leaf_whole_is_momentum_sgd():
    """With every leaf sent whole, DGC + plain SGD equals optax momentum SGD under jax.jit,
    step for step: DGC's summed velocities, scaled by the runtime's loss scale (1/8 for the
    mean loss), are the mean velocity, and the learning rate is applied once."""
    lr, steps = 0.1, 4
    dgc = C.DGC(sparsity=0.9, momentum=0.9, min_compressed_numel=10**9)
    step_fn, (p, _, batch) = tiny_case(optax.sgd(lr))
    compressed = al.parallelize(step_fn, method=al.DataParallel(), compression=dgc)
    ref_fn, (p_ref, s_ref, _) = tiny_case(optax.sgd(lr, momentum=0.9))
    ref = jax.jit(ref_fn)
    s = optax.sgd(lr).init(p)
    for _ in range(steps):
        p, s, loss = compressed(p, s, batch)
        p_ref, s_ref, loss_ref = ref(p_ref, s_ref, batch)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
