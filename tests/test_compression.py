"""Compressed data parallelism end to end: plans, the per-worker runtime, state, bad input.

The compressors' own arithmetic is tested in test_compressors.py; here they run inside a
parallelized step on 8 virtual CPU devices, as one node of 8 or as two "nodes" of 4 (the
same devices described as a two-node cluster, so the exchange is hierarchical).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import STEPS, reference_run
from _reference import run_steps as run

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.plan import BucketIssue, Plan
from alpa_lite.runtime.hlo import bytes_by_kind, collectives_in_hlo


def nodes(n: int = 2) -> al.Cluster:
    """The 8 local devices described as `n` nodes."""
    local = al.Cluster.local()
    if n == 1:
        return local
    return dataclasses.replace(local, name=f"local-{n}x{8 // n}", num_nodes=n,
                               devices_per_node=8 // n, inter_node=local.intra_node)


def two_nodes() -> al.Cluster:
    return nodes(2)


def mlp_case(hidden=32, batch=64, tx=None):
    def loss_fn(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    tx = tx or optax.sgd(0.1, momentum=0.9)

    def step(p, s, batch):
        loss, g = al.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k1, (16, hidden)) * 0.3, "b1": jnp.zeros(hidden),
         "w2": jax.random.normal(k2, (hidden, 4)) * 0.3}
    batch = (jax.random.normal(k3, (batch, 16)), jax.random.normal(k4, (batch, 4)))
    return step, (p, tx.init(p), batch)


@pytest.mark.parametrize("num_nodes", [1, 2, 8])
@pytest.mark.parametrize("example", ["gpt", "mlp"])
def test_exact_exchange_matches_jit(example, num_nodes):
    """Dense() through the per-worker runtime equals the undecorated step (rtol 1e-5), on
    one node, two nodes of four and eight nodes of one: issued in buckets, each one
    all-reduce over every worker (not the lossy methods' hierarchical exchange)."""
    step_fn, args, ref_losses, ref_params = reference_run(example)
    cl = nodes(num_nodes)
    step = al.parallelize(step_fn, method=al.DataParallel(), cluster=cl, compression=C.Dense())
    params, _, losses = run(step, args, STEPS)
    plan = step.plan(*args, cluster=cl)
    assert not plan.compression.hierarchical
    assert [b.issue for b in plan.sync_buckets] == [BucketIssue.RUNTIME]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", [C.PowerSGD(rank=1), C.TopK(0.1), C.DGC(0.9, momentum=0.0),
                                    C.OneBit(), C.QSGD(levels=4), C.TernGrad(), C.SignSGD(),
                                    C.RandomK(0.25), C.Cast("bf16")],
                         ids=lambda m: m.name)
def test_synchronous_methods_keep_every_replica_equal(method):
    step_fn, args = mlp_case(hidden=64)
    step = al.parallelize(step_fn, method=al.DataParallel(), cluster=two_nodes(),
                          compression=method)
    params, _, losses = run(step, args, 3)
    assert np.all(np.isfinite(losses))
    for leaf in jax.tree.leaves(params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])
    assert step.plan(*args, cluster=two_nodes()).compression.description == method.describe()


def test_compiled_exchange_carries_the_compressed_payload():
    """Top-k 1%: the gradient leaves travel as all-gathers of k values and k int32 indices,
    and no all-reduce of a whole gradient is left (bytes read from the compiled HLO)."""
    step_fn, args = mlp_case(hidden=512)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    dense = al.parallelize(step_fn, method=al.DataParallel(), compression=C.Dense())
    sparse = al.parallelize(step_fn, method=al.DataParallel(), compression=C.TopK(0.01))
    dense_hlo = bytes_by_kind(collectives_in_hlo(dense.compile(*args).hlo(*args)))
    sparse_hlo = bytes_by_kind(collectives_in_hlo(sparse.compile(*args).hlo(*args)))
    assert dense_hlo.get("all-reduce", 0) >= grad_bytes
    assert sparse_hlo.get("all-reduce", 0) < grad_bytes / 100   # the loss, the NaN count
    gathered = sparse_hlo.get("all-gather", 0)
    k_total = sum(max(1, round(x.size * 0.01)) for x in jax.tree.leaves(args[0]))
    assert gathered == 8 * k_total * (4 + 4)    # n gathered (value, index) pairs of 8 bytes
    plan = sparse.plan(*args)
    assert plan.compression.wire_bytes == pytest.approx(7 * k_total * 8)
    assert plan.compression.dense_wire_bytes == pytest.approx(2 * 7 / 8 * grad_bytes)


def test_nonfinite_gradient_raises_names_it_and_changes_nothing():
    step_fn, (p, s, (x, y)) = mlp_case()
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.TopK(0.1))
    p1, s1, _ = step(p, s, (x, y))
    before = jax.tree.map(np.asarray, step.compression_state)
    bad_x = x.at[3, 0].set(jnp.nan)
    with pytest.raises(al.NonFiniteGradientError, match=r"\['w1'\].*1 of 8 workers"):
        step(p1, s1, (bad_x, y))
    after = jax.tree.map(np.asarray, step.compression_state)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    skipping = al.parallelize(step_fn, method=al.DataParallel(), compression=C.TopK(0.1),
                              on_nonfinite="skip")
    with pytest.warns(UserWarning, match="update was skipped"):
        p2, s2, _ = skipping(p1, s1, (bad_x, y))
    assert all(a is b for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)))
    assert np.all(np.isfinite(np.asarray(jax.tree.leaves(skipping.compression_state)[0])))


def test_state_persists_restores_and_resets():
    step_fn, args = mlp_case()
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.TopK(0.05))
    with pytest.raises(ValueError, match="no compressed step has run"):
        step.compression_state
    p1, s1, _ = run(step, args, 2)
    saved = step.compression_state
    residuals = jax.tree.leaves(saved)
    assert residuals and all(r.shape[0] == 8 for r in residuals)
    assert any(np.abs(np.asarray(r)).sum() > 0 for r in residuals)   # error feedback holds mass
    first, _, first_losses = run(step, (p1, s1, args[2]), 2)
    step.set_compression_state(saved)
    again, _, again_losses = run(step, (p1, s1, args[2]), 2)
    assert first_losses == again_losses
    jax.tree.map(np.testing.assert_array_equal, first, again)
    step.reset_compression_state()
    assert all(not np.asarray(r).any() for r in jax.tree.leaves(step.compression_state))
    with pytest.raises(ValueError, match="structure|does not match"):
        step.set_compression_state({"nope": jnp.zeros(3)})


def test_delayed_averaging_follows_the_formula():
    """w_j <- w_j - lr (g_ij - g_(i-D)j + avg_(i-D)), checked against a direct simulation
    of 8 workers with plain SGD."""
    lr, D, steps = 0.1, 2, 5
    step_fn, (p, s, (x, y)) = mlp_case(tx=optax.sgd(lr))
    step = al.parallelize(step_fn, method=al.DataParallel(),
                          compression=C.DelayedAveraging(delay=D))
    got = p
    for _ in range(steps):
        got, s, _ = step(got, s, (x, y))

    def loss_fn(q, xb, yb):
        h = jnp.tanh(xb @ q["w1"] + q["b1"])
        return jnp.mean((h @ q["w2"] - yb) ** 2)
    xs, ys = x.reshape(8, -1, 16), y.reshape(8, -1, 4)
    workers = [p] * 8
    history = []            # per step: (local grads, their average)
    zero = jax.tree.map(jnp.zeros_like, p)
    for i in range(steps):
        grads = [jax.grad(loss_fn)(w, xs[j], ys[j]) for j, w in enumerate(workers)]
        avg = jax.tree.map(lambda *g: sum(g) / 8, *grads)
        old_g, old_avg = history[i - D] if i >= D else ([zero] * 8, zero)
        workers = [jax.tree.map(lambda w, g, og, oa: w - lr * (g - og + oa), w, g, og, old_avg)
                   for w, g, og in zip(workers, grads, old_g)]
        history.append((grads, avg))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(workers[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_plan_states_the_exchange_and_round_trips():
    step_fn, args = mlp_case()
    step = al.parallelize(step_fn, method=al.DataParallel(), cluster=two_nodes(),
                          compression=C.PowerSGD(rank=2))
    plan = step.plan(*args, cluster=two_nodes())
    c = plan.compression
    assert (c.axis, c.num_workers, c.hierarchical, c.delay) == ("node", 2, True, 0)
    assert c.loss_scale == pytest.approx(1 / 8)
    assert Plan.from_json(plan.to_json()) == plan
    assert "gradient exchange: PowerSGD rank 2" in plan.summary()
    loaded = step.with_plan(Plan.from_json(plan.to_json()))
    p_loaded, _, _ = run(loaded, args, 2)
    p_fresh, _, _ = run(step, args, 2)
    jax.tree.map(np.testing.assert_array_equal, p_loaded, p_fresh)


def _gpt_plan(cluster: str, compression):
    import gpt
    cfg = dataclasses.replace(gpt.CONFIGS["125M"], dtype="float16")
    tx = optax.adamw(1e-4)
    step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.DataParallel(),
                          compression=compression)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step.plan(*gpt.abstract_args(cfg, 64, tx), cluster=al.Cluster.preset(cluster))


def test_auto_compression_chooses_where_links_are_slow():
    lossy = C.AutoCompression(allow=C.common_lossy())
    nvlink = _gpt_plan("8xH100", lossy).compression
    assert nvlink.description == "none (all-reduce)" and nvlink.saved_s == 0
    wan = _gpt_plan("geo-4", lossy).compression
    assert wan.description != "none (all-reduce)"
    assert wan.uncompressed_step_time_s >= 3 * wan.step_time_s
    assert len(wan.candidates) == 1 + len(C.common_lossy())
    exact_only = _gpt_plan("geo-4", "auto").compression     # lossy only when allowed
    assert exact_only.description == "none (all-reduce)"


def test_bad_compression_input_is_refused():
    step_fn, args = mlp_case()
    with pytest.raises(ValueError, match="only name accepted is 'auto'"):
        al.parallelize(step_fn, compression="powersgd")
    with pytest.raises(TypeError, match="compression must be"):
        al.parallelize(step_fn, compression=3)
    with pytest.raises(ValueError, match="on_nonfinite"):
        al.parallelize(step_fn, compression=C.Dense(), on_nonfinite="ignore")
    # Hybrid plans compress (tests/test_hybrid_compression.py), but not with delayed
    # averaging, which keeps parameters per worker.
    tp = al.parallelize(step_fn, method=al.Manual(dp=4, tp=2),
                        compression=C.DelayedAveraging(delay=2))
    with pytest.raises(al.PlanningError, match="pure data-parallel plans"):
        tp.plan(*args)
    with pytest.raises(ValueError, match="delay must be"):
        C.DelayedAveraging(delay=0)

    def with_metric(p, s, batch):
        loss, g = al.value_and_grad(lambda q, b: jnp.mean((b[0] @ q["w1"]) ** 2))(p, batch)
        p = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
        return p, s, loss, jnp.max(batch[0])       # a result from the local batch
    metric = al.parallelize(with_metric, method=al.DataParallel(), compression=C.Dense())
    with pytest.raises(ValueError, match="every result must come from the loss"):
        metric(*args)

    def with_aux(p, s, batch):
        (loss, aux), g = al.value_and_grad(
            lambda q, b: (jnp.mean((b[0] @ q["w1"]) ** 2), 1.0), has_aux=True)(p, batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, loss
    aux = al.parallelize(with_aux, method=al.DataParallel(), compression=C.Dense())
    with pytest.raises((NotImplementedError, al.PlanningError), match="has_aux"):
        aux(*args)


def test_auto_method_with_auto_compression_runs_exactly():
    """Auto() with compression="auto" (no lossy method allowed) plans either the best
    uncompressed layout or data parallelism with the exact all-reduce; both equal jit."""
    step_fn, args = mlp_case()
    step = al.parallelize(step_fn, method=al.Auto(), compression="auto")
    plan = step.plan(*args)
    assert plan.compression is None or plan.compression.description == "none (all-reduce)"
    params, _, losses = run(step, args, 3)
    ref_params, _, ref_losses = run(jax.jit(step_fn), args, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
