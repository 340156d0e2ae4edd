"""The graph IR the planner works on: tensors, operator nodes, and what each input is.

An `OpGraph` is a flat, topologically ordered list of operator nodes (one per primitive
equation after nested calls are inlined) over numbered tensors. It carries what the cost
model needs (shapes, dtypes, FLOPs, bytes) and what the planner needs to tell parameters,
optimizer state, batch and gradients apart. It is built by `alpa_lite.ir.tracing.trace`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import weakref
from types import MappingProxyType
from typing import Any, Callable, Mapping, TypeVar

import jax
import numpy as np


class Role(enum.Enum):
    """What a tensor is to the training step."""
    PARAM = "param"            # an input differentiated by al.value_and_grad / al.grad
    OPT_STATE = "opt_state"    # any other input that is not the batch
    BATCH = "batch"            # a leaf of the batch argument(s)
    GRAD = "grad"              # a gradient produced by al.value_and_grad / al.grad
    CONST = "const"            # a constant captured by the traced function
    ACTIVATION = "activation"  # everything else


# JAX's extended dtypes met while tracing (typed PRNG keys: "key<fry>"), by name: numpy
# cannot interpret their names, so the graph keeps the dtype objects to rebuild avals.
_EXTENDED_DTYPES: dict[str, Any] = {}


# Names and item sizes by dtype: tracing asks for them once per tensor and operand (tens
# of thousands of times per trace), and numpy's and JAX's dtype checks cost microseconds.
_NAMES: dict[Any, str] = {}
_ITEMSIZES: dict[str, int] = {}


def dtype_name(dtype: Any) -> str:
    """The graph's name for a dtype: numpy's ("float32"), or JAX's own for its extended
    dtypes (typed PRNG keys: "key<fry>")."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):      # TypeError: an unhashable dtype-like (a list)
        pass
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        _EXTENDED_DTYPES[str(dtype)] = dtype
        name = str(dtype)
    else:
        name = str(np.dtype(dtype))
    try:
        _NAMES[dtype] = name
    except TypeError:
        pass
    return name


def as_dtype(name: str) -> Any:
    """The dtype `dtype_name` named (for `jax.ShapeDtypeStruct`)."""
    if name in _EXTENDED_DTYPES:
        return _EXTENDED_DTYPES[name]
    return np.dtype(name)


def dtype_itemsize(name: str) -> int:
    """Bytes per element; a typed key holds its implementation's uint32 words."""
    if name not in _ITEMSIZES:
        d = as_dtype(name)
        _ITEMSIZES[name] = int(np.prod(d._impl.key_shape)) * 4 \
            if jax.dtypes.issubdtype(d, jax.dtypes.extended) else d.itemsize
    return _ITEMSIZES[name]


def is_key(name: str) -> bool:
    """Whether a dtype name is a typed PRNG key's."""
    return name in _EXTENDED_DTYPES


@dataclasses.dataclass(frozen=True, slots=True)
class Tensor:
    """One value of the program. `shape` is the global (unsharded) shape."""
    id: int
    shape: tuple[int, ...]
    dtype: str
    name: str
    role: Role = Role.ACTIVATION

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * dtype_itemsize(self.dtype)

    def replace(self, **kw) -> "Tensor":
        return dataclasses.replace(self, **kw)

    def renumbered(self, id: int) -> "Tensor":
        """This tensor under another id: `replace(id=...)` by the constructor, several
        times faster (a large step's trace renumbers tens of thousands). Kept beside the
        fields, so that a field added is carried here too."""
        return Tensor(id, self.shape, self.dtype, self.name, self.role)


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One primitive application.

    `inputs` holds a tensor id per operand, or None where the operand is a literal.
    `params` are the primitive's parameters, read-only, as JAX gives them.
    """
    id: int
    primitive: str
    inputs: tuple[int | None, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    flops: float
    bytes_accessed: float
    scope: str = ""            # the name stack (jax.named_scope, jvp/transpose markers)

    @property
    def name(self) -> str:
        return f"{self.primitive}_{self.id}"

    def renumbered(self, id: int, inputs: tuple[int | None, ...] | None = None,
                   outputs: tuple[int, ...] | None = None) -> "Node":
        """This node under another id, reading and writing other tensor ids where given
        (as `Tensor.renumbered`)."""
        return Node(id, self.primitive, self.inputs if inputs is None else inputs,
                    self.outputs if outputs is None else outputs, self.params, self.flops,
                    self.bytes_accessed, self.scope)


@dataclasses.dataclass(frozen=True, eq=False)
class OpGraph:
    """A topologically ordered operator graph over numbered tensors."""
    tensors: tuple[Tensor, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]        # tensor ids of the flattened step arguments, in order
    outputs: tuple[int, ...]       # tensor ids of the flattened step results, in order
    # For each output position, the input position it carries into the next step (e.g.
    # new params -> params), or None. The runtime gives both the same sharding.
    output_ties: tuple[int | None, ...]

    def __post_init__(self):
        producers: dict[int, int] = {}
        consumers: dict[int, list[int]] = {t.id: [] for t in self.tensors}
        for node in self.nodes:
            for t in node.outputs:
                producers[t] = node.id
            for t in node.inputs:
                if t is not None:
                    consumers[t].append(node.id)
        object.__setattr__(self, "_producers", MappingProxyType(producers))
        object.__setattr__(self, "_consumers",
                           MappingProxyType({k: tuple(v) for k, v in consumers.items()}))

    def producer(self, tensor_id: int) -> int | None:
        """The node that computes a tensor, or None for inputs and constants."""
        return self._producers.get(tensor_id)

    def consumers(self, tensor_id: int) -> tuple[int, ...]:
        """The nodes that read a tensor, in program order (a node may appear twice)."""
        return self._consumers[tensor_id]

    def tensors_with_role(self, role: Role) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role is role)

    @property
    def total_flops(self) -> float:
        return float(sum(n.flops for n in self.nodes))

    def count_by_primitive(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.primitive] = counts.get(n.primitive, 0) + 1
        return dict(sorted(counts.items()))


_R = TypeVar("_R")


def per_graph(fn: Callable[["OpGraph"], _R]) -> Callable[["OpGraph"], _R]:
    """`fn(graph)` computed once per graph and kept while the graph lives: an `OpGraph` is
    immutable, and the planners ask the same graph-wide facts on every mesh they try."""
    known: "weakref.WeakKeyDictionary[OpGraph, _R]" = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(graph: "OpGraph") -> _R:
        if graph not in known:
            known[graph] = fn(graph)
        return known[graph]
    return cached
