"""Markers that tell the tracer what a value is: parameters, gradients.

`alpa_lite.value_and_grad` and `alpa_lite.grad` are drop-in replacements for the JAX
functions. Besides computing the same values, they wrap the differentiated arguments and
the resulting gradients in an identity primitive, `alpa_marker`, so the traced program says
which inputs are parameters and which values are their gradients. Under plain `jax.jit` the
marker lowers to nothing, so a decorated step runs unchanged outside alpa_lite too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

# What a marker says about the values it wraps.
PARAM = "param"
GRAD = "grad"
MARKER_KINDS = (PARAM, GRAD)

marker_p = Primitive("alpa_marker")
marker_p.multiple_results = True


def _marker_impl(*args, kind: str):
    del kind
    return list(args)


def _marker_abstract_eval(*avals, kind: str):
    del kind
    return list(avals)


def _marker_batching(args, dims, *, kind: str):
    return marker_p.bind(*args, kind=kind), dims


marker_p.def_impl(_marker_impl)
marker_p.def_abstract_eval(_marker_abstract_eval)
batching.primitive_batchers[marker_p] = _marker_batching
mlir.register_lowering(marker_p, lambda ctx, *args, kind: list(args))


def mark(tree: Any, kind: str) -> Any:
    """Returns `tree` unchanged, with every array leaf wrapped in a marker of `kind`."""
    if kind not in MARKER_KINDS:
        raise ValueError(f"unknown marker kind {kind!r}; expected one of {MARKER_KINDS}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(treedef, marker_p.bind(*leaves, kind=kind))


def _normalize_argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   *, micro_batch_statistics: bool = False, **kwargs) -> Callable:
    """Drop-in for `jax.value_and_grad` that marks parameters and gradients.

    Args:
      fun: the loss function.
      argnums: which positional arguments are differentiated (the parameters).
      has_aux: as in `jax.value_and_grad`. Under micro-batched plans each aux leaf is
        combined over the micro-batches by the rule the plan states (`PipelineSpec.aux`).
      micro_batch_statistics: under micro-batched plans, let statistics over the batch
        that per-example values use (BatchNorm's mean and variance) be computed per
        micro-batch, as gradient accumulation computes them; an aux sub-tree shaped like a
        non-differentiated argument (Flax's new `batch_stats`) is then that argument's new
        value, which each micro-batch reads from the one before (running averages updated
        in micro-batch order). This changes the step's math from the whole batch's, so it
        is off unless asked for; plans without micro-batches ignore it.
      **kwargs: passed on to `jax.value_and_grad` (`holomorphic`, `allow_int`, ...).

    Returns:
      A function with the same signature and results as `jax.value_and_grad(fun, ...)`.
    """
    nums = _normalize_argnums(argnums)
    inner = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args, **kw):
        if _HOOKS:
            return _hooked_value_and_grad(inner, nums, has_aux, args, kw)
        if _CAPTURE:
            if kwargs:
                raise NotImplementedError(
                    f"value_and_grad(..., {', '.join(kwargs)}=...) cannot be pipelined; "
                    "use a single stage and one micro-batch")
            return _captured_value_and_grad(fun, nums, has_aux, kw, args,
                                            micro_batch_statistics)
        args = list(args)
        for i in nums:
            if i >= len(args):
                raise TypeError(f"value_and_grad(argnums={argnums}) but the call passed "
                                f"only {len(args)} positional arguments")
            args[i] = mark(args[i], PARAM)
        value, grads = inner(*args, **kw)
        return value, mark(grads, GRAD)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **kwargs) -> Callable:
    """Drop-in for `jax.grad` that marks parameters and gradients (see `value_and_grad`)."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)   # (see there)

    @functools.wraps(fun)
    def wrapped(*args, **kw):
        value, grads = vg(*args, **kw)
        return (grads, value[1]) if has_aux else grads

    return wrapped


# ---- layer boundaries -----------------------------------------------------------------------
#
# `mark_layer_boundary(x)` is the identity on values. Its JVP marks the tangents and its
# transpose marks the cotangents, so a boundary placed in the forward pass appears at the
# mirrored place in the backward pass too, under jax.grad, jax.vjp and jax.jit alike.

boundary_p = Primitive("alpa_layer_boundary")
boundary_p.multiple_results = True
boundary_p.def_impl(lambda *args: list(args))
boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(boundary_p, lambda ctx, *args: list(args))
batching.primitive_batchers[boundary_p] = lambda args, dims: (boundary_p.bind(*args), dims)


def _boundary_jvp(primals, tangents):
    outs = boundary_p.bind(*primals)
    nonzero = [t for t in tangents if not isinstance(t, ad.Zero)]
    marked = iter(boundary_p.bind(*nonzero) if nonzero else [])
    return outs, [t if isinstance(t, ad.Zero) else next(marked) for t in tangents]


def _boundary_transpose(cts, *args):
    nonzero = [c for c in cts if not isinstance(c, ad.Zero)]
    marked = iter(boundary_p.bind(*nonzero) if nonzero else [])
    return [c if isinstance(c, ad.Zero) else next(marked) for c in cts]


ad.primitive_jvps[boundary_p] = _boundary_jvp
ad.primitive_transposes[boundary_p] = _boundary_transpose


def mark_layer_boundary(tree: Any) -> Any:
    """Marks the end of a layer: the values in `tree` are what crosses into the next layer.

    An identity on values (under plain `jax.jit` it compiles to nothing). When the loss
    function of a pipelined step contains boundaries, alpa_lite's layers are the spans
    between them instead of an automatic clustering; the stage DP (or `Manual(pp=...)`)
    then groups consecutive layers into stages. Place one after each transformer block::

        for block in params["blocks"]:
            x = al.mark_layer_boundary(block_fn(block, x))
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(treedef, boundary_p.bind(*leaves))


# ---- the gradient call, captured for pipelining ----------------------------------------------
#
# To pipeline a step, alpa_lite needs the loss function itself (to run it per stage and per
# micro-batch), not the gradient XLA would derive from the whole step. While a
# `capture_grad_calls()` block is active, `value_and_grad` does not differentiate: it records
# the call and binds `grad_call_p`, whose results have the shapes of (value, grads). The
# step's jaxpr then holds one `alpa_grad_call` equation between the code before and after it.

grad_call_p = Primitive("alpa_grad_call")
grad_call_p.multiple_results = True


@dataclasses.dataclass(eq=False)
class GradCall:
    """One captured `al.value_and_grad(fun, argnums, has_aux)(*args)` call.

    The call's argument leaves are split into array leaves (`avals`, the equation's
    operands) and everything else (static: configs, Python numbers), which `loss` closes over.
    Values of the step the loss function closes over (Flax's `def loss_fn(params)` reading
    `batch` from the step) are operands too, after the argument leaves (`num_closed`): the
    loss is then the function as traced at these shapes, replayed, and at another batch
    size the step is traced again (`ir.step_parts.loss_trace`).
    """
    loss: Callable[..., Any]       # loss(*array_leaves, *closed) -> value (or (value, aux))
    grad_leaves: tuple[int, ...]   # per gradient result leaf, the array leaf it differentiates
    has_aux: bool
    num_value_leaves: int          # leaves of value (1, or 1 + aux leaves)
    out_tree: Any                  # of (value, grads)
    avals: tuple[Any, ...]         # per array leaf, then per value closed over
    out_avals: tuple[Any, ...]     # per result leaf: value leaves, then gradient leaves
    micro_batch_statistics: bool = False
    num_closed: int = 0            # the step's values the loss function closes over
    # Per aux leaf: the array leaf (position in `avals`) it is the new value of, where an
    # aux sub-tree has the structure of a non-differentiated argument; else None.
    aux_updates: tuple[int | None, ...] = ()


_CAPTURE: list[list[GradCall]] = []
_SERIAL = itertools.count()


def _grad_call_abstract(*avals, index, serial):
    return list(_CAPTURE[-1][index].out_avals)


grad_call_p.def_abstract_eval(_grad_call_abstract)


def _grad_call_impl(*args, index, serial):
    raise RuntimeError("alpa_grad_call only exists while alpa_lite traces a step for "
                       "pipelining; it cannot be evaluated")


grad_call_p.def_impl(_grad_call_impl)


@contextlib.contextmanager
def capture_grad_calls():
    """While active, `value_and_grad` / `grad` record their calls; yields the list."""
    calls: list[GradCall] = []
    _CAPTURE.append(calls)
    try:
        yield calls
    finally:
        _CAPTURE.pop()


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _captured_value_and_grad(fun, nums, has_aux, kwargs, args,
                             micro_batch_statistics: bool = False):
    calls = _CAPTURE[-1]
    leaves, in_tree = jax.tree_util.tree_flatten(tuple(args))
    arrays = [i for i, x in enumerate(leaves) if _is_array(x)]
    # Leaf positions of the differentiated arguments, in the order jax returns their grads.
    offsets = [0]
    for a in args:
        offsets.append(offsets[-1] + len(jax.tree_util.tree_leaves(a)))
    diff = [j for i in nums for j in range(offsets[i], offsets[i + 1])]
    if any(j not in arrays for j in diff):
        raise TypeError(f"value_and_grad(argnums={nums}): a differentiated argument has a leaf "
                        "that is not an array; every parameter leaf must be a jax or numpy "
                        "array (pass static values through another argument)")
    slot = {j: k for k, j in enumerate(arrays)}

    def loss(*array_leaves):
        full = list(leaves)
        for j, x in zip(arrays, array_leaves):
            full[j] = x
        return fun(*jax.tree_util.tree_unflatten(in_tree, full), **kwargs)

    grad_leaves = tuple(slot[j] for j in diff)
    avals = tuple(jax.typeof(leaves[j]) for j in arrays)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    # Only the forward is traced here: a gradient has its parameter's shape and dtype. The
    # step's values the loss closes over are the trace's constants that are tracers of the
    # step: they become operands, and the loss its trace replayed (`_replayed`).
    closed_jaxpr, value_shape = jax.make_jaxpr(loss, return_shape=True)(*structs)
    closed = [c for c in closed_jaxpr.consts if isinstance(c, jax.core.Tracer)]
    if closed:
        loss = _replayed(closed_jaxpr, jax.tree_util.tree_structure(value_shape))
        avals = avals + tuple(jax.typeof(c) for c in closed)
    grad_tree = tuple(args[i] for i in nums) if len(nums) > 1 else args[nums[0]]
    grads_shape = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(grad_tree), [structs[i] for i in grad_leaves])
    value_leaves = jax.tree_util.tree_leaves(value_shape)
    aux_updates: tuple[int | None, ...] = ()
    if has_aux and micro_batch_statistics:
        candidates = [(args[i], [slot[j] for j in range(offsets[i], offsets[i + 1])])
                      for i in range(len(args)) if i not in nums
                      and all(j in slot for j in range(offsets[i], offsets[i + 1]))
                      and offsets[i + 1] > offsets[i]]
        aux_updates = _state_updates(value_shape[1], candidates)
    call = GradCall(loss=loss, grad_leaves=grad_leaves, has_aux=has_aux,
                    micro_batch_statistics=micro_batch_statistics, aux_updates=aux_updates,
                    num_closed=len(closed),
                    num_value_leaves=len(value_leaves),
                    out_tree=jax.tree_util.tree_structure((value_shape, grads_shape)),
                    avals=avals,
                    out_avals=tuple(jax.core.ShapedArray(x.shape, x.dtype)
                                    for x in value_leaves + [structs[i] for i in grad_leaves]))
    calls.append(call)
    # `serial` makes every captured call's parameters unique: JAX caches abstract
    # evaluation by parameters, and two steps' calls with the same operands may differ in
    # their results (another loss, another aux).
    outs = grad_call_p.bind(*[leaves[j] for j in arrays], *closed, index=len(calls) - 1,
                            serial=next(_SERIAL))
    return jax.tree_util.tree_unflatten(call.out_tree, outs)


def _replayed(closed_jaxpr, value_tree) -> Callable[..., Any]:
    """The loss as `closed_jaxpr` traced it, taking its tracer constants (the step's values
    it closed over) as trailing arguments, in order."""
    jaxpr, consts = closed_jaxpr.jaxpr, closed_jaxpr.consts
    hoisted = [isinstance(c, jax.core.Tracer) for c in consts]
    n = len(jaxpr.invars)

    def loss(*xs):
        given = iter(xs[n:])
        values = [next(given) if h else c for c, h in zip(consts, hoisted)]
        return jax.tree_util.tree_unflatten(value_tree,
                                            jax.core.eval_jaxpr(jaxpr, values, *xs[:n]))
    return loss


def _state_updates(aux, candidates) -> tuple[int | None, ...]:
    """Per leaf of `aux`, the array leaf it is the new value of: where a sub-tree of `aux`
    has the structure, shapes and dtypes of a candidate argument (Flax's `mutable` state
    returned as `{"batch_stats": new}` for an argument `batch_stats`)."""
    def sig(tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)

    sigs = [(sig(arg), slots) for arg, slots in candidates]
    matched: dict[int, list[int]] = {}
    used: set[int] = set()

    def is_state(sub) -> bool:
        if not jax.tree_util.tree_leaves(sub):
            return False
        s = sig(sub)
        for k, (c, slots) in enumerate(sigs):
            if s == c and k not in used:
                used.add(k)
                matched[id(sub)] = slots
                return True
        return False

    out: list[int | None] = []
    for item in jax.tree_util.tree_leaves(aux, is_leaf=is_state):
        if id(item) in matched:
            out.extend(matched[id(item)])
        else:
            out.append(None)
    return tuple(out)


# ---- gradient hooks ------------------------------------------------------------------------
#
# Compressed data parallelism runs the user's step once per worker, on the worker's share of
# the batch, and replaces the gradient all-reduce with its own exchange. While a hook is
# active, `value_and_grad` hands the hook the differentiated arguments before it
# differentiates (so it can keep the gradient local to the worker) and the loss and
# gradients after (to exchange them); the step sees what the hook returns.

_HOOKS: list = []


class GradientHook:
    """What `gradient_hook` calls; subclasses implement both methods."""

    def localize(self, params):
        """The differentiated arguments as the gradient should see them."""
        raise NotImplementedError

    def exchange(self, value, grads):
        """(loss, gradients) of this worker -> (loss, gradients) the step continues with."""
        raise NotImplementedError


@contextlib.contextmanager
def gradient_hook(hook: GradientHook):
    """While active, every `value_and_grad` / `grad` call goes through `hook`."""
    _HOOKS.append(hook)
    try:
        yield hook
    finally:
        _HOOKS.pop()


def _hooked_value_and_grad(inner, nums, has_aux, args, kw):
    if has_aux:
        raise NotImplementedError(
            "value_and_grad(..., has_aux=True) is not supported with gradient compression: "
            "the auxiliary output is computed on one worker's share of the batch, and there "
            "is no exact way to combine it; return it from a separate, uncompressed step")
    hook = _HOOKS[-1]
    args = list(args)
    for i in nums:
        if i >= len(args):
            raise TypeError(f"value_and_grad(argnums={nums}) but the call passed only "
                            f"{len(args)} positional arguments")
        args[i] = hook.localize(args[i])
    value, grads = inner(*args, **kw)
    return hook.exchange(value, grads)
