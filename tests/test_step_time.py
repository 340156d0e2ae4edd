"""The cost model's pricing rules against hand-computed values: fused element-wise kernels,
measured matmul curves, gradient reduction overlapped with the backward, and the step-time
breakdown every plan carries."""


import jax
import jax.numpy as jnp
import optax
import pytest

import alpa_lite as al
from alpa_lite.cost_models.devices import DEVICES
from alpa_lite.cost_models.overlap import FormedGradient, SyncOverlap, bucketed_sync
from alpa_lite.ir.tracing import trace
from alpa_lite.plan import Plan
from alpa_lite.plan.timing import TimeKind
from alpa_lite.planning.fusion import fuse

# ---------------------------------------------------------------- overlap


def test_bucketed_sync_hides_what_the_backward_covers():
    g = [FormedGradient(1.0, 20e6, 0.5), FormedGradient(3.0, 20e6, 0.5)]
    # Buckets of 30 MB: 20 + 20 MB does not fit one (XLA's combiner rule), so two:
    # 1..1.5 and 3..3.5 s, before the backward ends at 4 s. Of 50 MB: one, 3..4 s.
    assert bucketed_sync(g, 4.0, 30e6).exposed_s == 0.0
    assert bucketed_sync(g, 4.0, 30e6).buckets == 2
    assert bucketed_sync(g, 4.0, 50e6) == SyncOverlap(total_s=1.0, exposed_s=0.0, buckets=1)
    # Buckets of 10 MB: 1..1.5 and 3..3.5; the backward ends at 3.2: 0.3 s exposed.
    s = bucketed_sync(g, 3.2, 10e6)
    assert (s.buckets, s.total_s) == (2, 1.0)
    assert s.exposed_s == pytest.approx(0.3)
    assert s.hidden_s == pytest.approx(0.7)
    # A stream that is still busy delays the next bucket: 1..2.5, then 3..4 after it.
    g = [FormedGradient(1.0, 20e6, 1.5), FormedGradient(2.0, 20e6, 1.0)]
    assert bucketed_sync(g, 3.0, 10e6).exposed_s == pytest.approx(0.5)
    # In line (no overlap): everything is exposed.
    assert bucketed_sync(g, 3.0, 10e6, overlaps=False).exposed_s == pytest.approx(2.5)


def test_a_bucket_pays_one_latency():
    # Two 1 MB gradients, each 0.3 s alone of which 0.1 s latency, combined in one bucket:
    # 0.2 + 0.2 + one 0.1 = 0.5 s, from 2.0 s (the second is formed) to 2.5 s.
    g = [FormedGradient(1.0, 1e6, 0.3, 0.1), FormedGradient(2.0, 1e6, 0.3, 0.1)]
    s = bucketed_sync(g, 2.2)
    assert (s.buckets, s.total_s, s.exposed_s) == (1, pytest.approx(0.5), pytest.approx(0.3))
    # In line, as XLA:CPU runs them (combined all the same): all 0.5 s exposed.
    assert bucketed_sync(g, 2.2, overlaps=False).exposed_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="latency_s"):
        FormedGradient(0.0, 1.0, 0.1, 0.2)


def test_bucketed_sync_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucketed_sync([], 1.0, 0.0)
    with pytest.raises(ValueError, match="formed_s"):
        FormedGradient(-1.0, 1.0, 1.0)


# ---------------------------------------------------------------- devices


def test_a100_matmul_curve_is_the_measured_gemm_sweep():
    a100 = DEVICES["A100"]
    # cuBLASLt 8192^3 fp16 on Azure ND A100 v4: 253.7 TFLOP/s of 312.
    assert a100.matmul_efficiency_at(2 * 8192**3) == pytest.approx(253.7 / 312)
    # 1024^3: 119.4 TFLOP/s; the curve is flat below its first point.
    assert a100.matmul_efficiency_at(2 * 1024**3) == pytest.approx(119.4 / 312)
    assert a100.matmul_efficiency_at(1e6) == pytest.approx(119.4 / 312)
    # The H100 never exceeds the best shape scan's 792.1 TFLOP/s.
    h100 = DEVICES["H100"]
    assert max(e for _, e in h100.matmul_efficiency_curve) == pytest.approx(792.1 / 989)


# ---------------------------------------------------------------- fusion


def _graph(f, *avals):
    return trace(f, avals, batch_argnums=()).graph


def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def test_fused_layer_norm_moves_about_its_bytes_in_and_out():
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    s = jax.ShapeDtypeStruct((1024,), jnp.float32)
    graph = _graph(_layer_norm, x, s, s)
    io_bytes = 2 * 64 * 1024 * 4 + 2 * 1024 * 4          # x in, y out, scale and bias
    per_equation = sum(n.bytes_accessed for n in graph.nodes)
    gpu = fuse(graph, row_reductions_fuse=True)
    cpu = fuse(graph)
    # On a GPU (row reductions fused, XLA's normalization fusion): one kernel, x read
    # once, y written once.
    assert gpu.num_kernels == 1
    assert sum(gpu.bytes_accessed) == pytest.approx(io_bytes)
    # On a CPU each reduction ends a kernel: x is read again by each, still a few times
    # its bytes, far below charging every equation its operands and results.
    assert io_bytes < sum(cpu.bytes_accessed) <= 4 * io_bytes < per_equation


def test_broadcasts_inside_their_consumers_cost_nothing():
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)

    def masked(x):
        mask = jnp.tril(jnp.ones((256, 256), bool))
        return jnp.where(mask, x, 0.0)

    graph = _graph(masked, x)
    f = fuse(graph)
    for n in graph.nodes:
        if n.primitive in ("broadcast_in_dim", "iota"):
            assert f.duplicated[n.id] and f.bytes_accessed[n.id] == 0.0


# ---------------------------------------------------------------- step time


def _mlp_step(batch=64, width=512):
    def loss(p, x):
        return jnp.mean(jnp.square(jax.nn.relu(x @ p["w1"]) @ p["w2"]))

    tx = optax.sgd(0.1)

    def step(p, s, x):
        l, g = al.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    p = {"w1": jax.ShapeDtypeStruct((width, 4 * width), jnp.float32),
         "w2": jax.ShapeDtypeStruct((4 * width, width), jnp.float32)}
    return step, (p, jax.eval_shape(tx.init, p), jax.ShapeDtypeStruct((batch, width),
                                                                      jnp.float32))


def _check_breakdown(plan: Plan):
    t = plan.step_time
    assert t is not None
    assert plan.step_time_s == pytest.approx(sum(line.seconds for line in t.lines))
    assert all(line.seconds >= 0 for line in t.lines + t.hidden)
    assert "where the step time goes" in plan.summary()
    assert Plan.from_json(plan.to_json()).step_time == t


def test_data_parallel_sync_overlaps_the_backward_on_gpus_not_on_cpus():
    # A batch whose activations outweigh the weights, so reducing the weights' gradients
    # (not gathering activations) is the plan.
    step_fn, args = _mlp_step(batch=4096, width=256)
    step = al.parallelize(step_fn, method=al.DataParallel())
    gpu = step.plan(*args, cluster=al.Cluster.preset("8xA100"))
    cpu = step.plan(*args, cluster=al.Cluster.local())
    for plan in (gpu, cpu):
        _check_breakdown(plan)
    total = sum(g.time_s for g in gpu.gradient_sync)
    # On GPUs the second weight's reduction runs while the first weight's gradient is
    # computed: only part of the sync is exposed (and combined, it pays one latency).
    exposed = gpu.step_time.seconds(TimeKind.GRADIENT_SYNC)
    assert 0 < exposed < total
    assert exposed + gpu.step_time.hidden_seconds(TimeKind.GRADIENT_SYNC) <= total
    # XLA:CPU runs collectives in line: all of it is exposed, none hidden.
    cpu_total = sum(g.time_s for g in cpu.gradient_sync)
    assert 0 < cpu.step_time.seconds(TimeKind.GRADIENT_SYNC) <= cpu_total
    assert cpu.step_time.hidden == ()


def test_pipeline_breakdown_sums_to_the_simulated_step():
    step_fn, args = _mlp_step(batch=64)
    # Two matmul layers, two stages of four devices, four micro-batches.
    step = al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=4))
    plan = step.plan(*args, cluster=al.Cluster.preset("8xA100"))
    _check_breakdown(plan)
    assert plan.pipeline.step_time_s == pytest.approx(plan.step_time_s)
    assert plan.step_time.seconds(TimeKind.PIPELINE_BUBBLE) > 0


def test_a_stage_that_accumulates_keeps_its_backward():
    # Four data-parallel replicas accumulate their gradients over the micro-batches and
    # reduce them once a step, so the backward loses its per-micro-batch reductions. What
    # is left must be the backward's own work: stage 0's forward is one matmul and a relu,
    # its backward two matmuls. (A split of the stage's time by FLOP share gave the
    # reductions' time partly to the forward, and this backward came out 0.0 ms.)
    step_fn, args = _mlp_step(batch=64)
    step = al.parallelize(step_fn, method=al.Manual(dp=4, pp=2, num_micro_batches=4))
    plan = step.plan(*args, cluster=al.Cluster.preset("8xV100"))
    assert all(st.accumulate_axes == ("dp",) for st in plan.stages)
    assert all(st.backward_s > 0 for st in plan.stages)
    first = plan.stages[0]
    assert first.backward_s >= 1.5 * first.forward_s


def test_remat_alone_runs_as_one_recomputing_stage():
    # Manual(remat=True) used to be ignored without pp or micro-batches; it now runs (and
    # is priced) as one stage that recomputes its forward.
    step_fn, args = _mlp_step()
    plain = al.parallelize(step_fn, method=al.Manual(dp=8)).plan(
        *args, cluster=al.Cluster.preset("8xA100"))
    remat = al.parallelize(step_fn, method=al.Manual(dp=8, remat=True)).plan(
        *args, cluster=al.Cluster.preset("8xA100"))
    assert remat.pipeline is not None and remat.stages[0].remat
    assert remat.step_time.seconds(TimeKind.COMPUTE) > plain.step_time.seconds(TimeKind.COMPUTE)


def test_explain_shows_where_the_step_time_goes():
    from alpa_lite.tools.explain import stage_text
    step_fn, args = _mlp_step()
    plan = al.parallelize(step_fn, method=al.Auto(pipeline=False)).plan(
        *args, cluster=al.Cluster.preset("8xA100"))
    text = stage_text(plan)
    assert "where the step time goes" in text
    for line in plan.step_time.lines:
        assert line.kind.value in text
