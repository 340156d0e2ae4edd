"""The step-time breakdown of a plan (`plan.timing.StepTime`): what the estimate is made of.

Single-stage plans. The stage's operators run in the traced order; each costs its chosen
strategy's compute time plus the collectives it runs. Gradient reductions are told apart
from the other collectives (`gradient_sync.grad_reduction_ops`), and each gradient is
*formed* when the operator that reduces it finishes computing. Where the platform runs
collectives asynchronously beside compute (GPUs and TPUs: XLA's async collectives and
latency-hiding scheduler), the reductions overlap the rest of the backward in buckets
(`cost_models.overlap.bucketed_sync`: XLA combines them, one latency per bucket); only
what is left after the backward's end is on the critical path. XLA:CPU runs collectives
in line (combined too): there every bucket is exposed.
Operators after the last gradient is formed are the optimizer update.
The bucket size is the plan's own, chosen to leave the least reduction exposed
(`cost_models.overlap.choose_bucket_bytes`, Caramel's batching), with the reductions issued
in the order the backward forms their gradients (TicTac's ordering); the decision is kept
in the breakdown (`StepTime.sync_buckets`), and the runtime hands the size to XLA's
combiner on GPUs (`runtime.xla_options`), so the estimate prices what runs.

Pipelined plans. The schedule simulator gives the step of micro-batches; the critical
stage (the busiest) is split into its compute and its intra-op collectives per micro-batch
(in the ratio of its plan), the pipeline sends into what the simulator could not hide
(the step re-simulated without sends, subtracted), the rest of the simulated step is the
bubble. Each stage reduces its accumulated gradients once, after its own last backward,
in a program of its own (`runtime.pipeline`): stages whose last backward ends early hide
their reduction behind the others' work; what outlasts the simulated step is exposed.
The update follows.
"""

from __future__ import annotations

from collections.abc import Sequence

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.pipeline_schedule import (
    Schedule,
    ScheduleResult,
    StageTiming,
    simulate,
)
from alpa_lite.ir.graph import OpGraph, Role
from alpa_lite.plan import BucketIssue, StagePlan
from alpa_lite.plan.sharding import CommModel, LogicalMesh
from alpa_lite.plan.timing import StepTime, TimeKind, TimeLine
from alpa_lite.planning.gradient_sync import backward_timeline, sync_buckets
from alpa_lite.planning.intra_op import StageResult

__all__ = ["pipeline_step_time", "single_stage_step_time"]


def single_stage_step_time(graph: OpGraph, result: StageResult, cluster: Cluster) -> StepTime:
    """The breakdown of a single-stage plan's step (module docstring)."""
    grads = [t.id for t in graph.tensors_with_role(Role.GRAD)]
    overlaps = cluster.overlaps_collectives()
    mesh = LogicalMesh(result.stage.mesh_shape, result.stage.axis_names)
    tl = backward_timeline(graph, result, grads, CommModel(cluster, mesh), overlaps,
                           bucket_bytes=None)
    how = ("overlapped with the backward" if overlaps
           else "in line: this platform runs collectives synchronously")
    buckets = sync_buckets(tl, {t.id: t.name for t in graph.tensors}, 0,
                           BucketIssue.XLA_COMBINER, overlaps)
    cap = f" (cap {_mib(buckets.bucket_bytes)})" if buckets is not None else ""
    lines = [TimeLine(TimeKind.COMPUTE, tl.compute_s - tl.update_s,
                      "forward and backward kernels"),
             TimeLine(TimeKind.INTRA_OP_COMM, tl.intra_op_s, "collectives inside the step"),
             TimeLine(TimeKind.GRADIENT_SYNC, tl.sync.exposed_s,
                      f"{tl.reductions} reductions in {tl.sync.buckets} buckets{cap}, {how}"),
             TimeLine(TimeKind.OPTIMIZER_UPDATE, tl.update_s, "operators after the last gradient")]
    hidden = (TimeLine(TimeKind.GRADIENT_SYNC, tl.sync.hidden_s, "under the backward"),) \
        if tl.sync.hidden_s > 0 else ()
    return StepTime(lines=tuple(lines), hidden=hidden,
                    sync_buckets=() if buckets is None else (buckets,))


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def pipeline_step_time(stages: Sequence[StagePlan], timings: Sequence[StageTiming],
                       sim: ScheduleResult, num_micro_batches: int, schedule: Schedule,
                       reduce_s: Sequence[float], apply_s: float) -> StepTime:
    """The breakdown of a pipelined plan's step (module docstring).

    Args:
      stages: the stage plans (`compute_s` and `comm_s` per micro-batch).
      timings: what the simulator was given, per stage.
      sim: the simulated step.
      num_micro_batches, schedule: as simulated.
      reduce_s: per stage, its once-per-step gradient reduction (0 where none).
      apply_s: the optimizer update after the last reduction.
    """
    m = num_micro_batches
    critical = max(range(len(stages)), key=lambda s: sim.busy_s[s])
    st = stages[critical]
    busy = sim.busy_s[critical]
    work = st.compute_s + st.comm_s
    comm_share = st.comm_s / work if work > 0 else 0.0
    quiet = [StageTiming(forward_s=t.forward_s, backward_s=t.backward_s, remat=t.remat)
             for t in timings]
    without_sends = simulate(quiet, m, schedule).step_time_s
    sends = sim.step_time_s - without_sends
    finish = max(sim.finish_s[s] + reduce_s[s] for s in range(len(stages)))
    exposed_sync = max(0.0, finish - sim.step_time_s)
    lines = (
        TimeLine(TimeKind.COMPUTE, busy * (1 - comm_share),
                 f"stage {critical} (the busiest), {m} micro-batches"
                 + (", recomputation included" if st.remat else "")),
        TimeLine(TimeKind.INTRA_OP_COMM, busy * comm_share,
                 f"stage {critical}'s collectives inside its forward and backward"),
        TimeLine(TimeKind.PIPELINE_BUBBLE, without_sends - busy,
                 f"stage {critical} waiting on the others"),
        TimeLine(TimeKind.PIPELINE_SENDS, sends, "transfers between stages not under compute"),
        TimeLine(TimeKind.GRADIENT_SYNC, exposed_sync,
                 "once per step, after each stage's last backward"),
        TimeLine(TimeKind.OPTIMIZER_UPDATE, apply_s, "after the last reduction"),
    )
    hidden = []
    hidden_sync = max(reduce_s) - exposed_sync if reduce_s else 0.0
    if hidden_sync > 0:
        hidden.append(TimeLine(TimeKind.GRADIENT_SYNC, hidden_sync,
                               "reductions that ran while other stages still computed"))
    total_sends = sum(t.send_activation_s + t.send_gradient_s for t in timings) * m
    if total_sends - sends > 0:
        hidden.append(TimeLine(TimeKind.PIPELINE_SENDS, total_sends - sends,
                               "transfers under compute"))
    return StepTime(lines=lines, hidden=tuple(hidden))
