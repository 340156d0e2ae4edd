"""Gradient buckets: the size the cost model chooses (hand-computed cases), the issue order
(formation order finishes the exchange earliest), the Plan's record, and what the compiled
programs run: one all-reduce per bucket between the backward's operators where alpa_lite
issues them, XLA's combiner options on GPUs, and XLA:CPU's single combined all-reduce
where the partitioner places them."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.cost_models.overlap import (
    XLA_COMBINE_THRESHOLD_BYTES,
    FormedGradient,
    bucket_ranges,
    bucket_schedule,
    choose_bucket_bytes,
)
from alpa_lite.plan import BucketIssue, Plan, SyncBucket, SyncBuckets
from alpa_lite.plan.timing import TimeKind
from alpa_lite.runtime.executable import compile_plan
from alpa_lite.runtime.hlo import entry_schedule
from alpa_lite.runtime.xla_options import CPU_COMBINER_PASS, bucket_options

MiB = 2 ** 20

# ---------------------------------------------------------------- the cost model


def test_buckets_follow_xlas_combiner_rule():
    # A bucket takes gradients while it stays within the size; a larger one is alone.
    assert bucket_ranges([10, 10, 25, 5], 20) == ((0, 2), (2, 3), (3, 4))
    assert bucket_ranges([10, 10, 25, 5], 100) == ((0, 4),)
    assert bucket_ranges([], 20) == ()


def test_small_buckets_win_when_the_backward_can_hide_them():
    # Four 1 MiB gradients formed at 1, 2, 3, 4 s, each reduced in 1 s of which 0.1 s
    # latency; the backward ends at 4 s.
    g = [FormedGradient(t, MiB, 1.0, 0.1) for t in (1.0, 2.0, 3.0, 4.0)]
    # 1 MiB: each alone, 1..2, 2..3, 3..4, 4..5: 1 s exposed.
    # 2 MiB: (0.9 + 0.9 + 0.1) s from 2 s and from 4 s: 4..5.9, 1.9 s exposed.
    # One bucket: 3.6 + 0.1 s from 4 s: 3.7 s exposed.
    c = choose_bucket_bytes(g, 4.0)
    assert c.chosen.bucket_bytes == MiB and c.chosen.sync.buckets == 4
    assert c.chosen.sync.exposed_s == pytest.approx(1.0)
    assert c.runner_up.bucket_bytes == 2 * MiB
    assert c.runner_up.sync.exposed_s == pytest.approx(1.9)
    assert [s for s, _, _ in c.weighed] == [MiB, 2 * MiB, 4 * MiB]
    assert c.weighed[-1][1] == pytest.approx(3.7)


def test_one_bucket_wins_when_latency_dominates():
    # The same gradients formed late (3.7 .. 4.0 s), 0.9 s of each 1 s reduction latency.
    g = [FormedGradient(t, MiB, 1.0, 0.9) for t in (3.7, 3.8, 3.9, 4.0)]
    # 1 MiB: 3.7..4.7, then back to back to 7.7: 3.7 s exposed.
    # 2 MiB: 0.1 + 0.1 + 0.9 = 1.1 s from 3.8 s and after it: 4.9..6.0, 2.0 s exposed.
    # One bucket: 0.4 + 0.9 = 1.3 s from 4.0 s: 1.3 s exposed.
    c = choose_bucket_bytes(g, 4.0)
    assert c.chosen.sync.buckets == 1
    assert c.chosen.sync.exposed_s == pytest.approx(1.3)
    assert (c.runner_up.sync.buckets, c.runner_up.sync.exposed_s) == (2, pytest.approx(2.0))


def test_ties_go_to_fewer_buckets():
    # Everything hides under a long backward at any size: one bucket (fewest latencies).
    g = [FormedGradient(t, MiB, 0.1, 0.01) for t in (1.0, 2.0, 3.0)]
    assert choose_bucket_bytes(g, 100.0).chosen.sync.buckets == 1
    # In line (XLA:CPU): every bucket is exposed, so one bucket pays the fewest latencies.
    c = choose_bucket_bytes(g, 3.0, overlaps=False)
    assert (c.chosen.sync.buckets, c.chosen.sync.exposed_s) == (1, pytest.approx(0.28))
    with pytest.raises(ValueError, match="no gradients"):
        choose_bucket_bytes([], 1.0)


def test_formation_order_finishes_the_exchange_earliest():
    # Buckets released when their last gradient is formed, on one stream: issuing them in
    # release order (what bucket_schedule does) ends the exchange no later than any other
    # order (1|r_j|C_max; the argument is in cost_models.overlap's docstring).
    rng = np.random.default_rng(0)
    for _ in range(20):
        g = [FormedGradient(float(t), float(b), float(r), 0.0) for t, b, r in
             zip(rng.uniform(0, 5, 6), rng.integers(1, 4, 6) * MiB, rng.uniform(0.1, 2, 6))]
        s = bucket_schedule(g, 5.0, 2 * MiB)
        assert [g[i].formed_s for i in s.order] == sorted(x.formed_s for x in g)
        jobs = [(r.ready_s, r.end_s - r.start_s) for r in s.runs]

        def finish(order):
            clock = 0.0
            for ready, length in order:
                clock = max(clock, ready) + length
            return clock
        assert s.runs[-1].end_s == pytest.approx(finish(jobs))
        assert finish(jobs) <= min(finish(p) for p in itertools.permutations(jobs)) + 1e-12

# ---------------------------------------------------------------- the plan


def _mlp_step(batch, widths):
    """An MLP step with layers widths[0] -> widths[1] -> ...; tanh between them."""
    def loss(p, x):
        h = x
        for i in range(len(widths) - 1):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(jnp.square(h))

    tx = optax.sgd(0.1)

    def step(p, s, x):
        l, g = al.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    p = {f"w{i}": jax.ShapeDtypeStruct((a, b), jnp.float32)
         for i, (a, b) in enumerate(zip(widths, widths[1:]))}
    return step, (p, jax.eval_shape(tx.init, p),
                  jax.ShapeDtypeStruct((batch, widths[0]), jnp.float32))


# Four 4 MiB weights and a backward long enough on 8xH100 for buckets to hide under it.
_BIG = dict(batch=4096, widths=(1024,) * 5)


def test_the_plan_records_its_buckets_and_its_estimate_uses_them():
    step_fn, args = _mlp_step(**_BIG)
    step = al.parallelize(step_fn, method=al.DataParallel())
    plan = step.plan(*args, cluster=al.Cluster.preset("8xH100"))
    (b,) = plan.sync_buckets
    assert plan.sync_buckets_of(0) is b and b.issue is BucketIssue.XLA_COMBINER
    # One bucket per weight beats fewer, larger ones: each reduction hides under the
    # backward of the layers below it.
    assert b.num_buckets == 4 and b.overlaps
    assert sorted(n for k in b.buckets for n in k.grads) == \
        sorted(g.param for g in plan.gradient_sync)
    assert [k.nbytes for k in b.buckets] == [4 * MiB] * 4
    # Issued in formation order, each after its gradient exists, on one stream.
    assert all(x.ready_s <= y.ready_s for x, y in zip(b.buckets, b.buckets[1:]))
    assert all(k.ready_s < k.end_s for k in b.buckets)
    # The estimate's gradient-sync line is the chosen buckets' exposed time, and it beats
    # the runner-up.
    assert plan.step_time.seconds(TimeKind.GRADIENT_SYNC) == pytest.approx(b.exposed_s)
    assert b.exposed_s <= b.runner_up_exposed_s and b.runner_up_bytes > 0
    assert 0 < b.exposed_s < b.total_s
    # XLA's default 30 MiB would put all 16 MiB in one bucket, which starts only when the
    # backward is done.
    size, exposed, count = b.weighed_at(XLA_COMBINE_THRESHOLD_BYTES)
    assert count == 1 and size == 16 * MiB and exposed > b.exposed_s
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).sync_buckets == plan.sync_buckets
    assert "gradient buckets, stage 0: 4 of at most" in plan.summary()
    # Where collectives run in line (the CPU cluster), one bucket: nothing to hide under.
    local = step.plan(*args, cluster=al.Cluster.local())
    assert local.sync_buckets[0].num_buckets == 1 and not local.sync_buckets[0].overlaps


def test_the_full_precision_engine_is_priced_by_the_buckets_it_issues():
    """`compression=Dense()` issues its own buckets during the backward: its estimate is the compute plus what the buckets leave after the backward,
    not the whole exchange after it; on a cluster that runs collectives in line, the
    whole exchange. A lossy exchange compresses after the backward and is priced so."""
    step_fn, args = _mlp_step(**_BIG)
    gpus = al.Cluster.preset("8xH100")
    dense = al.parallelize(step_fn, method=al.DataParallel(), compression=C.Dense())
    plan = dense.plan(*args, cluster=gpus)
    (b,) = plan.sync_buckets
    c = plan.compression
    assert b.issue is BucketIssue.RUNTIME and b.overlaps and 0 < b.exposed_s < b.total_s
    assert c.sync_s == pytest.approx(b.exposed_s)
    assert c.step_time_s == pytest.approx(c.compute_s + b.exposed_s)
    assert c.uncompressed_step_time_s == pytest.approx(c.step_time_s) and c.saved_s == 0
    assert c.step_time_s < c.compute_s + c.dense_sync_s      # the exchange after the backward
    assert plan.step_time.hidden[0].seconds == pytest.approx(b.total_s - b.exposed_s)
    # The engine runs no collective but the exchange: its backward is compute only, and
    # no more of the exchange hides than that backward lasts.
    assert b.backward_end_s <= c.compute_s and b.total_s - b.exposed_s <= b.backward_end_s
    assert "4 all-reduce(s) over all 8 workers" in plan.summary()
    # A lossy exchange is priced after the backward, against the bucketed baseline.
    lossy = al.parallelize(step_fn, method=al.DataParallel(),
                           compression=C.TopK(ratio=0.01)).plan(*args, cluster=gpus)
    assert lossy.sync_buckets == () and lossy.compression.uncompressed_step_time_s == \
        pytest.approx(c.step_time_s)
    assert lossy.compression.step_time_s == pytest.approx(
        lossy.compression.compute_s + lossy.compression.sync_s)
    # In line (CPU cluster): one bucket, all of it after the backward.
    local = dense.plan(*args, cluster=al.Cluster.local()).compression
    assert local.sync_s == pytest.approx(local.dense_sync_s, rel=0.2)


def test_full_precision_buckets_run_over_every_worker_of_several_nodes():
    """On two nodes a bucketed Dense() exchange is one all-reduce per bucket over all the
    workers (not the hierarchical reduce-scatter / all-reduce / all-gather of the lossy
    exchanges), and the step computes what jax.jit computes."""
    step_fn, args = _mlp_step(batch=64, widths=(32, 48, 64, 80, 16))
    two_nodes = al.Cluster.of_gpus("H100", num_nodes=2, devices_per_node=4)
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.Dense())
    plan = step.plan(*args, cluster=two_nodes)
    (b,) = plan.sync_buckets
    assert b.issue is BucketIssue.RUNTIME and not plan.compression.hierarchical
    # Cut the planner's one bucket in two, as above, to see each issued on its own.
    names = [n for k in b.buckets for n in k.grads]
    sizes = {g.param: g.nbytes for g in plan.gradient_sync}
    two = dataclasses.replace(b, buckets=tuple(
        SyncBucket(tuple(h), sum(sizes[n] for n in h), 0.0, 0.0)
        for h in (names[:2], names[2:])))
    plan = dataclasses.replace(plan, step_time=dataclasses.replace(plan.step_time,
                                                                   sync_buckets=(two,)))
    exe = compile_plan(plan, step.program(plan, *args), jax.devices())
    real = _zeros(args)
    text = exe.hlo(*real)
    grads = [op for op in entry_schedule(text) if op.opcode == "all-reduce" and op.nbytes > 16]
    assert [op.nbytes for op in grads] == [k.nbytes for k in two.buckets]
    # Each over all eight workers: one replica group of every device.
    for op in grads:
        line = next(x for x in text.splitlines() if f"{op.name} = " in x)
        assert "replica_groups={{0,1,2,3,4,5,6,7}}" in line or \
            "replica_groups=[1,8]<=[8]" in line, line
    out = exe(*real)
    ref = jax.jit(step_fn)(*real)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_a_bucket_names_each_gradient_once():
    with pytest.raises(ValueError, match="more than one bucket"):
        SyncBuckets(0, MiB, (SyncBucket(("a",), 4, 0.0, 1.0), SyncBucket(("a",), 4, 1.0, 2.0)),
                    0.0, 2.0, 2.0, True, BucketIssue.RUNTIME)

# ---------------------------------------------------------------- what runs


def test_gpu_options_carry_the_bucket_size():
    b = SyncBuckets(0, 8 * MiB, (SyncBucket(("a",), 4, 0.0, 1.0),), 0.0, 1.0, 1.0, True,
                    BucketIssue.XLA_COMBINER)
    assert bucket_options(b, "cuda") == {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": 8 * MiB,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 8 * MiB}
    # XLA:CPU cannot cut buckets (its combiner's threshold is fixed): nothing is passed.
    assert bucket_options(b, "cpu") == {}
    issued = dataclasses.replace(b, issue=BucketIssue.RUNTIME,
                                 buckets=b.buckets + (SyncBucket(("b",), 4, 1.0, 2.0),))
    assert bucket_options(issued, "gpu")["xla_disable_hlo_passes"] == \
        "gpu-all-reduce-combiner,all-reduce-combiner"
    assert bucket_options(issued, "cpu") == {"xla_disable_hlo_passes": CPU_COMBINER_PASS}
    assert bucket_options(None, "gpu") == {}
    # Every option is one XLA knows (it refuses unknown names, even for another backend).
    for options in (bucket_options(b, "gpu"), bucket_options(issued, "gpu")):
        assert jax.jit(lambda x: x + 1, compiler_options=options)(1.0) == 2.0


def _zeros(args):
    return jax.tree.map(lambda a: jnp.full(a.shape, 0.01, a.dtype), args)


def test_the_runtime_issues_one_all_reduce_per_bucket_between_backward_operators():
    # Weights of distinct sizes, so each bucket's all-reduce is told by its bytes.
    step_fn, args = _mlp_step(batch=64, widths=(32, 48, 64, 80, 16))
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.Dense())
    plan = step.plan(*args, cluster=al.Cluster.preset("8xH100"))
    (b,) = plan.sync_buckets
    assert b.issue is BucketIssue.RUNTIME
    assert Plan.from_json(plan.to_json()).sync_buckets == (b,)
    # These weights are small: the planner puts them in one bucket. Cut it in two, in
    # the same (formation) order, to see the runtime follow the plan.
    names = [n for k in b.buckets for n in k.grads]
    assert len(names) == 4
    sizes = {g.param: g.nbytes for g in plan.gradient_sync}
    halves = (names[:2], names[2:])
    two = dataclasses.replace(b, buckets=tuple(
        SyncBucket(tuple(h), sum(sizes[n] for n in h), 0.0, 0.0) for h in halves))
    plan = dataclasses.replace(plan, step_time=dataclasses.replace(plan.step_time,
                                                                   sync_buckets=(two,)))
    exe = compile_plan(plan, step.program(plan, *args), jax.devices())
    assert exe.compiler_options == {"xla_disable_hlo_passes": CPU_COMBINER_PASS}
    real = _zeros(args)
    sched = entry_schedule(exe.hlo(*real))
    # The loss (4 bytes) and the NaN check (4 bytes a leaf) are all-reduced too.
    grads = [op for op in sched if op.opcode == "all-reduce" and op.nbytes > 16]
    assert [op.nbytes for op in grads] == [k.nbytes for k in two.buckets]
    last_backward = max(op.position for op in sched if op.is_backward_compute)
    assert grads[0].position < last_backward
    # And the step computes what jax.jit computes.
    out = exe(*real)
    ref = jax.jit(step_fn)(*real)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_xla_cpu_combines_what_the_partitioner_places():
    # The data-parallel plan for 8xH100 has four buckets; compiled here, XLA:CPU's
    # combiner (threshold fixed at int64 max) still makes one all-reduce of all four
    # gradients, after the backward's last operator: the buckets run on GPUs only.
    step_fn, args = _mlp_step(**_BIG)
    step = al.parallelize(step_fn, method=al.DataParallel())
    plan = step.plan(*args, cluster=al.Cluster.preset("8xH100"))
    exe = compile_plan(plan, step.program(plan, *args), jax.devices())
    assert plan.sync_buckets[0].num_buckets == 4 and exe.compiler_options == {}
    sched = entry_schedule(exe.compiled_text(*args))
    reductions = [op for op in sched if op.opcode == "all-reduce" and op.nbytes >= MiB]
    # (The loss's 4-byte sum rides in the same all-reduce.)
    assert len(reductions) == 1 and reductions[0].nbytes == 16 * MiB + 4
    # (The replayed program's operators are named after the plan's nodes, so its
    # backward is told by its matmuls: the last dot_general is the last weight gradient.)
    assert reductions[0].position > max(op.position for op in sched
                                        if op.opcode in ("dot", "fusion")
                                        and "dot_general" in op.op_name)
