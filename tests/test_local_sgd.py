"""Local SGD (`compression.LocalSGD`) end to end on 8 virtual CPU devices (8 workers).

Each worker steps on its own gradient and the workers average their parameters every H
steps; post-local SGD runs synchronous steps first; the average may travel as compressed
deltas. Compared with the synchronous data-parallel step and with a direct simulation of
8 workers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_compression import mlp_case, two_nodes

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.plan import Plan
from alpa_lite.runtime.hlo import bytes_by_kind, collectives_in_hlo

LR, MOMENTUM = 0.1, 0.9       # mlp_case's optimizer: optax.sgd(0.1, momentum=0.9)


def run(step, args, n):
    """`n` steps, blocking on each; returns (params, opt_state, losses)."""
    p, s, batch = args
    losses = []
    for _ in range(n):
        p, s, loss = step(p, s, batch)
        losses.append(float(loss.block_until_ready()))
    return p, s, losses


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def worker_copies(step, params):
    """Each parameter leaf's 8 per-worker copies, as numpy (rows = workers)."""
    exe = step.active_compressed
    leaves = jax.tree.leaves(params)
    copies = exe.replicas_of(leaves)
    assert set(copies) == set(range(len(leaves)))      # every leaf is kept per worker
    return [np.asarray(copies[i]) for i in range(len(leaves))]


def spread(copies) -> float:
    """Largest difference between any worker's copy and worker 0's."""
    return max(float(np.abs(c - c[0]).max()) for c in copies)


@pytest.mark.parametrize("cluster", [None, "two_nodes"])
def test_averaging_every_step_equals_synchronous_sgd(cluster):
    """H = 1, Dense: each worker steps on its own gradient, then the parameters are
    averaged; SGD with momentum is linear in the gradient and the momentum, so the mean of
    the workers' steps is the synchronous step (rtol 1e-5), on one node and hierarchical."""
    cl = two_nodes() if cluster else None
    step_fn, args = mlp_case()
    sync = al.parallelize(step_fn, method=al.DataParallel(), cluster=cl)
    local = al.parallelize(step_fn, method=al.DataParallel(), cluster=cl,
                           compression=C.LocalSGD(every=1))
    p_sync, _, l_sync = run(sync, args, 5)
    p_local, _, l_local = run(local, args, 5)
    np.testing.assert_allclose(l_local, l_sync, rtol=1e-5)
    assert_trees_close(p_local, p_sync)
    assert spread(worker_copies(local, p_local)) == 0.0     # every worker holds the average


def test_sum_loss_every_step_equals_synchronous_sgd():
    """With a summed loss (loss_scale 1) each worker's gradient is scaled by n, so that
    the workers' mean is still the synchronous gradient."""
    tx = optax.sgd(2e-3)

    def step_fn(p, s, batch):
        def loss_fn(q, b):
            h = jnp.tanh(b[0] @ q["w1"] + q["b1"])
            return jnp.sum((h @ q["w2"] - b[1]) ** 2)
        loss, g = al.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    _, (p, _, batch) = mlp_case()
    args = (p, tx.init(p), batch)
    sync = al.parallelize(step_fn, method=al.DataParallel())
    local = al.parallelize(step_fn, method=al.DataParallel(), compression=C.LocalSGD(every=1))
    assert local.plan(*args).compression.loss_scale == 1.0
    p_sync, _, l_sync = run(sync, args, 3)
    p_local, _, l_local = run(local, args, 3)
    np.testing.assert_allclose(l_local, l_sync, rtol=1e-5)
    assert_trees_close(p_local, p_sync)


def test_workers_diverge_between_averages_and_agree_after():
    """H = 4 against a direct simulation of 8 workers (own data share, own momentum,
    parameters averaged after steps 3 and 7); between averages the workers' parameters
    differ, right after one they are equal; the optimizer state is never averaged."""
    H, steps = 4, 8
    step_fn, (p, s, (x, y)) = mlp_case()
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.LocalSGD(every=H))
    tx = optax.sgd(LR, momentum=MOMENTUM)

    def loss_fn(q, xb, yb):
        h = jnp.tanh(xb @ q["w1"] + q["b1"])
        return jnp.mean((h @ q["w2"] - yb) ** 2)
    xs, ys = x.reshape(8, -1, 16), y.reshape(8, -1, 4)
    ref = [(p, tx.init(p)) for _ in range(8)]

    got, state = p, s
    for t in range(steps):
        got, state, loss = step(got, state, (x, y))
        loss.block_until_ready()
        stepped = []
        for j, (w, m) in enumerate(ref):
            updates, m = tx.update(jax.grad(loss_fn)(w, xs[j], ys[j]), m, w)
            stepped.append((optax.apply_updates(w, updates), m))
        ref = stepped
        averaged = (t + 1) % H == 0
        if averaged:
            mean = jax.tree.map(lambda *w: sum(w) / 8, *[w for w, _ in ref])
            ref = [(mean, m) for _, m in ref]
        copies = worker_copies(step, got)
        if averaged:
            assert spread(copies) == 0.0, f"step {t}: workers differ right after an average"
        else:
            assert spread(copies) > 1e-4, f"step {t}: workers should differ between averages"
        # Returned: worker 0's parameters (the average after an averaging step).
        assert_trees_close(got, ref[0][0])
        for j in (1, 7):
            for c, r in zip(copies, jax.tree.leaves(ref[j][0])):
                np.testing.assert_allclose(c[j], np.asarray(r), rtol=1e-5, atol=1e-6)
    # Momentum stays per worker, even right after the average of step 7.
    momenta = [np.asarray(m) for m in step.active_compressed.replicas_of(
        jax.tree.leaves(state)).values()]
    assert momenta and spread(momenta) > 1e-4


def test_local_step_compiles_without_any_collective():
    """The program of a local step moves nothing between workers: its compiled HLO has no
    collective at all (not even the loss's sum); the averaging step's program all-reduces
    at least the parameters' bytes, and a warm-up step's the gradients'."""
    step_fn, args = mlp_case(hidden=64)
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    step = al.parallelize(step_fn, method=al.DataParallel(),
                          compression=C.LocalSGD(every=3, warmup_steps=1))
    exe = step.compile(*args)
    warm = bytes_by_kind(collectives_in_hlo(exe.hlo(*args)))           # step 0: warm-up
    assert warm.get("all-reduce", 0) >= param_bytes
    p, s, _ = run(step, args, 1)
    assert collectives_in_hlo(exe.hlo(p, s, args[2])) == []             # step 1: local
    p, s, _ = run(step, (p, s, args[2]), 2)
    averaging = bytes_by_kind(collectives_in_hlo(exe.hlo(p, s, args[2])))   # step 3
    assert averaging.get("all-reduce", 0) >= param_bytes
    assert set(exe._compiled) == {("warmup",), ("local",), ("average", ())}


def test_warmup_steps_are_synchronous_sgd():
    """Post-local SGD: the first `warmup_steps` steps equal the synchronous data-parallel
    step (rtol 1e-5) with every worker holding the same parameters; then they go local."""
    step_fn, args = mlp_case()
    sync = al.parallelize(step_fn, method=al.DataParallel())
    post = al.parallelize(step_fn, method=al.DataParallel(),
                          compression=C.LocalSGD(every=4, warmup_steps=3,
                                                 compressor=C.PowerSGD(rank=1)))
    p_sync, s_sync, l_sync = run(sync, args, 3)
    p_post, s_post, l_post = run(post, args, 3)
    np.testing.assert_allclose(l_post, l_sync, rtol=1e-5)
    assert_trees_close(p_post, p_sync)
    assert_trees_close(s_post, s_sync)
    assert spread(worker_copies(post, p_post)) == 0.0
    # The last average (PowerSGD's delta is taken from it) is the warm-up's parameters.
    anchors = post.compression_state["anchor"]
    for a, w in zip(anchors, jax.tree.leaves(p_post)):
        for row in np.asarray(a):
            np.testing.assert_array_equal(row, np.asarray(w))
    p_post, _, _ = run(post, (p_post, s_post, args[2]), 1)              # step 3: local
    assert spread(worker_copies(post, p_post)) > 1e-4


@pytest.mark.parametrize("compressor", [C.PowerSGD(rank=2), C.TopK(0.1)],
                         ids=lambda c: c.name)
def test_compressed_delta_trains(compressor):
    """H = 4 with the parameter deltas compressed (error feedback): the loss after the last
    average is far below the first, the workers agree after each average, and the
    residuals carry what the deltas did not send."""
    step_fn, args = mlp_case(hidden=64)
    step = al.parallelize(step_fn, method=al.DataParallel(),
                          compression=C.LocalSGD(every=4, compressor=compressor))
    first = None
    p, s, batch = args
    for t in range(40):
        p, s, loss = step(p, s, batch)
        loss = float(loss.block_until_ready())
        if (t + 1) % 4 == 0:
            first = loss if first is None else first
            assert spread(worker_copies(step, p)) == 0.0
    assert np.isfinite(loss) and loss < 0.5 * first, (first, loss)
    residuals = jax.tree.leaves(step.compression_state["average"])
    assert any(np.abs(np.asarray(r)).sum() > 0 for r in residuals)


def test_nonfinite_gradient_on_a_local_step_raises():
    step_fn, (p, s, (x, y)) = mlp_case()
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.LocalSGD(every=4))
    bad_x = x.at[3, 0].set(jnp.nan)         # worker 0's share
    with pytest.raises(al.NonFiniteGradientError, match=r"\['w1'\].*1 of 8 workers"):
        step(p, s, (bad_x, y))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        C.LocalSGD(every=0)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        C.LocalSGD(every=2.0)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        C.LocalSGD(every=True)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        C.LocalSGD(every=4, warmup_steps=-1)
    with pytest.raises(ValueError, match="compressor must be"):
        C.LocalSGD(every=4, compressor="powersgd")
    with pytest.raises(ValueError, match="momentum=0.0"):
        C.LocalSGD(every=4, compressor=C.DGC(0.99, momentum=0.9))
    C.LocalSGD(every=4, compressor=C.DGC(0.99, momentum=0.0))          # accepted

    def no_params_out(p, s, batch):         # returns a new w1, not new params like p
        loss, g = al.value_and_grad(lambda q, b: jnp.mean((b[0] @ q["w1"]) ** 2))(p, batch)
        return p["w1"] - 0.1 * g["w1"], loss
    _, args = mlp_case()
    step = al.parallelize(no_params_out, method=al.DataParallel(),
                          compression=C.LocalSGD(every=2))
    with pytest.raises(ValueError, match="return the updated parameters"):
        step(*args)


def test_config_and_plan_round_trip_and_amortize_the_exchange():
    method = C.LocalSGD(every=4, warmup_steps=10, compressor=C.TopK(0.05))
    assert C.from_config(C.to_config(method)) == method
    assert C.from_config(C.to_config(C.LocalSGD(every=2))) == C.LocalSGD(every=2)
    step_fn, args = mlp_case()
    plans = {h: al.parallelize(step_fn, method=al.DataParallel(), cluster=two_nodes(),
                               compression=C.LocalSGD(every=h)).plan(*args,
                                                                     cluster=two_nodes())
             for h in (1, 4)}
    one, four = plans[1].compression, plans[4].compression
    # One average per 4 steps: the per-step exchange time and bytes are a quarter.
    assert four.sync_s == pytest.approx(one.sync_s / 4)
    assert four.wire_bytes == pytest.approx(one.wire_bytes / 4)
    assert four.step_time_s == pytest.approx(four.compute_s + one.sync_s / 4)
    assert "amortized over the 4 steps" in four.description
    assert (four.axis, four.num_workers, four.hierarchical, four.delay) == ("node", 2, True, 0)
    assert Plan.from_json(plans[4].to_json()) == plans[4]
    step = al.parallelize(step_fn, method=al.DataParallel(), cluster=two_nodes(),
                          compression=C.LocalSGD(every=4))
    loaded = step.with_plan(Plan.from_json(plans[4].to_json()))
    p_loaded, _, _ = run(loaded, args, 2)
    p_fresh, _, _ = run(step, args, 2)
    jax.tree.map(np.testing.assert_array_equal, p_loaded, p_fresh)


def test_checkpoint_mid_interval_continues_bit_identically(tmp_path):
    """Saved between two averages (the workers' parameters and momenta differ, the last
    average and the residuals are in the state) and restored into a fresh step: the
    continuation through the next average equals the uninterrupted run bit for bit."""
    method = C.LocalSGD(every=4, compressor=C.TopK(0.25))
    step_fn, args = mlp_case()
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=method)
    p, s, _ = run(step, args, 2)
    assert spread(worker_copies(step, p)) > 1e-4
    al.checkpoint.save(tmp_path, (p, s), step_number=2, step=step)
    p_ref, s_ref, losses_ref = run(step, (p, s, args[2]), 4)
    fresh = al.parallelize(step_fn, method=al.DataParallel(), compression=method)
    p, s = al.checkpoint.restore(tmp_path, (args[0], args[1]), step=fresh, batch=args[2])
    p, s, losses = run(fresh, (p, s, args[2]), 4)
    assert losses == losses_ref
    jax.tree.map(np.testing.assert_array_equal, (p, s), (p_ref, s_ref))
    jax.tree.map(np.testing.assert_array_equal, fresh.compression_state,
                 step.compression_state)


def test_cost_model_amortizes_one_exchange_over_h_steps():
    from alpa_lite.cost_models.gradient_sync import SyncEstimate, step_time
    # 1 ms link bytes + 0.5 ms latencies + 0.2 ms inside nodes + 0.1 ms compressing.
    sync = SyncEstimate(intra_s=2e-4, bytes_s=1e-3, latency_s=5e-4, compress_s=1e-4,
                        wire_bytes=1.0, dense_wire_bytes=1.0)
    assert step_time(3e-3, sync) == pytest.approx(3e-3 + 1.8e-3)
    assert step_time(3e-3, sync, every=4) == pytest.approx(3e-3 + 1.8e-3 / 4)
    with pytest.raises(ValueError, match="every must be >= 1"):
        step_time(3e-3, sync, every=0)
    with pytest.raises(ValueError, match="not both"):
        step_time(3e-3, sync, delay=2, every=4)
