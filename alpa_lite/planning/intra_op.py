"""Intra-operator planning: the sharding ILP of one stage on one logical mesh.

`plan_stage(graph, mesh, cluster, options)` builds Alpa's intra-op problem from the graph,
hands it to `alpa_lite.solvers.sharding_ilp` and turns the solution into a `StagePlan`:

- strategies of every unit (`alpa_lite.planning.strategies`), merged into groups of followers
  (`alpa_lite.planning.grouping`), node cost of a group strategy = compute + collectives of all its
  members;
- edges: a tensor flowing between two groups carries the resharding cost matrix between the
  producer's result spec and the consumer's operand spec; a result tied to an input (new
  params -> params) carries the per-step cost of resharding it back;
- memory: per-device bytes of the tensors live at the peak of the unsharded program (inputs
  always count), which is linear in the choice and so an ILP constraint;
- repeated layers: groups of one class (see `grouping.repeated_group_classes`) share one
  variable, so the ILP is about one layer's size whatever the depth.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import numpy as np

from alpa_lite.cost_models.cluster import Cluster, CollectiveKind
from alpa_lite.errors import MemoryBudgetError, PlanningError
from alpa_lite.ir.graph import OpGraph, Role, Tensor, per_graph
from alpa_lite.plan import CollectiveSummary, StagePlan
from alpa_lite.plan.sharding import (
    CollectiveOp,
    CommModel,
    LogicalMesh,
    TensorSpec,
    itemsize,
    reshard_collectives,
)
from alpa_lite.planning.grouping import Group, build_groups, follow_targets, repeated_group_classes
from alpa_lite.planning.memory import stage_memory
from alpa_lite.planning.strategies import (
    HEAVY,
    InputPin,
    NodePin,
    Strategy,
    Units,
    reshard_cost,
    unit_name,
)
from alpa_lite.solvers.sharding_ilp import (
    ILPEdge,
    ILPNode,
    InfeasibleMemoryError,
    ShardingProblem,
    Solver,
    solve_sharding_ilp,
)


@dataclasses.dataclass
class MeshMemo:
    """What `plan_stage` calls on one logical mesh shape and cluster can share: the
    strategies of structurally equal operators and the cost of each resharding. The
    pipeline planner plans every layer on every mesh; its layers repeat operators and
    tensors, so most of a layer's build is found here after the first."""
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster_fingerprint: str
    strategies: dict = dataclasses.field(default_factory=dict)
    reshard: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def for_mesh(cls, mesh: LogicalMesh, cluster: Cluster) -> "MeshMemo":
        return cls(tuple(mesh.shape), tuple(mesh.axis_names), cluster.fingerprint())

    def check(self, mesh: LogicalMesh, cluster: Cluster) -> None:
        if (tuple(mesh.shape), tuple(mesh.axis_names), cluster.fingerprint()) != \
                (self.mesh_shape, self.axis_names, self.cluster_fingerprint):
            raise ValueError(f"a MeshMemo for mesh {self.mesh_shape} {self.axis_names} was "
                             f"used on mesh {mesh.shape} {mesh.axis_names} or another "
                             "cluster: make one per mesh shape and cluster")


@dataclasses.dataclass(frozen=True)
class StageResult:
    stage: StagePlan
    objective_s: float
    unsharded_primitives: tuple[str, ...]
    nodes_before_merge: int
    nodes_after_merge: int
    ilp_nodes: int
    ilp_variables: int
    ilp_constraints: int
    build_s: float
    solve_s: float
    # The ILP's memory model (per device, bytes live at the unsharded program's peak): the
    # chosen plan's, and the least any plan reaches (memory is a sum over choices, so this
    # is exact).
    memory_bytes: float = 0.0
    min_memory_bytes: float = 0.0
    # The collectives of `stage.collectives`, per graph node that runs them (an operand's
    # reshard counts at its reader); node -1 holds the reshards of tied outputs.
    node_collectives: tuple[tuple[int, tuple[CollectiveOp, ...]], ...] = ()
    # Per graph node (by id), the compute time of its chosen strategy.
    node_compute_s: tuple[float, ...] = ()


@per_graph
def _live_at_peak(graph: OpGraph) -> frozenset[int]:
    """The tensors live where the unsharded program holds the most bytes (once per graph:
    it does not depend on the mesh)."""
    last_use = {}
    for node in graph.nodes:
        for t in node.inputs:
            if t is not None:
                last_use[t] = node.id
    end = len(graph.nodes)
    for t in graph.outputs:
        last_use[t] = end
    persistent = {t.id for t in graph.tensors if graph.producer(t.id) is None}
    for t in persistent:
        last_use[t] = end
    live = set(persistent)
    nbytes = {t.id: t.size * itemsize(t.dtype) for t in graph.tensors}
    cur = sum(nbytes[t] for t in live)
    best, best_set = cur, set(live)
    for node in graph.nodes:
        for t in node.outputs:
            live.add(t)
            cur += nbytes[t]
        if cur > best:
            best, best_set = cur, set(live)
        for t in set(x for x in node.inputs if x is not None) | set(node.outputs):
            if last_use.get(t, node.id) <= node.id and t in live and t not in persistent:
                live.discard(t)
                cur -= nbytes[t]
    return frozenset(best_set)


@dataclasses.dataclass(frozen=True)
class AmortizedReductions:
    """Gradient reductions a stage runs once per step, not per micro-batch: it accumulates
    its gradients per replica over `axes` (`planning.gradient_sync`). In the objective the
    all-reduces over those axes at `nodes` (the operators that form a parameter gradient)
    weigh `weight` (1/m) of their time, so that the layout is not chosen to avoid m
    reductions that run once; the plan's own costs stay what each collective takes."""
    nodes: frozenset[int]
    axes: tuple[str, ...]
    weight: float


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """How a stage's intra-op problem is built and solved.

    Attributes:
      pin: restricts the specs of input tensors (Manual and DataParallel plans).
      node_pin: restricts the strategies of operators (Manual plans).
      solver, time_limit_s: for the ILP.
      tensor_names: readable names for the sharding table (default: tensor names).
      tie_repeated: give structurally identical groups (the same operator in each of a
        model's repeated layers) one shared choice; see `repeated_group_classes`.
      param_memory_factor: bytes counted per parameter byte in the memory model (e.g. 4 for
        a parameter, its gradient and Adam's two moments, which live as long as it does).
      amortized: gradient reductions that run once per step (`AmortizedReductions`).
    """
    pin: InputPin | None = None
    node_pin: NodePin | None = None
    solver: Solver = Solver.HIGHS
    time_limit_s: float = 60.0
    tensor_names: Mapping[int, str] | None = None
    tie_repeated: bool = True
    param_memory_factor: float = 1.0
    amortized: AmortizedReductions | None = None


def plan_stage(graph: OpGraph, mesh: LogicalMesh, cluster: Cluster,
               options: StageOptions = StageOptions(),
               memory_budget_bytes: float | None = None,
               memo: "MeshMemo | None" = None) -> "StageResult":
    """Solves the intra-op sharding problem of `graph` on `mesh` within
    `memory_budget_bytes` per device (None: no limit): `build_stage`, then solve.

    Returns:
      The `StageResult`, whose `stage` is ready for the runtime.

    Raises:
      PlanningError: no strategy choice fits `memory_budget_bytes` (the message says the
        smallest peak memory any choice reaches) or a pin admits no sharding.
    """
    return build_stage(graph, mesh, cluster, options, memo).solve(memory_budget_bytes)


def build_stage(graph: OpGraph, mesh: LogicalMesh, cluster: Cluster,
                options: StageOptions = StageOptions(),
                memo: "MeshMemo | None" = None) -> "BuiltStage":
    """Builds the intra-op sharding problem of `graph` on `mesh`, to solve under one or
    several memory budgets (`BuiltStage.solve`).

    Args:
      graph: the traced program.
      mesh: the logical mesh (device block and axis names).
      cluster: for compute and collective costs.
      options: pins, solver and memory model (`StageOptions`).
      memo: work shared with other graphs planned on the same mesh shape and cluster.

    Raises:
      PlanningError: a pin admits no sharding.
    """
    t0 = time.perf_counter()
    pin, node_pin, param_memory_factor = (options.pin, options.node_pin,
                                          options.param_memory_factor)
    comm = CommModel(cluster, mesh)
    if memo is not None:
        memo.check(mesh, cluster)
    units = Units(graph, mesh, cluster, comm, pin, node_pin,
                  memo.strategies if memo is not None else None)
    cache: dict = memo.reshard if memo is not None else {}
    follow = follow_targets(graph, units)
    groups, group_of = build_groups(graph, units, follow, cache)
    off = units.offset
    if options.amortized is not None:
        _amortize(groups, units, options.amortized)

    # Memory per group strategy: per-device bytes of its members' tensors live at the peak.
    live = _live_at_peak(graph)
    # Bytes per device of a unit's k-th result under each of its strategies, by strategy
    # list (repeated layers share them).
    shard_bytes: dict[tuple, np.ndarray] = {}
    for g in groups:
        g.memory = np.zeros(len(g.cost))
        for u in g.members:
            outs = [units.source_tensors[u]] if u < off else graph.nodes[u - off].outputs
            for k, tid in enumerate(outs):
                if tid not in live:
                    continue
                t = graph.tensors[tid]
                factor = param_memory_factor if t.role is Role.PARAM else 1.0
                key = (id(units.strategies[u]), k, factor * t.size * itemsize(t.dtype))
                if key not in shard_bytes:
                    shard_bytes[key] = np.array([key[2] / st.out_specs[k].num_shards(mesh)
                                                 for st in units.strategies[u]])
                g.memory += shard_bytes[key][g.choice[u]]

    # Edges: every tensor read that is not a follow link.
    edges: dict[tuple[int, int], np.ndarray] = {}

    # Repeated layers repeat their edges: spec columns and cost matrices are memoised on
    # interned tuples, so each distinct edge is costed once.
    for g in groups:
        g.choice = {u: tuple(c) for u, c in g.choice.items()}
    interned: dict[tuple, tuple] = {}
    columns: dict[tuple, tuple] = {}

    def column(u: int, g: Group, side: str, k: int) -> tuple:
        key = (id(units.strategies[u]), g.choice[u], side, k)
        if key not in columns:
            strategies = units.strategies[u]
            col = tuple((strategies[i].out_specs[k] if side == "out" else strategies[i].in_specs[k])
                        for i in g.choice[u])
            columns[key] = interned.setdefault(col, col)
        return columns[key]

    matrices: dict[tuple, np.ndarray | None] = {}
    inside: dict[tuple, np.ndarray] = {}     # the same for a link inside one group

    def cost_matrix(t: Tensor, src: tuple, dst: tuple) -> np.ndarray | None:
        key = (id(src), id(dst), t.shape, t.dtype)
        if key not in matrices:
            src_idx = {sp: i for i, sp in enumerate(dict.fromkeys(src))}
            dst_idx = {sp: i for i, sp in enumerate(dict.fromkeys(dst))}
            small = np.array([[reshard_cost(units, t, a, b, cache) for b in dst_idx]
                              for a in src_idx])
            matrices[key] = small[np.ix_([src_idx[x] for x in src], [dst_idx[x] for x in dst])] \
                if small.any() else None
        return matrices[key]

    def add_edge(pu: int, k: int, t: Tensor, cu: int, side: str, pos: int) -> None:
        gp, gc = groups[group_of[pu]], groups[group_of[cu]]
        src = column(pu, gp, "out", k)
        dst = column(cu, gc, side, pos)
        if gp is gc:
            key = (id(src), id(dst), t.shape, t.dtype)
            if key not in inside:
                inside[key] = np.array([reshard_cost(units, t, a, b, cache)
                                        for a, b in zip(src, dst)])
            gp.cost += inside[key]
            return
        m = cost_matrix(t, src, dst)
        if m is not None:
            key = (group_of[pu], group_of[cu])
            edges[key] = edges.get(key, 0) + m

    for node in graph.nodes:
        cu = off + node.id
        for pos, tid in enumerate(node.inputs):
            if tid is None:
                continue
            pu = units.producer_unit(tid)
            f = follow.get(cu)
            if f is not None and f[0] == "fwd" and f[1] == pu and f[2] == pos:
                continue
            f = follow.get(pu)
            if f is not None and f[0] == "bwd" and f[1] == cu and f[2] == pos:
                continue
            add_edge(pu, units.out_index(pu, tid), graph.tensors[tid], cu, "in", pos)
    for out_pos, in_pos in enumerate(graph.output_ties):
        if in_pos is None:
            continue
        tid = graph.outputs[out_pos]
        iu = units.unit_of_source[graph.inputs[in_pos]]
        pu = units.producer_unit(tid)
        add_edge(pu, units.out_index(pu, tid), graph.tensors[tid], iu, "out", 0)

    cls = repeated_group_classes(graph, units, groups, edges) if options.tie_repeated \
        else list(range(len(groups)))
    problem = _tied_problem(graph, units, groups, edges, cls, None)
    return BuiltStage(graph, mesh, cluster, units, groups, group_of, cls, problem, cache,
                      dict(options.tensor_names or {}), options.solver, options.time_limit_s,
                      time.perf_counter() - t0, edges)


@dataclasses.dataclass(eq=False)
class BuiltStage:
    """A stage's intra-op problem, built once and solvable under several memory budgets."""
    graph: OpGraph
    mesh: LogicalMesh
    cluster: Cluster
    units: Units
    groups: list
    group_of: list
    cls: list
    problem: ShardingProblem
    cache: dict
    tensor_names: dict | None
    solver: Solver
    time_limit_s: float
    build_s: float
    edges: dict = dataclasses.field(default_factory=dict)   # (group, group) -> cost matrix

    def restricted(self, pin: InputPin) -> "BuiltStage":
        """This problem with the inputs' strategies limited to those `pin` allows, with no
        second build: what `build_stage` with `pin` in its options builds.

        A pin changes no group: an input leads its own (only a batch or optimizer-state
        input read once follows its reader, and a pin must leave those whole), and a unit
        that follows an input picks its strategy per strategy of the input. So the pinned
        problem is this one with the rows of the disallowed input strategies removed from
        each group, its edges cut to match. Groups of one repeated class share one choice;
        they keep the rows every member allows.

        Raises:
          PlanningError: `pin` allows no strategy of some input.
          ValueError: `pin` restricts an input that follows another unit.
        """
        t0 = time.perf_counter()
        units, graph, off = self.units, self.graph, self.units.offset
        rows_of_class: dict[int, np.ndarray] = {}
        for i, g in enumerate(self.groups):
            rows = np.ones(len(g.cost), dtype=bool)
            for u in g.members:
                if u >= off:
                    continue
                t = graph.tensors[units.source_tensors[u]]
                allowed = [pin(t, st.out_specs[0]) for st in units.strategies[u]]
                if all(allowed):
                    continue
                if not any(allowed):
                    raise PlanningError(
                        f"input {t.name} {t.shape} has no allowed sharding on mesh "
                        f"{dict(zip(self.mesh.axis_names, self.mesh.shape))}")
                if u != g.leader:
                    raise ValueError(f"the pin restricts input {t.name}, which follows another "
                                     "unit: build the problem with the pin instead")
                rows &= np.array([allowed[k] for k in g.choice[u]], dtype=bool)
            c = self.cls[i]
            rows_of_class[c] = rows if c not in rows_of_class else rows_of_class[c] & rows
        for c, rows in rows_of_class.items():
            if not rows.any():
                leader = self.groups[self.cls.index(c)].leader
                raise PlanningError(f"{unit_name(graph, units, leader)} has no strategy left on "
                                    f"mesh {self.mesh.shape} under the pin")
        keep = [np.flatnonzero(rows_of_class[self.cls[i]]) for i in range(len(self.groups))]
        groups = []
        for g, k in zip(self.groups, keep):
            ng = Group(g.leader, g.members,
                       {u: tuple(c[j] for j in k) for u, c in g.choice.items()}, g.cost[k])
            ng.memory = g.memory[k]
            groups.append(ng)
        edges = {(a, b): m[np.ix_(keep[a], keep[b])] for (a, b), m in self.edges.items()}
        problem = _tied_problem(graph, units, groups, edges, self.cls, None)
        return dataclasses.replace(self, groups=groups, problem=problem, edges=edges,
                                   build_s=time.perf_counter() - t0)

    @property
    def min_memory_bytes(self) -> float:
        """The least per-device memory any plan reaches (memory adds up over choices)."""
        return float(sum(min(n.memory) for n in self.problem.nodes if n.memory))

    def solve(self, memory_budget_bytes: float | None = None) -> StageResult:
        """The cheapest plan within `memory_budget_bytes` (None: no limit).

        Raises:
          PlanningError: no plan fits the budget.
        """
        problem = dataclasses.replace(self.problem, memory_budget_bytes=memory_budget_bytes)
        mesh, cls = self.mesh, self.cls
        try:
            tied = solve_sharding_ilp(problem, solver=self.solver,
                                      time_limit_s=self.time_limit_s)
            sol = dataclasses.replace(tied, choices=tuple(tied.choices[c] for c in cls))
        except InfeasibleMemoryError as e:
            raise MemoryBudgetError(
                f"no sharding on mesh {mesh.shape} fits the memory budget of "
                f"{e.budget_bytes / 2**30:.2f} GiB per device: the smallest peak memory any "
                f"plan reaches is {e.min_memory_bytes / 2**30:.2f} GiB. Use more devices, a "
                "smaller batch, or raise the budget", e.min_memory_bytes) from None
        stage, by_node, node_compute = _assemble(self, sol.choices)
        units = self.units
        return StageResult(stage=stage, objective_s=sol.objective_s,
                           unsharded_primitives=tuple(sorted(units.unsharded)),
                           nodes_before_merge=len(units.strategies),
                           nodes_after_merge=len(self.groups), ilp_nodes=len(problem.nodes),
                           ilp_variables=sol.num_variables,
                           ilp_constraints=sol.num_constraints, build_s=self.build_s,
                           solve_s=sol.solve_time_s, memory_bytes=sol.memory_bytes,
                           min_memory_bytes=self.min_memory_bytes,
                           node_collectives=tuple(sorted(by_node.items())),
                           node_compute_s=node_compute)


def _amortize(groups: list[Group], units: Units, amortized: AmortizedReductions) -> None:
    """Each group's cost with the all-reduces of `amortized` at its members charged at
    `amortized.weight` of their time (new cost arrays: the memo's are shared)."""
    axes, off = set(amortized.axes), units.offset
    by_list: dict[int, np.ndarray] = {}     # repeated layers share strategy lists
    for g in groups:
        for u in g.members:
            if u < off or u - off not in amortized.nodes:
                continue
            strategies = units.strategies[u]
            if id(strategies) not in by_list:
                by_list[id(strategies)] = np.array([
                    sum(c.time_s for c in st.collectives
                        if c.kind is CollectiveKind.ALL_REDUCE and set(c.axes) <= axes)
                    for st in strategies])
            saved = by_list[id(strategies)]
            if saved.any():
                g.cost = g.cost - (1.0 - amortized.weight) * saved[np.asarray(g.choice[u])]


def _tied_problem(graph, units, groups, edges, cls, memory_budget_bytes) -> ShardingProblem:
    """The ILP over group classes: costs and memory add up over a class's members; an edge
    inside a class is charged on the diagonal (both ends make the same choice)."""
    n = max(cls) + 1 if cls else 0
    cost: list = [None] * n
    memory: list = [None] * n
    leader = [0] * n
    for i, g in enumerate(groups):
        c = cls[i]
        if cost[c] is None:
            cost[c], memory[c], leader[c] = g.cost.copy(), g.memory.copy(), g.leader
        else:
            cost[c] += g.cost
            memory[c] += g.memory
    tied: dict[tuple[int, int], np.ndarray] = {}
    for (a, b), m in edges.items():
        ca, cb = cls[a], cls[b]
        if ca == cb:
            cost[ca] = cost[ca] + np.diagonal(m)
        elif ca < cb:
            tied[(ca, cb)] = tied.get((ca, cb), 0) + m
        else:
            tied[(cb, ca)] = tied.get((cb, ca), 0) + m.T
    return ShardingProblem(
        nodes=tuple(ILPNode(name=unit_name(graph, units, leader[c]),
                            costs=tuple(float(x) for x in cost[c]),
                            memory=tuple(float(x) for x in memory[c])) for c in range(n)),
        edges=tuple(ILPEdge(a, b, m) for (a, b), m in sorted(tied.items())),
        memory_budget_bytes=memory_budget_bytes)


def collective_summaries(colls) -> tuple[CollectiveSummary, ...]:
    """Collectives grouped by kind, axes and size, as a plan lists them."""
    summary: dict[tuple, list] = {}
    for c in colls:
        key = (c.kind.value, c.axes, c.nbytes)
        entry = summary.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += c.time_s
    return tuple(CollectiveSummary(k, tuple(a), n, cnt, t)
                 for (k, a, n), (cnt, t) in sorted(summary.items()))


def _assemble(built: "BuiltStage", choices
              ) -> tuple[StagePlan, dict[int, tuple[CollectiveOp, ...]], tuple[float, ...]]:
    """The stage plan of one solution, the collectives it runs per graph node, and each
    node's compute time."""
    graph, units, groups, group_of = built.graph, built.units, built.groups, built.group_of
    mesh, names = built.mesh, built.tensor_names
    off = units.offset
    chosen: list[Strategy] = []
    for u in range(len(units.strategies)):
        g = groups[group_of[u]]
        chosen.append(units.strategies[u][g.choice[u][choices[group_of[u]]]])

    def spec_of(tid: int) -> TensorSpec:
        u = units.producer_unit(tid)
        return chosen[u].out_specs[units.out_index(u, tid)]

    colls: list[CollectiveOp] = []
    by_node: dict[int, list[CollectiveOp]] = {}
    compute = 0.0
    for u, st in enumerate(chosen):
        colls.extend(st.collectives)
        compute += st.compute_s
        if st.collectives and u >= off:
            by_node.setdefault(u - off, []).extend(st.collectives)
    operand_specs = []
    done: set[tuple] = set()
    for node in graph.nodes:
        st = chosen[off + node.id]
        for pos, tid in enumerate(node.inputs):
            if tid is None or st.in_specs[pos] is None:
                continue
            src, dst = spec_of(tid), st.in_specs[pos]
            if src != dst:
                operand_specs.append((node.id, pos, dst))
                t = graph.tensors[tid]
                # XLA runs a collective on a value once, however many reshards of it need
                # it (gathering x for a replicated and for a batch-split reader is one
                # all-gather). The ILP charges each reader; the plan reports what runs.
                for c in reshard_collectives(t.shape, t.dtype, src, dst, units.comm):
                    key = (tid, c.kind, c.axes, c.nbytes)
                    if key not in done:
                        done.add(key)
                        colls.append(c)
                        by_node.setdefault(node.id, []).append(c)
    input_specs = tuple(spec_of(t) for t in graph.inputs)
    output_specs = []
    for out_pos, tid in enumerate(graph.outputs):
        tie = graph.output_ties[out_pos]
        spec = spec_of(tid)
        if tie is not None:
            t = graph.tensors[tid]
            tied = reshard_collectives(t.shape, t.dtype, spec, input_specs[tie], units.comm)
            colls.extend(tied)
            by_node.setdefault(-1, []).extend(tied)
            spec = input_specs[tie]
        output_specs.append(spec)
    tensor_specs = tuple((t, spec_of(t)) for node in graph.nodes for t in node.outputs)

    collectives = collective_summaries(colls)
    comm_s = float(sum(c.time_s for c in colls))

    names = names or {}
    table = []
    for tid in graph.inputs:
        table.append((names.get(tid, graph.tensors[tid].name), spec_of(tid)))
    for node in graph.nodes:
        if node.primitive in HEAVY:
            for tid in node.outputs:
                table.append((f"{node.name}{'@' + node.scope if node.scope else ''}",
                              spec_of(tid)))
    # The whole-stage estimate (planning.memory), not the ILP's linear model.
    memory = stage_memory(graph, mesh, input_specs, output_specs, tensor_specs,
                          operand_specs)
    first = mesh.device_offset
    stage = StagePlan(
        devices=tuple(range(first, first + mesh.num_devices)), mesh_shape=mesh.shape,
        axis_names=mesh.axis_names, shardings=tuple(table), collectives=collectives,
        compute_s=compute, comm_s=comm_s, total_s=compute + comm_s,
        peak_memory_bytes=memory.total,
        input_specs=input_specs, output_specs=tuple(output_specs), tensor_specs=tensor_specs,
        operand_specs=tuple(operand_specs), memory=memory)
    node_compute = tuple(chosen[off + n].compute_s for n in range(len(graph.nodes)))
    return stage, {n: tuple(c) for n, c in by_node.items()}, node_compute
