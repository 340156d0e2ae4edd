"""Primitives users' models hit (issue "8 ·", point 7): custom_vjp and custom_jvp functions,
jax.checkpoint with a policy, jnp.take with clipped and filled indices, argsort, top_k,
cumsum, and integer and boolean parameters that take no gradient: traced, planned and run
under every plan kind, equal to jax.jit; a loss that closes over step values (the batch,
as Flax's examples write it) pipelines, equal to jax.jit."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import step_of  # tests/_reference.py

import alpa_lite as al
from alpa_lite.errors import PlanningError


@jax.custom_vjp
def _relu(x):
    return jnp.maximum(x, 0)


_relu.defvjp(lambda x: (_relu(x), x), lambda x, g: (g * (x > 0),))


@jax.custom_jvp
def _softplus(x):
    return jnp.log1p(jnp.exp(x))


_softplus.defjvp(lambda p, t: (_softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

_block = jax.checkpoint(lambda w, h: jnp.tanh(h @ w),
                        policy=jax.checkpoint_policies.dots_saveable)


def _loss(diff, batch, rest):
    h = _softplus(_relu(batch["x"] @ diff["w1"]))
    h = _block(diff["w2"], h)
    e = jnp.take(diff["emb"], batch["ids"], axis=0, mode="clip")
    e2 = jnp.take(diff["emb"], batch["ids"] + 100, axis=0, mode="fill", fill_value=0.0)
    top, _ = jax.lax.top_k(h, 4)
    order = jnp.argsort(h, axis=-1)
    scale = rest["count"].astype(jnp.float32) * rest["flag"]
    return (jnp.mean(h) + jnp.mean(e) + jnp.mean(e2) + jnp.mean(top)
            + 1e-3 * jnp.mean(jnp.cumsum(h, axis=-1)) + 1e-6 * jnp.mean(order) + 0.0 * scale)


# SGD: Adam divides by the gradient's magnitude, turning round-off in near-zero gradients
# (summation order differs between plans) into visible differences.
TX = optax.sgd(0.1)


def _step(params, opt_state, batch):
    diff = {k: params[k] for k in ("w1", "w2", "emb")}
    rest = {k: params[k] for k in ("count", "flag")}
    loss, g = al.value_and_grad(_loss)(diff, batch, rest)
    u, opt_state = TX.update(g, opt_state, diff)
    return {**optax.apply_updates(diff, u), **rest}, opt_state, loss


def _args():
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w1": jax.random.normal(k[0], (16, 32)), "w2": jax.random.normal(k[1], (32, 32)),
              "emb": jax.random.normal(k[2], (50, 16)), "count": jnp.int32(3),
              "flag": jnp.bool_(True)}
    opt_state = TX.init({n: params[n] for n in ("w1", "w2", "emb")})
    batch = {"x": jax.random.normal(k[3], (32, 16)),
             "ids": jax.random.randint(k[4], (32,), 0, 60)}
    return params, opt_state, batch


@pytest.mark.parametrize("method", [al.DataParallel(), al.Auto(pipeline=False), al.Manual(dp=2, tp=4),
                                    al.Manual(dp=4, pp=2, num_micro_batches=2)],
                         ids=["dp", "auto", "dp2_tp4", "dp4_pp2_m2"])
def test_user_primitives_run_under_every_plan(method):
    args = _args()
    ref = jax.jit(_step)(*args)
    out = al.parallelize(_step, method=method)(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _closing_step(params, opt_state, batch):
    # The loss closes over the batch and two non-differentiated parameters, as Flax's
    # `def loss_fn(params)` reads `batch` from the step.
    diff = {k: params[k] for k in ("w1", "w2", "emb")}
    rest = {k: params[k] for k in ("count", "flag")}
    loss, g = al.value_and_grad(lambda d: _loss(d, batch, rest))(diff)
    u, opt_state = TX.update(g, opt_state, diff)
    return {**optax.apply_updates(diff, u), **rest}, opt_state, loss


@pytest.mark.parametrize("method", [al.Manual(dp=2, tp=2, pp=2, num_micro_batches=4),
                                    al.Auto(num_micro_batches=2)],
                         ids=["dp2_tp2_pp2_m4", "auto_m2"])
def test_a_loss_closing_over_step_values_pipelines_equal_to_jit(method):
    """The values a loss closes over are operands of its gradient call: split into
    micro-batches where they are batch data (the step is traced again at the micro-batch
    size to trace the loss there), handed whole where they are not."""
    args = _args()
    ref = jax.jit(_closing_step)(*args)
    step = al.parallelize(_closing_step, method=method)
    plan = step.plan(*args)
    assert plan.pipeline is not None and plan.pipeline.num_micro_batches == \
        method.num_micro_batches
    out = step(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_closed_over_value_that_does_not_follow_the_batch_is_refused_by_name():
    """A closed-over batch value whose rows are not the loss's examples (here: the batch
    tiled twice) cannot be traced at the micro-batch size: refused, naming what to do."""
    def step(params, opt_state, batch):
        diff = {k: params[k] for k in ("w1", "w2", "emb")}
        rest = {k: params[k] for k in ("count", "flag")}
        both = {"x": batch["x"], "ids": jnp.concatenate([batch["ids"], batch["ids"]])[:32]}
        loss, g = al.value_and_grad(lambda d: _loss(d, both, rest))(diff)
        u, opt_state = TX.update(g, opt_state, diff)
        return {**optax.apply_updates(diff, u), **rest}, opt_state, loss

    plan = al.parallelize(step, method=al.Manual(dp=4, pp=2, num_micro_batches=2))
    with pytest.raises(PlanningError, match="closes over .* value"):
        plan.plan(*_args())


def _noisy_loss(p, x, y, key):
    # Weight noise from a key: a draw that is not batch-shaped.
    w1 = p["w1"] + 0.01 * jax.random.normal(key, p["w1"].shape)
    return jnp.mean((jnp.tanh(x @ w1) @ p["w2"] - y) ** 2)


def _step_with_computed_operands(p, s, batch):
    key = jax.random.fold_in(batch["key"], 3)        # computed in the step
    x = batch["x"] * 0.5                              # the batch, normalised in the step
    loss, g = al.value_and_grad(_noisy_loss)(p, x, batch["y"], key)
    u, s = TX.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


def test_pipelines_take_loss_operands_computed_in_the_step():
    k = jax.random.split(jax.random.key(2), 4)
    p = {"w1": jax.random.normal(k[0], (16, 32)), "w2": jax.random.normal(k[1], (32, 8))}
    batch = {"x": jax.random.normal(k[2], (16, 16)), "y": jax.random.normal(k[3], (16, 8)),
             "key": jax.random.key(9)}
    args = (p, TX.init(p), batch)
    ref = jax.jit(_step_with_computed_operands)(*args)
    out = al.parallelize(_step_with_computed_operands,
                         method=al.Manual(dp=4, pp=2, num_micro_batches=2))(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@jax.custom_vjp
def _round_ste(x):
    return jnp.round(x)


# A straight-through estimator: the gradient of round taken as 1, not 0.
_round_ste.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


def _ste_loss(p, x):
    h = jnp.tanh(_round_ste(x @ p["w1"]))
    return jnp.mean((h @ p["w2"]) ** 2)


def _assert_pipelines_match_jit(step, args, micro_batch_counts, rtol, atol):
    ref = jax.jit(step)(*args)
    for m in micro_batch_counts:
        out = al.parallelize(step, method=al.Manual(dp=4, pp=2, num_micro_batches=m))(*args)
        np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_pipelines_keep_custom_vjp_rules():
    k = jax.random.split(jax.random.key(3), 3)
    p = {"w1": jax.random.normal(k[0], (16, 32)), "w2": jax.random.normal(k[1], (32, 8))}
    args = (p, TX.init(p), jax.random.normal(k[2], (16, 16)))
    _assert_pipelines_match_jit(step_of(_ste_loss, TX), args, (2,), rtol=1e-4, atol=1e-6)


def _relu_at_zero_loss(p, x):
    # Rounding puts exact zeros into relu's input (the bias starts at zero), where
    # jax.nn.relu's custom_jvp rule says the derivative is 0; the max(x, 0) it computes
    # with would split it, 0.5 each way. (An eval-mode BatchNorm CNN at initialisation, a
    # Hugging Face ResNet say, meets such zeros too.)
    h = jax.nn.relu(jnp.round(x @ p["w1"]) + p["b"])
    return jnp.mean((h @ p["w2"]) ** 2)


def test_pipelines_keep_custom_jvp_rules():
    k = jax.random.split(jax.random.key(4), 3)
    p = {"w1": jax.random.normal(k[0], (16, 32)), "b": jnp.zeros(32),
         "w2": jax.random.normal(k[1], (32, 8))}
    x = jax.random.normal(k[2], (16, 16))
    # The rule matters here: the bias's gradient differs where relu's input is 0.
    g_rule = jax.grad(_relu_at_zero_loss)(p, x)["b"]

    def with_max(p, x):
        h = jnp.maximum(jnp.round(x @ p["w1"]) + p["b"], 0.0)
        return jnp.mean((h @ p["w2"]) ** 2)

    assert not np.allclose(g_rule, jax.grad(with_max)(p, x)["b"])
    _assert_pipelines_match_jit(step_of(_relu_at_zero_loss, TX), (p, TX.init(p), x), (2, 1),
                                rtol=1e-5, atol=1e-7)


def _constrained_step(params, opt_state, batch):
    # As code written for pjit / MaxText pins an activation's sharding on its own mesh.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def loss(d, x):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ d["w1"]), spec)
        return jnp.mean(h @ d["w2"])

    diff = {k: params[k] for k in ("w1", "w2")}
    value, grads = al.value_and_grad(loss)(diff, batch["x"])
    updates, opt_state = TX.update(grads, opt_state, diff)
    return optax.apply_updates(diff, updates), opt_state, value


@pytest.mark.parametrize("method", [al.Manual(dp=2, tp=4),
                                    al.Manual(dp=4, pp=2, num_micro_batches=2)],
                         ids=["dp2_tp4", "dp4_pp2_m2"])
def test_a_users_sharding_constraint_is_the_identity_and_noted(method):
    """`with_sharding_constraint` in the user's code (on the user's own mesh) changes no
    value: the plan chooses every sharding itself, so the call is read as the identity,
    sharded and micro-batched like one, and the plan's notes say so."""
    params, _, batch = _args()
    params = {k: params[k] for k in ("w1", "w2")}
    args = (params, TX.init(params), batch)
    ref = jax.jit(_constrained_step)(*args)
    step = al.parallelize(_constrained_step, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # no "runs replicated" warning
        out = step(*args)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert any("with_sharding_constraint" in n for n in step.plan(*args).notes)


def test_a_step_called_under_the_users_mesh_runs_on_the_plans_devices():
    """Code written for pjit calls its step inside `jax.set_mesh(mesh)`, pinning values
    with bare PartitionSpecs: those trace against the user's mesh, the shardings they give
    later operators on it are dropped, and the plan's programs (a pipeline stage on half
    the devices) run on their own meshes."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def step(params, opt_state, batch):
        def loss(d, x):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ d["w1"]),
                                                 jax.sharding.PartitionSpec("data", "model"))
            # A bias broadcast onto h's rows takes h's sharding on the user's mesh.
            return jnp.mean(h @ d["w2"] + d["w2"][0])

        value, grads = al.value_and_grad(loss)(params, batch["x"])
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, _, batch = _args()
    params = {k: params[k] for k in ("w1", "w2")}
    args = (params, TX.init(params), batch)
    with jax.set_mesh(mesh):
        ref = jax.jit(step)(*args)
        out = al.parallelize(step, method=al.Manual(dp=4, pp=2, num_micro_batches=2))(*args)
    np.testing.assert_allclose(np.asarray(out[2]), np.asarray(ref[2]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _pinned_step():
    """A step written for pjit: its loss pins a value with a bare PartitionSpec."""
    def step(params, opt_state, batch):
        def loss(d, x):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ d["w1"]),
                                                 jax.sharding.PartitionSpec("data", "model"))
            return jnp.mean(h @ d["w2"])

        value, grads = al.value_and_grad(loss)(params, batch["x"])
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, _, batch = _args()
    params = {k: params[k] for k in ("w1", "w2")}
    return step, (params, TX.init(params), batch)


def test_compressed_data_parallelism_refuses_the_users_sharding_pins_by_name():
    """The per-worker engine of compressed data parallelism runs the step itself on each
    worker, where a pin names a mesh no worker has: refused at planning, by name, with the
    ways out. A compressed hybrid layout runs the traced step and equals jax.jit; Auto
    with AutoCompression weighs only such layouts and says why."""
    from alpa_lite import compression as C
    step, args = _pinned_step()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        ref = jax.jit(step)(*args)
        dp = al.parallelize(step, method=al.DataParallel(), compression=C.PowerSGD(rank=2))
        with pytest.raises(PlanningError, match="pins values with with_sharding_constraint.*hybrid"):
            dp.plan(*args)
        out = al.parallelize(step, method=al.Manual(dp=2, tp=4), compression=C.Dense())(*args)
        auto = al.parallelize(step, method=al.Auto(),
                              compression=C.AutoCompression(allow=C.common_lossy()))
        plan = auto.plan(*args, cluster=al.Cluster.preset("8xV100"))
    np.testing.assert_allclose(np.asarray(out[2]), np.asarray(ref[2]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    layout = next(c for c in plan.choices if c.what == "layout")
    assert "pure data parallelism refused" in layout.note
    assert plan.pipeline is not None                    # a hybrid layout runs
