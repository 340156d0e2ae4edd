"""Data-parallel plans whose gradient exchange is compressed or delayed.

`make_compressed_plan` starts from the data-parallel plan of the step (every device a
worker holding all parameters, planned by the ILP like `DataParallel()`), keeps its compute
and memory, and prices each exchange method with
`cost_models.gradient_sync` (hierarchical across nodes: full precision inside a node, the
method between nodes). It keeps:

- an explicit method (a compressor, `DelayedAveraging` or `LocalSGD`): that one;
- `AutoCompression(allow=...)`: the fastest that fits in device memory among the allowed
  methods and the plain all-reduce (a lossy one only when it is at least `min_speedup`
  times faster than the all-reduce); with `Auto()` as the method, also against the best
  uncompressed plan of any layout, which wins when it is faster (tensor parallelism inside
  a fast node can beat any data-parallel exchange).

The result is a `Plan` whose `compression` says what runs and what it saves.

A full-precision exchange (`Dense()`) is issued by the runtime in buckets, in the order the
backward forms the gradients, each one all-reduce over every worker (`Plan.sync_buckets`,
`BucketIssue.RUNTIME`). The buckets are chosen on the engine's own step: the
data-parallel plan's compute, no collective but the exchange (`worker_buckets`); the
estimate is theirs: only what outlasts the backward is on the step's path (on a cluster
that runs collectives in line, all of it). A lossy exchange compresses after the backward
and is priced so (`cost_models.gradient_sync`), delayed averaging and local SGD as that
module says.

Local SGD exchanges the parameters (float32) once every H steps and no gradient: its
`sync_s`, `wire_bytes` and step time are per step, the exchange amortized over H steps
after the synchronous warm-up, and its `description` says so with the time of one average.
`AutoCompression` never chooses local SGD by itself; `compression.auto` decides whether
it may be listed in `allow`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Mapping


from alpa_lite import compression as C
from alpa_lite.compression.momentum import dgc_with_momentum, momentum_states
from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.gradient_sync import (
    GradientLeaf,
    exchange_layout,
    gradient_sync,
    step_time,
)
from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import Role
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.plan import (
    Accumulation,
    BucketIssue,
    CompressionSpec,
    GradientSync,
    Plan,
    SyncBuckets,
    SyncCollective,
)
from alpa_lite.plan.methods import Auto, DataParallel, Manual
from alpa_lite.plan.sharding import CommModel, LogicalMesh, itemsize
from alpa_lite.plan.text import fmt_bytes, fmt_time
from alpa_lite.plan.timing import StepTime, TimeKind, TimeLine
from alpa_lite.planning.gradient_sync import sync_buckets, worker_timeline
from alpa_lite.planning.intra_op import StageResult
from alpa_lite.planning.spmd import make_plan, plan_with_result


def exchange_axis(cluster: Cluster) -> tuple[str, int, bool]:
    """(axis the exchange runs over, its workers, whether nodes reduce inside first)."""
    if cluster.num_nodes == 1:
        return "local", cluster.devices_per_node, False
    return "node", cluster.num_nodes, cluster.devices_per_node > 1


def gradient_leaves(traced: TracedStep) -> list[GradientLeaf]:
    """The step's gradient leaves (what `al.value_and_grad` returned)."""
    return [GradientLeaf(tuple(t.shape), itemsize(t.dtype))
            for t in traced.graph.tensors_with_role(Role.GRAD)]


def state_bytes(method, leaves: list[GradientLeaf], cluster: Cluster) -> float:
    """Per-device bytes of a method's per-worker state (residuals, queues)."""
    delay, exchange = _split(method)
    total = 0.0
    for leaf in leaves:
        shape, _, _ = exchange_layout(cluster, leaf)
        total += exchange.state_bytes(shape, "float32")
        # Delayed averaging keeps the last D local gradients and D - 1 averages.
        total += (2 * delay - 1) * leaf.numel * leaf.itemsize if delay else 0.0
        # Local SGD with a lossy exchange keeps the last average (the parameter's dtype).
        if isinstance(method, C.LocalSGD) and exchange.lossy:
            total += leaf.numel * leaf.itemsize
    return total


def _split(method) -> tuple[int, C.Compressor]:
    if isinstance(method, C.DelayedAveraging):
        return method.delay, method.compressor
    if isinstance(method, C.LocalSGD):
        return 0, method.compressor
    return 0, method


def _every(method) -> int:
    """Steps per exchange: local SGD's H, else 1."""
    return method.every if isinstance(method, C.LocalSGD) else 1


def _exchanged(method, leaves: list[GradientLeaf]) -> list[GradientLeaf]:
    """What travels: the gradient leaves, or for local SGD the parameters in float32."""
    if isinstance(method, C.LocalSGD):
        return [GradientLeaf(leaf.shape, 4) for leaf in leaves]
    return leaves


def _local_sgd_description(method: C.LocalSGD, compute: float, sync, dense) -> str:
    """Local SGD's `CompressionSpec.description`: the method, and how its exchange is
    counted in the plan's per-step figures."""
    h = method.every
    text = (f"{method.describe()}; one average takes {fmt_time(sync.total_s)} and "
            f"{fmt_bytes(sync.wire_bytes)} per worker, amortized over the {h} steps in the "
            f"per-step figures (a step that averages takes {fmt_time(compute + sync.total_s)}"
            f", the others {fmt_time(compute)})")
    if method.warmup_steps:
        text += (f"; the first {method.warmup_steps} steps are synchronous SGD (exact "
                 f"gradient all-reduce, {fmt_time(compute + dense.total_s)} per step), not "
                 f"in the estimate")
    return text


def _label(method) -> str:
    return "none (all-reduce)" if method == C.Dense() else method.describe()


def make_compressed_plan(traced: TracedStep, method, cluster: Cluster, compression,
                         loss_scale: float, tensor_names: Mapping[int, str] | None = None
                         ) -> Plan:
    """Plans `traced` as data parallelism with the gradient exchange `compression` (module
    docstring). `loss_scale` is how per-worker losses combine (1/n for a mean, 1 for a sum).
    """
    # DGC's momentum correction needs a plain-SGD optimizer (compression.momentum).
    if isinstance(method, Manual) and (method.tp != 1 or method.pipelined):
        raise PlanningError(
            f"gradient compression runs data parallelism over every device; {method!r} "
            "asks for tensor or pipeline parallelism. Use al.DataParallel() or al.Auto()")
    if isinstance(method, Auto) and method.num_micro_batches is not None:
        raise PlanningError("gradient compression does not combine with pipelining "
                            "(Auto(num_micro_batches=...)); drop one of them")
    if isinstance(method, DataParallel) and method.shard_optimizer_state:
        raise PlanningError("gradient compression needs every worker to hold the whole "
                            "optimizer state; use DataParallel() without ZeRO")
    dp_plan, dp_result = plan_with_result(traced, DataParallel(), cluster, tensor_names)
    leaves = gradient_leaves(traced)
    if not leaves:
        raise PlanningError("the step has no gradient (al.value_and_grad / al.grad): "
                            "there is nothing to compress")
    dtype = traced.graph.tensors_with_role(Role.GRAD)[0].dtype
    # The runtime runs the step per worker on its share of the batch: no collective but
    # the exchange (and the loss's sum). So the step is the data-parallel plan's compute
    # (batch split, weights whole) plus the exchange; the plan's own collectives (its
    # gradient all-reduces, or the gathers the ILP may prefer to them) do not run.
    compute = dp_plan.compute_s
    budget = cluster.device.memory_bytes
    if isinstance(compression, C.AutoCompression):
        options = [C.Dense()] + [m for m in compression.allow if m != C.Dense()]
    else:
        options = [compression]
    dense = gradient_sync(cluster, leaves, C.Dense(), dtype)
    # The full-precision exchange goes out in buckets, each as soon as its gradients
    # exist: only what outlasts the backward is on the step's path.
    buckets = worker_buckets(traced, dp_result, cluster)

    def step_of(option, sync) -> float:
        if option == C.Dense() and buckets is not None:
            return compute + buckets.exposed_s
        delay, _ = _split(option)
        return step_time(compute, sync, delay, _every(option))

    rows = []
    for option in options:
        _, exchange = _split(option)
        sync = gradient_sync(cluster, _exchanged(option, leaves), exchange, dtype)
        memory = dp_plan.peak_memory_bytes + state_bytes(option, leaves, cluster)
        rows.append((option, sync, step_of(option, sync), memory))
    pool = [r for r in rows if r[3] <= budget] or rows     # what fits, else everything
    option, sync, step, memory = min(pool, key=lambda r: r[2])
    dense_row = rows[0]
    if isinstance(compression, C.AutoCompression) and dense_row in pool and \
            dense_row[2] < compression.min_speedup * step:
        option, sync, step, memory = dense_row  # not worth a lossy method (AutoCompression)
    candidates = tuple((_label(o), float(t), bool(m <= budget)) for o, _, t, m in rows)
    if isinstance(method, Auto) and isinstance(compression, C.AutoCompression):
        try:
            best = make_plan(traced, method, cluster, tensor_names=tensor_names)
        except PlanningError:       # no uncompressed layout fits: data parallelism stays
            best = None
        if best is not None and best.step_time_s < step and \
                best.peak_memory_bytes <= budget:
            return dataclasses.replace(
                best, stats=dataclasses.replace(
                    best.stats, candidates=best.stats.candidates + tuple(
                        (f"data parallel, {label}", t) for label, t, _ in candidates)))
    if memory > budget:
        warnings.warn(
            f"data parallelism with {_label(option)} needs {memory / 2**30:.2f} GiB per device "
            f"(the whole model, its optimizer state and the exchange's state), above the "
            f"{budget / 2**30:.2f} GiB of cluster {cluster.name!r}: it will not run there. "
            "Use a smaller batch, al.Auto() without compression, or pipelining", stacklevel=3)
    axis, workers, hierarchical = exchange_axis(cluster)
    delay, exchange = _split(option)
    every = _every(option)      # local SGD: per-step figures amortize one exchange
    bucketed = option == C.Dense() and buckets is not None
    description = (_local_sgd_description(option, compute, sync, dense)
                   if isinstance(option, C.LocalSGD) else _label(option))
    spec = CompressionSpec(
        exchange=C.to_config(option), description=description, axis=axis,
        num_workers=workers, hierarchical=hierarchical and not bucketed, delay=delay,
        loss_scale=loss_scale, wire_bytes=sync.wire_bytes / every,
        dense_wire_bytes=dense.dense_wire_bytes,
        sync_s=(buckets.exposed_s if bucketed else
                max(step - compute - sync.compress_s, 0.0) if delay else sync.total_s / every),
        dense_sync_s=dense.total_s, compute_s=compute, step_time_s=step,
        uncompressed_step_time_s=step_of(C.Dense(), dense), candidates=candidates)
    # What runs: the step per worker, no collective of the data-parallel plan; each
    # gradient leaves through the exchange once per step.
    est = dp_plan.stages[0].memory
    if est is not None:     # the exchange's state (error feedback, ...) as workspace
        est = dataclasses.replace(est, workspace=est.workspace + memory - est.total)
    stage = dataclasses.replace(dp_plan.stages[0], peak_memory_bytes=memory, memory=est,
                                collectives=(),
                                comm_s=spec.sync_s, total_s=step)
    total = sum(leaf.numel * leaf.itemsize for leaf in leaves) or 1
    grads = traced.graph.tensors_with_role(Role.GRAD)
    names = tensor_names or {}
    # The buckets' all-reduces span both of the engine's axes ("node", "local").
    sizes = (("node", cluster.num_nodes), ("local", cluster.devices_per_node))
    axes = tuple(a for a, n in sizes if n > 1) if bucketed else (axis,)
    records = tuple(GradientSync(
        param=names.get(t.id, t.name), stage=0, accumulation=Accumulation.SINGLE,
        axes=axes, collective=SyncCollective.COMPRESSED, compressor=_label(option),
        nbytes=int(t.nbytes), count=1, time_s=spec.sync_s * t.nbytes / total) for t in grads)
    # A lossy exchange runs after the step's backward (runtime.compressed), or overlaps
    # the next step when delayed; the full-precision one in buckets during the backward:
    # `step` already says how much of it the step waits for.
    hidden = (TimeLine(TimeKind.GRADIENT_SYNC, buckets.total_s - buckets.exposed_s,
                       "buckets reduced under the backward"),) \
        if bucketed and buckets.total_s > buckets.exposed_s else ()
    breakdown = StepTime(lines=(
        TimeLine(TimeKind.COMPUTE, compute, "the step per worker on its share of the batch"),
        TimeLine(TimeKind.COMPRESSION, step - compute, _label(option))), hidden=hidden,
        sync_buckets=(buckets,) if bucketed else ())
    return dataclasses.replace(dp_plan, method=method, stages=(stage,),
                               compression=spec, gradient_sync=records, step_time=breakdown)


def worker_buckets(traced: TracedStep, dp_result: StageResult,
                   cluster: Cluster) -> SyncBuckets | None:
    """The buckets the per-worker engine issues a full-precision exchange in: the
    data-parallel plan's compute (batch split, weights whole) with no collective but one
    all-reduce of each gradient leaf of the step's `al.value_and_grad` over every worker
    (`planning.gradient_sync.worker_timeline`), at the size that leaves the least exposed.
    None where no gradient leaf is exchanged (literals only)."""
    graph = traced.graph
    leaves = [t for call in traced.grad_leaves for t in call if t is not None]
    stage = dp_result.stage
    comm = CommModel(cluster, LogicalMesh(stage.mesh_shape, stage.axis_names))
    overlaps = cluster.overlaps_collectives()
    timeline = worker_timeline(graph, dp_result, leaves, comm, overlaps)
    return sync_buckets(timeline, {t.id: t.name for t in graph.tensors}, 0,
                        BucketIssue.RUNTIME, overlaps)


def refuse_double_momentum(compression, opt_state_tensors: Iterable[Any],
                           param_shapes: Iterable[tuple[int, ...]],
                           names: Mapping[int, str] | None = None) -> None:
    """Raises PlanningError when DGC with momentum meets an optimizer with momentum.

    Args:
      compression: what the step was asked to exchange gradients with.
      opt_state_tensors: the step's optimizer-state tensors (`Graph.tensors_with_role(
        Role.OPT_STATE)`: objects with `id`, `name` and `shape`).
      param_shapes: the shapes of the step's parameters.
      names: the step's own names by tensor id (`tensor_names`), where they differ.
    """
    dgcs = dgc_with_momentum(compression)
    if not dgcs:
        return
    names = names or {}
    found = momentum_states(((names.get(t.id, t.name), tuple(t.shape))
                             for t in opt_state_tensors), param_shapes)
    if not found:
        return
    listed = ", ".join(s.name for s in found[:4]) + (f" and {len(found) - 4} more"
                                                     if len(found) > 4 else "")
    kinds = "; ".join(sorted({f"{s.field}: {s.kind}" for s in found}))
    m = dgcs[0].momentum
    raise PlanningError(
        f"{dgcs[0].describe().split(':')[0]} applies momentum {m:g} itself (momentum "
        f"correction: the exchange returns the summed velocities, so the optimizer must be "
        f"plain SGD), and the step's optimizer keeps momentum too: {listed} ({kinds}). The "
        f"momentum would be applied twice. Use optax.sgd(learning_rate) without momentum "
        f"(DGC then supplies momentum {m:g}), or DGC(..., momentum=0.0) to keep your "
        f"optimizer's momentum")
