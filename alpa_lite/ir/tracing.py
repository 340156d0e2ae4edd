"""Tracing: a JAX train step -> a flat `OpGraph` plus what is needed to re-run it.

`trace(fn, args, batch_argnums)` runs `jax.make_jaxpr` on abstract arguments (real arrays and
`jax.ShapeDtypeStruct`s both work, so nothing is allocated), then flattens the jaxpr:
nested `jit`, `custom_jvp_call`, `custom_vjp_call` and `remat2` calls are inlined, because the
planner must see (and shard) the operators inside them.

Loops. A `scan` whose body does matrix work (a stack of layers written with `lax.scan` or
`nn.scan`, and the reversed scan JAX's autodiff makes of it) and that runs at most
`MAX_UNROLLED_ITERATIONS` times is unrolled: iteration i reads slice i of the stacked
inputs (`xs[i]`), and the per-iteration results are stacked back. The planner then shards
each iteration's operators like any layer's (a stacked weight `[layers, ...]` splits on its
other axes, the layer axis stays whole) and can cut the stack into pipeline stages, which
Alpa could not. The price is a graph, and a compiled program, that grow with the trip
count, as a Python loop over layers would. Other loops (`while`, a long scan over time
steps, an element-wise scan) and `cond` stay one node each, costed as body x trip count
(XLA's own cost analysis counts a scan body once, which is why FLOPs are counted here from
the equations); `op_rules` derives how they may be split from their bodies. What was
unrolled, and what a `while` loop's unknown trip count was taken to be, is in
`TracedStep.notes` and from there in the plan.

`alpa_marker` equations (from `al.value_and_grad`) are removed; what they said becomes the
`Role` of the tensors they wrapped.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import inspect
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from alpa_lite.ir.batch_draws import batch_bits_p
from alpa_lite.ir.graph import (
    Node,
    OpGraph,
    Role,
    Tensor,
    as_dtype,
    dtype_itemsize,
    dtype_name,
    is_key,
)
from alpa_lite.ir.markers import GRAD, PARAM, boundary_p, capture_grad_calls, marker_p
from alpa_lite.ir.op_rules import CALL_BODIES, CUSTOM_DERIVATIVES

@dataclasses.dataclass(frozen=True, eq=False)
class TracedStep:
    """A traced train step: the graph, and what the runtime needs to replay it."""
    graph: OpGraph
    primitives: tuple[Any, ...]                   # the JAX primitive of each node
    literals: Mapping[tuple[int, int], Any]       # (node id, operand position) -> literal
    consts: Mapping[int, Any]                     # tensor id -> captured constant value
    in_tree: Any                                  # PyTreeDef of the positional args
    out_tree: Any                                 # PyTreeDef of the result
    input_avals: tuple[tuple[tuple[int, ...], str], ...]   # (shape, dtype) per input leaf
    fingerprint: str                              # hash of the program's structure
    # Node positions of `al.mark_layer_boundary` calls (a boundary before node i).
    boundaries: tuple[int, ...] = ()
    # With `capture=True`: the captured `al.value_and_grad` calls (see markers.GradCall).
    grad_calls: tuple[Any, ...] = ()
    # What tracing decided about loops (unrolled, kept whole, an assumed trip count).
    notes: tuple[str, ...] = ()
    # The shape of each `random_bits` equation, in trace order (see `trace_flat`).
    draw_shapes: tuple[tuple[int, ...], ...] = ()
    # Per `al.value_and_grad` call, in trace order: the tensor id of each gradient leaf in
    # the order the gradient pytree flattens (None for a leaf that is a literal, or that
    # nothing reads and dead-code elimination dropped). Tensor ids
    # follow creation, i.e. the backward's order, not the pytree's: an engine that handles
    # gradient leaves itself (`runtime.compressed`) maps them to the plan's names by this.
    grad_leaves: tuple[tuple[int | None, ...], ...] = ()
    # How many sharding constraints the traced step holds (the user's
    # `with_sharding_constraint` calls and their derivatives), each read as the identity:
    # the plan chooses every sharding.
    sharding_constraints: int = 0


class _Builder:
    """Accumulates tensors and nodes while walking (possibly nested) jaxprs."""

    def __init__(self):
        self.tensors: list[Tensor] = []
        self.nodes: list[Node] = []
        self.primitives: list[Any] = []
        self.literals: dict[tuple[int, int], Any] = {}
        self.consts: dict[int, Any] = {}
        self.roles: dict[int, Role] = {}
        self.grad_leaves: list[tuple[int | None, ...]] = []
        self.boundaries: list[int] = []
        self.notes: list[str] = []
        self.sharding_constraints = 0
        # Shapes of the `random_bits` equations met, in order; where `batch_draws` says so,
        # the k-th is drawn per micro-batch from the rows in tensor `rows` (`batch_draws`).
        self.draw_shapes: list[tuple[int, ...]] = []
        self.batch_draws: Sequence[bool] = ()
        self.rows: int | None = None
        # Keep functions with a custom derivative whole (see `trace_flat`).
        self.keep_custom_rules = False

    def new_tensor(self, aval, name: str = "", role: Role = Role.ACTIVATION) -> int:
        tid = len(self.tensors)
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = dtype_name(getattr(aval, "dtype", np.float32))
        self.tensors.append(Tensor(tid, shape, dtype, name or f"t{tid}", role))
        return tid

    def walk(self, jaxpr: jex.Jaxpr, env: dict, scope: str = "") -> None:
        """Appends the equations of `jaxpr` to the graph; `env` maps its vars to tensor ids
        (or to `jex.Literal`s)."""

        def read(atom):
            if isinstance(atom, jex.Literal):
                return atom
            return env[atom]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            in_atoms = [read(v) for v in eqn.invars]
            eqn_scope = "/".join(s for s in (scope, str(eqn.source_info.name_stack)) if s)
            if eqn.primitive is marker_p:
                kind = eqn.params["kind"]
                if kind == GRAD:
                    self.grad_leaves.append(tuple(None if isinstance(v, jex.Literal) else v
                                                  for v in in_atoms))
                for v_in, v_out in zip(in_atoms, eqn.outvars):
                    env[v_out] = v_in
                    if not isinstance(v_in, jex.Literal):
                        self.roles.setdefault(v_in, Role.PARAM if kind == PARAM else Role.GRAD)
                continue
            if eqn.primitive is boundary_p:
                for v_in, v_out in zip(in_atoms, eqn.outvars):
                    env[v_out] = v_in
                if not self.boundaries or self.boundaries[-1] != len(self.nodes):
                    self.boundaries.append(len(self.nodes))
                continue
            if name == "sharding_constraint":
                # The user's own sharding pin (code written for pjit) is the identity on
                # values; the plan chooses every sharding, so it is read as one.
                for v_in, v_out in zip(in_atoms, eqn.outvars):
                    env[v_out] = v_in
                self.sharding_constraints += 1
                self._note("with_sharding_constraint in the step: read as the identity "
                           "(the plan chooses every sharding, the user's pins included)")
                continue
            if name in CALL_BODIES and CALL_BODIES[name] in eqn.params and not (
                    self.keep_custom_rules and name in CUSTOM_DERIVATIVES):
                self._inline(eqn, eqn.params[CALL_BODIES[name]], in_atoms, env, eqn_scope)
                continue
            where = eqn_scope or "the step"
            if name == "scan" and unrolls(eqn.params):
                self._unroll_scan(eqn, in_atoms, env, eqn_scope)
                self._note(f"scan in {where}: unrolled into {eqn.params['length']} "
                           "iterations, each sharded and staged like a layer")
                continue
            if name == "scan":
                self._note(f"scan in {where}: its {eqn.params['length']} iterations run as "
                           "one loop, split only along dimensions its body keeps apart")
            elif name == "while":
                self._note(f"while loop in {where}: trip count unknown at trace time, "
                           "priced as one iteration")
            prim, params = eqn.primitive, dict(eqn.params)
            # Under the user's mesh (`jax.set_mesh`) an operator may carry the sharding of
            # its result on that mesh; the plan chooses it, on its own meshes.
            for key in _RESULT_SHARDINGS:
                if isinstance(params.get(key), jax.sharding.Sharding):
                    params[key] = None
            if name == "random_bits":
                k = len(self.draw_shapes)
                self.draw_shapes.append(tuple(params["shape"]))
                if k < len(self.batch_draws) and self.batch_draws[k]:
                    prim, in_atoms = batch_bits_p, [in_atoms[0], self.rows]
                    params = {"bit_width": params["bit_width"], "shape": tuple(params["shape"])}
            node_id = len(self.nodes)
            inputs: list[int | None] = []
            for pos, atom in enumerate(in_atoms):
                if isinstance(atom, jex.Literal):
                    self.literals[(node_id, pos)] = atom.val
                    inputs.append(None)
                else:
                    inputs.append(atom)
            outputs = [self.new_tensor(v.aval) for v in eqn.outvars]
            for v, t in zip(eqn.outvars, outputs):
                env[v] = t
            in_avals = [v.aval for v in eqn.invars]
            out_avals = [v.aval for v in eqn.outvars]
            self.nodes.append(Node(
                id=node_id, primitive=prim.name, inputs=tuple(inputs), outputs=tuple(outputs),
                params=MappingProxyType(params),
                flops=float(count_flops(name, eqn.params, in_avals, out_avals)),
                bytes_accessed=float(sum(_nbytes(a) for a in in_avals + out_avals)),
                scope=eqn_scope))
            self.primitives.append(prim)

    def _inline(self, eqn, body, in_atoms, env, scope):
        if isinstance(body, jex.ClosedJaxpr):
            inner, consts = body.jaxpr, body.consts
        else:
            inner, consts = body, ()
        inner_env: dict = {}
        for var, value in zip(inner.constvars, consts):
            inner_env[var] = self.add_const(var.aval, value)
        for var, atom in zip(inner.invars, in_atoms):
            inner_env[var] = atom
        self.walk(inner, inner_env, scope)
        for outer, inner_out in zip(eqn.outvars, inner.outvars):
            env[outer] = inner_out if isinstance(inner_out, jex.Literal) else inner_env[inner_out]

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _unroll_scan(self, eqn, in_atoms, env, scope):
        """Appends the scan's iterations one after the other (see the module docstring)."""
        p = eqn.params
        body, length = p["jaxpr"], p["length"]
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        consts = in_atoms[:n_consts]
        carry = list(in_atoms[n_consts:n_consts + n_carry])
        xs = in_atoms[n_consts + n_carry:]
        body_consts = [self.add_const(v.aval, c)
                       for v, c in zip(body.jaxpr.constvars, body.consts)]
        ys: list[list] = [[None] * length for _ in body.jaxpr.outvars[n_carry:]]
        for i in (reversed(range(length)) if p["reverse"] else range(length)):
            iter_scope = f"{scope}/iter{i}" if scope else f"iter{i}"
            x_i = [self.emit(lambda a, i=i: jax.lax.index_in_dim(a, i, 0, keepdims=False),
                             [x], iter_scope)[0] for x in xs]
            inner_env: dict = dict(zip(body.jaxpr.constvars, body_consts))
            inner_env.update(zip(body.jaxpr.invars, list(consts) + carry + x_i))
            self.walk(body.jaxpr, inner_env, iter_scope)
            outs = [v if isinstance(v, jex.Literal) else inner_env[v]
                    for v in body.jaxpr.outvars]
            carry = outs[:n_carry]
            for k, y in enumerate(outs[n_carry:]):
                ys[k][i] = y
        stacked = [self.emit(lambda *a: jnp.stack(a), per_iter, scope)[0] for per_iter in ys]
        for outer, atom in zip(eqn.outvars, carry + stacked):
            env[outer] = atom

    def emit(self, fn: Callable, atoms: Sequence[Any], scope: str) -> list:
        """Appends the equations of `fn` applied to `atoms` (tensor ids or literals);
        returns its results' atoms. How tracing writes glue such as slicing and stacking."""
        structs = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype)
                   if isinstance(a, jex.Literal) else
                   jax.ShapeDtypeStruct(self.tensors[a].shape, as_dtype(self.tensors[a].dtype))
                   for a in atoms]
        closed = jax.make_jaxpr(fn)(*structs)
        inner_env: dict = {v: self.add_const(v.aval, c)
                           for v, c in zip(closed.jaxpr.constvars, closed.consts)}
        inner_env.update(zip(closed.jaxpr.invars, atoms))
        self.walk(closed.jaxpr, inner_env, scope)
        return [v if isinstance(v, jex.Literal) else inner_env[v] for v in closed.jaxpr.outvars]

    def add_const(self, aval, value) -> int:
        tid = self.new_tensor(aval, role=Role.CONST)
        self.consts[tid] = value
        return tid


# A scan runs unrolled (see the module docstring) when it iterates at most this many times;
# 128 covers the deepest published transformer stacks (GPT-3 175B has 96 layers) while
# keeping a long scan over time steps a loop.
MAX_UNROLLED_ITERATIONS = 128
# Primitives that make a loop body "matrix work": a stack of layers rather than a loop of
# cheap element-wise updates.
_MATRIX_WORK = frozenset({"dot_general", "conv_general_dilated"})


def unrolls(params: Mapping[str, Any]) -> bool:
    """Whether tracing unrolls a scan with these parameters."""
    return (1 <= params["length"] <= MAX_UNROLLED_ITERATIONS
            and _does_matrix_work(params["jaxpr"].jaxpr))


def _does_matrix_work(jaxpr) -> bool:
    return any(e.primitive.name in _MATRIX_WORK or
               any(_does_matrix_work(sub) for sub in sub_jaxprs(e.params))
               for e in jaxpr.eqns)


def sub_jaxprs(params: Mapping[str, Any]) -> list:
    """The jaxprs an equation's parameters hold (loop and branch bodies, called functions),
    unwrapped from their `ClosedJaxpr`s."""
    found = []
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, jex.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex.Jaxpr):
                found.append(item)
    return found


def _nbytes(aval) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    return math.prod(shape) * dtype_itemsize(dtype_name(dtype))


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _jaxpr_flops(body) -> float:
    jaxpr = body.jaxpr if isinstance(body, jex.ClosedJaxpr) else body
    total = 0.0
    for e in jaxpr.eqns:
        total += count_flops(e.primitive.name, e.params,
                             [v.aval for v in e.invars], [v.aval for v in e.outvars])
    return total


def count_flops(name: str, params: Mapping[str, Any], in_avals: Sequence, out_avals: Sequence
                ) -> float:
    """FLOPs of one equation, counted from shapes (a multiply-add is 2 FLOPs).

    dot_general: 2 x output size x product of contracted dims. conv: 2 x output size x
    input features per group x kernel window. Loops and calls: their body, times the trip
    count for scan. Everything else: one FLOP per output (or input, for reductions) element.
    """
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        k = math.prod(in_avals[0].shape[d] for d in lhs_contract)
        return 2.0 * _size(out_avals[0]) * k
    if name == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs_shape = in_avals[1].shape
        in_feat = rhs_shape[dn.rhs_spec[1]]
        window = math.prod(rhs_shape[d] for d in dn.rhs_spec[2:])
        # batch_group_count > 1 (weight gradients) contracts over the batch instead.
        return 2.0 * _size(out_avals[0]) * in_feat * window
    if name == "scan":
        return params["length"] * _jaxpr_flops(params["jaxpr"])
    if name == "while":
        # The trip count is unknown at trace time: count one iteration, as XLA does.
        return _jaxpr_flops(params["body_jaxpr"]) + _jaxpr_flops(params["cond_jaxpr"])
    if name == "cond":
        return max(_jaxpr_flops(b) for b in params["branches"])
    for key in ("jaxpr", "call_jaxpr"):
        if key in params and isinstance(params[key], (jex.ClosedJaxpr, jex.Jaxpr)):
            return _jaxpr_flops(params[key])
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        return float(sum(_size(a) for a in in_avals))
    return float(sum(_size(a) for a in out_avals))


def _keystr(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return "/".join(parts)


def _arg_names(fn: Callable, nargs: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(nargs):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY,
                                                    params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"arg{i}")
    return names


def _to_abstract(leaf, where: str):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)
    if isinstance(leaf, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct((), jnp.asarray(leaf).dtype)
    raise TypeError(f"{where} is a {type(leaf).__name__}, not an array; every argument leaf "
                    "of a parallelized step must be a jax.Array, numpy array, Python scalar "
                    "or jax.ShapeDtypeStruct. Pass static values through a closure or "
                    "functools.partial instead.")


def trace(fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
          capture: bool = False) -> TracedStep:
    """Traces `fn(*args)` into a flat graph without running it.

    Args:
      fn: the train step.
      args: positional arguments; array leaves or `jax.ShapeDtypeStruct`s.
      batch_argnums: which positional arguments hold the batch (their leaves get
        `Role.BATCH`; the batch must be array-valued).
      capture: record `al.value_and_grad` calls as one `alpa_grad_call` node each instead
        of differentiating (for pipelining; see `markers.capture_grad_calls`).

    Returns:
      The `TracedStep`.
    """
    names = _arg_names(fn, len(args))
    abstract_args = []
    input_names: list[str] = []
    batch_leaf = []
    for i, arg in enumerate(args):
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
        leaves = []
        for path, leaf in paths_leaves:
            where = f"{names[i]}{('/' + _keystr(path)) if path else ''}"
            leaves.append(_to_abstract(leaf, f"argument {where}"))
            input_names.append(where)
            batch_leaf.append(i in batch_argnums)
        abstract_args.append(jax.tree_util.tree_unflatten(treedef, leaves))
    flat_abstract, in_tree = jax.tree_util.tree_flatten(tuple(abstract_args))

    calls: list = []
    try:
        if capture:
            # A fresh function object: JAX caches traces per function, and a capturing trace
            # must neither reuse nor leave behind the plain one.
            with capture_grad_calls() as calls:
                closed, out_shape = jax.make_jaxpr(lambda *a: fn(*a),
                                                   return_shape=True)(*abstract_args)
        else:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract_args)
    except (TypeError, ValueError) as e:
        if "PRNG key data" not in str(e):
            raise
        raise _bad_key_data(e, input_names, flat_abstract) from e
    out_tree = jax.tree_util.tree_structure(out_shape)

    roles = [Role.BATCH if is_batch else Role.OPT_STATE for is_batch in batch_leaf]
    b, input_ids, output_ids = _build(closed, roles, input_names, distinct_outputs=False)
    _eliminate_dead_code(b, input_ids, output_ids, b.boundaries)
    tensors = list(b.tensors)
    # A random key handed in with the batch is not batch data: it is never split over the
    # batch (each device and micro-batch draws from the whole step's key).
    for tid in random_key_inputs(b.nodes, tensors, input_ids):
        if tensors[tid].role is Role.BATCH:
            tensors[tid] = tensors[tid].replace(role=Role.OPT_STATE)
    for tid, role in b.roles.items():
        t = tensors[tid]
        if role is Role.PARAM and t.role is Role.OPT_STATE:
            tensors[tid] = t.replace(role=Role.PARAM)
        elif role is Role.GRAD and t.role is Role.ACTIVATION:
            tensors[tid] = t.replace(role=Role.GRAD)
    out_paths = [_keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    for pos, tid in enumerate(output_ids):
        t = tensors[tid]
        if t.role is Role.ACTIVATION:
            tensors[tid] = t.replace(name=f"out/{out_paths[pos]}" if out_paths[pos] else "out")

    graph = OpGraph(tensors=tuple(tensors), nodes=tuple(b.nodes), inputs=tuple(input_ids),
                    outputs=tuple(output_ids),
                    output_ties=_tie_outputs(args, out_shape, in_tree))
    input_avals = tuple((tuple(a.shape), dtype_name(a.dtype)) for a in flat_abstract)
    return TracedStep(graph=graph, primitives=tuple(b.primitives),
                      literals=MappingProxyType(b.literals), consts=MappingProxyType(b.consts),
                      in_tree=in_tree, out_tree=out_tree, input_avals=input_avals,
                      fingerprint=graph_fingerprint(graph), boundaries=tuple(b.boundaries),
                      grad_calls=tuple(calls), notes=tuple(b.notes),
                      grad_leaves=tuple(b.grad_leaves),
                      sharding_constraints=b.sharding_constraints)


def _bad_key_data(error: Exception, names: Sequence[str], avals: Sequence[Any]) -> TypeError:
    """JAX's error for a raw key of the wrong shape, naming the step's argument leaves that
    could be it."""
    want = tuple(jax.random.key_data(jax.random.key(0)).shape)
    bad = [f"{n} {list(a.shape)}" for n, a in zip(names, avals)
           if a.dtype == np.uint32 and tuple(a.shape[len(a.shape) - len(want):]) != want]
    where = f" (uint32 leaves not ending in {list(want)}: {', '.join(bad)})" if bad else ""
    return TypeError(
        f"a random key argument is not a key{where}: a raw key from jax.random.PRNGKey is "
        f"uint32 with trailing shape {list(want)}; pass jax.random.PRNGKey(seed) or "
        f"jax.random.key(seed) as it comes. JAX said: {error}")


# Operator parameters that pin a result's sharding (sharding-in-types under a mesh).
_RESULT_SHARDINGS = ("sharding", "out_sharding")


# Primitives that read a raw uint32 key (`jax.random.PRNGKey`) as key data.
_KEY_READERS = frozenset({"random_wrap", "threefry2x32", "random_bits", "random_split",
                          "random_fold_in"})


def random_key_inputs(nodes, tensors, input_ids) -> list[int]:
    """The step inputs that are random keys: typed keys (`jax.random.key`), and uint32
    arrays read as key data (`jax.random.PRNGKey`)."""
    readers: dict[int, set[str]] = {}
    for node in nodes:
        for t in node.inputs:
            if t is not None:
                readers.setdefault(t, set()).add(node.primitive)
    return [tid for tid in input_ids
            if is_key(tensors[tid].dtype)
            or (tensors[tid].dtype == "uint32" and readers.get(tid, set()) & _KEY_READERS)]


def trace_flat(fn: Callable, avals: Sequence[Any], roles: Sequence[Role],
               names: Sequence[str], batch_draws: Sequence[bool] = ()) -> TracedStep:
    """Traces `fn(*leaves)` (array leaves in, a flat tuple of arrays out) into a graph
    whose inputs carry the given roles; used for the pieces of a pipelined step.

    The pieces are differentiated later (`jax.vjp` of their replay), so a function with a
    custom derivative (`jax.custom_vjp`, `jax.custom_jvp`: a straight-through estimator,
    jax.nn.relu's derivative at 0) stays one node, whose replay brings its rule along;
    inlined, its body would be differentiated instead, silently.

    With `batch_draws` (per `random_bits` equation in trace order, whether its leading
    dimension is the batch's), the graph gets one more input, last: the micro-batch's row
    indices into the batch (uint32, a batch leaf), and the marked draws become
    `batch_draws.batch_bits_p`, which draw from those rows what the whole batch's draw
    holds there."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    rows = any(batch_draws)
    if rows:
        batch = next(a.shape[0] for a, r in zip(avals, roles) if r is Role.BATCH and a.shape)
        structs.append(jax.ShapeDtypeStruct((batch,), np.uint32))
        roles, names = list(roles) + [Role.BATCH], list(names) + ["micro-batch rows"]
        closed = jax.make_jaxpr(lambda *xs: fn(*xs[:-1]))(*structs)
    else:
        closed = jax.make_jaxpr(fn)(*structs)
    b, input_ids, output_ids = _build(closed, roles, names, distinct_outputs=True,
                                      batch_draws=batch_draws if rows else (),
                                      keep_custom_rules=True)
    boundaries = list(b.boundaries)
    _eliminate_dead_code(b, input_ids, output_ids, boundaries)
    tensors = list(b.tensors)
    for tid, role in b.roles.items():
        if tensors[tid].role is Role.ACTIVATION:
            tensors[tid] = tensors[tid].replace(role=role)
    graph = OpGraph(tensors=tuple(tensors), nodes=tuple(b.nodes), inputs=tuple(input_ids),
                    outputs=tuple(output_ids), output_ties=(None,) * len(output_ids))
    return TracedStep(graph=graph, primitives=tuple(b.primitives),
                      literals=MappingProxyType(b.literals), consts=MappingProxyType(b.consts),
                      in_tree=jax.tree_util.tree_structure(tuple(structs)),
                      out_tree=jax.tree_util.tree_structure(tuple(output_ids)),
                      input_avals=tuple((tuple(a.shape), dtype_name(a.dtype)) for a in structs),
                      fingerprint=graph_fingerprint(graph), boundaries=tuple(boundaries),
                      notes=tuple(b.notes), draw_shapes=tuple(b.draw_shapes),
                      sharding_constraints=b.sharding_constraints)


def sink_batch_free_work(traced: TracedStep) -> TracedStep:
    """The same program with every operator that reads no batch data (a weight cast to
    bfloat16, a key folded, a mask built) moved to just before its first reader.

    Loss functions often prepare all weights first (`jax.tree.map(lambda p: p.astype(bf16),
    params)`); in trace order that work sits in the first layer, so a pipeline's first stage
    would compute every later stage's weight copies and send them across each micro-batch.
    Moved to its reader, it runs on the stage that uses it, and repeated layers look alike.
    """
    g = traced.graph
    on_batch = {t.id for t in g.tensors if t.role is Role.BATCH}
    free = []
    for node in g.nodes:
        if any(t in on_batch for t in node.inputs if t is not None):
            on_batch.update(node.outputs)
            free.append(False)
        else:
            free.append(True)
    maker = {t: n.id for n in g.nodes for t in n.outputs}
    order: list[int] = []
    placed = [False] * len(g.nodes)

    def place(i: int) -> None:
        stack = [(i, False)]
        while stack:       # producers first (iteratively: chains can be long)
            j, ready = stack.pop()
            if placed[j]:
                continue
            if ready:
                placed[j] = True
                order.append(j)
                continue
            stack.append((j, True))
            stack.extend((maker[t], False) for t in reversed(g.nodes[j].inputs)
                         if t is not None and t in maker and not placed[maker[t]])

    new_at: dict[int, int] = {}
    for node in g.nodes:
        if not free[node.id]:
            new_at[node.id] = len(order)
            place(node.id)
    for node in g.nodes:
        place(node.id)
    if order == list(range(len(g.nodes))):
        return traced
    pos = {old: new for new, old in enumerate(order)}
    nodes = tuple(g.nodes[old].renumbered(new) for new, old in enumerate(order))
    # A boundary before old node i stays before the first batch-reading node from i on.
    kept = sorted(new_at)
    boundaries = []
    for b in traced.boundaries:
        k = bisect.bisect_left(kept, b)
        if k < len(kept):
            boundaries.append(new_at[kept[k]])
    graph = dataclasses.replace(g, nodes=nodes)
    return dataclasses.replace(
        traced, graph=graph, primitives=tuple(traced.primitives[old] for old in order),
        literals=MappingProxyType({(pos[n], p): v for (n, p), v in traced.literals.items()}),
        boundaries=tuple(sorted(set(b for b in boundaries if 0 < b < len(order)))),
        fingerprint=graph_fingerprint(graph))


def _build(closed, roles: Sequence[Role], names: Sequence[str], distinct_outputs: bool,
           batch_draws: Sequence[bool] = (), keep_custom_rules: bool = False):
    """Walks a closed jaxpr into a `_Builder`: its inputs get `roles` and `names`, its
    constants become CONST tensors. Returns the builder, the input ids and the output ids.

    A result that is a literal or an untouched input (or, with `distinct_outputs`, repeats an
    earlier result) still needs its own tensor: it is materialised with a copy, so every
    output has a producer of its own.
    """
    b = _Builder()
    env: dict = {}
    input_ids = []
    for var, role, name in zip(closed.jaxpr.invars, roles, names):
        tid = b.new_tensor(var.aval, name, role)
        env[var] = tid
        input_ids.append(tid)
    for var, value in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = b.add_const(var.aval, value)
    if batch_draws:
        b.batch_draws, b.rows = tuple(batch_draws), input_ids[-1]
    b.keep_custom_rules = keep_custom_rules
    b.walk(closed.jaxpr, env)
    output_ids: list[int] = []
    for v in closed.jaxpr.outvars:
        atom = v if isinstance(v, jex.Literal) else env[v]
        if isinstance(atom, jex.Literal) or atom in input_ids or \
                (distinct_outputs and atom in output_ids):
            atom = _materialise(b, atom, v.aval)
        output_ids.append(atom)
    return b, input_ids, output_ids


def _eliminate_dead_code(b: _Builder, input_ids: list[int], output_ids: list[int],
                         boundaries: list[int] | None = None) -> None:
    """Drops equations whose results nothing needs (make_jaxpr keeps them, e.g. the unused
    tangent seeds of a jvp) and the tensors only they touched; renumbers the nodes."""
    needed = set(output_ids)
    keep = []
    for node in reversed(b.nodes):
        if any(t in needed for t in node.outputs):
            keep.append(node.id)
            needed.update(t for t in node.inputs if t is not None)
    keep.reverse()
    node_map = {old: new for new, old in enumerate(keep)}
    used = set(input_ids) | needed | {t for i in keep for t in b.nodes[i].outputs}
    tensor_map = {old.id: new for new, old in enumerate(t for t in b.tensors if t.id in used)}
    b.tensors = [t.renumbered(tensor_map[t.id]) for t in b.tensors if t.id in used]
    nodes = []
    for i in keep:
        n = b.nodes[i]
        nodes.append(n.renumbered(
            node_map[i], tuple(None if t is None else tensor_map[t] for t in n.inputs),
            tuple(tensor_map[t] for t in n.outputs)))
    b.primitives = [b.primitives[i] for i in keep]
    b.literals = {(node_map[n], p): v for (n, p), v in b.literals.items() if n in node_map}
    b.consts = {tensor_map[t]: v for t, v in b.consts.items() if t in tensor_map}
    b.roles = {tensor_map[t]: r for t, r in b.roles.items() if t in tensor_map}
    # A gradient leaf nothing reads is dropped with its operators: like a literal leaf, it
    # needs no exchange (None).
    b.grad_leaves = [tuple(tensor_map.get(t) if t is not None else None for t in call)
                     for call in b.grad_leaves]
    b.nodes = nodes
    if boundaries is not None:
        # A boundary before old node i sits before the first kept node at or after i.
        kept = sorted(node_map)
        moved = [bisect.bisect_left(kept, i) for i in boundaries]
        boundaries[:] = sorted(set(m for m in moved if 0 < m < len(kept)))
    # The callers' id lists are renumbered in place.
    input_ids[:] = [tensor_map[t] for t in input_ids]
    output_ids[:] = [tensor_map[t] for t in output_ids]


def _materialise(b: _Builder, atom, aval) -> int:
    node_id = len(b.nodes)
    out = b.new_tensor(aval)
    if isinstance(atom, jex.Literal):
        b.literals[(node_id, 0)] = atom.val
        inputs = (None,)
    else:
        inputs = (atom,)
    prim = jax.lax.copy_p
    b.nodes.append(Node(id=node_id, primitive=prim.name, inputs=inputs, outputs=(out,),
                        params=MappingProxyType({}), flops=0.0,
                        bytes_accessed=2.0 * _nbytes(aval)))
    b.primitives.append(prim)
    return out


def _tie_outputs(args, out_shape, in_tree) -> tuple[int | None, ...]:
    """Pairs each result leaf with the input leaf it replaces in the next step.

    A top-level result (the step returns a tuple) is tied to the first positional argument
    with the same tree structure and leaf shapes and dtypes: new params to params, new
    optimizer state to optimizer state. This is how a training loop feeds a step, so giving
    the pair one sharding saves a reshard per step.
    """
    top = out_shape if isinstance(out_shape, (tuple, list)) else (out_shape,)
    arg_offsets, offset = [], 0
    arg_sigs = []
    for a in args:
        leaves, treedef = jax.tree_util.tree_flatten(a)
        arg_offsets.append(offset)
        offset += len(leaves)
        arg_sigs.append((treedef, tuple(_leaf_sig(x) for x in leaves)))
    ties: list[int | None] = []
    used: set[int] = set()
    for res in top:
        leaves, treedef = jax.tree_util.tree_flatten(res)
        sig = (treedef, tuple(_leaf_sig(x) for x in leaves))
        match = next((i for i, s in enumerate(arg_sigs) if s == sig and i not in used
                      and leaves), None)
        if match is None:
            ties.extend([None] * len(leaves))
        else:
            used.add(match)
            ties.extend(arg_offsets[match] + j for j in range(len(leaves)))
    return tuple(ties)


def _leaf_sig(x) -> tuple[tuple[int, ...], str]:
    dtype = getattr(x, "dtype", None)
    return tuple(np.shape(x)), dtype_name(dtype if dtype is not None else np.asarray(x).dtype)


def graph_fingerprint(graph: OpGraph) -> str:
    """A hash of the graph's structure: shapes, dtypes and roles, operators and wiring."""
    h = hashlib.sha256()
    for t in graph.tensors:
        h.update(f"{t.shape}{t.dtype}{t.role.value}".encode())
    for n in graph.nodes:
        h.update(f"{n.primitive}{n.inputs}{n.outputs}".encode())
    return h.hexdigest()[:16]
