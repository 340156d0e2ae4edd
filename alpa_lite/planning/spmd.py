"""From a traced step, a method and a cluster to a `Plan`.

`make_plan(traced, method, cluster)` turns the user's method into a search space and runs
the intra-op ILP over it:

- `Auto`: every 2-D logical mesh shape over the devices (mesh (1, N) and (N, 1) are the same
  problem, so only one is solved); the cheapest estimated step wins.
- `Manual(dp, tp)`: mesh (dp, tp). The batch is split over dp, weights are replicated over
  dp, and over tp each weight gets the Megatron split found by `megatron_weight_dims`; the
  ILP then places everything else, so manual plans are costed exactly like auto plans.
- `DataParallel`: `Manual(dp=N, tp=1)`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.errors import MemoryBudgetError, PlanningError
from alpa_lite.ir.batch import batch_dims, batch_size
from alpa_lite.ir.graph import OpGraph, Role, Tensor
from alpa_lite.ir.op_rules import node_labels
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.plan import Alternative, Explanation, Plan, PlanningStats
from alpa_lite.plan.methods import Auto, DataParallel, Manual, Method, SolverChoice
from alpa_lite.plan.memory import format_bytes
from alpa_lite.plan.sharding import LogicalMesh, TensorSpec
from alpa_lite.planning.gradient_sync import single_stage_sync
from alpa_lite.planning.intra_op import StageOptions, StageResult, build_stage, plan_stage
from alpa_lite.planning.memory import memory_floor, solve_within_memory
from alpa_lite.planning.step_time import single_stage_step_time
from alpa_lite.planning.strategies import NodePin
from alpa_lite.planning.workers import map_forked
from alpa_lite.progress import ILPS, Progress, report
from alpa_lite.solvers.sharding_ilp import Solver

_VIEW_OPS = frozenset({"convert_element_type", "copy", "copy_p", "transpose",
                       "broadcast_in_dim", "reduce_precision"})


def solver_for(choice: SolverChoice) -> Solver:
    return Solver.CBC if choice is SolverChoice.CBC else Solver.HIGHS


def auto_mesh_shapes(num_devices: int) -> tuple[tuple[int, int], ...]:
    """Every 2-D factorisation (a, b) of the device count; (1, N) stands for (N, 1) too."""
    shapes = [(a, num_devices // a) for a in range(1, num_devices + 1) if num_devices % a == 0]
    return tuple(s for s in shapes if s != (num_devices, 1) or num_devices == 1)


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """Per parameter, the dimension split over tp (None: whole); and per matmul that reads a
    parameter (through casts or transposes), that operand's dims mapped to the param's."""
    weight_dims: dict[int, int | None]
    weight_reads: tuple[tuple[int, int, int, tuple[int | None, ...]], ...]  # node, pos, param, dim map

    def operand_spec(self, param: int, dmap: tuple[int | None, ...]) -> TensorSpec:
        pdim = self.weight_dims.get(param)
        return TensorSpec(tuple(("tp",) if pdim is not None and d == pdim else ()
                                for d in dmap))


def megatron_weight_dims(graph: OpGraph, tp: int) -> MegatronLayout:
    """Which dimension of each parameter Megatron-LM splits over the tensor-parallel axis.

    Walks the forward pass tracking which dimension of each activation is split. A matmul
    whose activation operand is whole splits its weight's output features (column parallel:
    its result is split on those features); one whose activation is split on the contracted
    dimension splits the weight's input features (row parallel: its result is a partial sum,
    whole after the all-reduce). Attention follows: the fused QKV projection is
    column-split, the head reshape carries the split to the heads, the two attention
    matmuls keep it, and the output projection is row-split. A bias or scale added to a
    split activation is split the same way. Returns param tensor id -> dim (None: whole).
    """
    split: dict[int, int | None] = {}          # tensor id -> split dim or None
    view: dict[int, tuple[int, tuple[int | None, ...]]] = {}   # tensor -> (param, dim map)
    assigned: dict[int, int | None] = {}
    reads: list[tuple[int, int, int, tuple[int | None, ...]]] = []
    for t in graph.tensors:
        if t.role is Role.PARAM:
            view[t.id] = (t.id, tuple(range(len(t.shape))))

    def assign(param: int, pdim: int | None) -> None:
        if param in assigned:
            return
        if pdim is not None and graph.tensors[param].shape[pdim] % tp:
            pdim = None
        assigned[param] = pdim

    for node, labels in zip(graph.nodes, node_labels(graph)):
        if labels is None:
            continue
        # Views of parameters (casts, transposes, broadcasts) keep pointing at the param.
        if node.primitive in _VIEW_OPS and node.inputs[0] in view and labels.operands[0]:
            param, dmap = view[node.inputs[0]]
            lab_in, lab_out = labels.operands[0], labels.outputs[0]
            out_map = tuple(dmap[lab_in.index(l)] if l in lab_in else None for l in lab_out)
            view[node.outputs[0]] = (param, out_map)
        # The split label carried by the activation operands.
        act_labels = []
        for pos, t in enumerate(node.inputs):
            if t is None or t in view or labels.operands[pos] is None:
                continue
            d = split.get(t)
            if d is not None:
                act_labels.append(labels.operands[pos][d])
        carried = act_labels[0] if act_labels else None
        params_here = [(pos, t) for pos, t in enumerate(node.inputs)
                       if t is not None and t in view and labels.operands[pos] is not None]
        if node.primitive == "dot_general" and params_here:
            pos, t = params_here[0]
            param, dmap = view[t]
            reads.append((node.id, pos, param, dmap))
            plab = labels.operands[pos]
            out_labels = set(labels.outputs[0])
            if carried is None:
                free = [d for d, l in enumerate(plab) if l in out_labels
                        and not any(l in (labels.operands[q] or ())
                                    for q in range(len(node.inputs)) if q != pos)]
                if free and param not in assigned:
                    assign(param, dmap[free[-1]])
                pd = assigned.get(param)
                if pd is not None and pd in dmap:
                    carried = plab[dmap.index(pd)]
            elif carried in plab and carried not in out_labels:
                assign(param, dmap[plab.index(carried)])
            else:
                assign(param, None)
        elif params_here and carried is not None:
            for pos, t in params_here:
                param, dmap = view[t]
                plab = labels.operands[pos]
                if carried in plab and dmap[plab.index(carried)] is not None:
                    assign(param, dmap[plab.index(carried)])
        for k, t in enumerate(node.outputs):
            lab = labels.outputs[k]
            ok = carried is not None and carried in lab and carried not in labels.fixed \
                and labels.sizes[carried] % tp == 0
            split[t] = lab.index(carried) if ok else None
    for t in graph.tensors:
        if t.role is Role.PARAM:
            assigned.setdefault(t.id, None)
    return MegatronLayout(assigned, tuple(reads))


def manual_pins(graph: OpGraph, dp: int, tp: int, zero: bool,
                 seeds: Mapping[int, int | None] | None = None, split_batch: bool = False):
    """Input and operator pins of a Manual(dp, tp) plan. With `split_batch` (DataParallel)
    every value that carries the batch keeps it split over dp: without it the ILP may
    gather the batch and compute replicated, which skips the gradient all-reduce on slow
    links but is not data parallelism."""
    layout = megatron_weight_dims(graph, tp)
    weight_dims = layout.weight_dims if tp > 1 else {}
    read_spec = {(n, pos): layout.operand_spec(param, dmap) if tp > 1
                 else TensorSpec.replicated(len(dmap))
                 for n, pos, param, dmap in layout.weight_reads}

    # Data parallelism splits the batch dimension and nothing else: dp may only split the
    # dimension that carries the batch; a tensor without one (weights, their gradients,
    # the optimizer update) is whole over dp, except under ZeRO, where it may split.
    bdims = batch_dims(graph, seeds)

    def signature(node) -> tuple:
        return (tuple(read_spec.get((node.id, pos)) for pos in range(len(node.inputs))),
                tuple(bdims.get(t) for t in node.outputs))

    def allows(node, strategy) -> bool:
        # Matmuls read their weights as stored: no weight is resharded in the forward or
        # backward pass, as in Megatron-LM.
        for pos in range(len(node.inputs)):
            want = read_spec.get((node.id, pos))
            if want is not None and strategy.in_specs[pos] != want:
                return False
        for t, spec in zip(node.outputs, strategy.out_specs):
            d = spec.dim_of("dp")
            if d is not None and d != bdims.get(t) and not (zero and bdims.get(t) is None):
                return False
            if split_batch and dp > 1 and bdims.get(t) is not None and d != bdims[t]:
                return False
        return True

    def pin(t: Tensor, spec: TensorSpec) -> bool:
        dp_dim = spec.dim_of("dp")
        tp_dim = spec.dim_of("tp")
        if t.role is Role.BATCH:
            return (dp == 1 or dp_dim == bdims.get(t.id)) and tp_dim is None
        if t.role is Role.PARAM:
            return dp_dim is None and tp_dim == weight_dims.get(t.id)
        if t.role is Role.OPT_STATE and zero and dp > 1:
            first = next((d for d, s in enumerate(t.shape)
                          if s % dp == 0 and not (spec.dims[d] and "tp" in spec.dims[d]
                                                  and spec.dims[d][0] == "tp")), None)
            return dp_dim == first
        return dp_dim is None
    return pin, NodePin(allows, signature)


def _check_batch(graph: OpGraph, dp: int) -> None:
    batch_size({t.name: t.shape for t in graph.tensors_with_role(Role.BATCH)})
    for t in graph.tensors_with_role(Role.BATCH):
        if t.shape[0] % dp:
            raise PlanningError(
                f"batch leaf {t.name} has leading dimension {t.shape[0]}, which is not "
                f"divisible by dp={dp}; use a batch size that is a multiple of {dp}")


def _solve_fitting(graph: OpGraph, mesh: LogicalMesh, cluster: Cluster, options: StageOptions,
                   budget: float) -> StageResult:
    """The stage's cheapest plan whose whole-stage memory estimate (`StagePlan.memory`)
    fits `budget` per device: the ILP's budget is tightened until it does
    (`planning.memory.solve_within_memory`); PlanningError where it never does."""
    res, _ = solve_within_memory(build_stage(graph, mesh, cluster, options), budget,
                                 lambda r: r.stage.memory)
    return res


def make_plan(traced: TracedStep, method: Method, cluster: Cluster,
              tensor_names: Mapping[int, str] | None = None,
              progress: Progress | None = None) -> Plan:
    """Plans `traced` for `cluster` with `method`. See the module docstring.

    `progress` is told of each intra-op problem solved (`alpa_lite.progress`)."""
    return plan_with_result(traced, method, cluster, tensor_names, progress)[0]


def plan_with_result(traced: TracedStep, method: Method, cluster: Cluster,
                     tensor_names: Mapping[int, str] | None = None,
                     progress: Progress | None = None) -> tuple[Plan, StageResult]:
    """`make_plan`'s plan and the chosen stage's intra-op result (per-operator costs), for
    a planner that prices another engine running the same operators."""
    graph = traced.graph
    n = cluster.num_devices
    if isinstance(method, DataParallel):
        method_m = Manual(dp=n, tp=1, shard_optimizer_state=method.shard_optimizer_state)
    else:
        method_m = method
    results: list[tuple[LogicalMesh, StageResult]] = []
    options = StageOptions(solver=solver_for(method_m.solver),
                           time_limit_s=method_m.time_limit_s, tensor_names=tensor_names)
    failures: list[PlanningError] = []
    if isinstance(method_m, Manual):
        if method_m.num_devices != n:
            raise ValueError(f"{method!r}: dp x tp = {method_m.num_devices} but the cluster "
                             f"{cluster.name!r} has {n} devices; choose dp and tp whose "
                             f"product is {n}")
        _check_batch(graph, method_m.dp)
        mesh = LogicalMesh((method_m.dp, method_m.tp), ("dp", "tp"))
        pin, node_pin = manual_pins(graph, method_m.dp, method_m.tp,
                                     method_m.shard_optimizer_state,
                                     split_batch=isinstance(method, DataParallel))
        report(progress, ILPS, 0, 1)
        # The layout is the user's; within it the ILP places the rest so that the whole
        # stage fits the device. Where nothing does, the plan is still made (tools such as
        # `compare` rank it as "does not fit" by `peak_memory_bytes`), with a warning.
        manual_options = dataclasses.replace(options, pin=pin, node_pin=node_pin)
        try:
            res = _solve_fitting(graph, mesh, cluster, manual_options,
                                 cluster.device.memory_bytes)
        except PlanningError as e:
            res = plan_stage(graph, mesh, cluster, manual_options)
            warnings.warn(f"{method!r} does not fit cluster {cluster.name!r}: {e}",
                          stacklevel=4)
        results.append((mesh, res))
        report(progress, ILPS, 1, 1)
    elif isinstance(method_m, Auto):
        budget = method_m.memory_budget_bytes or cluster.device.memory_bytes
        floor = memory_floor(graph, n)
        if floor.total > budget:
            # No sharding can fit: say so before building any mesh's ILP.
            raise MemoryBudgetError(
                f"no logical mesh gives a plan that fits {format_bytes(budget)} per device: "
                f"the smallest peak memory any plan reaches is at least {floor.describe()} "
                f"(every tensor split over all {n} devices); pipeline it, use more devices "
                "or a smaller batch", floor.total)
        shapes = method_m.mesh_shapes or auto_mesh_shapes(n)
        for shape in shapes:
            if shape[0] * shape[1] != n:
                raise ValueError(f"Auto(mesh_shapes=...) has {shape}, whose product is not "
                                 f"the {n} devices of cluster {cluster.name!r}")
        # Each mesh's ILP, and, where Auto chooses the meshes, the textbook layouts: data
        # parallelism and Megatron's dp x tp on each mesh. Inside a mesh the ILP charges a
        # gradient all-reduce in full, though the step hides it under the backward where
        # the platform overlaps communication, so a mesh's ILP optimum can lose to them on
        # the whole step (BERT-base on 8xH100 1.06x DataParallel's; GPT-350M at batch 4 on
        # 8xV100 1.03x Manual(dp=4, tp=2)'s). They are independent problems, planned on
        # every core (`planning.workers`).
        layouts = [] if method_m.mesh_shapes is not None else \
            [(n, 1)] + [tuple(s) for s in shapes if s[1] > 1]
        jobs = [(False, tuple(shape)) for shape in shapes] + [(True, dt) for dt in layouts]

        def solve(job):
            textbook, dims = job      # (dp, tp) of a textbook layout, else a mesh shape
            if textbook:
                return _manual_candidate(graph, *dims, cluster, options, budget)
            mesh = LogicalMesh(dims, ("x", "y"))
            return mesh, _solve_fitting(graph, mesh, cluster, options, budget)

        finished = 0

        def tick(i, outcome):
            nonlocal finished
            finished += 1
            report(progress, ILPS, finished, len(jobs))

        report(progress, ILPS, 0, len(jobs))
        for outcome in map_forked(solve, jobs, tick):
            if outcome.error is not None:
                failures.append(outcome.error)
            elif outcome.value is not None:
                results.append(outcome.value)
        if not results:
            msg = "no logical mesh gives a plan that fits: " + " | ".join(map(str, failures))
            peaks = [getattr(e, "peak_bytes", None) for e in failures]
            if failures and None not in peaks:
                raise MemoryBudgetError(msg, min(peaks))
            raise PlanningError(msg)
    else:
        raise TypeError(f"method must be al.Auto(), al.Manual(...) or al.DataParallel(), "
                        f"got {method!r}")
    # Meshes compete on their whole step (gradient sync overlapped where the platform
    # overlaps it), not on the ILP's sum of costs.
    times = {id(r): single_stage_step_time(graph, r, cluster) for _, r in results}
    best_mesh, best = min(results, key=lambda r: (round(times[id(r[1])].total_s, 12),
                                                  r[0].shape))
    if best.unsharded_primitives:
        warnings.warn(f"no sharding rule for {', '.join(best.unsharded_primitives)}: these "
                      "operators run replicated on every device (correct, but not split)",
                      stacklevel=4)
    stats = PlanningStats(
        build_s=sum(r.build_s for _, r in results), solve_s=sum(r.solve_s for _, r in results),
        nodes_before_merge=best.nodes_before_merge, nodes_after_merge=best.nodes_after_merge,
        ilp_nodes=best.ilp_nodes,
        ilp_variables=best.ilp_variables, ilp_constraints=best.ilp_constraints,
        candidates=tuple((_mesh_label(m), times[id(r)].total_s) for m, r in results))
    explanation = None
    if isinstance(method_m, Auto):
        # For `alpa-lite explain`: every mesh tried, with its estimate (the ILP enforced
        # the budget, so a mesh either has a plan that fits or none).
        budget = method_m.memory_budget_bytes or cluster.device.memory_bytes
        alts = [Alternative("mesh", 0, _mesh_label(m), times[id(r)].total_s,
                            r.stage.peak_memory_bytes, r.stage.peak_memory_bytes <= budget,
                            chosen=r is best) for m, r in results]
        alts += [Alternative("mesh", 0, f"mesh {tuple(shape)}: no plan fits", 0.0, 0.0, False)
                 for shape in shapes if tuple(shape) not in {m.shape for m, _ in results}]
        explanation = Explanation(alternatives=tuple(alts))
    return Plan(method=method, cluster_name=cluster.name,
                cluster_fingerprint=cluster.fingerprint(),
                program_fingerprint=traced.fingerprint, input_signature=traced.input_avals,
                stages=(best.stage,), unsharded_primitives=best.unsharded_primitives,
                stats=stats, explanation=explanation,
                gradient_sync=single_stage_sync(graph, best, best_mesh, tensor_names or {}),
                step_time=times[id(best)], notes=traced.notes), best


def _manual_candidate(graph: OpGraph, dp: int, tp: int, cluster: Cluster,
                      options: StageOptions, budget: float):
    """DataParallel (tp = 1) or Manual(dp, tp)'s layout as an Auto candidate: (mesh,
    result), or None where the batch does not split over dp or the plan does not fit."""
    try:
        _check_batch(graph, dp)
        pin, node_pin = manual_pins(graph, dp, tp, False, split_batch=tp == 1)
        mesh = LogicalMesh((dp, tp), ("dp", "tp"))
        return mesh, _solve_fitting(graph, mesh, cluster,
                                    dataclasses.replace(options, pin=pin, node_pin=node_pin),
                                    budget)
    except PlanningError:
        return None


def _mesh_label(mesh: LogicalMesh) -> str:
    if mesh.axis_names != ("dp", "tp"):
        return f"mesh {mesh.shape}"
    if mesh.shape[1] == 1:
        return f"data parallel {mesh.shape}"
    return f"Megatron dp x tp {mesh.shape}"


def replace_stats(plan: Plan, **kw) -> Plan:
    return dataclasses.replace(plan, stats=dataclasses.replace(plan.stats, **kw))
