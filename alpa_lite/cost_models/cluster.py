"""Clusters: devices grouped into nodes, and the links inside and between nodes.

A :class:`Cluster` is ``num_nodes`` nodes of ``devices_per_node`` identical devices, one
:class:`LinkSpec` for traffic inside a node and one for traffic between nodes. Devices are
numbered row-major: device ``i`` lives on node ``i // devices_per_node``. Clusters come from
named presets (:meth:`Cluster.preset`), from the machine at hand (:meth:`Cluster.local`), or
from JSON (:meth:`Cluster.from_json`), and print themselves back as deterministic JSON with a
fingerprint that identifies the hardware a plan was made for.

How a published bandwidth becomes ``LinkSpec.bandwidth_bytes_per_s``
--------------------------------------------------------------------
``bandwidth_bytes_per_s`` is the per-device, one-direction bandwidth that a ring collective
sees (the beta of the alpha-beta model). nccl-tests reports all-reduce *bus bandwidth*
``busbw = algbw * 2(n-1)/n`` with ``algbw = M / t`` (nccl-tests doc/PERFORMANCE.md). Our ring
all-reduce model is ``t = 2(n-1)*alpha + 2(n-1)/n * M / B``; for large M the alpha term
vanishes and ``busbw = M/t * 2(n-1)/n = B``. So **the link bandwidth is the published ring
busbw itself**, and ``collectives.all_reduce_time`` reproduces that busbw for large messages
(tested on the 8xH100 preset at 1 GiB). Where only a wire rate is known we derive an
effective rate by the protocol efficiency NCCL's maintainer quotes for NVLink 4
(450 GB/s line rate -> 370 GB/s effective, ratio 0.82, nccl-tests issue 212).

Inter-node bandwidth is per device, too. When a node's NICs are shared by its devices
(AWS p3.16xlarge: one 25 Gbit/s link per node of 8 V100s; a wide-area site link), the
per-device bandwidth is ``node bandwidth / devices_per_node``: in an SPMD program every
device of a node runs its mesh-axis collective at the same time, so each gets 1/8 of the
node's link. With one NIC per GPU (DGX A100/H100) the per-NIC busbw is the per-device rate.

Latency (alpha) per message is taken from NCCL's own tuning model (src/graph/tuning.cc,
``hwLat``, Ring/Simple protocol, per ring step): 5.7 us on NVLink, 6.6 us on the network.

Measured collectives
--------------------
A preset link has one alpha and one beta, and every collective is priced from them with its
own formula (``collectives.py``). On real hardware the collectives differ by more than their
formulas say (on the 8 virtual CPU devices here, against the all-reduce's link: all-to-all
2.4x and reduce-scatter 1.4x less bandwidth, send/recv 26x the latency per message, in
``bench/results/fidelity_cpu.json``). Calibration therefore times each collective
and records, besides the all-reduce fit as the link's own figures, a
:class:`MeasuredCollective` per other collective; ``LinkSpec.for_collective`` gives the
figures a collective is priced with.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from alpa_lite.cost_models.devices import (
    DEVICES,
    DeviceSpec,
    check_keys,
    require_int,
    require_name,
    require_non_negative,
    require_positive,
)

__all__ = [
    "LinkSpec", "MeasuredCollective", "CollectiveKind", "COLLECTIVE_KINDS", "Cluster",
    "CLUSTER_JSON_FORMAT", "device_key",
]

CLUSTER_JSON_FORMAT = "alpa_lite.cluster/1"
"""The ``"format"`` tag written by :meth:`Cluster.to_json` and required by ``from_json``."""


class CollectiveKind(enum.Enum):
    """Collectives the planner prices; values are the HLO op names. Here rather than in
    ``collectives.py`` (which prices them) because a link carries figures per collective.

    ``SEND_RECV`` is point-to-point; in HLO it appears as ``collective-permute`` (from
    ``lax.ppermute``) or as ``send``/``recv`` pairs.
    """

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    SEND_RECV = "send-recv"


COLLECTIVE_KINDS = tuple(k.value for k in CollectiveKind)
"""The collectives a link can carry measured figures for, by name."""


def _check_alpha_beta(spec: Any, owner: str) -> None:
    """Validates (and stores as floats) a frozen spec's bandwidth and latency."""
    object.__setattr__(
        spec,
        "bandwidth_bytes_per_s",
        require_positive(owner, "bandwidth_bytes_per_s", spec.bandwidth_bytes_per_s),
    )
    object.__setattr__(
        spec, "latency_s", require_non_negative(owner, "latency_s", spec.latency_s)
    )


@dataclass(frozen=True)
class MeasuredCollective:
    """One collective's own alpha and beta on a link, fitted to timings of that collective.

    Attributes:
      kind: One of ``COLLECTIVE_KINDS``.
      bandwidth_bytes_per_s: Beta, in the convention of that collective's formula.
      latency_s: Alpha, per step of that collective's formula.
    """

    kind: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(
                f"MeasuredCollective: kind = {self.kind!r} is not a collective; use one of "
                f"{list(COLLECTIVE_KINDS)}."
            )
        owner = f"MeasuredCollective {self.kind!r}"
        _check_alpha_beta(self, owner)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "latency_s": self.latency_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeasuredCollective:
        check_keys(
            "MeasuredCollective.from_dict", d, ("kind", "bandwidth_bytes_per_s", "latency_s")
        )
        return cls(d["kind"], d["bandwidth_bytes_per_s"], d["latency_s"])


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link, as the alpha-beta collective model sees it.

    Attributes:
      name: Short name, e.g. ``"nvlink4"``, ``"ib-ndr"``, ``"wan"``.
      bandwidth_bytes_per_s: Per device, one direction: the effective bandwidth a ring
        collective sees (= the published ring all-reduce bus bandwidth; module docstring).
      latency_s: Alpha, the fixed cost of one message (one ring step), in seconds.
      measured: Collectives timed on this link with figures of their own (calibration;
        module docstring); the others use ``bandwidth_bytes_per_s`` and ``latency_s``.
        Kept in ``COLLECTIVE_KINDS`` order.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    measured: tuple[MeasuredCollective, ...] = ()

    def __post_init__(self) -> None:
        require_name("LinkSpec", "name", self.name)
        owner = f"LinkSpec {self.name!r}"
        _check_alpha_beta(self, owner)
        try:
            measured = tuple(self.measured)
        except TypeError:
            measured = None
        if measured is None or not all(isinstance(m, MeasuredCollective) for m in measured):
            raise ValueError(
                f"{owner}: measured must be a tuple of MeasuredCollective, got "
                f"{self.measured!r}."
            )
        kinds = [m.kind for m in measured]
        if len(set(kinds)) != len(kinds):
            raise ValueError(
                f"{owner}: measured lists a collective twice ({kinds}); give each one once."
            )
        object.__setattr__(
            self, "measured", tuple(sorted(measured, key=lambda m: COLLECTIVE_KINDS.index(m.kind)))
        )
        # Built once: the planner prices collectives on this link thousands of times.
        object.__setattr__(self, "_by_kind", {
            m.kind: LinkSpec(f"{self.name}:{m.kind}", m.bandwidth_bytes_per_s, m.latency_s)
            for m in self.measured
        })

    def for_collective(self, kind: str) -> LinkSpec:
        """The link as collective ``kind`` (a ``COLLECTIVE_KINDS`` value) is priced on it:
        its measured figures if calibration timed it, else this link's own."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(
                f"LinkSpec.for_collective: {kind!r} is not a collective; use one of "
                f"{list(COLLECTIVE_KINDS)}."
            )
        return self._by_kind.get(kind, self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``LinkSpec.from_dict(link.to_dict()) == link``. ``measured``
        is written only when there is any, so a preset's JSON (and fingerprint) stays."""
        d: dict[str, Any] = {
            "name": self.name,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "latency_s": self.latency_s,
        }
        if self.measured:
            d["measured"] = [m.to_dict() for m in self.measured]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkSpec:
        """Builds a LinkSpec from :meth:`to_dict` output; strict about keys and values."""
        check_keys("LinkSpec.from_dict", d, ("name", "bandwidth_bytes_per_s", "latency_s"),
                    ("measured",))
        measured = d.get("measured", [])
        if not isinstance(measured, list):
            raise ValueError(
                f"LinkSpec.from_dict: 'measured' must be a list of collectives, got "
                f"{type(measured).__name__}."
            )
        return cls(
            name=d["name"],
            bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"],
            latency_s=d["latency_s"],
            measured=tuple(MeasuredCollective.from_dict(m) for m in measured),
        )


_CLUSTER_KEYS = (
    "format",
    "name",
    "device",
    "num_nodes",
    "devices_per_node",
    "intra_node",
    "inter_node",
    "platform",
)


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` x ``devices_per_node`` identical devices and the links between them.

    Attributes:
      name: Preset or user name, e.g. ``"4x8xH100"``.
      device: The spec of every device.
      num_nodes: Number of nodes (hosts).
      devices_per_node: Devices in each node.
      intra_node: Link between devices of one node.
      inter_node: Link between nodes, per device (module docstring). Required iff
        ``num_nodes > 1``.
      platform: ``"simulated"`` for presets and JSON clusters, or the JAX platform
        (``"cpu"``, ``"gpu"``) for :meth:`local`.

    Example:
      >>> c = Cluster.preset("4x8xH100")
      >>> c.num_devices, c.node_of(9)
      (32, 1)
    """

    name: str
    device: DeviceSpec
    num_nodes: int
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    platform: str = "simulated"

    def __post_init__(self) -> None:
        require_name("Cluster", "name", self.name)
        owner = f"Cluster {self.name!r}"
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(
                f"{owner}: device must be a DeviceSpec, got {self.device!r}; "
                f"use one of alpa_lite.cost_models.devices.DEVICES ({sorted(DEVICES)})."
            )
        object.__setattr__(self, "num_nodes", require_int(owner, "num_nodes", self.num_nodes, 1))
        object.__setattr__(
            self,
            "devices_per_node",
            require_int(owner, "devices_per_node", self.devices_per_node, 1),
        )
        if not isinstance(self.intra_node, LinkSpec):
            raise ValueError(f"{owner}: intra_node must be a LinkSpec, got {self.intra_node!r}.")
        if self.num_nodes > 1 and self.inter_node is None:
            raise ValueError(
                f"{owner}: num_nodes = {self.num_nodes} but inter_node is None; "
                f"give an inter_node LinkSpec for the links between nodes."
            )
        if self.num_nodes == 1 and self.inter_node is not None:
            raise ValueError(
                f"{owner}: num_nodes = 1 but inter_node = {self.inter_node!r}; a single-node "
                f"cluster has no inter-node link: pass inter_node=None."
            )
        if self.inter_node is not None and not isinstance(self.inter_node, LinkSpec):
            raise ValueError(f"{owner}: inter_node must be a LinkSpec, got {self.inter_node!r}.")
        require_name(owner, "platform", self.platform)

    @property
    def num_devices(self) -> int:
        """Total devices: ``num_nodes * devices_per_node``."""
        return self.num_nodes * self.devices_per_node

    def overlaps_collectives(self) -> bool:
        """Whether collectives run beside compute on this cluster: XLA runs them
        asynchronously on GPUs and TPUs, in line on CPUs. Presets ("simulated") are GPU
        clusters."""
        return self.platform != "cpu"

    def node_of(self, device_index: int) -> int:
        """The node holding device ``device_index`` (row-major: ``i // devices_per_node``)."""
        i = require_int(f"Cluster {self.name!r}.node_of", "device_index", device_index, 0)
        if i >= self.num_devices:
            raise ValueError(
                f"Cluster {self.name!r}.node_of: device_index = {i} but the cluster has "
                f"{self.num_devices} devices (0 .. {self.num_devices - 1})."
            )
        return i // self.devices_per_node

    def can_run_on(self, local: Cluster) -> bool:
        """Whether a plan made for this cluster can run on ``local`` (``Cluster.local()``).

        True when both have the same number of devices and either the same device spec
        (the local devices described as another grouping into nodes, e.g. a two-node plan
        run on one machine) or the same platform and devices per node (a calibrated
        description of the local devices, ``alpa_lite.tools.calibrate``: measured device and
        link figures in place of the nominal ones).
        """
        if self.num_devices != local.num_devices:
            return False
        if self.device == local.device:
            return True
        return self.platform == local.platform and self.devices_per_node == local.devices_per_node

    # ---------------------------------------------------------------- constructors

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names accepted by :meth:`preset`."""
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A named cluster preset (see :meth:`presets` and the module constants).

        Raises:
          ValueError: for an unknown name; the message lists the known names.
        """
        if name not in _PRESETS:
            raise ValueError(
                f"unknown cluster preset {name!r}; known presets: {list(_PRESETS)}. "
                f"For other hardware build a Cluster or load one with Cluster.from_json."
            )
        return _PRESETS[name]

    @classmethod
    def of_gpus(cls, device: str, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """``num_nodes`` nodes of ``devices_per_node`` GPUs of a known kind (``"H200"``,
        ``"H100"``, ``"A100"``, ``"V100"``) with that kind's links, as the presets have
        them (NVLink inside a node; InfiniBand, or Alpa's 25 Gbit/s Ethernet for V100
        nodes, between nodes): a cluster to plan for without owning it.

        Raises:
          ValueError: for an unknown kind or sizes below 1.
        """
        if device not in _GPU_LINKS:
            raise ValueError(f"Cluster.of_gpus: no figures for GPU kind {device!r}; known "
                             f"kinds: {sorted(_GPU_LINKS)}. For other hardware build a "
                             "Cluster or measure one with `alpa-lite calibrate`.")
        require_int("Cluster.of_gpus", "num_nodes", num_nodes, 1)
        require_int("Cluster.of_gpus", "devices_per_node", devices_per_node, 1)
        name = (f"{devices_per_node}x{device}" if num_nodes == 1
                else f"{num_nodes}x{devices_per_node}x{device}")
        return _gpu_cluster(name, device, num_nodes, devices_per_node)

    @classmethod
    def local(cls, *, allow_unknown: bool = False) -> Cluster:
        """The cluster of all devices JAX sees (``jax.devices()``), across all processes.

        Nodes are the JAX processes (grouped by ``device.process_index``). The device spec
        comes from the ``device_kind`` JAX reports (:func:`device_key`): H200, H100, A100 and
        V100 GPUs get their datasheet rows of :data:`DEVICES`; CPU devices the ``[Nominal]``
        ``DEVICES["CPU"]``. Links are assumptions, not measurements: GPUs get the
        NVLink/network links of the matching preset; CPU devices a nominal shared-memory
        link inside a process and a nominal loopback link between processes. Calibrate
        (``alpa_lite.tools.calibrate.calibrate``, ``alpa-lite calibrate``) before trusting
        absolute times.

        Args:
          allow_unknown: For a device kind with no row in :data:`DEVICES`, return the
            local devices' shape (platform, nodes, devices per node) with a placeholder
            device of ``[Nominal]`` figures (memory as JAX reports it) instead of raising:
            what calibration starts from and what a plan's cluster is checked against
            (``can_run_on``). Never plan with it: its FLOP rates are stand-ins.

        Raises:
          ValueError: for a device kind alpa_lite has no figures for (unless
            ``allow_unknown``; the message says how to describe the devices in a cluster
            JSON), mixed device kinds, or unequal device counts per process.
        """
        import jax  # Lazy: the cost models never need JAX except here.

        devices = jax.devices()
        platform = devices[0].platform
        kinds = sorted({d.device_kind for d in devices})
        if len(kinds) != 1:
            raise ValueError(
                f"Cluster.local: mixed device kinds {kinds}; alpa_lite models identical "
                f"devices: use a preset or a JSON cluster."
            )
        kind = kinds[0]
        per_process: dict[int, int] = {}
        for d in devices:
            per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
        counts = sorted(set(per_process.values()))
        if len(counts) != 1:
            raise ValueError(
                f"Cluster.local: processes hold unequal device counts {per_process}; "
                f"give every process the same number of devices."
            )
        num_nodes, devices_per_node = len(per_process), counts[0]

        key = device_key(platform, kind)
        if key == "CPU":
            device, intra, inter = DEVICES["CPU"], _CPU_SHARED_MEMORY_LINK, _CPU_LOOPBACK_LINK
        elif key is not None:
            device = DEVICES[key]
            intra, inter = _GPU_LINKS[key]
        elif allow_unknown:
            device = _placeholder_device(kind, _reported_memory_bytes(devices))
            intra, inter = _UNCALIBRATED_INTRA_LINK, _UNCALIBRATED_INTER_LINK
        else:
            raise ValueError(_unknown_device_message(platform, kind))
        return cls(
            name=f"local-{platform}-{num_nodes}x{devices_per_node}",
            device=device,
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            intra_node=intra,
            inter_node=inter if num_nodes > 1 else None,
            platform=platform,
        )

    # ---------------------------------------------------------------- serialisation

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys, indent 2) tagged ``"format": "alpa_lite.cluster/1"``."""
        d = {
            "format": CLUSTER_JSON_FORMAT,
            "name": self.name,
            "device": self.device.to_dict(),
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": None if self.inter_node is None else self.inter_node.to_dict(),
            "platform": self.platform,
        }
        return json.dumps(d, sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        """Parses :meth:`to_json` output.

        Raises:
          ValueError: for malformed JSON, a missing or wrong ``format`` tag, missing or
            unknown fields, or bad values; the message names the field and the fix.
        """
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(
                f"Cluster.from_json: not valid JSON ({e}); pass the text written by "
                f"Cluster.to_json()."
            ) from None
        if not isinstance(d, dict):
            raise ValueError(
                f"Cluster.from_json: expected a JSON object, got {type(d).__name__}; pass "
                f"the text written by Cluster.to_json()."
            )
        if d.get("format") != CLUSTER_JSON_FORMAT:
            raise ValueError(
                f"Cluster.from_json: field 'format' is {d.get('format')!r}, expected "
                f"{CLUSTER_JSON_FORMAT!r}; add \"format\": \"{CLUSTER_JSON_FORMAT}\" or "
                f"re-export the cluster with Cluster.to_json()."
            )
        check_keys("Cluster.from_json", d, _CLUSTER_KEYS)

        def field(name: str, build):
            try:
                return build(d[name])
            except ValueError as e:
                raise ValueError(f"Cluster.from_json: field {name!r}: {e}") from None

        device = field("device", DeviceSpec.from_dict)
        intra = field("intra_node", LinkSpec.from_dict)
        inter = field("inter_node", lambda x: None if x is None else LinkSpec.from_dict(x))
        try:
            return cls(
                name=d["name"],
                device=device,
                num_nodes=d["num_nodes"],
                devices_per_node=d["devices_per_node"],
                intra_node=intra,
                inter_node=inter,
                platform=d["platform"],
            )
        except ValueError as e:
            raise ValueError(f"Cluster.from_json: {e}") from None

    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of :meth:`to_json`; equal clusters, equal prints."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------------------
# Links. bandwidth = per-device ring busbw (module docstring); latency = alpha per step.
# --------------------------------------------------------------------------------------

# NCCL src/graph/tuning.cc, hwLat[NVLINK][Ring][Simple] = 5.7 us per ring step (the V100's
# NVLink 2, for which no all-reduce sweep was found).
_NVLINK_LATENCY_S = 5.7e-6
# NCCL src/graph/tuning.cc, hwLat[NET][Ring][Simple] = 6.6 us per ring step (InfiniBand).
_IB_LATENCY_S = 6.6e-6

# H100 and A100 NVLink inside a node: alpha (per ring step) and busbw fitted by
# bench/calibrate_links.py (cost_models.calibration.fit_link, relative-error least squares)
# to the nccl-tests all_reduce_perf sweeps of 8 GPUs, 1 KiB .. 8 GiB, on Azure ND H100 v5
# and ND A100 v4 (bench/data/device_microbenchmarks.json; every point within +-30%). Small
# messages cost ~33 us (H100) / ~46 us (A100) whatever their size; large ones reach
# 466-479 GB/s on the H100 (NVLink SHARP) and 228-232 GB/s on the A100
# (data/nccl_allreduce_busbw.csv): the fit's single bandwidth sits between.
_NVLINK4_H100_LATENCY_S = 2.37e-06
_NVLINK4_H100_RING_BUSBW_BYTES_PER_S = 4.214e+11
_NVLINK3_A100_LATENCY_S = 3.256e-06
_NVLINK3_A100_RING_BUSBW_BYTES_PER_S = 1.974e+11
# V100 NVLink 2: 300 GB/s aggregate bidirectional per GPU = 150 GB/s per direction (V100
# datasheet; six 25 GB/s links). [Derived] effective = 150 * (370/450) ~ 123 GB/s, the
# protocol efficiency NCCL reaches on NVLink 4 (nccl-tests issue 212). The hybrid cube
# mesh (p3.16xlarge / DGX-1) may do worse; no published ring busbw is in HARDWARE.md.
_V100_NVLINK2_PER_DIRECTION_BYTES_PER_S = 150e9
_NVLINK_PROTOCOL_EFFICIENCY = 370e9 / 450e9
_NVLINK2_V100_RING_BUSBW_BYTES_PER_S = (
    _V100_NVLINK2_PER_DIRECTION_BYTES_PER_S * _NVLINK_PROTOCOL_EFFICIENCY
)
# DGX H100: 8 x NDR 400 Gb/s per node, one NIC per GPU; 46-48 GB/s per NIC (AddyLaddy,
# nccl-tests issues 290 and 267; CSV row "DGX/HGX H100, 8x NDR"). Midpoint 47 GB/s.
_IB_NDR_PER_NIC_BUSBW_BYTES_PER_S = 47e9
# DGX A100: 8 x HDR 200 Gb/s per node, one NIC per GPU; all-reduce busbw ~192 GB/s per
# node = 24 GB/s per NIC (AddyLaddy, nccl issue 812; CSV row "DGX A100, 8x HDR").
_IB_HDR_PER_NODE_BUSBW_BYTES_PER_S = 192e9
_IB_HDR_NICS_PER_NODE = 8
# AWS p3.16xlarge (Alpa's testbed, Alpa paper OSDI'22 sec. 8): 25 Gbit/s per node,
# shared by its 8 V100s.
_P3_ETHERNET_PER_NODE_BYTES_PER_S = 25e9 / 8
_P3_GPUS_PER_NODE = 8
# [Nominal] TCP over AWS ENA: tens of microseconds per message; no published figure in
# HARDWARE.md, so 50 us.
_P3_ETHERNET_LATENCY_S = 50e-6
# Wide area between sites (seeds/004, Zhu et al. "Distributed Training Across the World"):
# 35-277 ms latency, 13-63 Mbit/s. A ring is bounded by its slowest hop, so the geo link
# takes the slowest bandwidth (13 Mbit/s) and the largest latency (277 ms, Tokyo-London;
# the slide's figures look like round-trip times, so this is conservative).
_WAN_SLOWEST_PER_SITE_BYTES_PER_S = 13e6 / 8
_WAN_LARGEST_LATENCY_S = 0.277
# [Nominal] Virtual CPU devices of one process exchange data through host memory.
_CPU_SHARED_MEMORY_BYTES_PER_S = 5e9
_CPU_SHARED_MEMORY_LATENCY_S = 10e-6
# [Nominal] CPU processes on one machine talk over loopback TCP (gloo).
_CPU_LOOPBACK_BYTES_PER_S = 1e9
_CPU_LOOPBACK_LATENCY_S = 50e-6

_NVLINK4_H100 = LinkSpec("nvlink4", _NVLINK4_H100_RING_BUSBW_BYTES_PER_S, _NVLINK4_H100_LATENCY_S)
_NVLINK3_A100 = LinkSpec("nvlink3", _NVLINK3_A100_RING_BUSBW_BYTES_PER_S, _NVLINK3_A100_LATENCY_S)
_NVLINK2_V100 = LinkSpec("nvlink2", _NVLINK2_V100_RING_BUSBW_BYTES_PER_S, _NVLINK_LATENCY_S)
_IB_NDR = LinkSpec("ib-ndr", _IB_NDR_PER_NIC_BUSBW_BYTES_PER_S, _IB_LATENCY_S)
_IB_HDR = LinkSpec(
    "ib-hdr", _IB_HDR_PER_NODE_BUSBW_BYTES_PER_S / _IB_HDR_NICS_PER_NODE, _IB_LATENCY_S
)
# Per device: the node's 25 Gbit/s divided among its 8 GPUs (module docstring).
_P3_ETHERNET = LinkSpec(
    "eth-25gbit-per-node",
    _P3_ETHERNET_PER_NODE_BYTES_PER_S / _P3_GPUS_PER_NODE,
    _P3_ETHERNET_LATENCY_S,
)
_CPU_SHARED_MEMORY_LINK = LinkSpec(
    "cpu-shared-memory", _CPU_SHARED_MEMORY_BYTES_PER_S, _CPU_SHARED_MEMORY_LATENCY_S
)
_CPU_LOOPBACK_LINK = LinkSpec("cpu-loopback", _CPU_LOOPBACK_BYTES_PER_S, _CPU_LOOPBACK_LATENCY_S)

# geo-4 sites are 8xV100 servers ("eight-V100 server", seeds/004), each site's WAN link
# shared by its 8 GPUs.
_GEO_GPUS_PER_SITE = 8
_WAN = LinkSpec(
    "wan", _WAN_SLOWEST_PER_SITE_BYTES_PER_S / _GEO_GPUS_PER_SITE, _WAN_LARGEST_LATENCY_S
)

# Links that Cluster.local() assumes for each GPU kind: (intra-node, inter-node).
# H200: NVLink 4 at 900 GB/s bidirectional per GPU as on the H100 (H200 datasheet), and
# DGX H200 nodes have DGX H100's 8 x NDR 400 Gb/s, so the H100's links.
_GPU_LINKS: dict[str, tuple[LinkSpec, LinkSpec]] = {
    "H200": (_NVLINK4_H100, _IB_NDR),
    "H100": (_NVLINK4_H100, _IB_NDR),
    "A100": (_NVLINK3_A100, _IB_HDR),
    "V100": (_NVLINK2_V100, _P3_ETHERNET),
}


# [Nominal] Stand-ins for the links of devices alpa_lite has no figures for
# (Cluster.local(allow_unknown=True)), until calibration measures them: PCIe 4.0 x16
# (32 GB/s per direction, ~25 GB/s reached) inside a node, 100 Gbit/s Ethernet between nodes.
_UNCALIBRATED_INTRA_LINK = LinkSpec("uncalibrated-intra-node", 25e9, 10e-6)
_UNCALIBRATED_INTER_LINK = LinkSpec("uncalibrated-inter-node", 100e9 / 8, 50e-6)
# [Nominal] The placeholder device's figures: replaced by calibration's measurements; the
# memory size is JAX's where JAX reports one (memory_stats()["bytes_limit"]).
_PLACEHOLDER_FLOPS_PER_S = 1e12
_PLACEHOLDER_MEMORY_BYTES = 16e9
_PLACEHOLDER_MEMORY_BANDWIDTH_BYTES_PER_S = 500e9

# GPU device kinds with a datasheet row in DEVICES, matched as a word of the device_kind JAX
# reports: "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
# "Tesla V100-SXM2-16GB" (a GH200, "NVIDIA GH200 480GB", is not an H200).
_GPU_KINDS = ("H200", "H100", "A100", "V100")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def device_key(platform: str, device_kind: str) -> str | None:
    """The :data:`DEVICES` key for a device as JAX reports it (``device.platform``,
    ``device.device_kind``): ``"CPU"`` for CPU devices, ``"H200"`` for ``"NVIDIA H200"``,
    ...; None for a device alpa_lite has no figures for."""
    if platform == "cpu":
        return "CPU"
    if platform not in _GPU_PLATFORMS:
        return None
    words = re.split(r"[^A-Z0-9]+", device_kind.upper())
    return next((k for k in _GPU_KINDS if k in words), None)


def _unknown_device_message(platform: str, kind: str) -> str:
    """What Cluster.local says about a device it has no figures for: which one, and how
    to describe it."""
    return (
        f"Cluster.local: JAX reports device_kind {kind!r} on platform {platform!r}, which "
        f"alpa_lite has no figures for (it knows {', '.join(_GPU_KINDS)} GPUs and CPU "
        f"devices). Describe the devices in a cluster JSON: measure them on this machine "
        f"with `alpa-lite calibrate -o cluster.json`, or write one by hand in the format of "
        f"Cluster.to_json (`alpa-lite clusters --json 8xH100` prints an example: set the "
        f"device's peak_flops_per_s, memory_bytes and memory_bandwidth_bytes_per_s, "
        f"num_nodes, devices_per_node, the links, and \"platform\": \"{platform}\" to run "
        f"on these devices). Then pass it: `alpa-lite plan ... --cluster cluster.json`, or "
        f"al.parallelize(..., cluster=al.Cluster.from_json(open('cluster.json').read()))."
    )


def _reported_memory_bytes(devices) -> float | None:
    """Memory per device as JAX reports it (``memory_stats()["bytes_limit"]`` of the first
    device that answers; devices of other processes do not), or None."""
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 -- no stats here (another process's, a fake, a CPU)
            continue
        if stats and stats.get("bytes_limit"):
            return float(stats["bytes_limit"])
    return None


def _placeholder_device(kind: str, memory_bytes: float | None) -> DeviceSpec:
    """The ``[Nominal]`` device of ``Cluster.local(allow_unknown=True)`` for ``kind``."""
    return DeviceSpec(
        name=f"{kind} (uncalibrated)",
        peak_flops_per_s=(("float32", _PLACEHOLDER_FLOPS_PER_S),),
        memory_bytes=memory_bytes or _PLACEHOLDER_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=_PLACEHOLDER_MEMORY_BANDWIDTH_BYTES_PER_S,
    )


def _gpu_cluster(name: str, short: str, num_nodes: int, per_node: int, inter=None) -> Cluster:
    intra, default_inter = _GPU_LINKS[short]
    if num_nodes > 1 and inter is None:
        inter = default_inter
    return Cluster(
        name=name,
        device=DEVICES[short],
        num_nodes=num_nodes,
        devices_per_node=per_node,
        intra_node=intra,
        inter_node=inter if num_nodes > 1 else None,
    )


_PRESETS: dict[str, Cluster] = {
    c.name: c
    for c in (
        _gpu_cluster("1xH100", "H100", 1, 1),
        _gpu_cluster("8xH100", "H100", 1, 8),
        _gpu_cluster("4x8xH100", "H100", 4, 8),
        _gpu_cluster("8xA100", "A100", 1, 8),
        _gpu_cluster("8x8xA100", "A100", 8, 8),
        # GPT-3 planning scale: 128 DGX A100 nodes, 8 x HDR 200 Gb/s per node.
        _gpu_cluster("1024xA100", "A100", 128, 8),
        # Alpa's testbed: p3.16xlarge (8 V100, NVLink) nodes, 25 Gbit/s between nodes.
        _gpu_cluster("8xV100", "V100", 1, 8),
        _gpu_cluster("8x8xV100", "V100", 8, 8),
        # 4 sites of 8xV100 linked by wide area (seeds/004); the slowest hop bounds a ring.
        _gpu_cluster("geo-4", "V100", 4, _GEO_GPUS_PER_SITE, inter=_WAN),
    )
}
