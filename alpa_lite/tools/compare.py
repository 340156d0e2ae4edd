"""`compare`: the auto plans against every Megatron-style manual plan, ranked.

    rows = al.compare(train_step, params, opt_state, batch, cluster=al.Cluster.preset("8xV100"))
    best = rows[0]          # the fastest plan that fits; rows[i].plan is the Plan itself

What is planned (every plan from the same traced step, costed by the same cost model):

- auto: `Auto()` (one SPMD stage) and `Auto(num_micro_batches=m)` for every m in
  `micro_batches` that divides the batch (the inter-op search chooses the stages);
- Megatron grid: `Manual(dp, tp, pp, num_micro_batches=m)` for every dp x tp x pp equal to
  the device count with tp dividing the devices of a node (tensor parallelism stays on the
  fast links) and pp no more than the devices, every m in `micro_batches` whose
  micro-batch splits evenly over dp, with and without recomputation where pp > 1;
- ZeRO: `DataParallel(shard_optimizer_state=True)`.

A configuration the planner refuses (layers fewer than pp, no sharding fits the memory
budget, a micro-batch count the model's loss cannot be split into) is a row with `error`
set and no time. Rows are sorted: plans that fit device memory first, fastest first; then
those that do not fit; then the refused.

Throughput. `samples_per_s` = batch / estimated step time. `model_tflops_per_device` =
model FLOPs per step / step time / devices / 1e12, where model FLOPs are the FLOPs of every
operator the step's gradients depend on, i.e. one forward and one backward pass, counted
from the traced jaxpr exactly as the cost model counts them (dot_general contracting and
batch dimensions, convolution windows, one FLOP per element for the rest); the optimizer
update is not counted, nor is recomputation (as in the MFU convention of the PaLM paper,
Appendix B), so a plan that recomputes does not look busier than it is.

With `measure=True` every plan that fits is also run on the local devices (the target
cluster must be them, or a calibrated description of them): the arguments are placed where
the plan wants them (as a training loop holds them), then one call compiles and
`measure_steps` timed calls follow, the median kept in `measured_step_s`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from alpa_lite.api import ParallelizedStep
from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import OpGraph, Role
from alpa_lite.plan import Plan
from alpa_lite.plan.methods import Auto, DataParallel, Manual, Method, megatron_grid
from alpa_lite.progress import Progress, report

DEFAULT_MICRO_BATCHES = (1, 4, 16)
PLANS = "plans"
MEASURE = "measure"
"""The progress phases `compare` reports (plans done / total, plans measured / total),
beside the planners' own."""


@dataclasses.dataclass(frozen=True)
class CompareRow:
    """One plan of the comparison (module docstring for how each number is computed)."""
    label: str                  # e.g. "auto m=4", "dp=2 tp=4 pp=1 m=1", "ZeRO dp=8"
    kind: str                   # "auto", "manual" or "zero"
    method: str                 # repr of the method planned
    num_micro_batches: int
    remat: bool                 # any stage recomputes its forward
    stages: str                 # e.g. "1 x (2, 4)" or "2 x (1, 4)": stages x logical mesh
    step_time_s: float          # estimated; math.inf for a refused configuration
    samples_per_s: float
    model_tflops_per_device: float
    peak_memory_bytes: float    # per device, the largest stage's
    fits: bool                  # peak memory within the device's memory
    speedup_vs_best_manual: float   # best fitting manual/ZeRO step time / this one (nan: none)
    model_flops: float          # per step, forward + backward
    error: str = ""             # why the planner refused this configuration
    measured_step_s: float | None = None
    plan: Plan | None = dataclasses.field(default=None, compare=False, repr=False)


def candidate_methods(num_devices: int, devices_per_node: int, batch: int,
                      micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES
                      ) -> list[tuple[str, str, Method]]:
    """(label, kind, method) of every plan `compare` makes, auto first."""
    ms = [m for m in dict.fromkeys(micro_batches) if batch % m == 0]
    out: list[tuple[str, str, Method]] = [("auto", "auto", Auto())]
    out += [(f"auto m={m}", "auto", Auto(num_micro_batches=m)) for m in ms]
    for dp, tp, pp in megatron_grid(num_devices, devices_per_node):
        for m in ms:
            if (batch // m) % dp:
                continue
            for remat in ((False, True) if pp > 1 else (False,)):
                label = f"dp={dp} tp={tp} pp={pp} m={m}" + (" remat" if remat else "")
                out.append((label, "manual", Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=m,
                                                    remat=remat)))
    out.append((f"ZeRO dp={num_devices}", "zero", DataParallel(shard_optimizer_state=True)))
    return out


def model_flops(graph: OpGraph) -> float:
    """FLOPs of every operator the gradients depend on: forward + backward (module
    docstring). Falls back to every operator when the step marks no gradients."""
    grads = [t.id for t in graph.tensors_with_role(Role.GRAD)]
    if not grads:
        return graph.total_flops
    needed, stack, seen = set(), list(grads), set(grads)
    while stack:
        node = graph.producer(stack.pop())
        if node is None or node in needed:
            continue
        needed.add(node)
        for t in graph.nodes[node].inputs:
            if t is not None and t not in seen:
                seen.add(t)
                stack.append(t)
    return float(sum(graph.nodes[i].flops for i in needed))


def _stages_text(plan: Plan) -> str:
    meshes = [tuple(st.mesh_shape) for st in plan.stages]
    if len(set(meshes)) == 1:
        return f"{len(meshes)} x {meshes[0]}"
    return " + ".join(str(m) for m in meshes)


def compare(step_fn: Callable | ParallelizedStep, *args, cluster: Cluster,
            micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
            batch_argnums: Sequence[int] | None = None,
            progress: Progress | None = None, measure: bool = False,
            measure_steps: int = 3, real_args: Sequence[Any] | None = None
            ) -> tuple[CompareRow, ...]:
    """Plans `step_fn` every way (module docstring) and ranks the plans.

    Args:
      step_fn: the train step, plain or wrapped by `al.parallelize` (its method is ignored).
      *args: its positional arguments, arrays or `jax.ShapeDtypeStruct`s.
      cluster: the cluster to plan for.
      micro_batches: micro-batch counts to try (those not dividing the batch are skipped).
      batch_argnums: the batch arguments (default: the last; a wrapped step's own).
      progress: told `(PLANS, done, total)` per plan and each plan's planning phases.
      measure: also run every plan that fits on the local devices (`cluster` must be them).
      measure_steps: timed steps per plan (after one that compiles).
      real_args: arrays to measure with (default: `args`, which must then be arrays).

    Returns:
      The rows, ranked (module docstring).

    Raises:
      ValueError: no arguments, an empty micro-batch set, or `measure` on a cluster that
        is not the local devices or without real arrays.
    """
    if not args:
        raise ValueError("compare needs the step's positional arguments (params, ..., batch)")
    if any(not isinstance(m, int) or m < 1 for m in micro_batches):
        raise ValueError(f"micro_batches must be positive integers, got {list(micro_batches)}")
    if isinstance(step_fn, ParallelizedStep):
        # Its method, cluster and compression are not compared: only its function is.
        if batch_argnums is None:
            batch_argnums = step_fn.batch_argnums
        step_fn = step_fn.fn
    # The step carries `cluster` so that measured plans run as planned for it (a
    # calibrated description of the local devices, not only Cluster.local()).
    base = ParallelizedStep(step_fn, Auto(), cluster, batch_argnums)
    if measure:
        _check_measurable(cluster, args if real_args is None else real_args)
    traced = base.trace(*args)
    flops = model_flops(traced.graph)
    batch = _batch_size(traced.graph)
    candidates = candidate_methods(cluster.num_devices, cluster.devices_per_node, batch,
                                   micro_batches)
    done = []
    for i, (label, kind, method) in enumerate(candidates):
        report(progress, PLANS, i, len(candidates))
        step = base.with_method(method)
        try:
            plan = step.plan(*args, cluster=cluster, progress=progress)
        except (PlanningError, ValueError) as e:
            done.append((label, kind, method, None, _one_line(e)))
            continue
        done.append((label, kind, method, plan, ""))
    report(progress, PLANS, len(candidates), len(candidates))

    def fits(plan: Plan) -> bool:
        return plan.peak_memory_bytes <= cluster.device.memory_bytes

    manual = [p.step_time_s for _, kind, _, p, _ in done
              if p is not None and kind != "auto" and fits(p)]
    best_manual = min(manual) if manual else math.nan
    rows = []
    for label, kind, method, plan, error in done:
        m = method.num_micro_batches if isinstance(method, (Auto, Manual)) else 1
        if plan is None:
            rows.append(CompareRow(label, kind, repr(method), m or 1, False, "-", math.inf,
                                   0.0, 0.0, 0.0, False, math.nan, flops, error=error))
            continue
        t = plan.step_time_s
        rows.append(CompareRow(
            label=label, kind=kind, method=repr(method),
            num_micro_batches=plan.pipeline.num_micro_batches if plan.pipeline else 1,
            remat=any(st.remat for st in plan.stages), stages=_stages_text(plan),
            step_time_s=t, samples_per_s=batch / t if t > 0 else math.inf,
            model_tflops_per_device=flops / t / cluster.num_devices / 1e12 if t > 0 else 0.0,
            peak_memory_bytes=plan.peak_memory_bytes, fits=fits(plan),
            speedup_vs_best_manual=best_manual / t if t > 0 else math.nan,
            model_flops=flops, plan=plan))
    # Plans that fit, fastest first (ties: the candidates' order, auto first); then those
    # that do not fit; then the refused ones.
    order = sorted(range(len(rows)), key=lambda i: (rows[i].error != "", not rows[i].fits,
                                                    rows[i].step_time_s, i))
    rows = [rows[i] for i in order]
    if measure:
        rows = _measure(base, rows, args if real_args is None else tuple(real_args),
                        measure_steps, progress)
    return tuple(rows)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _batch_size(graph: OpGraph) -> int:
    for t in graph.tensors_with_role(Role.BATCH):
        if t.shape:
            return int(t.shape[0])
    raise ValueError("compare needs a batch argument with a leading batch dimension")


def _check_measurable(cluster: Cluster, args) -> None:
    # The local devices' shape: a calibrated cluster may describe devices DEVICES lacks.
    local = Cluster.local(allow_unknown=True)
    if not cluster.can_run_on(local):
        raise ValueError(f"measuring runs the plans on the local devices ({local.name}), but "
                         f"the plans are for {cluster.name!r}; compare for the local cluster "
                         "(or a calibrated one: alpa-lite calibrate) to measure")
    if not all(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree_util.tree_leaves(args)):
        raise ValueError("measuring needs real arrays, but the arguments are not all arrays "
                         "(e.g. jax.ShapeDtypeStructs); pass real_args=")


def _measure(base: ParallelizedStep, rows: list[CompareRow], args: tuple, steps: int,
             progress: Progress | None) -> list[CompareRow]:
    out = []
    total = sum(1 for r in rows if r.plan is not None and r.fits)
    measured = 0
    for row in rows:
        if row.plan is None or not row.fits:
            out.append(row)
            continue
        report(progress, MEASURE, measured, total)
        measured += 1
        step = base.with_plan(row.plan)
        # Placed once where the plan wants them, as in a training loop (each step's results
        # are the next step's arguments): the timed calls move no arguments.
        placed = jax.device_put(args, step.input_shardings(*args))
        jax.block_until_ready(step(*placed))        # compiles
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(*placed))
            times.append(time.perf_counter() - t0)
        out.append(dataclasses.replace(row, measured_step_s=statistics.median(times)))
    report(progress, MEASURE, total, total)
    return out
