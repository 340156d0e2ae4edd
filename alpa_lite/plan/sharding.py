"""Sharding specs on a logical mesh, and what it costs to move between them.

A `TensorSpec` says, per tensor dimension, which mesh axes split it (a pure-data twin of
`jax.sharding.PartitionSpec`). `reshard_collectives` lists the collectives that turn one
spec into another, with per-device byte counts defined the way XLA's HLO shapes show them,
so a plan's prediction can be checked against the compiled program:

  all-reduce / all-to-all: bytes of the per-device operand;
  all-gather / reduce-scatter: bytes of the per-device result.

Sharding a dimension that was replicated is a local slice and costs nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.collectives import (
    AxisTopology,
    CollectiveKind,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    mesh_axis_topology,
    reduce_scatter_time,
)


@dataclasses.dataclass(frozen=True, slots=True)
class LogicalMesh:
    """A logical device mesh: axis sizes and names over a contiguous block of devices."""
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_offset: int = 0

    def __post_init__(self):
        if len(self.shape) != len(self.axis_names):
            raise ValueError(f"mesh shape {self.shape} has {len(self.shape)} axes but "
                             f"axis_names {self.axis_names} has {len(self.axis_names)}")
        if any(s < 1 for s in self.shape):
            raise ValueError(f"mesh shape {self.shape} has an axis smaller than 1")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names {self.axis_names} repeat a name")

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_names.index(name)]

    def sharded_axes(self) -> tuple[str, ...]:
        """Axes with more than one device (the only ones worth sharding over)."""
        return tuple(n for n, s in zip(self.axis_names, self.shape) if s > 1)

    def __reduce__(self):
        # Pickled by its constructor's arguments: a frozen dataclass with slots otherwise
        # pickles through `dataclasses.fields()` once per object, several times slower,
        # and every answer of the planning workers holds meshes, specs and collectives by
        # the thousand.
        return LogicalMesh, (self.shape, self.axis_names, self.device_offset)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """Per dimension, the mesh axes that split it (outermost first); () = replicated."""
    dims: tuple[tuple[str, ...], ...]

    @staticmethod
    def replicated(rank: int) -> "TensorSpec":
        return TensorSpec(((),) * rank)

    @property
    def rank(self) -> int:
        return len(self.dims)

    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    def dim_of(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def num_shards(self, mesh: LogicalMesh) -> int:
        return math.prod(mesh.axis_size(a) for a in self.axes())

    def local_shape(self, shape: Sequence[int], mesh: LogicalMesh) -> tuple[int, ...]:
        return tuple(s // math.prod(mesh.axis_size(a) for a in d)
                     for s, d in zip(shape, self.dims))

    def is_replicated(self) -> bool:
        return not self.axes()

    def to_json(self) -> list:
        return [list(d) for d in self.dims]

    @staticmethod
    def from_json(obj) -> "TensorSpec":
        if not isinstance(obj, list) or not all(
                isinstance(d, list) and all(isinstance(a, str) for a in d) for d in obj):
            raise ValueError(f"a tensor spec must be a list of lists of axis names, got {obj!r}")
        return TensorSpec(tuple(tuple(d) for d in obj))

    def __reduce__(self):
        return TensorSpec, (self.dims,)     # as LogicalMesh.__reduce__

    def __str__(self) -> str:
        if self.is_replicated():
            return "R" if self.dims else "scalar"
        parts = []
        for d in self.dims:
            parts.append("-" if not d else d[0] if len(d) == 1 else "(" + ",".join(d) + ")")
        return "[" + ",".join(parts) + "]"


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveOp:
    """One collective the plan predicts: kind, the mesh axes it spans, bytes, time."""
    kind: CollectiveKind
    axes: tuple[str, ...]
    nbytes: int
    time_s: float

    def __reduce__(self):
        return CollectiveOp, (self.kind, self.axes, self.nbytes, self.time_s)  # as above


class CommModel:
    """Collective times over the axes of one logical mesh laid on a cluster."""

    def __init__(self, cluster: Cluster, mesh: LogicalMesh):
        self.cluster = cluster
        self.mesh = mesh
        self._topo = {name: mesh_axis_topology(cluster, mesh.shape, i, mesh.device_offset)
                      for i, name in enumerate(mesh.axis_names)}

    def topology(self, axis: str) -> AxisTopology:
        """How the groups along one mesh axis sit on the cluster's links."""
        return self._topo[axis]

    def _inner_first(self, axes: Sequence[str]) -> list[str]:
        return sorted(axes, key=lambda a: -self.mesh.axis_names.index(a))

    def all_reduce(self, nbytes: float, axes: Sequence[str]) -> float:
        """All-reduce over several axes: reduce-scatter inside the innermost, all-reduce the
        shard over the rest, all-gather back (the hierarchical algorithm)."""
        axes = self._inner_first(axes)
        if not axes or nbytes == 0:
            return 0.0
        inner, rest = axes[0], axes[1:]
        if not rest:
            return all_reduce_time(nbytes, self._topo[inner])
        n = self.mesh.axis_size(inner)
        return (reduce_scatter_time(nbytes, self._topo[inner])
                + self.all_reduce(nbytes / n, rest)
                + all_gather_time(nbytes, self._topo[inner]))

    def all_gather(self, nbytes: float, axes: Sequence[str]) -> float:
        """All-gather whose per-device result is `nbytes`: outer axes first, then inner."""
        total, size = 0.0, nbytes
        for a in self._inner_first(axes):
            total += all_gather_time(size, self._topo[a])
            size /= self.mesh.axis_size(a)
        return total

    def reduce_scatter(self, nbytes: float, axes: Sequence[str]) -> float:
        """Reduce-scatter whose per-device result is `nbytes`: inner axes first."""
        total, size = 0.0, nbytes * math.prod(self.mesh.axis_size(a) for a in axes)
        for a in self._inner_first(axes):
            total += reduce_scatter_time(size, self._topo[a])
            size /= self.mesh.axis_size(a)
        return total

    def all_to_all(self, nbytes: float, axes: Sequence[str]) -> float:
        return sum(all_to_all_time(nbytes, self._topo[a]) for a in axes)

    def op(self, kind: CollectiveKind, nbytes: float, axes: Sequence[str]) -> CollectiveOp:
        if kind is CollectiveKind.ALL_REDUCE:
            t = self.all_reduce(nbytes, axes)
        elif kind is CollectiveKind.ALL_GATHER:
            t = self.all_gather(nbytes, axes)
        elif kind is CollectiveKind.ALL_TO_ALL:
            t = self.all_to_all(nbytes, axes)
        elif kind is CollectiveKind.REDUCE_SCATTER:
            t = self.reduce_scatter(nbytes, axes)
        else:
            raise ValueError(f"no cost rule for {kind} in a reshard")
        return CollectiveOp(kind, tuple(axes), int(nbytes), float(t))


def itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys (threefry: two uint32 words)
        return 8


def reshard_collectives(shape: Sequence[int], dtype: str, src: TensorSpec, dst: TensorSpec,
                        comm: CommModel) -> tuple[CollectiveOp, ...]:
    """The collectives that turn a tensor sharded as `src` into `dst` (empty if free).

    An axis that is dropped is an all-gather; an axis that moves from one dimension to
    another is an all-to-all; an axis that is added is a local slice.
    """
    if src == dst:
        return ()
    mesh = comm.mesh
    total = math.prod(shape) * itemsize(dtype)
    if total == 0:
        return ()
    ops: list[CollectiveOp] = []
    moved, dropped = [], []
    for a in src.axes():
        d_src, d_dst = src.dim_of(a), dst.dim_of(a)
        if d_dst is None:
            dropped.append(a)
        elif d_dst != d_src or src.dims[d_src].index(a) != dst.dims[d_dst].index(a):
            moved.append(a)
    local = total / src.num_shards(mesh)
    if moved and not _simple_move(src, dst, moved):
        # XLA moves an axis with an all-to-all only when it is the minor-most split of
        # both dimensions and nothing else changes there; otherwise it gathers what moves
        # and slices again (SPMD "involuntary full rematerialization"): that is the cost.
        dropped, moved = dropped + moved, []
    # XLA gathers first, one dimension at a time, the last dimension first (the axes that
    # split one dimension are gathered together), then moves axes on the gathered value.
    size = local
    for d in reversed(range(src.rank)):
        axes = [a for a in src.dims[d] if a in dropped]
        if axes:
            size *= math.prod(mesh.axis_size(a) for a in axes)
            ops.append(comm.op(CollectiveKind.ALL_GATHER, size, axes))
    groups: dict[tuple[int, int], list[str]] = {}
    for a in moved:
        groups.setdefault((src.dim_of(a), dst.dim_of(a)), []).append(a)
    for axes in groups.values():
        ops.append(comm.op(CollectiveKind.ALL_TO_ALL, size, axes))
    return tuple(ops)


def _simple_move(src: TensorSpec, dst: TensorSpec, moved: Sequence[str]) -> bool:
    """Whether XLA moves these axes with all-to-alls: the axes moving between one pair of
    dimensions must be the minor-most splits of both, in the same order, with nothing
    else changing on those two dimensions (after the gathers)."""
    src_dims = list(src.dims)
    groups: dict[tuple[int, int], list[str]] = {}
    for a in moved:
        groups.setdefault((src.dim_of(a), dst.dim_of(a)), []).append(a)
    for (d1, d2), axes in groups.items():
        m = tuple(a for a in src_dims[d1] if a in axes)
        if len(m) != len(axes):
            return False
        if (src_dims[d1][len(src_dims[d1]) - len(m):] != m or dst.dims[d1] != src_dims[d1][:-len(m)]
                or dst.dims[d2][len(dst.dims[d2]) - len(m):] != m
                or dst.dims[d2][:-len(m)] != src_dims[d2]):
            return False
    return True
