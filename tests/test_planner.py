"""The planner on known cases: Alpa's reference MLP results, Megatron layouts, plans as data.

The reference cases run on a simulated 1 x 4 cluster whose link has no latency, so a plan's
communication time is exactly its volume over the bandwidth, and whose matmuls are slow
enough that splitting them pays: the setting in which Alpa's ILP must find data parallelism
for a wide batch and Megatron-style model parallelism for a wide layer.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite.cost_models import DeviceSpec, LinkSpec
from alpa_lite.cost_models.collectives import all_reduce_time, mesh_axis_topology
from alpa_lite.ir.graph import Role
from alpa_lite.planning.spmd import megatron_weight_dims

BANDWIDTH = 1e9  # bytes/s, 1 GB/s: times are bytes / 1e9


def _comm_only_cluster(n: int = 4) -> al.Cluster:
    # Matmuls take long enough that splitting them pays (100 GFLOP/s); element-wise work is
    # nearly free (memory bandwidth 1e13); the link is pure bandwidth (no latency).
    slow = DeviceSpec(name="slow-matmul", peak_flops_per_s=(("float32", 1e11),),
                      memory_bytes=1e12, memory_bandwidth_bytes_per_s=1e13)
    link = LinkSpec(name="beta-only", bandwidth_bytes_per_s=BANDWIDTH, latency_s=0.0)
    return al.Cluster(name=f"beta-only-{n}", device=slow, num_nodes=1, devices_per_node=n,
                      intra_node=link)


def _mlp_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _mlp_step(params, opt_state, batch, tx=optax.sgd(1e-2)):
    loss, grads = al.value_and_grad(_mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _mlp_args(batch: int, hidden: int):
    f32 = jnp.float32
    params = {"w1": jax.ShapeDtypeStruct((hidden, hidden), f32),
              "w2": jax.ShapeDtypeStruct((hidden, hidden), f32)}
    data = {"x": jax.ShapeDtypeStruct((batch, hidden), f32),
            "y": jax.ShapeDtypeStruct((batch, hidden), f32)}
    return params, optax.sgd(1e-2).init(params), data


def _ar_time(nbytes: float, cluster: al.Cluster) -> float:
    return all_reduce_time(nbytes, mesh_axis_topology(cluster, (1, 4), 1))


def test_reference_wide_batch_is_data_parallel():
    cluster = _comm_only_cluster()
    step = al.parallelize(_mlp_step, method=al.Auto(mesh_shapes=((1, 4),)))
    plan = step.plan(*_mlp_args(1024, 128), cluster=cluster)
    st = plan.stages[0]
    assert str(st.sharding_of("batch/x")) == "[y,-]"
    assert str(st.sharding_of("dot_general_0@jvp()")) == "[y,-]"    # forward split by batch
    assert str(st.sharding_of("dot_general_3@jvp()")) == "[y,-]"
    # The only traffic is the gradient sync of the two 128 x 128 weights (and the 4-byte
    # loss). The planner may all-reduce the gradients (weights replicated) or
    # reduce-scatter them and all-gather the updated weights (ZeRO: the update itself is
    # split); with ring collectives both cost exactly 2 x AR(128 x 128 x 4 bytes).
    weight_bytes = 128 * 128 * 4
    assert all(c.nbytes <= weight_bytes for c in plan.collectives())
    expected = 2 * _ar_time(weight_bytes, cluster) + _ar_time(4, cluster)
    assert plan.comm_s == pytest.approx(expected, rel=1e-9)
    # Forced to keep weights whole (plain data parallelism), the same traffic is two
    # gradient all-reduces.
    dp = al.parallelize(_mlp_step, method=al.DataParallel()).plan(*_mlp_args(1024, 128),
                                                                   cluster=cluster)
    assert str(dp.stages[0].sharding_of("params/w1")) == "R"
    grads = [c for c in dp.collectives() if c.nbytes == weight_bytes]
    assert [(c.kind, c.count) for c in grads] == [("all-reduce", 2)]
    assert dp.comm_s == pytest.approx(expected, rel=1e-9)


def test_reference_wide_layer_is_megatron():
    cluster = _comm_only_cluster()
    step = al.parallelize(_mlp_step, method=al.Auto(mesh_shapes=((1, 4),)))
    plan = step.plan(*_mlp_args(128, 1024), cluster=cluster)
    st = plan.stages[0]
    assert str(st.sharding_of("params/w1")) == "[-,y]"       # column split
    assert str(st.sharding_of("params/w2")) == "[y,-]"       # row split
    # One activation all-reduce (128 x 1024 floats) in the forward pass, nothing else but
    # the 4-byte loss.
    big = [c for c in plan.collectives() if c.nbytes > 4]
    assert [(c.kind, c.nbytes, c.count) for c in big] == [("all-reduce", 128 * 1024 * 4, 1)]
    assert plan.comm_s == pytest.approx(_ar_time(128 * 1024 * 4, cluster), rel=1e-6)


def test_megatron_layout_of_gpt():
    import gpt
    cfg = gpt.CONFIGS["tiny"]
    step = al.parallelize(gpt.make_train_step(cfg, optax.sgd(0.1)))
    graph = step.trace(*gpt.abstract_args(cfg, 16, optax.sgd(0.1))).graph
    dims = megatron_weight_dims(graph, tp=4).weight_dims
    by_name = {graph.tensors[t].name: d for t, d in dims.items()}
    block = "params/blocks/0/"
    assert by_name[block + "attn/qkv/w"] == 1      # column parallel (heads)
    assert by_name[block + "attn/proj/w"] == 0     # row parallel
    assert by_name[block + "mlp/fc/w"] == 1        # column parallel
    assert by_name[block + "mlp/proj/w"] == 0      # row parallel
    assert by_name[block + "attn/qkv/b"] == 0      # bias of a column-split layer is split
    assert by_name[block + "ln_1/scale"] is None   # layer norms stay whole


def test_plan_json_round_trip_and_determinism():
    args = _mlp_args(4096, 1024)
    plans = [al.parallelize(_mlp_step).plan(*args, cluster=al.Cluster.preset("8xV100"))
             for _ in range(2)]
    text = plans[0].to_json()
    assert text == plans[1].to_json()                 # planning is deterministic
    again = al.Plan.from_json(text)
    assert again == plans[0]
    assert again.to_json() == text                    # byte-identical round trip
    summary = plans[0].summary()
    assert "params/w1" in summary and "estimated step" in summary
    assert any(c.kind in summary for c in plans[0].collectives())


def test_plans_for_big_models_from_shapes_only():
    import gpt
    cfg = gpt.CONFIGS["350M"]
    tx = optax.adamw(1e-3)
    args = gpt.abstract_args(cfg, 8, tx)
    plan = al.parallelize(gpt.make_train_step(cfg, tx), method=al.Auto(pipeline=False)).plan(
        *args, cluster=al.Cluster.preset("8xH100"))
    assert plan.stages[0].mesh_shape in {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert 0 < plan.peak_memory_bytes < al.Cluster.preset("8xH100").device.memory_bytes
    assert plan.stats.ilp_nodes < plan.stats.nodes_after_merge < plan.stats.nodes_before_merge


def _head_scaled_layers_loss(params, batch):
    # Each layer scales its heads by its own row of a stacked array, as Hugging Face's
    # BERT applies `head_mask[i]`: the slice's static index differs from layer to layer.
    h = batch["x"]
    for i, (w, b) in enumerate(params["layers"]):
        z = (h @ w + b).reshape(h.shape[0], 4, -1) * params["head_scale"][i][None, :, None]
        h = h + jax.nn.gelu(z.reshape(h.shape))
    return jnp.mean((h - batch["y"]) ** 2)


def _head_scaled_layers_args(depth: int):
    f32, hidden = jnp.float32, 256
    params = {"layers": [(jax.ShapeDtypeStruct((hidden, hidden), f32),
                          jax.ShapeDtypeStruct((hidden,), f32)) for _ in range(depth)],
              "head_scale": jax.ShapeDtypeStruct((depth, 4), f32)}
    data = {"x": jax.ShapeDtypeStruct((64, hidden), f32),
            "y": jax.ShapeDtypeStruct((64, hidden), f32)}
    return params, optax.adam(1e-3).init(params), data


def test_layers_that_slice_their_own_row_of_a_stacked_array_share_one_ilp_choice():
    """The ILP is about one layer's size whatever the depth, also where each layer reads
    its own row of a stacked array (a slice whose static index differs per layer): the
    interior layers' groups are alike by content, so twice the layers add no ILP node."""
    tx = optax.adam(1e-3)

    def step(params, opt_state, batch):
        loss, grads = al.value_and_grad(_head_scaled_layers_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    nodes = {}
    for depth in (8, 16):
        plan = al.parallelize(step, method=al.Manual(dp=2, tp=4)).plan(
            *_head_scaled_layers_args(depth), cluster=al.Cluster.preset("8xV100"))
        nodes[depth] = (plan.stats.ilp_nodes, plan.stats.nodes_after_merge)
    assert nodes[16][1] >= nodes[8][1] + 8 * 4     # many more groups ...
    assert nodes[16][0] == nodes[8][0]             # ... and not one more ILP node


# ---- bad input: a clear error, nothing changed ------------------------------------------


def test_memory_budget_no_plan_fits():
    args = _mlp_args(1024, 1024)
    step = al.parallelize(_mlp_step, method=al.Auto(memory_budget_bytes=1024.0))
    with pytest.raises(al.PlanningError, match="smallest peak memory any plan reaches"):
        step.plan(*args, cluster=al.Cluster.preset("8xV100"))


def test_manual_product_must_match_devices():
    step = al.parallelize(_mlp_step, method=al.Manual(dp=2, tp=2))
    with pytest.raises(ValueError, match="dp x tp = 4 but the cluster"):
        step.plan(*_mlp_args(64, 64), cluster=al.Cluster.preset("8xV100"))


def test_batch_not_divisible_by_dp():
    step = al.parallelize(_mlp_step, method=al.DataParallel())
    with pytest.raises(al.PlanningError, match="not divisible by dp=8"):
        step.plan(*_mlp_args(12, 64), cluster=al.Cluster.preset("8xV100"))


def test_indivisible_shapes_are_replicated_not_rejected():
    # 6 rows and 10 features divide by no mesh axis of 8 devices except 2: Auto still
    # plans, using only splits that divide.
    plan = al.parallelize(_mlp_step).plan(*_mlp_args(6, 10), cluster=al.Cluster.preset("8xV100"))
    for _, spec in plan.stages[0].shardings:
        for dim_axes in spec.dims:
            assert dim_axes in ((), ("x",)) or plan.stages[0].mesh_shape[0] == 2


def test_a_non_array_batch_leaf_is_held_static():
    # As eqx.filter_jit holds it (tests/test_static_leaves.py): the step plans as without it.
    params, opt_state, batch = _mlp_args(64, 64)
    step = al.parallelize(_mlp_step)
    noted = step.plan(params, opt_state, dict(batch, note="not an array"))
    assert noted.step_time_s == step.plan(params, opt_state, batch).step_time_s


def test_plan_for_other_cluster_or_shapes_is_refused():
    params = {"w1": jnp.ones((64, 64)), "w2": jnp.ones((64, 64))}
    batch = {"x": jnp.ones((64, 64)), "y": jnp.ones((64, 64))}
    opt_state = optax.sgd(1e-2).init(params)
    step = al.parallelize(_mlp_step)
    other_cluster = step.plan(params, opt_state, batch, cluster=al.Cluster.preset("8xV100"))
    with pytest.raises(al.PlanMismatchError, match="made for cluster '8xV100'"):
        step.with_plan(other_cluster)(params, opt_state, batch)
    local = step.plan(params, opt_state, batch)
    bigger = {"x": jnp.ones((128, 64)), "y": jnp.ones((128, 64))}
    with pytest.raises(al.PlanMismatchError, match="other argument shapes"):
        step.with_plan(local)(params, opt_state, bigger)
    # The loaded plan runs when it does match.
    _, _, loss = step.with_plan(al.Plan.from_json(local.to_json()))(params, opt_state, batch)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed"),
    ('{"format": "something/else"}', "not an alpa_lite plan"),
    ('{"format": "alpa_lite.plan/4", "method": "x"}', "malformed"),
])
def test_malformed_plan_json(text, match):
    with pytest.raises(ValueError, match=match):
        al.Plan.from_json(text)


def test_primitive_without_rule_is_replicated_with_a_warning():
    def loss_fn(params, batch):
        # cholesky has no sharding rule: it must run replicated, not crash.
        m = batch["x"].T @ batch["x"] + 64.0 * jnp.eye(batch["x"].shape[1])
        return jnp.sum(jnp.linalg.cholesky(m) @ params["w"])

    def step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), opt_state, loss

    params = {"w": jnp.ones((8, 8))}
    batch = {"x": jnp.ones((16, 8))}
    with pytest.warns(UserWarning, match="no sharding rule for cholesky"):
        plan = al.parallelize(step).plan(params, (), batch)
    assert "cholesky" in plan.unsharded_primitives
    new_params, _, loss = al.parallelize(step)(params, (), batch)
    ref_params, _, ref_loss = jax.jit(step)(params, (), batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(new_params["w"], ref_params["w"], rtol=1e-5)


def test_roles_are_marked():
    step = al.parallelize(_mlp_step)
    graph = step.trace(*_mlp_args(64, 64)).graph
    roles = {t.name: t.role for t in graph.tensors if t.role is not Role.ACTIVATION}
    assert roles["params/w1"] is Role.PARAM and roles["batch/x"] is Role.BATCH
    assert sum(r is Role.GRAD for r in roles.values()) == 2
    assert graph.output_ties[:2] == (0, 1)   # new params feed the next step's params


def test_repeated_layers_keep_equal_keys_around_calls_kept_for_their_rules():
    """A pipeline's pieces keep each jax.nn.relu whole (its custom_jvp rule); every layer
    traces its own jaxpr object for the same body. Keyed by content, the layers' calls
    still share strategies, and with them one ILP choice per repeated layer."""
    from alpa_lite.ir.tracing import trace_flat
    from alpa_lite.planning.strategies import structural_keys

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    g = trace_flat(lambda x, a, b: (jax.nn.relu(jax.nn.relu(x @ a) @ b),), [x, w, w],
                   [Role.BATCH, Role.PARAM, Role.PARAM], ["x", "a", "b"]).graph
    calls = [n for n in g.nodes if n.primitive == "custom_jvp_call"]
    assert len(calls) == 2
    assert calls[0].params["call_jaxpr"] is not calls[1].params["call_jaxpr"]
    keys = structural_keys(g)
    assert keys[calls[0].id] == keys[calls[1].id]
