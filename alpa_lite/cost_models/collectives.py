"""Collective communication costs: alpha-beta times for the collectives of one mesh axis.

Every message costs ``T = alpha + M / B`` (seeds/003, "T = L + M/B"), with ``alpha`` the
link's ``latency_s`` and ``B`` its per-device ``bandwidth_bytes_per_s``. For a group of
``n`` devices and a message of ``M`` bytes:

=====================  ================================================  ===============
collective             time                                              source
=====================  ================================================  ===============
ring all-reduce        ``2(n-1)*alpha + 2(n-1)/n * M/B``                 Patarasuk & Yuan
                                                                         2009; NCCL busbw
tree all-reduce        ``2*ceil(log2 n) * (alpha + M/B)``                seeds/003 T_tree
butterfly all-reduce   ``ceil(log2 n) * (alpha + M/B)``                  seeds/003 T_bf
parameter server       ``2 * (alpha + (n-1)*M/B)``                       seeds/003 T_PS,
                                                                         server link shared
all-gather             ``(n-1)*alpha + (n-1)/n * M/B``  (M = result)     Thakur et al. 2005
reduce-scatter         ``(n-1)*alpha + (n-1)/n * M/B``  (M = input)      Thakur et al. 2005
all-to-all             ``(n-1)*alpha + (n-1)/n * M/B``  (M = per device) pairwise exchange
send/recv              ``alpha + M/B``                                   seeds/003
=====================  ================================================  ===============

Choices, where the seed and practice differ:

* Ring: the seed's ``2(L + T'/P)`` assumes a fully connected network where a node sends
  to all ``P-1`` peers at once. Real rings (NCCL) take ``2(n-1)`` steps of ``M/n`` bytes
  over one link, which gives the formula above, and it is the one nccl-tests' bus
  bandwidth is defined against (see ``cluster.py`` for how busbw becomes ``B``).
* Tree: the seed's non-pipelined binary tree, reduce then broadcast, each step carrying the
  whole message. NCCL pipelines its double binary tree (Sanders, Speck & Traeff 2009) and
  reaches ring-like bandwidth; we keep the seed's simple form so the algorithms stay
  distinguishable, and round ``log2 n`` up (the seed floors it, which would price 3 devices
  like 2).
* Butterfly (recursive doubling): ``log2 n`` exchange steps of the full message, as in the
  seed; ``ceil`` for non-powers of two.
* Parameter server: the seed's ``2(L + T')`` assumes the server has a separate link to each
  worker. Here the server is one of the ``n`` devices with one link, so its link carries the
  ``(n-1)`` incoming gradients (and ``(n-1)`` outgoing copies in the broadcast):
  ``2(alpha + (n-1) M/B)``. With a dedicated extra server it would be ``n M``.
* All-to-all: each device keeps ``1/n`` of its tensor and sends ``M/n`` to each of the
  other ``n-1`` devices, one message each, sequentially on its link.
* Size 1 or 0 bytes: 0.0 s for every collective.

Hierarchy (:class:`AxisTopology` with ``local_size < size``): a group of ``n = L*N`` devices,
``L`` per node on ``N`` nodes (NCCL's and seeds/003's "ring inside, ring across, broadcast
inside").

* all-reduce: reduce-scatter over the ``L`` local devices (intra link), all-reduce of
  ``M/L`` among the ``N`` nodes (inter link, chosen algorithm; the ``L`` devices of a node
  do this at once, each on its share of the node's bandwidth), all-gather over ``L``.
* reduce-scatter: inside the node first (``M`` -> ``M/L``), then across nodes on ``M/L``.
  all-gather: across nodes on ``M/L`` then inside the node to ``M``. Either way the slow link
  carries only ``(N-1)/N * M/L`` per device; times add.
* all-to-all: ``(L-1)/n`` of the tensor goes over the intra link and ``(n-L)/n`` over the
  inter link, concurrently; the time is the larger of the two, in practice the inter-node
  part.
* ``local_size == 1`` (a group spanning nodes with one device on each): all of the above
  reduce to the flat formula on the inter-node link, the slowest hop bounding the ring.

Each formula takes its alpha and beta from ``link.for_collective(kind)``: a calibrated link
carries figures fitted to timings of each collective (``cluster.py``, "Measured
collectives"); a preset link prices every collective with its one alpha and beta. Inside a
hierarchical all-reduce the local reduce-scatter and all-gather use their own figures.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from alpa_lite.cost_models.cluster import Cluster, CollectiveKind, LinkSpec
from alpa_lite.cost_models.devices import require_int, require_non_negative

__all__ = [
    "CollectiveKind",
    "AllReduceAlgorithm",
    "AxisTopology",
    "mesh_axis_topology",
    "all_reduce_time",
    "all_gather_time",
    "reduce_scatter_time",
    "all_to_all_time",
    "send_recv_time",
    "collective_time",
]


class AllReduceAlgorithm(enum.Enum):
    """All-reduce algorithms of seeds/003 (formulas in the module docstring)."""

    RING = "ring"
    TREE = "tree"
    BUTTERFLY = "butterfly"
    PARAMETER_SERVER = "parameter-server"


@dataclass(frozen=True)
class AxisTopology:
    """The device groups of one mesh axis, as the cost model sees them.

    Attributes:
      size: Devices in one group (the mesh axis size).
      local_size: How many of a group's devices share a node; ``size % local_size == 0``.
      intra_node: Link between devices of a node.
      inter_node: Link between nodes (per device); ``None`` iff ``local_size == size``.
    """

    size: int
    local_size: int
    intra_node: LinkSpec
    inter_node: LinkSpec | None

    def __post_init__(self) -> None:
        owner = "AxisTopology"
        object.__setattr__(self, "size", require_int(owner, "size", self.size, 1))
        object.__setattr__(
            self, "local_size", require_int(owner, "local_size", self.local_size, 1)
        )
        if self.size % self.local_size != 0:
            raise ValueError(
                f"{owner}: size = {self.size} is not a multiple of local_size = "
                f"{self.local_size}; every node must hold the same number of group devices."
            )
        if not isinstance(self.intra_node, LinkSpec):
            raise ValueError(f"{owner}: intra_node must be a LinkSpec, got {self.intra_node!r}.")
        spans_nodes = self.local_size < self.size
        if spans_nodes and not isinstance(self.inter_node, LinkSpec):
            raise ValueError(
                f"{owner}: local_size = {self.local_size} < size = {self.size}, so the group "
                f"spans nodes and needs an inter_node LinkSpec, got {self.inter_node!r}."
            )
        if not spans_nodes and self.inter_node is not None:
            raise ValueError(
                f"{owner}: local_size == size = {self.size} (one node) but inter_node = "
                f"{self.inter_node!r}; pass inter_node=None."
            )

    @property
    def num_nodes(self) -> int:
        """Nodes one group spans: ``size // local_size``."""
        return self.size // self.local_size


def mesh_axis_topology(
    cluster: Cluster, mesh_shape: tuple[int, ...], axis: int, device_offset: int = 0
) -> AxisTopology:
    """The topology of the groups along ``axis`` of a logical mesh placed on ``cluster``.

    The mesh is laid row-major over devices ``device_offset .. device_offset + prod(mesh_shape)
    - 1``. A group is the devices that differ only in the ``axis`` coordinate; we inspect the
    group containing the first device. If the group's devices are spread evenly over its
    nodes, ``local_size`` is the count per node; if not (an unaligned submesh), we price it
    as a flat ring over the inter-node link (``local_size = 1``), since the slowest hop
    bounds a ring.

    Args:
      cluster: The cluster.
      mesh_shape: Logical mesh shape, e.g. ``(4, 8)``.
      axis: The mesh axis (negative counts from the end).
      device_offset: First device of the submesh.

    Returns:
      The :class:`AxisTopology` of the axis.

    Raises:
      ValueError: for a bad shape or axis, or a mesh that does not fit on the cluster.

    Example:
      >>> c = Cluster.preset("4x8xH100")
      >>> mesh_axis_topology(c, (8, 4), 0).local_size
      2
    """
    owner = "mesh_axis_topology"
    try:
        shape = tuple(mesh_shape)
    except TypeError:
        raise ValueError(f"{owner}: mesh_shape must be a tuple of ints, got {mesh_shape!r}.")
    if not shape:
        raise ValueError(f"{owner}: mesh_shape is empty; give at least one axis, e.g. (8,).")
    shape = tuple(require_int(owner, f"mesh_shape[{i}]", s, 1) for i, s in enumerate(shape))
    ax = require_int(owner, "axis", axis, -len(shape))
    if ax >= len(shape):
        raise ValueError(
            f"{owner}: axis = {axis} but mesh_shape {shape} has {len(shape)} axes "
            f"(valid: {-len(shape)} .. {len(shape) - 1})."
        )
    ax %= len(shape)
    offset = require_int(owner, "device_offset", device_offset, 0)
    total = math.prod(shape)
    if offset + total > cluster.num_devices:
        raise ValueError(
            f"{owner}: mesh_shape {shape} needs {total} devices from device_offset {offset} "
            f"(up to device {offset + total - 1}), but cluster {cluster.name!r} has "
            f"{cluster.num_devices}; use a smaller mesh or offset."
        )
    size = shape[ax]
    stride = math.prod(shape[ax + 1 :])
    per_node: dict[int, int] = {}
    for k in range(size):
        node = cluster.node_of(offset + k * stride)
        per_node[node] = per_node.get(node, 0) + 1
    counts = set(per_node.values())
    if len(per_node) == 1:
        return AxisTopology(size, size, cluster.intra_node, None)
    local_size = counts.pop() if len(counts) == 1 else 1
    return AxisTopology(size, local_size, cluster.intra_node, cluster.inter_node)


# --------------------------------------------------------------------------------------
# Flat (one-link) formulas.
# --------------------------------------------------------------------------------------


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()  # ceil(log2 n) for n >= 1


def _flat_all_reduce(n: int, m: float, link: LinkSpec, algorithm: AllReduceAlgorithm) -> float:
    if n == 1 or m == 0.0:
        return 0.0
    link = link.for_collective(CollectiveKind.ALL_REDUCE.value)
    a, b = link.latency_s, link.bandwidth_bytes_per_s
    if algorithm is AllReduceAlgorithm.RING:
        return 2 * (n - 1) * a + 2 * (n - 1) / n * m / b
    if algorithm is AllReduceAlgorithm.TREE:
        return 2 * _ceil_log2(n) * (a + m / b)
    if algorithm is AllReduceAlgorithm.BUTTERFLY:
        return _ceil_log2(n) * (a + m / b)
    if algorithm is AllReduceAlgorithm.PARAMETER_SERVER:
        return 2 * (a + (n - 1) * m / b)
    raise ValueError(
        f"all_reduce_time: algorithm must be an AllReduceAlgorithm, got {algorithm!r}; "
        f"choose one of {[x.name for x in AllReduceAlgorithm]}."
    )


def _flat_one_pass(n: int, m: float, link: LinkSpec, kind: CollectiveKind) -> float:
    """(n-1) steps moving (n-1)/n of M: all-gather, reduce-scatter, all-to-all."""
    if n == 1 or m == 0.0:
        return 0.0
    link = link.for_collective(kind.value)
    return (n - 1) * link.latency_s + (n - 1) / n * m / link.bandwidth_bytes_per_s


def _check_args(fn: str, nbytes: Any, topo: AxisTopology) -> float:
    if not isinstance(topo, AxisTopology):
        raise ValueError(
            f"{fn}: topo must be an AxisTopology, got {topo!r}; build one with "
            f"mesh_axis_topology(cluster, mesh_shape, axis)."
        )
    return require_non_negative(fn, "nbytes", nbytes)


# --------------------------------------------------------------------------------------
# Public collective times.
# --------------------------------------------------------------------------------------


def all_reduce_time(
    nbytes: float,
    topo: AxisTopology,
    algorithm: AllReduceAlgorithm = AllReduceAlgorithm.RING,
) -> float:
    """Seconds to all-reduce ``nbytes`` (the per-device buffer) over one axis group.

    Flat groups use ``algorithm`` on the intra-node link. Groups spanning nodes are
    hierarchical: ring reduce-scatter inside the node, ``algorithm`` across nodes on
    ``nbytes / local_size``, ring all-gather inside the node.

    Example:
      >>> link = LinkSpec("l", 1e9, 1e-6)
      >>> t = all_reduce_time(1e6, AxisTopology(4, 4, link, None))
      >>> round(t, 9) == round(2 * 3 * 1e-6 + 2 * 3 / 4 * 1e6 / 1e9, 9)
      True
    """
    m = _check_args("all_reduce_time", nbytes, topo)
    if not isinstance(algorithm, AllReduceAlgorithm):
        raise ValueError(
            f"all_reduce_time: algorithm must be an AllReduceAlgorithm, got {algorithm!r}."
        )
    if topo.size == 1 or m == 0.0:
        return 0.0
    if topo.inter_node is None:
        return _flat_all_reduce(topo.size, m, topo.intra_node, algorithm)
    local = topo.local_size
    scatter = _flat_one_pass(local, m, topo.intra_node, CollectiveKind.REDUCE_SCATTER)
    outer = _flat_all_reduce(topo.num_nodes, m / local, topo.inter_node, algorithm)
    gather = _flat_one_pass(local, m, topo.intra_node, CollectiveKind.ALL_GATHER)
    return scatter + outer + gather


def all_gather_time(nbytes: float, topo: AxisTopology) -> float:
    """Seconds to all-gather over one axis group; ``nbytes`` = gathered result per device."""
    m = _check_args("all_gather_time", nbytes, topo)
    if topo.size == 1 or m == 0.0:
        return 0.0
    kind = CollectiveKind.ALL_GATHER
    if topo.inter_node is None:
        return _flat_one_pass(topo.size, m, topo.intra_node, kind)
    local = topo.local_size
    return _flat_one_pass(topo.num_nodes, m / local, topo.inter_node, kind) + _flat_one_pass(
        local, m, topo.intra_node, kind
    )


def reduce_scatter_time(nbytes: float, topo: AxisTopology) -> float:
    """Seconds to reduce-scatter over one axis group; ``nbytes`` = full input per device."""
    m = _check_args("reduce_scatter_time", nbytes, topo)
    if topo.size == 1 or m == 0.0:
        return 0.0
    kind = CollectiveKind.REDUCE_SCATTER
    if topo.inter_node is None:
        return _flat_one_pass(topo.size, m, topo.intra_node, kind)
    local = topo.local_size
    return _flat_one_pass(local, m, topo.intra_node, kind) + _flat_one_pass(
        topo.num_nodes, m / local, topo.inter_node, kind
    )


def all_to_all_time(nbytes: float, topo: AxisTopology) -> float:
    """Seconds for an all-to-all over one axis group; ``nbytes`` = per-device tensor.

    Each device keeps ``1/n`` and sends ``nbytes/n`` to each other device. Across nodes
    the intra- and inter-node parts run concurrently and the slower (inter) bounds it.
    """
    m = _check_args("all_to_all_time", nbytes, topo)
    n = topo.size
    if n == 1 or m == 0.0:
        return 0.0
    kind = CollectiveKind.ALL_TO_ALL
    if topo.inter_node is None:
        return _flat_one_pass(n, m, topo.intra_node, kind)
    local = topo.local_size
    intra = topo.intra_node.for_collective(kind.value)
    inter = topo.inter_node.for_collective(kind.value)
    t_intra = (local - 1) * intra.latency_s + (local - 1) / n * m / intra.bandwidth_bytes_per_s
    t_inter = (n - local) * inter.latency_s + (n - local) / n * m / inter.bandwidth_bytes_per_s
    return max(t_intra, t_inter)


def send_recv_time(nbytes: float, link: LinkSpec) -> float:
    """Seconds to send ``nbytes`` over ``link``: ``alpha + M/B`` (0.0 for 0 bytes)."""
    m = require_non_negative("send_recv_time", "nbytes", nbytes)
    if not isinstance(link, LinkSpec):
        raise ValueError(f"send_recv_time: link must be a LinkSpec, got {link!r}.")
    if m == 0.0:
        return 0.0
    link = link.for_collective(CollectiveKind.SEND_RECV.value)
    return link.latency_s + m / link.bandwidth_bytes_per_s


def collective_time(kind: CollectiveKind, nbytes: float, topo: AxisTopology) -> float:
    """Dispatches on ``kind``; all-reduce uses the ring.

    ``SEND_RECV`` over a topology (a ``ppermute`` along the axis) uses its slowest link:
    the inter-node link when the group spans nodes; 0.0 for a group of one.
    """
    if kind is CollectiveKind.ALL_REDUCE:
        return all_reduce_time(nbytes, topo)
    if kind is CollectiveKind.ALL_GATHER:
        return all_gather_time(nbytes, topo)
    if kind is CollectiveKind.REDUCE_SCATTER:
        return reduce_scatter_time(nbytes, topo)
    if kind is CollectiveKind.ALL_TO_ALL:
        return all_to_all_time(nbytes, topo)
    if kind is CollectiveKind.SEND_RECV:
        _check_args("collective_time", nbytes, topo)
        if topo.size == 1:
            return 0.0
        link = topo.inter_node if topo.inter_node is not None else topo.intra_node
        return send_recv_time(nbytes, link)
    raise ValueError(
        f"collective_time: kind must be a CollectiveKind, got {kind!r}; choose one of "
        f"{[k.name for k in CollectiveKind]}."
    )
