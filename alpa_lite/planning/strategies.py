"""Sharding strategies: every way to split each input tensor and each operator.

A *unit* is an input tensor or an operator of the graph. `Units` enumerates, for each unit on
one logical mesh, its `Strategy`s: operand and result specs (from the operator's
`op_rules.DimLabels`), its compute time (roofline over the split work) and the collectives it
implies (all-reduce of partial sums; reduce-scatter variants).

Compute is priced per kernel as XLA runs it (`planning.fusion`): an element-wise equation
moves its share of its fused kernel's memory traffic, not all its operands and results, and
each fused kernel pays the device's per-kernel overhead once. A batch
input's strategies also pay for copying the batch from the host. Operators repeated across
layers are enumerated once and share one list.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Hashable

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.collectives import CollectiveKind
from alpa_lite.cost_models.compute import compute_time
from alpa_lite.cost_models.devices import DeviceSpec
from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import Node, OpGraph, Role, Tensor, per_graph
from alpa_lite.ir.op_rules import DimLabels, dim_labels, enumerate_assignments
from alpa_lite.plan.sharding import (
    CollectiveOp,
    CommModel,
    LogicalMesh,
    TensorSpec,
    itemsize,
    reshard_collectives,
)
from alpa_lite.planning.fusion import FusionResult, fuse, is_standalone

# Host-to-device copy bandwidth for the batch: PCIe 4.0 x16 moves ~25 GB/s in practice
# (32 GB/s raw; PCI-SIG PCIe 4.0 base specification, 16 GT/s x 16 lanes, 128b/130b).
HOST_TO_DEVICE_BYTES_PER_S = 25e9

# Operators that own an ILP variable; the rest follow a neighbour (alpa_lite.planning.grouping).
HEAVY = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add",
                   "scatter_add", "scatter"})
MATMUL = frozenset({"dot_general", "conv_general_dilated"})
BROADCASTS = frozenset({"broadcast_in_dim", "iota"})


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


@dataclasses.dataclass(frozen=True)
class NodePin:
    """Restricts the strategies of operators, as `InputPin` does inputs' (if it admits none
    of an operator's, the operator keeps all: a pin is a preference of the method, not a
    constraint the shapes can always meet).

    Attributes:
      allows: whether the operator may take the strategy.
      signature: what of the operator `allows` reads besides the strategy: two operators
        with equal signatures and one shared strategy list keep the same strategies, so
        repeated layers are filtered once.
    """
    allows: Callable[[Node, Strategy], bool]
    signature: Callable[[Node], Hashable]


class Units:
    """Strategies for every input tensor (unit id = position in graph.inputs, or a
    constant's) and every node (unit id = offset + node id)."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, cluster: Cluster, comm: CommModel,
                 pin: InputPin | None, node_pin: NodePin | None = None,
                 memo: dict | None = None):
        """`memo`: strategies by structural key, shared by every graph planned on the same
        mesh shape and cluster (the pipeline planner's layers); None for a private one."""
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
        # XLA:GPU runs row-wise normalizations (softmax, layer norm) as one kernel; XLA:CPU
        # ends a fusion at each reduction (`planning.fusion.fuse`).
        self.fusion = fuse(graph, row_reductions_fuse=cluster.platform != "cpu")
        for tid in self.source_tensors:
            self.strategies.append(self._input_strategies(graph.tensors[tid], pin))
        # Repeated layers repeat their operators: enumerate each distinct operator once and
        # share the list (the follow-choice memo below keys on the shared list too).
        by_key: dict[tuple, tuple[list[Strategy], str | None]] = {} if memo is None else memo
        filtered: dict[tuple, list[Strategy]] = {}     # by strategy list and signature
        # The fused traffic depends on the node's neighbours, so it is part of the key.
        fused = self.fusion
        for node, skey in zip(graph.nodes, structural_keys(graph)):
            key = (skey, fused.bytes_accessed[node.id], fused.kernels[node.id])
            if key not in by_key:
                by_key[key] = self._node_strategies(node)
            strategies, unsharded = by_key[key]
            if unsharded is not None:
                self.unsharded.add(unsharded)
            if node_pin is not None:
                fkey = (id(strategies), node_pin.signature(node))
                if fkey not in filtered:
                    kept = [st for st in strategies if node_pin.allows(node, st)]
                    filtered[fkey] = kept if kept and len(kept) < len(strategies) \
                        else strategies
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

    def _node_strategies(self, node: Node) -> tuple[list[Strategy], str | None]:
        """The node's strategies, and its primitive if it has no sharding rule."""
        g = self.graph
        in_shapes = [None if t is None else g.tensors[t].shape for t in node.inputs]
        outs = [g.tensors[t] for t in node.outputs]
        labels = dim_labels(node.primitive, node.params, in_shapes, [o.shape for o in outs])
        dtype = outs[0].dtype if outs else "float32"
        if labels is None:
            unsharded = node.primitive if (node.primitive not in ("copy", "copy_p") and
                                           any(len(o.shape) for o in outs)) else None
            in_specs = tuple(None if s is None else TensorSpec.replicated(len(s))
                             for s in in_shapes)
            return [Strategy(in_specs, tuple(TensorSpec.replicated(len(o.shape)) for o in outs),
                             node_compute_time(node, self.fusion, self.cluster.device,
                                               dtype))], unsharded
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
                out_bytes = o.size * itemsize(o.dtype) / spec.num_shards(self.mesh)
                for group in reduced_groups if out_bytes else ():
                    colls.append(self.comm.op(CollectiveKind.ALL_REDUCE, out_bytes, group))
            compute = node_compute_time(node, self.fusion, self.cluster.device, dtype,
                                        shards)
            result.append(Strategy(tuple(in_specs), out_specs, compute, tuple(colls), shards))
            # On CPU, XLA has no reduce-scatter (it all-reduces and slices, and rewrites that
            # its own way), and the plain all-reduce followed by a free slice costs the
            # same, so split-result variants are only offered on accelerators.
            if partial and len(outs) == 1 and self.cluster.platform != "cpu":
                result.extend(self._scattered_variants(outs[0], tuple(in_specs), out_specs[0],
                                                       reduced_groups, compute, shards))
        return result, None

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


def node_compute_time(node: Node, fusion: FusionResult, device: DeviceSpec, dtype: str,
                      shards: int = 1) -> float:
    """One operator's compute time on one device, its work split `shards` ways, priced as
    XLA runs it: its share of its fused kernel's memory traffic, the kernels it starts,
    and no work of its own for a broadcast or iota inside its consumers' kernels (index
    arithmetic there; its bytes where it is written out)."""
    flops = 0.0 if fusion.duplicated[node.id] else node.flops
    # A library call (matmul, gather, sort, ...) is one kernel; element-wise work pays for
    # the fused kernels it starts.
    kernels = 1 if is_standalone(node) else fusion.kernels[node.id]
    return compute_time(flops / shards, fusion.bytes_accessed[node.id] / shards, device, dtype,
                        node.primitive in MATMUL, kernels)


@per_graph
def structural_keys(graph: OpGraph) -> tuple[tuple, ...]:
    """`structural_key` of every node, by node id (once per graph: the planners build its
    strategies on every mesh)."""
    return tuple(structural_key(graph, node) for node in graph.nodes)


def structural_key(graph: OpGraph, node: Node) -> tuple:
    """Two nodes with equal keys have equal strategies (same primitive, parameters,
    operand and result types, work)."""
    # A sub-program enters by its printed text, not its object: each traced layer brings
    # its own jaxpr for the same body (jax.nn.relu's custom_jvp call in every layer of a
    # pipeline's pieces), and keyed by object, repeated layers stopped sharing strategies,
    # and with them their ILP choice (`grouping.repeated_group_classes`).
    params = []
    for k, v in sorted(node.params.items()):
        params.append((k, v if isinstance(v, (int, float, str, bool, type(None))) else
                       str(v) if hasattr(v, "eqns") or hasattr(v, "jaxpr") else repr(v)))
    ins = tuple(None if t is None else (graph.tensors[t].shape, graph.tensors[t].dtype)
                for t in node.inputs)
    outs = tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in node.outputs)
    return (node.primitive, ins, outs, tuple(params), node.flops, node.bytes_accessed)


def reshard_cost(units: Units, t: Tensor, src: TensorSpec, dst: TensorSpec | None,
                  cache: dict) -> float:
    if dst is None or src is dst:
        return 0.0
    # Keyed on the specs' dims (plain tuples): an ILP build asks this hundreds of thousands
    # of times, and tuples hash and compare in C where the dataclass's methods are Python.
    key = (t.shape, t.dtype, src.dims, dst.dims)
    cost = cache.get(key)
    if cost is None:
        cost = 0.0 if src.dims == dst.dims else sum(
            c.time_s for c in reshard_collectives(t.shape, t.dtype, src, dst, units.comm))
        cache[key] = cost
    return cost


def unit_name(graph: OpGraph, units: Units, u: int) -> str:
    if u < units.offset:
        return graph.tensors[units.source_tensors[u]].name
    return graph.nodes[u - units.offset].name


