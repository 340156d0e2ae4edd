"""Sharding rules: each primitive described as an einsum over labelled dimensions.

Every operator is described by `DimLabels`: an integer label per dimension of each operand
and result. Dimensions that share a label are split together; a label that appears in the
operands but in no result is reduced over (a contraction), so splitting it leaves partial
results that an all-reduce combines; a label in `fixed` may not be split (a scanned axis, a
sliced dimension, a gathered-from axis). A sharding strategy assigns each mesh axis to one
label or to none, and `enumerate_assignments` lists every valid assignment. This is the
Alpa formulation (a matmul C[b,i,j] = A[b,i,k]·B[b,k,j] on a 2-D mesh assigns mesh axes to
{b, i, j, k}) made uniform across primitives, so a new primitive needs only its labels.

Control flow (`scan`, `while`, `cond`) gets a rule derived from its body: a dimension of
an operand may be split if it flows through every operator of the body as a label that is
never fixed or reduced, and, for a loop, the carry comes back with the same label (its
sharding is a fixed point of the body). Each device then runs the whole loop on its own
block, with no communication inside it.

A primitive without a rule gets `None` from `dim_labels`, and the planner replicates it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Mapping, Sequence

import jax
from jax.extend import core as jex

from alpa_lite.ir.graph import OpGraph, per_graph

# Ops that combine operands of one shape element by element (rank-0 operands broadcast).
ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex conj copy
copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag
integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
population_count pow real reduce_precision rem round rsqrt select_n shift_left
shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh
xor convert_element_type threefry2x32 bitcast_convert_type
""".split())

# How partial results of a reduction are combined (all are an all-reduce in HLO).
_REDUCE_KIND = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
                "reduce_prod": "prod", "reduce_and": "and", "reduce_or": "or",
                "reduce_xor": "xor"}
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


@dataclasses.dataclass(frozen=True)
class DimLabels:
    """An operator as an einsum over labelled dimensions.

    operands: per operand, a label per dimension, or None for an operand with no tensor
      (a literal) or one that must stay replicated.
    outputs: per result, a label per dimension.
    sizes: label -> dimension size.
    fixed: labels that may not be split.
    reduce_kind: how partial results combine if a reduced label is split ("sum", "max", ...),
      or None if reduced labels may not be split.
    """
    operands: tuple[tuple[int, ...] | None, ...]
    outputs: tuple[tuple[int, ...], ...]
    sizes: Mapping[int, int]
    fixed: frozenset[int] = frozenset()
    reduce_kind: str | None = "sum"

    @functools.cached_property
    def reduced(self) -> frozenset[int]:
        out = {l for o in self.outputs for l in o}
        return frozenset(l for op in self.operands if op for l in op if l not in out)


class _Labeler:
    def __init__(self):
        self.sizes: dict[int, int] = {}

    def new(self, size: int) -> int:
        label = len(self.sizes)
        self.sizes[label] = int(size)
        return label

    def fresh(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.new(s) for s in shape)


def dim_labels(primitive: str, params: Mapping[str, Any], in_shapes: Sequence[tuple | None],
               out_shapes: Sequence[tuple]) -> DimLabels | None:
    """The labelled-dimension description of one equation, or None if there is no rule.

    `in_shapes` has None for literal operands.
    """
    L = _Labeler()
    fn = _RULES.get(primitive)
    if fn is None and primitive in ELEMENTWISE:
        fn = _elementwise
    if fn is None and primitive in _REDUCE_KIND:
        fn = _reduce
    if fn is None and primitive in _CUMULATIVE:
        fn = _cumulative
    if fn is None:
        return None
    return fn(L, primitive, params, list(in_shapes), list(out_shapes))


@per_graph
def node_labels(graph: OpGraph) -> tuple[DimLabels | None, ...]:
    """`dim_labels` of each node of the graph, by node id (computed once per graph)."""
    shapes = [t.shape for t in graph.tensors]
    return tuple(dim_labels(n.primitive, n.params,
                            [None if t is None else shapes[t] for t in n.inputs],
                            [shapes[t] for t in n.outputs]) for n in graph.nodes)


def _elementwise(L, prim, params, ins, outs):
    shape = outs[0]
    if any(o != shape for o in outs):
        return None
    labels = L.fresh(shape)
    operands = []
    for s in ins:
        if s is None or len(s) == 0:
            operands.append(None)
        elif len(s) == len(shape) and all(a == b or a == 1 for a, b in zip(s, shape)):
            # A size-1 dimension broadcasts against the result's: it gets its own label.
            operands.append(tuple(l if a == b else L.new(1)
                                  for l, a, b in zip(labels, s, shape)))
        else:
            return None
    return DimLabels(tuple(operands), (labels,) * len(outs), L.sizes)


def _reduce(L, prim, params, ins, outs):
    axes = set(params["axes"])
    labels = L.fresh(ins[0])
    out = tuple(l for d, l in enumerate(labels) if d not in axes)
    return DimLabels((labels,), (out,), L.sizes, reduce_kind=_REDUCE_KIND[prim])


def _argminmax(L, prim, params, ins, outs):
    axes = set(params["axes"])
    labels = L.fresh(ins[0])
    out = tuple(l for d, l in enumerate(labels) if d not in axes)
    fixed = frozenset(labels[d] for d in axes)
    return DimLabels((labels,), (out,), L.sizes, fixed=fixed, reduce_kind=None)


def _cumulative(L, prim, params, ins, outs):
    labels = L.fresh(ins[0])
    return DimLabels((labels,), (labels,), L.sizes, fixed=frozenset({labels[params["axis"]]}))


def _dot_general(L, prim, params, ins, outs):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = ins
    if lhs is None or rhs is None:
        return None
    ll: list[int | None] = [None] * len(lhs)
    rl: list[int | None] = [None] * len(rhs)
    batch = []
    for a, b in zip(lb, rb):
        ll[a] = rl[b] = L.new(lhs[a])
        batch.append(ll[a])
    for a, b in zip(lc, rc):
        ll[a] = rl[b] = L.new(lhs[a])
    lfree = [d for d in range(len(lhs)) if ll[d] is None]
    rfree = [d for d in range(len(rhs)) if rl[d] is None]
    for d in lfree:
        ll[d] = L.new(lhs[d])
    for d in rfree:
        rl[d] = L.new(rhs[d])
    out = tuple(batch) + tuple(ll[d] for d in lfree) + tuple(rl[d] for d in rfree)
    return DimLabels((tuple(ll), tuple(rl)), (out,), L.sizes)


def _conv(L, prim, params, ins, outs):
    """out[n, o, win] = sum over c, window of lhs[n, c, win'] * rhs[o, c, window].

    Grouped convolutions split one dimension into (group, member) with the group major:
    with `feature_group_count` G, input channels are G x (C/G), output features G x (O/G),
    and group g's output features read only group g's channels (depthwise: C/G = 1); with
    `batch_group_count` B (the weight gradient of a grouped convolution), the lhs batch is
    B x (N/B) and group b's output features read only batch group b. A block split of a
    grouped dimension into parts that each hold whole groups splits the groups, so the
    grouped dimensions of lhs, rhs and result share one label of size G (or B), which XLA
    partitions without communication; the member parts (a group's input channels, the
    result's batch of a batch-grouped convolution) stay whole.
    """
    lhs, rhs = ins
    if lhs is None or rhs is None:
        return None
    dn = params["dimension_numbers"]
    groups = params.get("feature_group_count", 1)
    batch_groups = params.get("batch_group_count", 1)
    ll = list(L.fresh(lhs))
    rl = list(L.fresh(rhs))
    ol = list(L.fresh(outs[0]))
    n, c = dn.lhs_spec[0], dn.lhs_spec[1]
    o, i = dn.rhs_spec[0], dn.rhs_spec[1]
    on, oc = dn.out_spec[0], dn.out_spec[1]
    fixed = set()
    if groups > 1:
        # Channel groups: lhs channels, rhs output features and result features by group;
        # the channels within a group are contracted whole on each device.
        ll[c] = rl[o] = ol[oc] = L.new(groups)
        ol[on] = ll[n]
        fixed.add(rl[i])
    elif batch_groups > 1:
        # Batch groups: lhs batch, rhs output features and result features by group; the
        # input channels are contracted (split: partial sums), the result's batch whole.
        ll[n] = rl[o] = ol[oc] = L.new(batch_groups)
        rl[i] = ll[c]
        fixed.add(ol[on])
    else:
        ol[on] = ll[n]
        ol[oc] = rl[o]
        rl[i] = ll[c]
    fixed |= {ll[d] for d in dn.lhs_spec[2:]} | {rl[d] for d in dn.rhs_spec[2:]} \
        | {ol[d] for d in dn.out_spec[2:]}
    return DimLabels((tuple(ll), tuple(rl)), (tuple(ol),), L.sizes, fixed=frozenset(fixed))


def _broadcast_in_dim(L, prim, params, ins, outs):
    out = list(L.fresh(outs[0]))
    if ins[0] is None or len(ins[0]) == 0:
        return DimLabels((None,) * len(ins), (tuple(out),), L.sizes)
    op = []
    for d, od in enumerate(params["broadcast_dimensions"]):
        if ins[0][d] == outs[0][od]:
            op.append(out[od])
        else:
            op.append(L.new(ins[0][d]))
    return DimLabels((tuple(op),) + (None,) * (len(ins) - 1), (tuple(out),), L.sizes)


def _transpose(L, prim, params, ins, outs):
    labels = L.fresh(ins[0])
    return DimLabels((labels,), (tuple(labels[p] for p in params["permutation"]),), L.sizes)


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Splits two shapes into runs of dimensions with equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif pj < pi and j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                return None
        # Absorb trailing size-1 dims into this group.
        groups.append((gi, gj))
    return groups


def _reshape(L, prim, params, ins, outs):
    # `dimensions`: the operand is transposed by this permutation before the reshape
    # (jax's grouped-convolution gradients write weights so). Label the transposed shape,
    # then hand each label back to the operand dimension it came from.
    perm = params.get("dimensions") or tuple(range(len(ins[0])))
    src, dst = tuple(ins[0][d] for d in perm), tuple(outs[0])
    groups = _reshape_groups(src, dst)
    if groups is None:
        return None
    il: list[int] = [0] * len(src)
    ol: list[int] = [0] * len(dst)
    fixed = set()
    for gi, gj in groups:
        # Only the most-major non-trivial dimension of a group carries a split: a block
        # split of the major dim of [A*B] is a block split of A.
        mi = next((d for d in gi if src[d] > 1), gi[0] if gi else None)
        mj = next((d for d in gj if dst[d] > 1), gj[0] if gj else None)
        shared = None
        if mi is not None and mj is not None:
            shared = L.new(math.gcd(src[mi], dst[mj]))
        for d in gi:
            if d == mi and shared is not None:
                il[d] = shared
            else:
                il[d] = L.new(src[d]); fixed.add(il[d])
        for d in gj:
            if d == mj and shared is not None:
                ol[d] = shared
            else:
                ol[d] = L.new(dst[d]); fixed.add(ol[d])
    operand = [0] * len(src)
    for k, d in enumerate(perm):
        operand[d] = il[k]
    return DimLabels((tuple(operand),) + (None,) * (len(ins) - 1), (tuple(ol),), L.sizes,
                     fixed=frozenset(fixed))


def _squeeze(L, prim, params, ins, outs):
    labels = L.fresh(ins[0])
    drop = {d % len(ins[0]) for d in params["dimensions"]}
    return DimLabels((labels,), (tuple(l for d, l in enumerate(labels) if d not in drop),),
                     L.sizes)


def _same_rank_with_fixed(fixed_dims_fn):
    def rule(L, prim, params, ins, outs):
        labels = L.fresh(outs[0])
        fixed_dims = fixed_dims_fn(params, ins, outs)
        operands = []
        for s in ins:
            if s is None or len(s) != len(outs[0]):
                operands.append(None)
            else:
                operands.append(tuple(labels[d] if s[d] == outs[0][d] or d in fixed_dims
                                      else L.new(s[d]) for d in range(len(s))))
        fixed = {labels[d] for d in fixed_dims}
        for op in operands:
            if op:
                fixed |= {l for d, l in enumerate(op) if l not in labels}
        return DimLabels(tuple(operands), (labels,) * len(outs), L.sizes,
                         fixed=frozenset(fixed), reduce_kind=None)
    return rule


def _slice_fixed(params, ins, outs):
    return {d for d in range(len(outs[0])) if ins[0][d] != outs[0][d]}


def _concat_fixed(params, ins, outs):
    return {params["dimension"]}


def _pad_fixed(params, ins, outs):
    return {d for d, cfg in enumerate(params["padding_config"]) if tuple(cfg) != (0, 0, 0)}


def _dus_fixed(params, ins, outs):
    return {d for d in range(len(outs[0])) if ins[1][d] != outs[0][d]}


def _dims_param_fixed(key):
    def fn(params, ins, outs):
        v = params[key]
        return set(v) if isinstance(v, (tuple, list)) else {v}
    return fn


def _windowed(L, prim, params, ins, outs):
    """reduce_window_* and select_and_scatter_add: a dimension the window slides over
    (window or stride > 1, or padded) stays whole; the others split freely."""
    window = params.get("window_dimensions")
    strides = params.get("window_strides")
    padding = params.get("padding")
    dilation = params.get("window_dilation") or params.get("base_dilation")
    rank = len(outs[0])
    free = [window[d] == 1 and strides[d] == 1 and tuple(padding[d]) == (0, 0)
            and (dilation is None or dilation[d] == 1) for d in range(rank)]
    out = L.fresh(outs[0])
    operands = []
    fixed = {out[d] for d in range(rank) if not free[d]}
    for s in ins:
        if s is None or len(s) != rank:
            operands.append(None)
            continue
        lab = tuple(out[d] if free[d] and s[d] == outs[0][d] else L.new(s[d])
                    for d in range(rank))
        fixed |= {l for l in lab if l not in out}
        operands.append(lab)
    return DimLabels(tuple(operands), (out,) * len(outs), L.sizes, fixed=frozenset(fixed),
                     reduce_kind=None)


def _stack(L, prim, params, ins, outs):
    """Operands of one shape stacked along a new dimension `axis`: their dimensions split
    together, the new one stays whole."""
    if any(s is None or tuple(s) != tuple(ins[0]) for s in ins):
        return None
    labels = L.fresh(ins[0])
    axis = params["axis"] % len(outs[0])
    new = L.new(outs[0][axis])
    out = labels[:axis] + (new,) + labels[axis:]
    return DimLabels((labels,) * len(ins), (out,), L.sizes, fixed=frozenset({new}),
                     reduce_kind=None)


def _batch_bits(L, prim, params, ins, outs):
    """`batch_draws.batch_bits_p`: bits drawn at the rows of the batch it is given; its
    leading dimension is the rows', every dimension splits (the draw is element-wise in
    its position)."""
    out = L.fresh(outs[0])
    return DimLabels((None, (out[0],)), (out,), L.sizes, reduce_kind=None)


def _iota(L, prim, params, ins, outs):
    return DimLabels((), (L.fresh(outs[0]),), L.sizes)


def _top_k(L, prim, params, ins, outs):
    """The k largest along the last dimension: the other dimensions split freely, the last
    stays whole (values and indices alike)."""
    if ins[0] is None or not len(ins[0]):
        return None
    labels = L.fresh(ins[0])
    k = L.new(outs[0][-1])
    out = tuple(labels[:-1]) + (k,)
    return DimLabels((labels,), (out, out), L.sizes, fixed=frozenset({labels[-1], k}))


def _key_trailing(L, prim, params, ins, outs):
    """Keys and their data: `random_unwrap` appends the key's words as trailing dimensions,
    `random_wrap` removes them, `random_split` / `random_fold_in` append or keep the
    count of new keys. The shared leading dimensions split; the rest stays whole."""
    if ins[0] is None:
        return None
    src, dst = ins[0], outs[0]
    n = min(len(src), len(dst))
    lead = L.fresh(src[:n]) if src[:n] == dst[:n] else None
    if lead is None:
        return None
    extra_in = tuple(L.new(d) for d in src[n:])
    extra_out = tuple(L.new(d) for d in dst[n:])
    operands = (tuple(lead) + extra_in,) + (None,) * (len(ins) - 1)
    return DimLabels(operands, (tuple(lead) + extra_out,), L.sizes,
                     fixed=frozenset(extra_in + extra_out))


def _random_bits(L, prim, params, ins, outs):
    """Bits drawn from one key: any split of the result draws, shard by shard, exactly the
    bits of the whole, when JAX's threefry is partitionable (`jax_threefry_partitionable`,
    on by default); otherwise, and for a batch of keys, no rule (replicated)."""
    if ins[0] is None or len(ins[0]) or not jax.config.jax_threefry_partitionable:
        return None
    return DimLabels((None,), (L.fresh(outs[0]),), L.sizes)


def _index_dims(indices: Sequence[int], n_batch: int) -> list[int] | None:
    """The dimensions of a gather/scatter index array that enumerate lookups (all but the
    trailing index-vector dimension)."""
    if len(indices) == n_batch + 1:
        return list(range(len(indices) - 1))
    if len(indices) == n_batch:
        return list(range(len(indices)))
    return None


def _gather(L, prim, params, ins, outs):
    operand, indices = ins
    dn = params["dimension_numbers"]
    if operand is None or indices is None:
        return None
    out = list(L.fresh(outs[0]))
    ol = list(L.fresh(operand))
    il = list(L.fresh(indices))
    offset_dims = list(dn.offset_dims)
    batch_out = [d for d in range(len(outs[0])) if d not in offset_dims]
    idx_dims = _index_dims(indices, len(batch_out))
    if idx_dims is None:
        return None
    for od, idd in zip(batch_out, idx_dims):
        il[idd] = out[od]
    fixed = {il[d] for d in range(len(indices)) if d not in idx_dims}
    # Batching dims (take_along_axis): operand dim i pairs with an index dim.
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    for od, idd in zip(op_batch, getattr(dn, "start_indices_batching_dims", ())):
        ol[od] = il[idd]
    window = [d for d in range(len(operand))
              if d not in dn.collapsed_slice_dims and d not in op_batch]
    slice_sizes = params["slice_sizes"]
    for od, wd in zip(offset_dims, window):
        if slice_sizes[wd] == operand[wd] and wd not in dn.start_index_map:
            ol[wd] = out[od]
        else:
            fixed.add(out[od])
    fixed |= {ol[d] for d in range(len(operand)) if ol[d] not in out}
    return DimLabels((tuple(ol), tuple(il)), (tuple(out),), L.sizes, fixed=frozenset(fixed),
                     reduce_kind=None)


def _scatter(L, prim, params, ins, outs):
    operand, indices, updates = ins[0], ins[1], ins[2]
    dn = params["dimension_numbers"]
    if None in (operand, indices, updates):
        return None
    out = list(L.fresh(outs[0]))
    ul = list(L.fresh(updates))
    il = list(L.fresh(indices))
    window = list(dn.update_window_dims)
    scatter_dims = [d for d in range(len(updates)) if d not in window]
    idx_dims = _index_dims(indices, len(scatter_dims))
    if idx_dims is None:
        return None
    for ud, idd in zip(scatter_dims, idx_dims):
        il[idd] = ul[ud]
    fixed = {il[d] for d in range(len(indices)) if d not in idx_dims}
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    for od, idd in zip(op_batch, getattr(dn, "scatter_indices_batching_dims", ())):
        out[od] = il[idd]
    op_window = [d for d in range(len(operand))
                 if d not in dn.inserted_window_dims and d not in op_batch]
    for ud, od in zip(window, op_window):
        if updates[ud] == operand[od] and od not in dn.scatter_dims_to_operand_dims:
            ul[ud] = out[od]
        else:
            fixed.add(ul[ud])
    fixed |= {out[d] for d in dn.scatter_dims_to_operand_dims}
    is_add = prim in ("scatter-add", "scatter_add")
    if not is_add:
        fixed |= {ul[d] for d in scatter_dims if ul[d] not in out}
    else:
        # The window stays whole: with its lookups split (partial sums) and its window
        # split too, XLA's partitioner reduces the whole operand rather than the split the
        # plan would predict (the compiled HLO of an embedding gradient on a 4x2 mesh).
        fixed |= {ul[d] for d in window}
    out = tuple(out)
    return DimLabels((out, tuple(il), tuple(ul)), (out,), L.sizes, fixed=frozenset(fixed),
                     reduce_kind="sum" if is_add else None)


# Call primitives whose body is an ordinary function of its operands, and where each keeps
# its body (tracing inlines them; a loop body's rule looks through them).
CALL_BODIES = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


# Calls that carry their own derivative rule, kept whole where the program is differentiated
# after tracing (`tracing.trace_flat`): a straight-through estimator's custom_vjp,
# jax.nn.relu's custom_jvp (derivative 0 at exactly 0, where max(x, 0) would give 0.5).
CUSTOM_DERIVATIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


class _BodyDims:
    """Union-find over the dimensions (variable, axis) of a body's values: dimensions in
    one class carry one label through every operator; a class is blocked where some
    operator may not split it."""

    def __init__(self):
        self.parent: dict[Any, Any] = {}
        self.size: dict[Any, int] = {}
        self.blocked: set[Any] = set()

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def add(self, x, size: int):
        r = self.find(x)
        self.size[r] = math.gcd(self.size.get(r, 0), int(size))

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.size[ra] = math.gcd(self.size.get(ra, 0), self.size.pop(rb, 0))
            if rb in self.blocked:
                self.blocked.add(ra)

    def block(self, x):
        self.blocked.add(self.find(x))

    def is_blocked(self, x) -> bool:
        return self.find(x) in self.blocked

    def dims(self, var) -> list[tuple[Any, int]]:
        shape = tuple(getattr(var.aval, "shape", ()))
        for d, n in enumerate(shape):
            self.add((var, d), n)
        return [(var, d) for d in range(len(shape))]

    def tie(self, a, b):
        """Dimension d of value a is dimension d of value b (a loop's carry, a branch's
        operand): one class each, or blocked if the two are not alike."""
        da, db = self.dims(a), self.dims(b)
        if len(da) != len(db):
            for x in da + db:
                self.block(x)
            return
        for x, y in zip(da, db):
            self.union(x, y)

    def walk(self, jaxpr) -> None:
        """Joins the dimensions each equation of `jaxpr` labels alike (nested calls and
        loops included) and blocks those it may not split."""
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            invars = [v for v in eqn.invars if not _is_literal(v)]
            body = eqn.params.get(CALL_BODIES.get(name, ""), None)
            if body is not None:
                inner = getattr(body, "jaxpr", body)
                for outer, v in zip(eqn.invars, inner.invars):
                    if not _is_literal(outer):
                        self.tie(outer, v)
                self.walk(inner)
                for outer, v in zip(eqn.outvars, inner.outvars):
                    if _is_literal(v):
                        for x in self.dims(outer):
                            self.block(x)
                    else:
                        self.tie(outer, v)
                continue
            in_shapes = [None if _is_literal(v) else tuple(v.aval.shape) for v in eqn.invars]
            out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
            rule = dim_labels(name, eqn.params, in_shapes, out_shapes)
            if rule is None:
                for v in invars + list(eqn.outvars):
                    if not _is_literal(v):
                        for x in self.dims(v):
                            self.block(x)
                continue
            members: dict[int, list] = {}
            for vars_, labels in ((eqn.invars, rule.operands), (eqn.outvars, rule.outputs)):
                for v, labs in zip(vars_, labels):
                    if _is_literal(v):
                        continue
                    dims = self.dims(v)
                    if labs is None:
                        for x in dims:
                            self.block(x)
                        continue
                    for x, l in zip(dims, labs):
                        members.setdefault(l, []).append(x)
            # A reduced label, split, would need a collective inside the loop: keep it whole.
            stuck = rule.fixed | rule.reduced
            for l, xs in members.items():
                self.add(xs[0], rule.sizes[l])
                for x in xs[1:]:
                    self.union(xs[0], x)
                if l in stuck:
                    self.block(xs[0])


def _is_literal(v) -> bool:
    return isinstance(v, jex.Literal)


def _body_rule(L, ins, outs, operand_vars, output_vars, dims: _BodyDims,
               stacked_operands: int = 0, stacked_outputs: int = 0) -> DimLabels:
    """The operator's labels from its body's classes: operand k reads body value
    `operand_vars[k]` (None: stays whole), result j is body value `output_vars[j]`; the
    last `stacked_operands` / `stacked_outputs` carry a leading iteration axis that
    stays whole."""
    label_of: dict[Any, int] = {}
    fixed: set[int] = set()

    def labels_for(var, shape, stacked: bool):
        lead = (L.new(shape[0]),) if stacked else ()
        fixed.update(lead)
        if var is None or _is_literal(var):
            rest = tuple(L.new(n) for n in shape[len(lead):])
            fixed.update(rest)
            return lead + rest
        own = []
        for x in dims.dims(var):
            r = dims.find(x)
            if r not in label_of:
                label_of[r] = L.new(dims.size.get(r, 1) or 1)
                if dims.is_blocked(x):
                    fixed.add(label_of[r])
            own.append(label_of[r])
        if len(set(own)) != len(own):
            # Two dimensions of one value in one class: splitting it would split both.
            fixed.update(own)
        return lead + tuple(own)

    n_ops = len(ins)
    operands = tuple(None if s is None else labels_for(v, s, k >= n_ops - stacked_operands)
                     for k, (v, s) in enumerate(zip(operand_vars, ins)))
    n_outs = len(outs)
    outputs = tuple(labels_for(v, s, j >= n_outs - stacked_outputs)
                    for j, (v, s) in enumerate(zip(output_vars, outs)))
    # A label no result carries would be reduced inside the loop: keep it whole.
    out_labels = {l for o in outputs for l in o}
    fixed |= {l for op in operands if op for l in op if l not in out_labels}
    return DimLabels(operands, outputs, L.sizes, fixed=frozenset(fixed), reduce_kind=None)


def _scan(L, prim, params, ins, outs):
    body = params["jaxpr"].jaxpr
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    dims = _BodyDims()
    dims.walk(body)
    for v_in, v_out in zip(body.invars[n_consts:n_consts + n_carry], body.outvars[:n_carry]):
        if _is_literal(v_out):
            for x in dims.dims(v_in):
                dims.block(x)
        else:
            dims.tie(v_in, v_out)
    n_xs = len(body.invars) - n_consts - n_carry
    return _body_rule(L, ins, outs, body.invars, body.outvars, dims,
                      stacked_operands=n_xs, stacked_outputs=len(outs) - n_carry)


def _while(L, prim, params, ins, outs):
    body, cond = params["body_jaxpr"].jaxpr, params["cond_jaxpr"].jaxpr
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    dims = _BodyDims()
    dims.walk(body)
    dims.walk(cond)
    carry_in = body.invars[nb:]
    for v_in, v_cond, v_out in zip(carry_in, cond.invars[nc:], body.outvars):
        dims.tie(v_in, v_cond)
        if _is_literal(v_out):
            for x in dims.dims(v_in):
                dims.block(x)
        else:
            dims.tie(v_in, v_out)
    operand_vars = list(cond.invars[:nc]) + list(body.invars[:nb]) + list(carry_in)
    return _body_rule(L, ins, outs, operand_vars, list(carry_in), dims)


def _cond(L, prim, params, ins, outs):
    branches = [b.jaxpr for b in params["branches"]]
    dims = _BodyDims()
    first = branches[0]
    for b in branches:
        dims.walk(b)
    for b in branches[1:]:
        for v0, v in zip(first.invars, b.invars):
            dims.tie(v0, v)
        for v0, v in zip(first.outvars, b.outvars):
            if _is_literal(v0) or _is_literal(v):
                for x in ([] if _is_literal(v0) else dims.dims(v0)) + \
                        ([] if _is_literal(v) else dims.dims(v)):
                    dims.block(x)
            else:
                dims.tie(v0, v)
    # Operand 0 is the branch index (or predicate): every device needs it whole.
    return _body_rule(L, ins, outs, [None] + list(first.invars), list(first.outvars), dims)


def _call(L, prim, params, ins, outs):
    """A call kept whole (a function with a custom derivative): its body's rule."""
    body = params[CALL_BODIES[prim]]
    body = getattr(body, "jaxpr", body)
    dims = _BodyDims()
    dims.walk(body)
    return _body_rule(L, ins, outs, body.invars, body.outvars, dims)


_RULES = {
    "custom_jvp_call": _call,
    "custom_vjp_call": _call,
    "custom_vjp_call_jaxpr": _call,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "argmax": _argminmax,
    "argmin": _argminmax,
    "iota": _iota,
    "stack": _stack,
    "random_bits": _random_bits,
    "alpa_batch_bits": _batch_bits,
    "random_wrap": _key_trailing,
    "random_unwrap": _key_trailing,
    "random_split": _key_trailing,
    "random_fold_in": _key_trailing,
    "top_k": _top_k,
    "slice": _same_rank_with_fixed(_slice_fixed),
    "dynamic_slice": _same_rank_with_fixed(_slice_fixed),
    "dynamic_update_slice": _same_rank_with_fixed(_dus_fixed),
    "concatenate": _same_rank_with_fixed(_concat_fixed),
    "pad": _same_rank_with_fixed(_pad_fixed),
    "rev": _same_rank_with_fixed(_dims_param_fixed("dimensions")),
    "sort": _same_rank_with_fixed(_dims_param_fixed("dimension")),
    "split": _same_rank_with_fixed(_dims_param_fixed("axis")),
    "gather": _gather,
    "reduce_window_sum": _windowed,
    "reduce_window_max": _windowed,
    "reduce_window_min": _windowed,
    "reduce_window": _windowed,
    "select_and_scatter_add": _windowed,
    "select_and_gather_add": _windowed,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
}


def enumerate_assignments(labels: DimLabels, axes: Sequence[tuple[str, int]]
                          ) -> list[dict[int, tuple[str, ...]]]:
    """Every valid map label -> mesh axes (outermost first), one entry per strategy.

    Each mesh axis goes to at most one label; a label's size must be divisible by the
    product of its axes; fixed labels get none; reduced labels only if partial results
    can be combined.
    """
    candidates = sorted(l for l in labels.sizes if l not in labels.fixed)
    candidates = [l for l in candidates
                  if labels.reduce_kind is not None or l not in labels.reduced]
    used = {l for op in labels.operands if op for l in op} | {l for o in labels.outputs for l in o}
    candidates = [l for l in candidates if l in used]
    result = []
    for choice in itertools.product([None] + candidates, repeat=len(axes)):
        assign: dict[int, list[str]] = {}
        for (name, _), label in zip(axes, choice):
            if label is not None:
                assign.setdefault(label, []).append(name)
        ok = True
        for label, names in assign.items():
            n = math.prod(size for name, size in axes if name in names)
            if labels.sizes[label] % n:
                ok = False
                break
        if ok:
            result.append({l: tuple(v) for l, v in assign.items()})
    return result
