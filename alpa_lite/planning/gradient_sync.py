"""Gradient sync of a pipelined stage: accumulate over micro-batches, reduce once per step.

Under a plain SPMD backward, every micro-batch's parameter gradients are partial sums over
the devices that split the batch, and the partitioner reduces them inside each backward: m
reductions per step. `stage_sync` decides, for one stage of a pipelined plan, whether its
backward can instead run per device over those mesh axes (the *accumulation axes*), so each
device sums its own partial gradients over the micro-batches and the stage reduces them
once after its last backward, as Megatron, DeepSpeed and Alpa do.

Each replica replays the stage program traced at its share of the micro-batch
(`ir.step_parts.local_stage_program`, which also proves the split keeps the loss exact) on its
slice of what enters the backward. That sums to the plan's backward when every value
crossing into or out of it is sliced along its batch dimension, or holds no batch at all
(`splits_only_batch` says which value breaks it, e.g. a layer's auxiliary loss term
handed between stages). Where it fails, the stage keeps reducing in each backward and says
why (`StagePlan.accumulate_note`); either way the Plan records what runs (`GradientSync`)
and the estimate charges it: collectives over the accumulation axes leave the
per-micro-batch backward, one reduction of the stage's gradients joins the step.

`backward_timeline` plays a program's gradient reductions out beside its backward, in
buckets (`cost_models.overlap`). A single-stage plan chooses its bucket size there and
records it (`sync_buckets`, kept in the plan's `StepTime`); a pipelined stage whose
backward reduces per micro-batch is priced at XLA's default combine threshold, which is
what its programs run (the pipeline planner records no bucket size for them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from alpa_lite.cost_models.cluster import Cluster, CollectiveKind
from alpa_lite.cost_models.overlap import (
    XLA_COMBINE_THRESHOLD_BYTES,
    BucketChoice,
    BucketSchedule,
    FormedGradient,
    SyncOverlap,
    bucket_schedule,
    choose_bucket_bytes,
)
from alpa_lite.errors import PlanningError
from alpa_lite.ir.batch import batch_dims
from alpa_lite.ir.graph import OpGraph, Role, per_graph
from alpa_lite.ir.one_example import without_ones
from alpa_lite.ir.step_parts import (
    StageProgram,
    StepParts,
    local_stage_program,
)
from alpa_lite.plan import (
    Accumulation,
    BucketIssue,
    GradientSync,
    StagePlan,
    SyncBucket,
    SyncBuckets,
    SyncCollective,
)
from alpa_lite.plan.sharding import CollectiveOp, CommModel, LogicalMesh, TensorSpec
from alpa_lite.planning.intra_op import StageResult, collective_summaries
from alpa_lite.planning.stage_exchange import ExchangeRequest, GradShard, choose_exchange


@dataclasses.dataclass(frozen=True)
class PlannedStage:
    """One chosen stage as the pipeline planner hands it on: its index, program, logical
    mesh, the intra-op result it came from and its plan so far."""
    index: int
    prog: StageProgram
    mesh: LogicalMesh
    result: StageResult
    plan: StagePlan


@dataclasses.dataclass(frozen=True)
class StageSync:
    """A stage with its gradient sync decided: the stage (costs adjusted), one record per
    parameter, and the time of its once-per-step reduction (or compressed exchange)."""
    stage: StagePlan
    records: tuple[GradientSync, ...]
    reduce_s: float
    uncompressed: "StageSync | None" = None   # with a compressed exchange: the same stage
                                              # all-reducing in full precision


def batch_axes(prog: StageProgram, stage: StagePlan,
               fwd_bdims: Mapping[int, int]) -> tuple[str, ...]:
    """The mesh axes that split the batch dimension of every batch-carrying stage input
    (major first); () when the inputs disagree or none carries the batch."""
    spec = dict(zip(prog.fb.graph.inputs, stage.input_specs))
    found = None
    for t_fb, t in zip(prog.fb_acts, prog.acts):
        d = fwd_bdims.get(t)
        if d is None:
            continue
        axes = spec[t_fb].dims[d]
        if found is not None and axes != found:
            return ()
        found = axes
    return found or ()


@dataclasses.dataclass(frozen=True)
class ReplicaSplit:
    """Whether a stage's backward can run per replica (`splits_only_batch`)."""
    refused: str | None                      # why not; None: it can
    # (fb tensor id, batch dimension) of each value that enters the replica's program with
    # other size-1 dimensions than the stage's: the replica reshapes its slice along that
    # dimension (`StagePlan.accumulate_reshapes`).
    reshaped: tuple[tuple[int, int], ...] = ()


def splits_only_batch(parts: StepParts, prog: StageProgram, local: StageProgram,
                      stage: StagePlan, mesh: LogicalMesh, axes: tuple[str, ...],
                      fwd_bdims: Mapping[int, int]) -> ReplicaSplit:
    """Whether the stage's backward, run per replica over `axes`, sums to the backward
    the plan runs (`ReplicaSplit.refused` None), or why not.

    Each replica runs the program traced at its share of the micro-batch on its slice of
    what enters the backward, the slice along the tensor's batch dimension, which must be
    the one dimension that shrinks per replica (`ir.batch.batch_dims` follows it through
    reshapes and transposes; where it cannot, the slice could mix examples). A value
    without the batch in it must not depend on the batch either (a layer's auxiliary loss
    term handed to a later stage would be the whole micro-batch's on every replica), and
    every cotangent does; the loss's cotangent is the exception, scaled by
    `local_loss_scale`. What leaves (the
    gradients) must be split as the plan says: over `axes`, major-most, on the batch
    dimension, and on no other; what enters may also be whole over `axes`, since slicing
    a replicated value moves nothing. A value the replica's program holds with other
    size-1 dimensions (one example per replica) enters reshaped (`ReplicaSplit.reshaped`);
    one that leaves so is refused."""
    g, gl = prog.fb.graph, local.fb.graph
    if len(g.tensors) != len(gl.tensors) or len(g.nodes) != len(gl.nodes):
        return ReplicaSplit("the program traced per replica has another structure")
    replicas = math.prod(mesh.axis_size(a) for a in axes)
    spec: dict[int, TensorSpec] = dict(stage.tensor_specs)
    spec.update(zip(g.inputs, stage.input_specs))
    spec.update(zip(g.outputs, stage.output_specs))
    diff_outs = [t for t, d in zip(prog.outputs, prog.diff_outputs) if d]
    seeds = dict(zip(prog.fb_acts, (fwd_bdims.get(t) for t in prog.acts)))
    seeds.update(zip(prog.fb_cts, (fwd_bdims.get(t) for t in diff_outs)))
    bdim = batch_dims(g, seeds)
    # Values that depend on the batch: forward values from the step's batch leaves, and
    # inside the program whatever they feed.
    on_batch = _batch_dependent(parts.forward.graph)
    dep = {t_fb for t_fb, t in zip(prog.fb_acts, prog.acts) if t in on_batch}
    # A cotangent is a sum over the micro-batch's examples whatever its primal is (the
    # gradient reaching a weight cast made before a stage boundary has no batch dimension
    # but sums every example's): each replica would get the whole sum.
    dep |= {t_fb for t_fb, t in zip(prog.fb_cts, diff_outs)
            if t != parts.forward.graph.outputs[0]}
    for node in g.nodes:
        if any(t in dep for t in node.inputs if t is not None):
            dep.update(node.outputs)
    leaving = set(prog.fb_param_grads) | set(prog.fb_act_grads)
    fwd = parts.forward.graph
    grad_of = {t: fwd.tensors[p].name for t, p in zip(prog.fb_param_grads, prog.params)}
    reshaped: list[tuple[int, int]] = []
    entering = set(g.inputs) | (set() if stage.remat else set(prog.residuals))
    for t in g.tensors:
        if t.id not in leaving and t.id not in entering:
            continue
        shape, lshape = tuple(t.shape), tuple(gl.tensors[t.id].shape)
        if len(shape) != len(lshape):
            # The replica's program holds it with other size-1 dimensions (JAX traced one
            # example so, `ir.one_example`): the replica reshapes its slice along the batch
            # dimension, which holds the same elements in the same order.
            d = bdim.get(t.id)
            if t.id in leaving or d is None or shape[d] % replicas:
                return ReplicaSplit(f"{t.name} changes rank per replica")
            sliced = shape[:d] + (shape[d] // replicas,) + shape[d + 1:]
            if without_ones(sliced) != without_ones(lshape):
                return ReplicaSplit(f"{t.name} changes rank per replica")
            reshaped.append((t.id, d))
            lshape = sliced
        shrunk = [i for i, (a, b) in enumerate(zip(shape, lshape)) if a != b]
        if not shrunk and t.id in dep and t.id in entering:
            return ReplicaSplit(f"{t.name} {list(shape)} has no batch dimension but "
                                "depends on the batch")
        if len(shrunk) > 1 or shrunk and shape[shrunk[0]] != lshape[shrunk[0]] * replicas:
            return ReplicaSplit(f"{t.name} {list(shape)} does not split evenly over "
                                f"{replicas} replicas")
        if shrunk and t.id in dep and shrunk != [bdim.get(t.id)]:
            # (A value broadcast to the batch size without depending on the batch, such
            # as a causal mask, is the same in every slice.)
            return ReplicaSplit(f"{t.name} {list(shape)} does not split along its batch "
                                "dimension")
        s = spec.get(t.id, TensorSpec.replicated(len(shape)))
        for i, dims in enumerate(s.dims):
            on_axes = any(a in axes for a in dims)
            if i not in shrunk:
                if on_axes and t.id in grad_of:
                    # (A replica would accumulate the whole gradient where the plan keeps
                    # a 1/replicas shard: the stage's memory estimate does not hold it.)
                    return ReplicaSplit(f"the gradient of {grad_of[t.id]} is sharded over "
                                        f"{axes} (reduce-scattered in each backward)")
                if on_axes:
                    return ReplicaSplit(f"{t.name} is split over {axes} on a dimension "
                                        "that is not the batch")
            elif tuple(dims[:len(axes)]) != axes and (t.id in leaving or on_axes):
                return ReplicaSplit(f"{t.name} {list(shape)} is not split over {axes} on "
                                    f"its batch dimension (spec {s.dims})")
    return ReplicaSplit(None, tuple(reshaped))


@per_graph
def _batch_dependent(forward: OpGraph) -> frozenset[int]:
    """Forward values computed from the step's batch leaves (once per forward graph: every
    stage of every candidate plan asks; GPT-175B's graph has ~16,000 operators)."""
    dep = {t.id for t in forward.tensors_with_role(Role.BATCH)}
    for node in forward.nodes:
        if any(t in dep for t in node.inputs if t is not None):
            dep.update(node.outputs)
    return frozenset(dep)


def stage_sync(parts: StepParts, planned: PlannedStage, cluster: Cluster,
               fwd_bdims: Mapping[int, int], names: Mapping[int, str],
               exchange: ExchangeRequest | None = None) -> StageSync:
    """Decides how a stage syncs its gradients and prices it (module docstring).

    With `exchange` (compression asked for) the backward must run per replica, even for
    one micro-batch, so that each device holds its own gradients to compress; the stage's
    once-per-step reduction is then the exchange `planning.stage_exchange` chooses, and
    the result's `uncompressed` is the same stage with a full-precision all-reduce.

    Raises:
      PlanningError: compression asked for, but the stage has no data-parallel axis, or
        its backward cannot run per replica (the message says why).
    """
    prog, result, stage, index, mesh = (planned.prog, planned.result, planned.plan,
                                        planned.index, planned.mesh)
    m = parts.num_micro_batches
    fb = prog.fb.graph
    out_spec = dict(zip(fb.outputs, stage.output_specs))
    grads = list(zip(prog.fb_params, prog.fb_param_grads))

    def nbytes(t: int) -> int:
        tt = fb.tensors[t]
        return int(tt.nbytes // out_spec[t].num_shards(mesh))

    axes = batch_axes(prog, stage, fwd_bdims)
    reshaped: tuple[tuple[int, int], ...] = ()
    why = "one micro-batch" if m == 1 else \
        "the stage's inputs do not split the batch over one set of mesh axes"
    if axes and (m > 1 or exchange is not None):
        try:
            local, scale = local_stage_program(parts, prog,
                                               math.prod(mesh.axis_size(a) for a in axes))
            split = splits_only_batch(parts, prog, local, stage, mesh, axes, fwd_bdims)
            why, reshaped = split.refused, split.reshaped
        except PlanningError as e:
            why = str(e)
    if exchange is not None and (why is not None or not axes):
        if axes:
            replicas = math.prod(mesh.axis_size(a) for a in axes)
            g = parts.forward.graph
            rows = next((g.tensors[t].shape[0] for t, b in zip(g.inputs, parts.batch_inputs)
                         if b and g.tensors[t].shape), 0)
            detail = (f"this stage's backward cannot run per replica (each of its {replicas} "
                      f"replicas would compute {rows // replicas} of a micro-batch's {rows} "
                      f"examples): {why}; plan without compression, or with fewer "
                      "micro-batches or fewer data-parallel replicas")
        else:
            detail = ("no mesh axis of this stage splits the batch (there is no data "
                      "parallelism to compress); plan without compression, or with a "
                      "layout whose dp is > 1")
        raise PlanningError(f"stage {index}: gradient compression exchanges the gradients "
                            f"each data-parallel replica accumulates, and {detail}")
    if why is not None:
        # The backward reduces each gradient itself (where the plan says), once per
        # micro-batch; that time is inside the stage's backward estimate.
        by_node = dict(result.node_collectives)
        records = []
        for p, g in grads:
            red_axes, kind, time_s = grad_reduction(fb, by_node, g, mesh)
            reduced = kind is not SyncCollective.NONE
            records.append(GradientSync(
                param=names.get(p, fb.tensors[p].name), stage=index,
                accumulation=(Accumulation.SINGLE if m == 1 else
                              Accumulation.REDUCED if reduced else Accumulation.LOCAL),
                axes=red_axes, collective=kind, compressor=None, nbytes=nbytes(g),
                count=m if reduced else 0, time_s=m * time_s))
        note = why if m > 1 and any(r.accumulation is Accumulation.REDUCED
                                    for r in records) else ""
        # Where collectives run beside compute, a reduction overlaps the rest of its
        # micro-batch's backward: only what outlasts it stays on the stage's critical path.
        hidden = backward_timeline(fb, result, [g for _, g in grads], CommModel(cluster, mesh),
                                   cluster.overlaps_collectives()).sync.hidden_s
        return StageSync(dataclasses.replace(
            stage, accumulate_note=note, backward_s=stage.backward_s - hidden,
            comm_s=stage.comm_s - hidden, total_s=stage.total_s - hidden),
            tuple(records), 0.0)
    # The backward runs per device over `axes`: its collectives over them vanish, but for
    # the gradients of activations without the batch in them, summed over the replicas.
    comm = CommModel(cluster, mesh)
    bwd = set(prog.remat_nodes if stage.remat else prog.bwd_nodes)
    kept, dropped = [], 0.0
    for node, colls in result.node_collectives:
        for c in colls:
            if node in bwd and set(c.axes) <= set(axes):
                dropped += c.time_s
            else:
                kept.append(c)
    lg = local.fb.graph
    for t in prog.fb_act_grads:
        if tuple(fb.tensors[t].shape) == tuple(lg.tensors[t].shape):
            c = comm.op(CollectiveKind.ALL_REDUCE, nbytes(t), axes)
            kept.append(c)
            dropped -= c.time_s
    total = sum(nbytes(g) for _, g in grads)
    reduce_s = comm.all_reduce(total, axes)
    records = tuple(GradientSync(
        param=names.get(p, fb.tensors[p].name), stage=index,
        accumulation=Accumulation.LOCAL, axes=axes, collective=SyncCollective.ALL_REDUCE,
        compressor=None, nbytes=nbytes(g), count=1,
        time_s=reduce_s * nbytes(g) / total if total else 0.0) for p, g in grads)
    # With remat the backward task also runs the forward again, and its collectives over
    # `axes` vanish there too: the backward can lose more than its own collectives, and
    # the rest comes off the forward's share (`StageTiming` prices the recompute by it).
    backward = stage.backward_s - dropped
    forward = stage.forward_s + min(backward, 0.0)
    new = dataclasses.replace(
        stage, collectives=collective_summaries(kept), comm_s=stage.comm_s - dropped,
        forward_s=max(forward, 0.0), backward_s=max(backward, 0.0),
        total_s=stage.total_s - dropped, accumulate_axes=axes, local_loss_scale=scale,
        accumulate_reshapes=reshaped)
    dense = StageSync(new, records, reduce_s)
    if exchange is None:
        return dense
    shards = [GradShard(out_spec[g].local_shape(fb.tensors[g].shape, mesh), fb.tensors[g].dtype)
              for _, g in grads]
    chosen = choose_exchange(exchange, shards, comm, axes)
    if chosen is None:      # compressing saves nothing on these axes' links
        return dense
    desc = chosen.compressor.describe()
    records = tuple(dataclasses.replace(
        r, collective=SyncCollective.COMPRESSED if c else SyncCollective.ALL_REDUCE,
        compressor=desc if c else None, nbytes=int(w) if c else r.nbytes, time_s=t)
        for r, c, w, t in zip(records, chosen.exchange.compressed, chosen.grad_wire_bytes,
                              chosen.grad_s))
    return StageSync(dataclasses.replace(new, exchange=chosen.exchange), records,
                     chosen.exchange.sync_s, uncompressed=dense)


# Operators a gradient passes through unchanged in kind after its partial sums are formed
# (a reduction XLA runs at their input is the gradient's own reduction).
_PASS_THROUGH = frozenset({"add", "add_any", "convert_element_type", "transpose", "reshape",
                           "copy", "copy_p", "squeeze", "broadcast_in_dim", "reduce_sum"})


def gradient_nodes(graph: OpGraph, tid: int) -> list[int]:
    """The operators that form one gradient, where a plan reduces it: its producer and the
    pass-through operators feeding only it."""
    found, stack, seen = [], [graph.producer(tid)], set()
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        found.append(n)
        node = graph.nodes[n]
        if node.primitive in _PASS_THROUGH or n == graph.producer(tid):
            for u in node.inputs:
                if u is not None and len(graph.consumers(u)) == 1:
                    stack.append(graph.producer(u))
    return found


def grad_reduction_ops(graph: OpGraph, by_node: Mapping[int, tuple], tid: int
                       ) -> list[tuple[int, CollectiveOp]]:
    """The collectives that reduce one gradient where it is formed, with the node running
    each (`gradient_nodes`)."""
    return [(n, c) for n in gradient_nodes(graph, tid) for c in by_node.get(n, ())
            if c.kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)]


def grad_reduction(graph: OpGraph, by_node: Mapping[int, tuple], tid: int,
                   mesh: LogicalMesh) -> tuple[tuple[str, ...], SyncCollective, float]:
    """How the plan reduces one gradient where it is formed: over which mesh axes, with
    which collective, and the time (`grad_reduction_ops`)."""
    found = [c for _, c in grad_reduction_ops(graph, by_node, tid)]
    axes = tuple(a for a in mesh.axis_names if any(a in c.axes for c in found))
    if not found:
        return axes, SyncCollective.NONE, 0.0
    kind = SyncCollective.REDUCE_SCATTER if any(
        c.kind is CollectiveKind.REDUCE_SCATTER for c in found) else SyncCollective.ALL_REDUCE
    return axes, kind, float(sum(c.time_s for c in found))


@dataclasses.dataclass(frozen=True)
class BackwardTimeline:
    """One program's operators in traced order, with its gradient reductions told apart.

    Attributes:
      compute_s: every operator's compute.
      intra_op_s: collectives on the critical path: all but the gradient reductions.
      update_s: compute after the last gradient is formed (the optimizer update, if the
        program holds one).
      sync: the gradient reductions beside the backward (`cost_models.overlap`), at the
        bucket size of `schedule`.
      reductions: how many gradient reductions run.
      backward_end_s: when the operator forming the last gradient ends.
      schedule: the buckets played out (None where nothing is reduced).
      choice: where the bucket size was chosen (`bucket_bytes=None`), what was weighed.
      reduced: per gradient reduction, in the order given to the cost model, the gradient
        tensors it reduces.
    """
    compute_s: float
    intra_op_s: float
    update_s: float
    sync: SyncOverlap
    reductions: int
    backward_end_s: float = 0.0
    schedule: BucketSchedule | None = None
    choice: BucketChoice | None = None
    reduced: tuple[tuple[int, ...], ...] = ()


def backward_timeline(graph: OpGraph, result: StageResult, grad_tids: Sequence[int],
                      comm: CommModel, overlaps: bool,
                      bucket_bytes: float | None = XLA_COMBINE_THRESHOLD_BYTES
                      ) -> BackwardTimeline:
    """Plays `graph` under `result`'s plan: each operator's compute, then its collectives
    (gradient reductions, `grad_reduction_ops`, aside). A gradient is formed when the
    operator that reduces it has computed; its reductions are combined into buckets (one
    latency each, priced by `comm`, the stage mesh's model) and overlap the rest of the
    backward where the platform `overlaps` collectives with compute.

    Args:
      bucket_bytes: the bucket size; None: the size that leaves the least exposed
        (`cost_models.overlap.choose_bucket_bytes`). The default is XLA's own combine
        threshold, what runs where the plan records no size.
    """
    by_node = dict(result.node_collectives)
    grad_ops: dict[int, list] = {}            # node -> its gradient reductions
    # (node, id(op)) -> the gradients it reduces (repeated layers share op objects, so an
    # op is told apart by its node too).
    op_grads: dict[tuple[int, int], list[int]] = {}
    for tid in grad_tids:
        for node, op in grad_reduction_ops(graph, by_node, tid):
            if all(op is not o for o in grad_ops.get(node, ())):
                grad_ops.setdefault(node, []).append(op)
            if tid not in op_grads.setdefault((node, id(op)), []):
                op_grads[(node, id(op))].append(tid)
    clock, ends, intra_op = 0.0, [], 0.0
    for node in graph.nodes:
        clock += result.node_compute_s[node.id]
        ends.append(clock)
        mine = grad_ops.get(node.id, ())
        other = sum(c.time_s for c in by_node.get(node.id, ()) if all(c is not o for o in mine))
        clock += other
        intra_op += other
    # Reshards of tied outputs (node -1) run at the end.
    intra_op += sum(c.time_s for c in by_node.get(-1, ()))
    producers = [p for p in (graph.producer(t) for t in grad_tids) if p is not None]
    ops = [(node, op) for node, node_ops in sorted(grad_ops.items()) for op in node_ops]
    formed = [FormedGradient(ends[node], op.nbytes, op.time_s,
                             min(op.time_s, comm.op(op.kind, 1, op.axes).time_s))
              for node, op in ops]
    return _played(graph, result, ends, max(producers, default=-1), formed,
                   tuple(tuple(op_grads[(node, id(op))]) for node, op in ops), intra_op,
                   overlaps, bucket_bytes)


def worker_timeline(graph: OpGraph, result: StageResult, grad_tids: Sequence[int],
                    comm: CommModel, overlaps: bool) -> BackwardTimeline:
    """The step as the per-worker engine runs it (`runtime.compressed` with a
    full-precision exchange): `result`'s operators, each its compute only (the engine runs
    no collective of the plan), and one all-reduce of each gradient in `grad_tids` over
    every axis of `comm`'s mesh, formed when its producer ends; bucketed at the size that
    leaves the least exposed (`cost_models.overlap.choose_bucket_bytes`). A gradient no
    operator produces is formed at the start."""
    ends = list(itertools.accumulate(result.node_compute_s))     # compute only, by node
    axes = tuple(a for a, n in zip(comm.mesh.axis_names, comm.mesh.shape) if n > 1)
    grads = list(dict.fromkeys(grad_tids))
    producers = [graph.producer(t) for t in grads]
    latency = comm.all_reduce(1, axes) if axes else 0.0
    formed = []
    for t, p in zip(grads, producers):
        took = comm.all_reduce(graph.tensors[t].nbytes, axes) if axes else 0.0
        formed.append(FormedGradient(ends[p] if p is not None else 0.0,
                                     graph.tensors[t].nbytes, took, min(took, latency)))
    last = max((p for p in producers if p is not None), default=-1)
    return _played(graph, result, ends, last, formed, tuple((t,) for t in grads), 0.0,
                   overlaps, None)


def _played(graph: OpGraph, result: StageResult, ends: Sequence[float], last_grad: int,
            formed: list[FormedGradient], reduced: tuple[tuple[int, ...], ...],
            intra_op_s: float, overlaps: bool, bucket_bytes: float | None
            ) -> BackwardTimeline:
    """A timeline from its operators' end times (`ends`, by node) and the gradient
    reductions `formed` (reducing `reduced`), played out in buckets of `bucket_bytes`
    (None: the size that leaves the least exposed); the backward ends with node
    `last_grad` (-1: none), and what follows it is the update."""
    backward_end = ends[last_grad] if last_grad >= 0 else 0.0
    update = sum(result.node_compute_s[i] for i in range(last_grad + 1, len(graph.nodes)))
    choice = schedule = None
    if not formed:
        sync = SyncOverlap(total_s=0.0, exposed_s=0.0, buckets=0)
    elif bucket_bytes is None:
        choice = choose_bucket_bytes(formed, backward_end, overlaps)
        schedule = choice.chosen
        sync = schedule.sync
    else:
        schedule = bucket_schedule(formed, backward_end, bucket_bytes, overlaps)
        sync = schedule.sync
    return BackwardTimeline(compute_s=float(sum(result.node_compute_s)),
                            intra_op_s=intra_op_s, update_s=update, sync=sync,
                            reductions=len(formed), backward_end_s=backward_end,
                            schedule=schedule, choice=choice, reduced=reduced)


def sync_buckets(timeline: BackwardTimeline, names: Mapping[int, str], stage: int,
                 issue: BucketIssue, overlaps: bool) -> SyncBuckets | None:
    """The Plan's record of `timeline`'s buckets (None where nothing is reduced).

    A gradient belongs to the bucket holding its last reduction (it is complete, and
    reduced, only then; the partitioner reduces a gradient in one place but for rare
    sums of partial sums); `names` gives the names `Plan.gradient_sync` uses."""
    sched, choice = timeline.schedule, timeline.choice
    if sched is None:
        return None
    bucket_of_op = {}
    for b, run in enumerate(sched.runs):
        for k in range(run.start, run.stop):
            bucket_of_op[sched.order[k]] = b
    home: dict[int, tuple[int, int]] = {}     # gradient -> (bucket, issue position)
    for pos, i in enumerate(sched.order):
        for tid in timeline.reduced[i]:
            home[tid] = (bucket_of_op[i], pos)
    members: list[list[int]] = [[] for _ in sched.runs]
    for tid, (b, _) in sorted(home.items(), key=lambda kv: kv[1][1]):
        members[b].append(tid)
    buckets = tuple(SyncBucket(tuple(names[t] for t in members[b]), int(run.nbytes),
                               float(run.ready_s), float(run.end_s))
                    for b, run in enumerate(sched.runs))
    runner = choice.runner_up if choice is not None else None
    return SyncBuckets(
        stage=stage, bucket_bytes=int(math.ceil(sched.bucket_bytes)), buckets=buckets,
        exposed_s=float(sched.sync.exposed_s), total_s=float(sched.sync.total_s),
        backward_end_s=float(timeline.backward_end_s), overlaps=overlaps, issue=issue,
        runner_up_bytes=0 if runner is None else int(math.ceil(runner.bucket_bytes)),
        runner_up_exposed_s=0.0 if runner is None else float(runner.sync.exposed_s),
        runner_up_buckets=0 if runner is None else runner.sync.buckets,
        weighed=() if choice is None else tuple((int(math.ceil(n)), float(e), int(k))
                                                for n, e, k in choice.weighed))


def single_stage_sync(graph: OpGraph, result: StageResult, mesh: LogicalMesh,
                      names: Mapping[int, str]) -> tuple[GradientSync, ...]:
    """One record per gradient of a single-stage plan (`grad_reduction`)."""
    by_node = dict(result.node_collectives)
    spec = dict(result.stage.tensor_specs)
    records = []
    for t in graph.tensors_with_role(Role.GRAD):
        axes, kind, time_s = grad_reduction(graph, by_node, t.id, mesh)
        s = spec.get(t.id, TensorSpec.replicated(len(t.shape)))
        records.append(GradientSync(
            param=names.get(t.id, t.name), stage=0, accumulation=Accumulation.SINGLE,
            axes=axes, collective=kind, compressor=None,
            nbytes=int(t.nbytes // s.num_shards(mesh)),
            count=0 if kind is SyncCollective.NONE else 1, time_s=time_s))
    return tuple(records)
