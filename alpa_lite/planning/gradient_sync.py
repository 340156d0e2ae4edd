"""Gradient sync of a pipelined stage: accumulate over micro-batches, reduce once per step.

Under a plain SPMD backward, every micro-batch's parameter gradients are partial sums over
the devices that split the batch, and the partitioner reduces them inside each backward: m
reductions per step. `stage_sync` decides, for one stage of a pipelined plan, whether its
backward can instead run per device over those mesh axes (the *accumulation axes*), so each
device sums its own partial gradients over the micro-batches and the stage reduces them
once after its last backward, as Megatron, DeepSpeed and Alpa do.

That is exact when the axes split the batch and nothing else: every tensor of the stage's
forward+backward program is split over them on its batch dimension (major-most) or not at
all. The check traces the loss at 1/replicas of the micro-batch (`ir.step_parts.
local_forward`, which also proves the split keeps the loss exact) and compares every
tensor's shape there with its spec here. Where it fails, the stage keeps reducing in each
backward; either way the Plan records what runs (`GradientSync`) and the estimate charges
it: collectives over the accumulation axes leave the per-micro-batch backward, one
reduction of the stage's gradients joins the step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from alpa_lite.cost_models.cluster import Cluster, CollectiveKind
from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import OpGraph, Role
from alpa_lite.ir.step_parts import StageProgram, StepParts, local_forward, stage_program
from alpa_lite.plan import Accumulation, GradientSync, StagePlan, SyncCollective
from alpa_lite.plan.sharding import CommModel, LogicalMesh, TensorSpec
from alpa_lite.planning.intra_op import StageResult, collective_summaries


_ORDER_DEPENDENT = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort",
                              "top_k", "argsort", "argmax", "argmin"})


@dataclasses.dataclass(frozen=True)
class StageSync:
    """A stage with its gradient sync decided: the stage (costs adjusted), one record per
    parameter, and the time of its once-per-step reduction."""
    stage: StagePlan
    records: tuple[GradientSync, ...]
    reduce_s: float


def batch_axes(prog: StageProgram, stage: StagePlan, fwd_bdims: dict[int, int]) -> tuple[str, ...]:
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


def splits_only_batch(prog: StageProgram, local: StageProgram, stage: StagePlan,
                      mesh: LogicalMesh, axes: tuple[str, ...]) -> str | None:
    """None when the per-replica program lines up with the stage's plan over `axes`; else
    why not.

    A replica's share of a tensor is its slice along the one dimension that shrinks per
    replica (the batch). What leaves the backward (parameter and activation gradients)
    must be split as the plan says: over `axes` (major-most) on that dimension, and on no
    other. What enters (parameters, activations, residuals, cotangents) may also be whole
    over `axes`, since slicing a replicated value moves nothing. Inside, every tensor is
    computed per replica: the micro-batch proof behind `local_forward` makes that exact,
    and the plan's splits over the other axes still apply."""
    g, gl = prog.fb.graph, local.fb.graph
    if len(g.tensors) != len(gl.tensors) or len(g.nodes) != len(gl.nodes):
        return "the program traced per replica has another structure"
    # Scans and sorts along the tokens (e.g. a mixture of experts' capacity positions)
    # differ per replica in ways the shape check does not see; a MoE layer's gradients
    # came out different under a per-replica backward, so such stages reduce per
    # micro-batch until the proof covers them.
    ordered = {n.primitive for n in g.nodes} & _ORDER_DEPENDENT
    if ordered:
        return f"the stage runs {sorted(ordered)}, whose per-replica result is not proven"
    replicas = math.prod(mesh.axis_size(a) for a in axes)
    spec: dict[int, TensorSpec] = dict(stage.tensor_specs)
    spec.update(zip(g.inputs, stage.input_specs))
    spec.update(zip(g.outputs, stage.output_specs))
    leaving = set(prog.fb_param_grads) | set(prog.fb_act_grads)
    entering = set(g.inputs) | (set() if stage.remat else set(prog.residuals))
    for t in g.tensors:
        shape, lshape = tuple(t.shape), tuple(gl.tensors[t.id].shape)
        if len(shape) != len(lshape):
            return f"{t.name} changes rank per replica"
        if t.id not in leaving and t.id not in entering:
            continue
        if sum(a != b for a, b in zip(shape, lshape)) > 1:
            return f"{t.name} shrinks on more than one dimension per replica"
        s = spec.get(t.id, TensorSpec.replicated(len(shape)))
        for full, part, dims in zip(shape, lshape, s.dims):
            on_axes = any(a in axes for a in dims)
            if full == part:
                if on_axes:
                    return f"{t.name} is split over {axes} on a dimension that is not the batch"
            elif full != part * replicas:
                return f"{t.name} does not split evenly over {replicas} replicas"
            elif tuple(dims[:len(axes)]) != axes and (t.id in leaving or on_axes):
                return (f"{t.name} {list(shape)} is not split over {axes} on its batch "
                        f"dimension (spec {s.dims})")
    return None


def stage_sync(parts: StepParts, prog: StageProgram, result: StageResult, stage: StagePlan,
               index: int, mesh: LogicalMesh, cluster: Cluster, fwd_bdims: dict[int, int],
               names: dict[int, str]) -> StageSync:
    """Decides how stage `index` syncs its gradients and prices it (module docstring)."""
    m = parts.num_micro_batches
    fb = prog.fb.graph
    out_spec = dict(zip(fb.outputs, stage.output_specs))
    grads = list(zip(prog.fb_params, prog.fb_param_grads))

    def nbytes(t: int) -> int:
        tt = fb.tensors[t]
        return int(tt.nbytes // out_spec[t].num_shards(mesh))

    axes = batch_axes(prog, stage, fwd_bdims) if m > 1 else ()
    why = "one micro-batch" if m == 1 else "no mesh axis splits the batch"
    scale = 1.0
    if axes and any(mesh.axis_size(a) > 1 for a in mesh.axis_names if a not in axes):
        # With tensor parallelism beside the batch axes, a MoE stage's gradients came out
        # different under the per-replica backward (not yet understood): keep reducing
        # per micro-batch there.
        why = "the stage also splits over other axes"
    elif axes:
        replicas = math.prod(mesh.axis_size(a) for a in axes)
        try:
            local_fwd, scale = local_forward(parts, replicas)
            why = splits_only_batch(prog, stage_program(local_fwd, prog.start, prog.stop),
                                    stage, mesh, axes)
        except PlanningError as e:
            why = str(e)
    if axes and why is None:
        # The backward runs per device over `axes`: its collectives over them vanish.
        bwd = set(prog.remat_nodes if stage.remat else prog.bwd_nodes)
        kept, dropped = [], 0.0
        for node, colls in result.node_collectives:
            for c in colls:
                if node in bwd and set(c.axes) <= set(axes):
                    dropped += c.time_s
                else:
                    kept.append(c)
        comm = CommModel(cluster, mesh)
        total = sum(nbytes(g) for _, g in grads)
        reduce_s = comm.all_reduce(total, axes)
        records = tuple(GradientSync(
            param=names.get(p, fb.tensors[p].name), stage=index,
            accumulation=Accumulation.LOCAL, axes=axes, collective=SyncCollective.ALL_REDUCE,
            compressor=None, nbytes=nbytes(g), count=1,
            time_s=reduce_s * nbytes(g) / total if total else 0.0) for p, g in grads)
        # The stage's forward/backward split is by FLOPs; what the split gave the backward
        # may be less than its collectives: the rest comes off the forward's share.
        backward = stage.backward_s - dropped
        forward = stage.forward_s + min(backward, 0.0)
        new = dataclasses.replace(
            stage, collectives=collective_summaries(kept), comm_s=stage.comm_s - dropped,
            forward_s=max(forward, 0.0), backward_s=max(backward, 0.0),
            total_s=stage.total_s - dropped, accumulate_axes=axes, local_loss_scale=scale)
        return StageSync(new, records, reduce_s)
    # The backward reduces over the batch axes itself, once per micro-batch; its time is
    # inside the stage's backward estimate.
    acc = Accumulation.SINGLE if m == 1 else Accumulation.REDUCED
    records = tuple(GradientSync(
        param=names.get(p, fb.tensors[p].name), stage=index, accumulation=acc, axes=axes,
        collective=SyncCollective.ALL_REDUCE if axes else SyncCollective.NONE,
        compressor=None, nbytes=nbytes(g), count=m if axes else 0, time_s=0.0)
        for p, g in grads)
    return StageSync(stage, records, 0.0)


# Operators a gradient passes through unchanged in kind after its partial sums are formed
# (a reduction XLA runs at their input is the gradient's own reduction).
_PASS_THROUGH = frozenset({"add", "add_any", "convert_element_type", "transpose", "reshape",
                           "copy", "copy_p", "squeeze", "broadcast_in_dim", "reduce_sum"})


def single_stage_sync(graph: OpGraph, result: StageResult, mesh: LogicalMesh,
                      names: Mapping[int, str]) -> tuple[GradientSync, ...]:
    """One record per gradient of a single-stage plan: the reductions the plan runs where
    the gradient is formed (its producer, and the pass-through operators feeding only it)."""
    by_node = dict(result.node_collectives)
    spec = dict(result.stage.tensor_specs)
    records = []
    for t in graph.tensors_with_role(Role.GRAD):
        found, stack, seen = [], [graph.producer(t.id)], set()
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            found += [c for c in by_node.get(n, ())
                      if c.kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)]
            node = graph.nodes[n]
            if node.primitive in _PASS_THROUGH or n == graph.producer(t.id):
                for u in node.inputs:
                    if u is not None and len(graph.consumers(u)) == 1:
                        stack.append(graph.producer(u))
        axes = tuple(a for a in mesh.axis_names if any(a in c.axes for c in found))
        kind = SyncCollective.NONE
        if found:
            kind = SyncCollective.REDUCE_SCATTER if any(
                c.kind is CollectiveKind.REDUCE_SCATTER for c in found) \
                else SyncCollective.ALL_REDUCE
        s = spec.get(t.id, TensorSpec.replicated(len(t.shape)))
        records.append(GradientSync(
            param=names.get(t.id, t.name), stage=0, accumulation=Accumulation.SINGLE,
            axes=axes, collective=kind, compressor=None,
            nbytes=int(t.nbytes // s.num_shards(mesh)), count=1 if found else 0,
            time_s=float(sum(c.time_s for c in found))))
    return tuple(records)
