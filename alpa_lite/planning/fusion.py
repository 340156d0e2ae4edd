"""Fusion: which traced equations XLA runs as one kernel, and what each kernel moves.

The traced graph has one node per jaxpr equation, but XLA does not run one kernel per
equation: it fuses chains of element-wise work into "loop" and "input" fusions, so a
`layer_norm` of ~12 equations reads its input and writes its output once or twice, not
twelve times. `fuse(graph)` groups the nodes the way XLA broadly does and returns, per
node, its share of its group's memory traffic and the element-wise kernels it starts.

The planner prices compute this way (`planning.strategies`): each node's compute time uses
its share of its group's traffic, and each fused kernel pays the device's per-kernel
overhead once, on its first node. On the CPU GPT step it counts 271 element-wise kernels
where the compiled single-device HLO has 286 fusions.

The rules (a simplification of XLA's `InstructionFusion` / `GpuInstructionFusion`, which
fuse a producer into its consumer when the producer is element-wise-like and the fusion
creates no cycle; reductions may absorb producers but end a loop fusion):

- *Own kernels* (`STANDALONE`): matmuls and convolutions (library calls: cuBLAS / oneDNN /
  Eigen), gathers, scatters, sorts, cumulative ops, control flow, collectives, RNG, copies
  of inputs to outputs and any primitive with a sub-program. Each is a group of one that
  reads every operand and writes every result; matmuls keep paying
  `DeviceSpec.op_overhead_s` (`FusionResult.kernels` counts element-wise kernels only).
- *Free duplicates* (`DUPLICABLE`, and anything computed from literals only): broadcasts
  and iotas are re-computed inside each consuming fusion (XLA duplicates them rather than
  materialising the broadcast array), so a consumer reads the broadcast's operand (a bias
  of H elements), not its (B, T, H) result; constant sub-expressions (a causal mask from
  iota and compare) cost nothing.
- *Fusible* (the rest: element-wise, convert, select, reshape, transpose, slice, pad,
  concatenate, reductions): a node joins the group of one of its operands' producers when
  that group is still open and the join creates no cycle between groups. A group closes
  at a reduction: the reduction's consumers start a new kernel (the reduced result must be
  complete first).
- *No cycles*: a node may join group G only if every operand it reads from outside G was
  produced before G's first node. Then every edge between groups runs from a lower first
  node to a higher one, so the groups are acyclic by construction (stricter than XLA,
  which checks reachability; it only ever splits a fusion XLA would make).

- *Cheap producers are re-computed*: a consumer re-does a cheap element-wise producer of
  another group (not in XLA's `IsExpensive` list: no exp, tanh, divide ...) rather than
  read its result, when that reads no more bytes; a softmax's f32 upcast of bf16 scores is
  then never written in f32.

Memory traffic of a group: each distinct tensor it reads that was made outside it (graph
inputs, constants, other groups' results; through a duplicate, that duplicate's operands)
plus each result that leaves it (read by another group, or a graph output). A node is
charged the reads it is the first in its group to make and the results of its own that
leave the group, so a group's nodes sum to its traffic and a sharded node still divides
its share by its shards. Each fusible group with any traffic is one kernel, counted on its
first node.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Callable

from alpa_lite.ir.graph import Node, OpGraph
from alpa_lite.ir.op_rules import CUSTOM_DERIVATIVES
from alpa_lite.ir.tracing import sub_jaxprs
from alpa_lite.plan.sharding import itemsize

__all__ = ["DUPLICABLE", "STANDALONE", "FusionResult", "fuse", "is_standalone"]

STANDALONE = frozenset({
    "dot_general", "conv_general_dilated",
    "gather", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
    "scatter-min", "scatter_min", "scatter-max", "scatter_max", "dynamic_update_slice",
    "sort", "top_k", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "select_and_scatter_add", "select_and_gather_add", "argsort",
    "while", "scan", "cond", "custom_call", "alpa_grad_call",
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
    "reduce_scatter", "all_reduce",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
    "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform", "alpa_batch_bits",
    "copy", "copy_p", "device_put", "optimization_barrier",
    "fft", "cholesky", "triangular_solve", "lu", "qr", "eigh", "eig", "svd",
})
DUPLICABLE = frozenset({"broadcast_in_dim", "iota"})
# Reductions end a loop fusion (their consumers start a new kernel). `reduce_precision` is
# element-wise despite its name.
# XLA's `HloInstruction::IsExpensive` (xla/hlo/ir/hlo_instruction.cc) lists the
# element-wise ops it will not duplicate into several fusions (transcendentals, division,
# power); the rest are cheap to re-compute.
_EXPENSIVE = frozenset({"exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "div",
                        "rem", "pow", "sqrt", "rsqrt", "cbrt", "sin", "cos", "tan", "atan2",
                        "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
                        "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin"})


@dataclasses.dataclass(frozen=True)
class FusionResult:
    """Per node (indexed by node id): its fusion group (the id of the group's first node),
    the memory bytes it is charged, the element-wise kernels it starts (0 or 1), and
    whether it is a free duplicate (a broadcast, an iota or a constant sub-expression that
    XLA re-computes as index arithmetic inside each consumer: no work of its own unless
    it must be written out, which `kernels` then says)."""
    group: tuple[int, ...]
    bytes_accessed: tuple[float, ...]
    kernels: tuple[int, ...]
    duplicated: tuple[bool, ...] = ()

    @property
    def num_kernels(self) -> int:
        """Element-wise (fused) kernels: matmuls and other own-kernel ops not counted."""
        return sum(self.kernels)


_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _body_primitives(node: Node) -> frozenset[str] | None:
    """The primitives a call kept whole only for its derivative rule (`jax.nn.relu`'s
    custom_jvp in a pipeline's pieces) runs, nested calls' included; None for any other
    node. XLA compiles the body inlined, so such a call fuses as its body does."""
    if node.primitive not in CUSTOM_DERIVATIVES:
        return None
    found: set[str] = set()
    pending = sub_jaxprs(node.params)
    while pending:
        for eqn in pending.pop().eqns:
            found.add(eqn.primitive.name)
            pending.extend(sub_jaxprs(eqn.params))
    return frozenset(found)


def is_standalone(node: Node) -> bool:
    # A primitive with a sub-program (a call tracing left in place) is its own kernel(s),
    # unless it is a call kept for its derivative rule around element-wise work only.
    if node.primitive in STANDALONE:
        return True
    if not any(k in node.params for k in _BODY_KEYS):
        return False
    # Loops and branches in the body are in STANDALONE.
    body = _body_primitives(node)
    return not body or bool(body & (STANDALONE | _REDUCTIONS))


def _is_cheap(node: Node) -> bool:
    """Cheap to re-compute in a consumer's fusion: element-wise-like, not expensive, not a
    reduction (whose result needs all of its input)."""
    if node.primitive in CUSTOM_DERIVATIVES:
        # Fused as its body (`is_standalone`), and cheap where every operator of it is.
        body = _body_primitives(node)
        return bool(body) and not body & (_EXPENSIVE | _REDUCTIONS | STANDALONE)
    return (node.primitive not in _EXPENSIVE and node.primitive not in _REDUCTIONS
            and not is_standalone(node))


def _is_row_reduction(graph: OpGraph, node: Node) -> bool:
    """A reduction over the last dimension of its operand only (a softmax's max and sum, a
    layer norm's mean and variance)."""
    operand = graph.tensors[node.inputs[0]] if node.inputs and node.inputs[0] is not None \
        else None
    axes = tuple(node.params.get("axes", ()))
    return operand is not None and len(operand.shape) >= 1 and axes == (len(operand.shape) - 1,)


# Fusion results by graph: a graph is planned on several meshes (and its layers on many),
# and its fusion does not depend on the mesh.
_FUSED: "weakref.WeakKeyDictionary[OpGraph, dict[bool, FusionResult]]" = \
    weakref.WeakKeyDictionary()


def fuse(graph: OpGraph, row_reductions_fuse: bool = False) -> FusionResult:
    """Groups `graph`'s nodes into kernels (`_fuse`), once per graph and flag."""
    by_flag = _FUSED.setdefault(graph, {})
    if row_reductions_fuse not in by_flag:
        by_flag[row_reductions_fuse] = _fuse(graph, row_reductions_fuse)
    return by_flag[row_reductions_fuse]


def _fuse(graph: OpGraph, row_reductions_fuse: bool = False) -> FusionResult:
    """Groups `graph`'s nodes into kernels and prices each node's share (module docstring).

    Args:
      graph: a traced graph (topologically ordered, as `OpGraph` guarantees).
      row_reductions_fuse: a reduction over only the last dimension keeps its group open,
        so its consumers join its kernel: XLA:GPU's normalization fusion (the Triton
        softmax rewriter) runs a softmax or a layer norm as one kernel that reads each row
        once. Measured on the lent H100: bf16 softmax over [8, 16, S, S] moves its input
        once and its output once at the element-wise bandwidth (bench/data/h100_jax_sweep.json,
        `softmax_bf16` rows, fitted with `gelu_bf16` to one bandwidth in
        bench/results/calibrated_1xH100_fit.json). XLA:CPU ends a loop fusion at every
        reduction: False there.

    Returns:
      The `FusionResult`.
    """
    n_nodes = len(graph.nodes)
    standalone = [is_standalone(n) for n in graph.nodes]
    # Duplicates: broadcasts and iotas, and anything (not standalone) computed from
    # literals and duplicates only, i.e. with no graph input or real result among its
    # operands (constant sub-expressions such as a causal mask).
    dup = [False] * n_nodes
    for n in graph.nodes:
        if standalone[n.id]:
            continue
        producers = [graph.producer(t) for t in n.inputs if t is not None]
        dup[n.id] = n.primitive in DUPLICABLE or all(p is not None and dup[p]
                                                      for p in producers)

    def sources(tid: int) -> set[int]:
        """The tensors a reader of `tid` really reads: through duplicates, their operands."""
        p = graph.producer(tid)
        if p is None or not dup[p]:
            return {tid}
        out: set[int] = set()
        for t in graph.nodes[p].inputs:
            if t is not None:
                out |= sources(t)
        return out

    group = list(range(n_nodes))       # group id = id of the group's first node
    closed: set[int] = set()
    for n in graph.nodes:
        if standalone[n.id] or dup[n.id]:
            continue
        reads = set().union(*(sources(t) for t in n.inputs if t is not None))
        read_groups = {group[p] for p in (graph.producer(t) for t in reads)
                       if p is not None and not standalone[p]}
        # Try the most recent open group first (the tightest producer-consumer chain).
        for g in sorted(read_groups, reverse=True):
            if g in closed:
                continue
            ok = all(p is None or group[p] == g or p < g
                     for p in (graph.producer(t) for t in reads))
            if ok:
                group[n.id] = g
                break
        if n.primitive in _REDUCTIONS and not (row_reductions_fuse and _is_row_reduction(graph, n)):
            closed.add(group[n.id])

    # What each group reads from memory. A consumer re-computes a cheap element-wise
    # producer of another group instead of reading its result when that reads no more
    # bytes (XLA duplicates cheap producers into their consumers' fusions; a softmax's
    # f32 upcast of bf16 scores is re-done by each of its reductions' consumers, not
    # written out in f32).
    nbytes = [float(t.size * itemsize(t.dtype)) for t in graph.tensors]
    cheap = [_is_cheap(n) for n in graph.nodes]
    NO_GROUP = -1       # `walk` as for a group that holds none of the producers it meets

    def walk(tid: int, g: int, reads: Callable[[int, int], frozenset[int]]
             ) -> tuple[frozenset[int], frozenset[int]]:
        """The tensors a kernel of group `g` reads from memory for `tid` (`reads` answers
        for the operands), and the groups of the producers met on the way."""
        p = graph.producer(tid)
        if p is None or standalone[p]:
            return frozenset({tid}), frozenset()
        met = {group[p]}
        if group[p] == g:
            return frozenset(), frozenset(met)           # inside the group: no memory read
        if not (dup[p] or cheap[p]):
            return frozenset({tid}), frozenset(met)
        # A free duplicate reads only its own operands' memory; a cheap producer is
        # re-computed only where that reads no more bytes than reading its result. The
        # operands' reads are gathered until they outgrow it: a union only grows, so the
        # answer is known then (a residual stream's chain of adds is not walked back to
        # the first layer).
        limit = math.inf if dup[p] else nbytes[tid]
        total, again = 0.0, set()
        for t in graph.nodes[p].inputs:
            if t is None:
                continue
            for r in reads(t, g):
                if r not in again:
                    again.add(r)
                    total += nbytes[r]
            met |= groups_met(t)
            if total > limit:
                return frozenset({tid}), frozenset(met)
        return frozenset(again), frozenset(met)

    # Most of what a kernel reads does not depend on which kernel reads it: a tensor's
    # reads are walked once for no group in particular (`free`, with the groups met on
    # the way), and again for a group `g` only where `g` was met, where the walk stops
    # inside `g` (one walk per tensor and group was most of the planner's time on a
    # Hugging Face BERT layer: 150k walks for 6,940 nodes).
    free: dict[int, frozenset[int]] = {}
    met_on: dict[int, frozenset[int]] = {}

    def groups_met(tid: int) -> frozenset[int]:
        free_reads(tid, NO_GROUP)
        return met_on[tid]

    def free_reads(tid: int, g: int) -> frozenset[int]:
        if tid not in free:
            free[tid], met_on[tid] = walk(tid, NO_GROUP, free_reads)
        return free[tid]

    memo: dict[tuple[int, int], frozenset[int]] = {}

    def reads_for(tid: int, g: int) -> frozenset[int]:
        if g not in groups_met(tid):
            return free[tid]
        key = (tid, g)
        if key not in memo:
            memo[key] = walk(tid, g, reads_for)[0]
        return memo[key]

    node_reads: list[list[int]] = [[] for _ in range(n_nodes)]
    read_from_memory: set[int] = set(graph.outputs)
    for n in graph.nodes:
        if standalone[n.id]:
            read_from_memory.update(t for t in n.inputs if t is not None)
            continue
        if dup[n.id]:
            continue
        for t in n.inputs:
            if t is not None:
                node_reads[n.id].extend(sorted(reads_for(t, group[n.id])))
        read_from_memory.update(node_reads[n.id])

    bytes_out = [0.0] * n_nodes
    kernels = [0] * n_nodes
    seen_reads: dict[int, set[int]] = {}
    for n in graph.nodes:
        if standalone[n.id]:
            # Its own kernel: every operand read, every result written (as tracing counts).
            bytes_out[n.id] = n.bytes_accessed
            continue
        if dup[n.id]:
            # Free unless its result must exist in memory (a graph output, an operand of a
            # standalone op, or read by a group): then it is written once.
            written = [t for t in n.outputs if t in read_from_memory]
            if written:
                bytes_out[n.id] = sum(nbytes[t] for t in written) + sum(
                    nbytes[t] for t in n.inputs
                    if t is not None and graph.producer(t) is None)
                kernels[n.id] = 1
            continue
        seen = seen_reads.setdefault(group[n.id], set())
        b = 0.0
        for s in node_reads[n.id]:
            if s not in seen:
                seen.add(s)
                b += nbytes[s]
        b += sum(nbytes[t] for t in n.outputs if t in read_from_memory)
        bytes_out[n.id] = b
    started: set[int] = set()         # groups whose kernel is counted
    for n in graph.nodes:
        if not standalone[n.id] and not dup[n.id]:
            g = group[n.id]
            if bytes_out[n.id] > 0 and g not in started:
                started.add(g)
                kernels[n.id] = 1
    return FusionResult(tuple(group), tuple(bytes_out), tuple(kernels), tuple(dup))
