"""Markers that tell the tracer what a value is: parameters, gradients.

`alpa_lite.value_and_grad` and `alpa_lite.grad` are drop-in replacements for the JAX
functions. Besides computing the same values, they wrap the differentiated arguments and
the resulting gradients in an identity primitive, `alpa_marker`, so the traced program says
which inputs are parameters and which values are their gradients. Under plain `jax.jit` the
marker lowers to nothing, so a decorated step runs unchanged outside alpa_lite too.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

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
                   **kwargs) -> Callable:
    """Drop-in for `jax.value_and_grad` that marks parameters and gradients.

    Args:
      fun: the loss function.
      argnums: which positional arguments are differentiated (the parameters).
      has_aux: as in `jax.value_and_grad`.
      **kwargs: passed on to `jax.value_and_grad` (`holomorphic`, `allow_int`, ...).

    Returns:
      A function with the same signature and results as `jax.value_and_grad(fun, ...)`.
    """
    nums = _normalize_argnums(argnums)
    inner = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args, **kw):
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
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args, **kw):
        value, grads = vg(*args, **kw)
        return (grads, value[1]) if has_aux else grads

    return wrapped
