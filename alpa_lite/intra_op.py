"""Intra-operator planning: the sharding ILP of one stage on one logical mesh.

`plan_stage(graph, mesh, cluster, pins, ...)` builds Alpa's intra-op problem from the graph,
hands it to `alpa_lite.solvers.sharding_ilp` and turns the solution into a `StagePlan`.

The problem is kept small the way Alpa does it, made systematic:
- *Units*: every input tensor and every operator gets a list of `Strategy`s (its operand and
  result specs, its compute time, the collectives it implies), enumerated from its
  `op_rules.DimLabels`.
- *Groups*: only heavy units (matmuls, convolutions, gathers, scatters, parameters, inputs
  read more than once) own an ILP variable. A light unit follows one neighbour: an
  element-wise op, reduction, reshape or broadcast follows its largest operand; a unit with
  no tensor operand to follow (iota, a literal broadcast, an input read once) follows its
  only consumer. For each strategy of its group, a follower takes its own strategy that is
  cheapest given its neighbour's spec, and the cost of any reshard this forces is charged to
  the group. Node cost of a group strategy = compute + collectives of all its members.
- *Edges*: a tensor flowing between two groups carries the resharding cost matrix between
  the producer's result spec and the consumer's operand spec; a result tied to an input
  (new params -> params) carries the per-step cost of resharding it back.
- *Memory*: per-device bytes of the tensors live at the peak of the unsharded program
  (inputs always count), which is linear in the choice and so an ILP constraint.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import numpy as np

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.collectives import CollectiveKind
from alpa_lite.cost_models.compute import compute_time
from alpa_lite.errors import PlanningError
from alpa_lite.graph import Node, OpGraph, Role, Tensor
from alpa_lite.op_rules import DimLabels, dim_labels, enumerate_assignments
from alpa_lite.plan import CollectiveSummary, StagePlan
from alpa_lite.sharding import (CollectiveOp, CommModel, LogicalMesh, TensorSpec, itemsize,
                                reshard_collectives)
from alpa_lite.solvers.sharding_ilp import (ILPEdge, ILPNode, InfeasibleMemoryError,
                                            ShardingProblem, Solver, solve_sharding_ilp)

# Host-to-device copy bandwidth for the batch: PCIe 4.0 x16 moves ~25 GB/s in practice
# (32 GB/s raw; PCI-SIG PCIe 4.0 base specification, 16 GT/s x 16 lanes, 128b/130b).
HOST_TO_DEVICE_BYTES_PER_S = 25e9

_HEAVY = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add",
                    "scatter_add", "scatter"})
_MATMUL = frozenset({"dot_general", "conv_general_dilated"})
_BROADCASTS = frozenset({"broadcast_in_dim", "iota"})


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to shard a unit: its operand and result specs and what it costs."""
    in_specs: tuple[TensorSpec | None, ...]
    out_specs: tuple[TensorSpec, ...]
    compute_s: float
    collectives: tuple[CollectiveOp, ...] = ()
    work_shards: int = 1

    @property
    def comm_s(self) -> float:
        return sum(c.time_s for c in self.collectives)

    @functools.cached_property
    def cost_s(self) -> float:
        return self.compute_s + self.comm_s

    def describe(self) -> str:
        ins = ",".join("." if s is None else str(s) for s in self.in_specs)
        outs = ",".join(str(s) for s in self.out_specs)
        extra = "".join(f" +{c.kind.value}({','.join(c.axes)})" for c in self.collectives)
        return f"{ins} -> {outs}{extra}" if self.in_specs else f"{outs}{extra}"


# A pin restricts the strategies of an input tensor: called with the tensor and a candidate
# spec, it says whether the spec is allowed.
InputPin = Callable[[Tensor, TensorSpec], bool]
# A node pin restricts the strategies of an operator the same way (if it admits none of
# them, the operator keeps all: a pin is a preference of the method, not a constraint the
# shapes can always meet).
NodePin = Callable[[Node, Strategy], bool]


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


class _Units:
    """Strategies for every input tensor (unit id = position in graph.inputs, or a
    constant's) and every node (unit id = offset + node id)."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, cluster: Cluster, comm: CommModel,
                 pin: InputPin | None, node_pin: NodePin | None = None):
        self.graph = graph
        self.mesh = mesh
        self.cluster = cluster
        self.comm = comm
        self.axes = [(n, mesh.axis_size(n)) for n in mesh.sharded_axes()]
        self.source_tensors = [t.id for t in graph.tensors if graph.producer(t.id) is None]
        self.unit_of_source = {t: i for i, t in enumerate(self.source_tensors)}
        self.offset = len(self.source_tensors)
        self.unsharded: set[str] = set()
        self.strategies: list[list[Strategy]] = []
        for tid in self.source_tensors:
            self.strategies.append(self._input_strategies(graph.tensors[tid], pin))
        # Repeated layers repeat their operators: enumerate each distinct operator once and
        # share the list (the follow-choice memo below keys on the shared list too).
        by_key: dict[tuple, list[Strategy]] = {}
        filtered: dict[tuple, list[Strategy]] = {}
        for node in graph.nodes:
            key = _structural_key(graph, node)
            if key not in by_key:
                by_key[key] = self._node_strategies(node)
            strategies = by_key[key]
            if node_pin is not None:
                kept = tuple(i for i, st in enumerate(strategies) if node_pin(node, st))
                if kept and len(kept) < len(strategies):
                    fkey = (id(strategies), kept)
                    if fkey not in filtered:
                        filtered[fkey] = [strategies[i] for i in kept]
                    strategies = filtered[fkey]
            self.strategies.append(strategies)

    def producer_unit(self, tid: int) -> int:
        p = self.graph.producer(tid)
        return self.unit_of_source[tid] if p is None else self.offset + p

    def out_index(self, unit: int, tid: int) -> int:
        if unit < self.offset:
            return 0
        return self.graph.nodes[unit - self.offset].outputs.index(tid)

    def _input_strategies(self, t: Tensor, pin: InputPin | None) -> list[Strategy]:
        if t.role is Role.CONST or not t.shape:
            return [Strategy((), (TensorSpec.replicated(len(t.shape)),), 0.0)]
        labels = tuple(range(len(t.shape)))
        dl = DimLabels((labels,), (labels,), dict(zip(labels, t.shape)))
        out = []
        for assign in enumerate_assignments(dl, self.axes):
            spec = TensorSpec(tuple(assign.get(l, ()) for l in labels))
            if pin is None or pin(t, spec):
                # A new batch is copied from the host every step: each device loads its
                # shard. Parameters and optimizer state stay on the devices.
                load = (t.nbytes / spec.num_shards(self.mesh) / HOST_TO_DEVICE_BYTES_PER_S
                        if t.role is Role.BATCH else 0.0)
                out.append(Strategy((), (spec,), load, (), spec.num_shards(self.mesh)))
        if not out:
            raise PlanningError(
                f"input {t.name} {t.shape} has no allowed sharding on mesh "
                f"{dict(zip(self.mesh.axis_names, self.mesh.shape))}: the required split does "
                "not divide its dimensions; choose a mesh whose axes divide it")
        return out

    def _node_strategies(self, node: Node) -> list[Strategy]:
        g = self.graph
        in_shapes = [None if t is None else g.tensors[t].shape for t in node.inputs]
        outs = [g.tensors[t] for t in node.outputs]
        labels = dim_labels(node.primitive, node.params, in_shapes, [o.shape for o in outs])
        dtype = outs[0].dtype if outs else "float32"
        is_mm = node.primitive in _MATMUL
        if labels is None:
            if node.primitive not in ("copy", "copy_p") and any(len(o.shape) for o in outs):
                self.unsharded.add(node.primitive)
            in_specs = tuple(None if s is None else TensorSpec.replicated(len(s))
                             for s in in_shapes)
            return [Strategy(in_specs, tuple(TensorSpec.replicated(len(o.shape)) for o in outs),
                             compute_time(node.flops, node.bytes_accessed,
                                          self.cluster.device, dtype, is_mm))]
        result = []
        for assign in enumerate_assignments(labels, self.axes):
            in_specs = []
            for s, lab in zip(in_shapes, labels.operands):
                if s is None:
                    in_specs.append(None)
                elif lab is None:
                    in_specs.append(TensorSpec.replicated(len(s)))
                else:
                    in_specs.append(TensorSpec(tuple(assign.get(l, ()) for l in lab)))
            out_specs = tuple(TensorSpec(tuple(assign.get(l, ()) for l in lab))
                              for lab in labels.outputs)
            shards = math.prod(self.mesh.axis_size(a) for v in assign.values() for a in v)
            partial = [a for l, v in assign.items() if l in labels.reduced for a in v]
            colls = []
            # XLA combines partial sums one reduced dimension at a time: a dimension split
            # over (x, y) is one all-reduce over both, two split dimensions are two.
            reduced_groups = [v for l, v in sorted(assign.items()) if l in labels.reduced]
            for o, spec in zip(outs, out_specs):
                nbytes = o.size * itemsize(o.dtype) / spec.num_shards(self.mesh)
                for group in reduced_groups if nbytes else ():
                    colls.append(self.comm.op(CollectiveKind.ALL_REDUCE, nbytes, group))
            compute = compute_time(node.flops / shards, node.bytes_accessed / shards,
                                   self.cluster.device, dtype, is_mm)
            result.append(Strategy(tuple(in_specs), out_specs, compute, tuple(colls), shards))
            # On CPU, XLA has no reduce-scatter (it all-reduces and slices, and rewrites that
            # its own way), and the plain all-reduce followed by a free slice costs the
            # same, so split-result variants are only offered on accelerators.
            if partial and len(outs) == 1 and self.cluster.platform != "cpu":
                result.extend(self._scattered_variants(outs[0], tuple(in_specs), out_specs[0],
                                                       reduced_groups, compute, shards))
        return result

    def _scattered_variants(self, out: Tensor, in_specs, out_spec: TensorSpec,
                            reduced_groups: list[tuple[str, ...]], compute: float, shards: int
                            ) -> list[Strategy]:
        """Partial sums reduced straight into a split result (ZeRO's gradient sync).

        Over the axis the result is split on, the sum is a reduce-scatter; sums over the
        other partial axes run after it, on the smaller split result (the order XLA uses).
        """
        variants = []
        whole = out.size * itemsize(out.dtype) / out_spec.num_shards(self.mesh)
        for axis in [a for group in reduced_groups for a in group]:
            n = self.mesh.axis_size(axis)
            rest = [tuple(a for a in group if a != axis) for group in reduced_groups]
            for d, dim_axes in enumerate(out_spec.dims):
                if dim_axes or out.shape[d] % n:
                    continue
                spec = TensorSpec(tuple((axis,) if i == d else a
                                        for i, a in enumerate(out_spec.dims)))
                colls = [self.comm.op(CollectiveKind.REDUCE_SCATTER, whole / n, [axis])]
                colls += [self.comm.op(CollectiveKind.ALL_REDUCE, whole / n, group)
                          for group in rest if group]
                variants.append(Strategy(in_specs, (spec,), compute, tuple(colls), shards))
        return variants


def _structural_key(graph: OpGraph, node: Node) -> tuple:
    """Two nodes with equal keys have equal strategies (same primitive, parameters,
    operand and result types, work)."""
    params = []
    for k, v in sorted(node.params.items()):
        params.append((k, v if isinstance(v, (int, float, str, bool, type(None))) else
                       id(v) if hasattr(v, "eqns") or hasattr(v, "jaxpr") else repr(v)))
    ins = tuple(None if t is None else (graph.tensors[t].shape, graph.tensors[t].dtype)
                for t in node.inputs)
    outs = tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in node.outputs)
    return (node.primitive, ins, outs, tuple(params), node.flops, node.bytes_accessed)


def _reshard_cost(units: _Units, t: Tensor, src: TensorSpec, dst: TensorSpec | None,
                  cache: dict) -> float:
    if dst is None or src == dst:
        return 0.0
    key = (t.shape, t.dtype, src, dst)
    if key not in cache:
        cache[key] = sum(c.time_s for c in reshard_collectives(t.shape, t.dtype, src, dst,
                                                               units.comm))
    return cache[key]


@dataclasses.dataclass
class _Group:
    leader: int
    members: list[int]
    # choice[member][s] = the member's strategy index under group strategy s
    choice: dict[int, list[int]]
    cost: np.ndarray      # per group strategy, seconds


def _follow_targets(graph: OpGraph, units: _Units) -> dict[int, tuple[str, int, int]]:
    """For each light unit, whom it follows: ("fwd", producer unit, operand pos) or
    ("bwd", consumer unit, operand pos of the consumer that reads it)."""
    follow: dict[int, tuple[str, int, int]] = {}
    off = units.offset
    source_like: set[int] = set()
    # Inputs read by exactly one node (not parameters) follow that node.
    for tid, u in units.unit_of_source.items():
        t = graph.tensors[tid]
        cons = graph.consumers(tid)
        if t.role in (Role.BATCH, Role.OPT_STATE) and len(cons) == 1 \
                and len(units.strategies[u]) > 1:
            source_like.add(u)
    for node in graph.nodes:
        u = off + node.id
        if node.primitive in _HEAVY or len(units.strategies[u]) == 1:
            continue
        best = None
        for pos, tid in enumerate(node.inputs):
            if tid is None or units.strategies[u][0].in_specs[pos] is None:
                continue
            pu = units.producer_unit(tid)
            if pu in source_like:
                continue
            # Follow real data over a broadcast of something smaller: an element-wise op
            # of an activation and a broadcast scalar should take the activation's spec.
            prod = graph.producer(tid)
            broadcast = prod is not None and graph.nodes[prod].primitive in _BROADCASTS
            key = (not broadcast, graph.tensors[tid].size)
            if best is None or key > best[0]:
                best = (key, pu, pos)
        if best is not None:
            follow[u] = ("fwd", best[1], best[2])
        else:
            source_like.add(u)
    # Source-like units follow their only consumer, if they have exactly one.
    for u in sorted(source_like, reverse=True):
        outs = [units.source_tensors[u]] if u < off else list(graph.nodes[u - off].outputs)
        readers = [(c, pos) for tid in outs for c in graph.consumers(tid)
                   for pos, x in enumerate(graph.nodes[c].inputs) if x == tid]
        readers = list(dict.fromkeys(readers))
        if len(readers) == 1 and len(outs) == 1:
            follow[u] = ("bwd", off + readers[0][0], readers[0][1])
    return follow


def _build_groups(graph: OpGraph, units: _Units, follow, cache) -> tuple[list[_Group], dict[int, int]]:
    off = units.offset
    group_of: dict[int, int] = {}
    groups: list[_Group] = []
    n_units = len(units.strategies)
    for u in range(n_units):
        if u not in follow:
            group_of[u] = len(groups)
            n = len(units.strategies[u])
            groups.append(_Group(u, [u], {u: list(range(n))},
                                 np.array([s.cost_s for s in units.strategies[u]])))

    def attach(u: int, target: int, pick) -> None:
        g = groups[group_of[target]]
        choice = []
        for s in range(len(g.cost)):
            idx, extra = pick(g.choice[target][s])
            choice.append(idx)
            g.cost[s] += units.strategies[u][idx].cost_s + extra
        g.members.append(u)
        g.choice[u] = choice
        group_of[u] = group_of[target]

    def resolved(target: int) -> bool:
        return target in group_of

    shared_memo: dict[tuple, tuple[int, float]] = {}

    # Forward followers in program order, then backward followers from the end; a chain
    # whose target is not resolved yet is retried, and anything left becomes a leader.
    pending = sorted(follow)
    for _ in range(4):
        progress, rest = False, []
        fwd = [u for u in pending if follow[u][0] == "fwd"]
        bwd = sorted((u for u in pending if follow[u][0] == "bwd"), reverse=True)
        for u in fwd + bwd:
            kind, target, pos = follow[u]
            if not resolved(target):
                rest.append(u)
                continue
            if kind == "fwd":
                tid = graph.nodes[u - off].inputs[pos]
                t = graph.tensors[tid]
                k = units.out_index(target, tid)
                memo: dict[int, tuple[int, float]] = {}

                def pick(ts, u=u, t=t, k=k, target=target, pos=pos, memo=memo):
                    if ts not in memo:
                        src = units.strategies[target][ts].out_specs[k]
                        key = ("fwd", id(units.strategies[u]), pos, src, t.shape, t.dtype)
                        if key not in shared_memo:
                            shared_memo[key] = _follow_choice(
                                units.strategies[u], lambda st: st.in_specs[pos], src,
                                lambda st: _reshard_cost(units, t, src, st.in_specs[pos], cache))
                        memo[ts] = shared_memo[key]
                    return memo[ts]
            else:
                node = graph.nodes[target - off]
                tid = node.inputs[pos]
                t = graph.tensors[tid]
                k = units.out_index(u, tid)
                memo = {}

                def pick(ts, u=u, t=t, k=k, target=target, pos=pos, memo=memo):
                    if ts not in memo:
                        dst = units.strategies[target][ts].in_specs[pos]
                        key = ("bwd", id(units.strategies[u]), k, dst, t.shape, t.dtype)
                        if key not in shared_memo:
                            shared_memo[key] = _follow_choice(
                                units.strategies[u], lambda st: st.out_specs[k], dst,
                                lambda st: _reshard_cost(units, t, st.out_specs[k], dst, cache))
                        memo[ts] = shared_memo[key]
                    return memo[ts]
            attach(u, target, pick)
            progress = True
        pending = rest
        if not pending or not progress:
            break
    for u in pending:
        group_of[u] = len(groups)
        n = len(units.strategies[u])
        groups.append(_Group(u, [u], {u: list(range(n))},
                             np.array([s.cost_s for s in units.strategies[u]])))
        follow.pop(u)
    return groups, group_of


def _follow_choice(strategies: Sequence[Strategy], spec_of: Callable[[Strategy], TensorSpec],
                   target: TensorSpec | None, reshard: Callable[[Strategy], float]
                   ) -> tuple[int, float]:
    """A follower's strategy given its neighbour's spec on the link between them.

    It takes the neighbour's spec as it is when it can (the least extra splitting among
    those, then the cheapest); only when no strategy matches does it take the one with the
    least own cost + reshard cost. Copying the spec, rather than picking the locally
    cheapest, keeps a group's strategies the leader's: a follower that split further just
    because slicing is free would push reshards onto edges it cannot see.
    """
    exact = [i for i, st in enumerate(strategies) if spec_of(st) == target]
    if exact:
        best = min(exact, key=lambda i: (strategies[i].work_shards,
                                         round(strategies[i].cost_s, 15), i))
        return best, 0.0
    best, best_key, best_extra = 0, None, 0.0
    for i, st in enumerate(strategies):
        extra = reshard(st)
        key = (round(st.cost_s + extra, 15), st.work_shards, i)
        if best_key is None or key < best_key:
            best, best_key, best_extra = i, key, extra
    return best, best_extra


def _live_at_peak(graph: OpGraph) -> set[int]:
    """The tensors live where the unsharded program holds the most bytes."""
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
    return best_set


def plan_stage(graph: OpGraph, mesh: LogicalMesh, cluster: Cluster, *,
               pin: InputPin | None = None, node_pin: NodePin | None = None,
               memory_budget_bytes: float | None = None,
               solver: Solver = Solver.HIGHS, time_limit_s: float = 60.0,
               tensor_names: dict[int, str] | None = None,
               tie_repeated: bool = True) -> StageResult:
    """Solves the intra-op sharding problem of `graph` on `mesh`.

    Args:
      graph: the traced program.
      mesh: the logical mesh (device block and axis names).
      cluster: for compute and collective costs.
      pin: restricts the specs of input tensors (Manual and DataParallel plans).
      node_pin: restricts the strategies of operators (Manual plans).
      memory_budget_bytes: per-device limit, or None.
      solver, time_limit_s: for the ILP.
      tensor_names: readable names for the sharding table (default: tensor names).
      tie_repeated: give structurally identical groups (the same operator in each of a
        model's repeated layers) one shared choice; see `_repeated_group_classes`.

    Returns:
      The `StageResult`, whose `stage` is ready for the runtime.

    Raises:
      PlanningError: no strategy choice fits `memory_budget_bytes` (the message says the
        smallest peak memory any choice reaches) or a pin admits no sharding.
    """
    t0 = time.perf_counter()
    comm = CommModel(cluster, mesh)
    units = _Units(graph, mesh, cluster, comm, pin, node_pin)
    cache: dict = {}
    follow = _follow_targets(graph, units)
    groups, group_of = _build_groups(graph, units, follow, cache)
    off = units.offset

    # Memory per group strategy: per-device bytes of its members' tensors live at the peak.
    live = _live_at_peak(graph)
    for g in groups:
        g.memory = np.zeros(len(g.cost))
        for u in g.members:
            outs = [units.source_tensors[u]] if u < off else graph.nodes[u - off].outputs
            for k, tid in enumerate(outs):
                if tid not in live:
                    continue
                t = graph.tensors[tid]
                for s in range(len(g.cost)):
                    spec = units.strategies[u][g.choice[u][s]].out_specs[k]
                    g.memory[s] += t.size * itemsize(t.dtype) / spec.num_shards(mesh)

    # Edges: every tensor read that is not a follow link.
    edges: dict[tuple[int, int], np.ndarray] = {}

    # Repeated layers repeat their edges: spec columns and cost matrices are memoised on
    # interned tuples, so each distinct edge is costed once.
    for g in groups:
        g.choice = {u: tuple(c) for u, c in g.choice.items()}
    interned: dict[tuple, tuple] = {}
    columns: dict[tuple, tuple] = {}

    def column(u: int, g: _Group, side: str, k: int) -> tuple:
        key = (id(units.strategies[u]), g.choice[u], side, k)
        if key not in columns:
            strategies = units.strategies[u]
            col = tuple((strategies[i].out_specs[k] if side == "out" else strategies[i].in_specs[k])
                        for i in g.choice[u])
            columns[key] = interned.setdefault(col, col)
        return columns[key]

    matrices: dict[tuple, np.ndarray | None] = {}

    def cost_matrix(t: Tensor, src: tuple, dst: tuple) -> np.ndarray | None:
        key = (id(src), id(dst), t.shape, t.dtype)
        if key not in matrices:
            src_idx = {sp: i for i, sp in enumerate(dict.fromkeys(src))}
            dst_idx = {sp: i for i, sp in enumerate(dict.fromkeys(dst))}
            small = np.array([[_reshard_cost(units, t, a, b, cache) for b in dst_idx]
                              for a in src_idx])
            matrices[key] = small[np.ix_([src_idx[x] for x in src], [dst_idx[x] for x in dst])] \
                if small.any() else None
        return matrices[key]

    def add_edge(pu: int, k: int, t: Tensor, cu: int, side: str, pos: int) -> None:
        gp, gc = groups[group_of[pu]], groups[group_of[cu]]
        src = column(pu, gp, "out", k)
        dst = column(cu, gc, side, pos)
        if gp is gc:
            for s_, (a, b) in enumerate(zip(src, dst)):
                gp.cost[s_] += _reshard_cost(units, t, a, b, cache)
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

    cls = _repeated_group_classes(graph, units, groups, edges) if tie_repeated \
        else list(range(len(groups)))
    problem = _tied_problem(graph, units, groups, edges, cls, memory_budget_bytes)
    build_s = time.perf_counter() - t0
    try:
        tied = solve_sharding_ilp(problem, solver=solver, time_limit_s=time_limit_s)
        sol = dataclasses.replace(tied, choices=tuple(tied.choices[c] for c in cls))
    except InfeasibleMemoryError as e:
        raise PlanningError(
            f"no sharding on mesh {mesh.shape} fits the memory budget of "
            f"{e.budget_bytes / 2**30:.2f} GiB per device: the smallest peak memory any plan "
            f"reaches is {e.min_memory_bytes / 2**30:.2f} GiB. Use more devices, a smaller "
            "batch, or raise the budget") from None
    stage = _assemble(graph, units, groups, group_of, sol.choices, mesh, cluster, cache,
                      tensor_names)
    return StageResult(stage=stage, objective_s=sol.objective_s,
                       unsharded_primitives=tuple(sorted(units.unsharded)),
                       nodes_before_merge=len(units.strategies), nodes_after_merge=len(groups),
                       ilp_nodes=len(problem.nodes),
                       ilp_variables=sol.num_variables, ilp_constraints=sol.num_constraints,
                       build_s=build_s, solve_s=sol.solve_time_s)


def _group_signature(graph: OpGraph, units: _Units, g: _Group) -> tuple:
    sig = []
    for u in g.members:
        if u < units.offset:
            t = graph.tensors[units.source_tensors[u]]
            sig.append((t.shape, t.dtype, t.role.value,
                        tuple(st.out_specs for st in units.strategies[u])))
        else:
            sig.append(id(units.strategies[u]))
    return (tuple(sig), tuple(g.choice[u] for u in g.members))


def _repeated_group_classes(graph: OpGraph, units: _Units, groups: list[_Group],
                            edges: dict[tuple[int, int], np.ndarray], rounds: int = 4
                            ) -> list[int]:
    """Classes of groups that play the same part in repeated layers.

    A model's repeated blocks (transformer layers, residual blocks) yield groups with the
    same operators, strategies and costs. Refining "same members" by the classes of each
    group's neighbours for a few rounds (colour refinement, as in the Weisfeiler-Lehman
    test) separates the first and last blocks, which touch the embedding or the loss, from
    the interior ones. Groups of one class then share one ILP choice: every interior layer
    gets the same sharding, as in every hand-written plan, and the ILP shrinks by the layer
    count. Groups whose costs differ never share a class.
    """
    colour: list = []
    for g in groups:
        colour.append(hash((_group_signature(graph, units, g), g.cost.tobytes(),
                            g.memory.tobytes())))
    nbrs: list[list[tuple]] = [[] for _ in groups]
    for (a, b), m in edges.items():
        h = hash(m.tobytes())
        nbrs[a].append(("out", b, h))
        nbrs[b].append(("in", a, h))
    for _ in range(rounds):
        colour = [hash((colour[i], tuple(sorted((d, colour[j], h) for d, j, h in nbrs[i]))))
                  for i in range(len(groups))]
    first: dict = {}
    classes = []
    for i, c in enumerate(colour):
        classes.append(first.setdefault(c, len(first)))
    return classes


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
        nodes=tuple(ILPNode(name=_unit_name(graph, units, leader[c]),
                            costs=tuple(float(x) for x in cost[c]),
                            memory=tuple(float(x) for x in memory[c])) for c in range(n)),
        edges=tuple(ILPEdge(a, b, m) for (a, b), m in sorted(tied.items())),
        memory_budget_bytes=memory_budget_bytes)


def _unit_name(graph: OpGraph, units: _Units, u: int) -> str:
    if u < units.offset:
        return graph.tensors[units.source_tensors[u]].name
    return graph.nodes[u - units.offset].name


def _assemble(graph, units, groups, group_of, choices, mesh, cluster, cache, names) -> StagePlan:
    off = units.offset
    chosen: list[Strategy] = []
    for u in range(len(units.strategies)):
        g = groups[group_of[u]]
        chosen.append(units.strategies[u][g.choice[u][choices[group_of[u]]]])

    def spec_of(tid: int) -> TensorSpec:
        u = units.producer_unit(tid)
        return chosen[u].out_specs[units.out_index(u, tid)]

    colls: list[CollectiveOp] = []
    compute = 0.0
    for st in chosen:
        colls.extend(st.collectives)
        compute += st.compute_s
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
    input_specs = tuple(spec_of(t) for t in graph.inputs)
    output_specs = []
    for out_pos, tid in enumerate(graph.outputs):
        tie = graph.output_ties[out_pos]
        spec = spec_of(tid)
        if tie is not None:
            t = graph.tensors[tid]
            colls.extend(reshard_collectives(t.shape, t.dtype, spec, input_specs[tie], units.comm))
            spec = input_specs[tie]
        output_specs.append(spec)
    tensor_specs = tuple((t, spec_of(t)) for node in graph.nodes for t in node.outputs)

    summary: dict[tuple, list] = {}
    for c in colls:
        key = (c.kind.value, c.axes, c.nbytes)
        entry = summary.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += c.time_s
    collectives = tuple(CollectiveSummary(k, tuple(a), n, cnt, t)
                        for (k, a, n), (cnt, t) in sorted(summary.items()))
    comm_s = float(sum(c.time_s for c in colls))

    names = names or {}
    table = []
    for tid in graph.inputs:
        table.append((names.get(tid, graph.tensors[tid].name), spec_of(tid)))
    for node in graph.nodes:
        if node.primitive in _HEAVY:
            for tid in node.outputs:
                table.append((f"{node.name}{'@' + node.scope if node.scope else ''}",
                              spec_of(tid)))
    live = _live_at_peak(graph)
    peak = sum(graph.tensors[t].size * itemsize(graph.tensors[t].dtype)
               / spec_of(t).num_shards(mesh) for t in live)
    first = mesh.device_offset
    return StagePlan(
        devices=tuple(range(first, first + mesh.num_devices)), mesh_shape=mesh.shape,
        axis_names=mesh.axis_names, shardings=tuple(table), collectives=collectives,
        compute_s=compute, comm_s=comm_s, total_s=compute + comm_s, peak_memory_bytes=peak,
        input_specs=input_specs, output_specs=tuple(output_specs), tensor_specs=tensor_specs,
        operand_specs=tuple(operand_specs))
