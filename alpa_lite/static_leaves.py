"""Non-array leaves of a step's arguments and results, held static.

Equinox modules carry their activation functions (and other Python objects) as pytree
leaves, and Equinox's own `eqx.filter_jit` traces the array leaves and holds every other
leaf static. `parallelize` does the same: a step called with such leaves is planned and
run as the step of its array leaves alone (`StaticStep`), once per distinct set of static
values, and its results get their own non-array leaves back. Nothing static is computed
on, so no plan's math depends on it; a static leaf must be hashable, as for `jax.jit`'s
static arguments, since plans are cached by it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np


def is_array_leaf(x: Any) -> bool:
    """A leaf the step computes on: an array, an abstract array or a Python number (which
    `parallelize` makes an array)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct,
                          jax.core.Tracer, bool, int, float, complex))


@dataclasses.dataclass(frozen=True)
class StaticLeaves:
    """The non-array leaves of a pytree: its structure, and each leaf's position among all
    its leaves with its value."""
    treedef: Any
    positions: tuple[int, ...]
    values: tuple[Any, ...]

    def as_none(self) -> "StaticLeaves":
        """The same positions holding None (a pytree shaped like the original, such as
        the arguments' shardings, with nothing at the static leaves)."""
        return dataclasses.replace(self, values=(None,) * len(self.values))

    def restore(self, arrays: list[Any]) -> Any:
        """The pytree from its array leaves, in order, and these static ones."""
        leaves: list[Any] = []
        arrays_left = iter(arrays)
        statics = dict(zip(self.positions, self.values))
        for i in range(self.treedef.num_leaves):
            leaves.append(statics[i] if i in statics else next(arrays_left))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def split_static(tree: Any, what: str,
                 flat: tuple[list, Any] | None = None) -> tuple[Any, StaticLeaves | None]:
    """`tree` with each non-array leaf replaced by None, and those leaves (None where there
    are none). `what` names the tree in errors; `flat`: its (leaves, treedef) where the
    caller has them.

    Raises:
      TypeError: a non-array leaf is not hashable.
    """
    # (Every call of a step passes through here: paths only for an error.)
    leaves, treedef = flat if flat is not None else jax.tree_util.tree_flatten(tree)
    positions = tuple(i for i, x in enumerate(leaves) if not is_array_leaf(x))
    if not positions:
        return tree, None
    for i in positions:
        try:
            hash(leaves[i])
        except TypeError:
            path = jax.tree_util.tree_flatten_with_path(tree)[0][i][0]
            raise TypeError(
                f"{what} leaf {jax.tree_util.keystr(path)} is a {type(leaves[i]).__name__}: "
                "not an array, so it is held static (as eqx.filter_jit holds it), and static "
                "leaves must be hashable; make it an array, or pass it through a closure or "
                "functools.partial") from None
    static = StaticLeaves(treedef, positions, tuple(leaves[i] for i in positions))
    held = set(positions)
    stripped = [None if i in held else x for i, x in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, stripped), static


class StaticStep:
    """`fn` as a step of its arguments' array leaves: called with the non-array leaves of
    `static` as None, it puts them back, runs `fn`, and returns its results with their
    non-array leaves as None, kept in `results` (the same on every trace) for `restore`."""

    def __init__(self, fn: Callable, static: StaticLeaves):
        self.fn = fn
        self.static = static
        self.results: StaticLeaves | None = None
        # Name and docstring only: the function's own attributes would overwrite ours.
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args):
        out = self.fn(*self.static.restore(jax.tree_util.tree_leaves(args)))
        stripped, self.results = split_static(out, "a result")
        return stripped

    def restore(self, out: Any) -> Any:
        """The step's results with their non-array leaves put back."""
        if self.results is None:
            return out
        return self.results.restore(jax.tree_util.tree_leaves(out))
