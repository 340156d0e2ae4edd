"""Tests for alpa_lite.cost_models: specs, presets, JSON, collective and compute costs.

Expected values are written out as arithmetic (alpha-beta terms) so each can be checked by
hand against the formulas in ``cost_models/collectives.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import json
import math

import numpy as np
import pytest

from alpa_lite.cost_models import (
    DEVICES,
    AllReduceAlgorithm,
    AxisTopology,
    Cluster,
    CollectiveKind,
    DeviceSpec,
    LinkSpec,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    compute_time,
    mesh_axis_topology,
    reduce_scatter_time,
    send_recv_time,
)

# A link with round numbers: alpha = 1 us, B = 1 GB/s.
LINK = LinkSpec("test", 1e9, 1e-6)
# A slow "inter-node" link: alpha = 10 us, B = 0.1 GB/s.
SLOW = LinkSpec("slow", 1e8, 1e-5)
FLAT4 = AxisTopology(size=4, local_size=4, intra_node=LINK, inter_node=None)
M = 1e6  # bytes

REQUIRED_PRESETS = (
    "1xH100",
    "8xH100",
    "4x8xH100",
    "8xA100",
    "8x8xA100",
    "8xV100",
    "8x8xV100",
    "geo-4",
    "1024xA100",
)


# ------------------------------------------------------------------ devices


def test_device_peaks_and_fallback():
    h100 = DEVICES["H100"]
    assert h100.peak_flops("bfloat16") == 989e12
    assert h100.peak_flops(np.dtype("float16")) == 989e12
    assert h100.peak_flops("float32") == 67e12
    # int32 has no entry: falls back to the float32 peak.
    assert h100.peak_flops("int32") == 67e12
    assert h100.peak_flops(np.int8) == 67e12
    # V100 has no bf16 tensor cores: bf16 is priced at its fp32 peak.
    assert DEVICES["V100"].peak_flops("bfloat16") == 15.7e12
    assert DEVICES["V100"].peak_flops("float16") == 125e12
    assert DEVICES["A100"].peak_flops("bfloat16") == 312e12
    assert DEVICES["CPU"].peak_flops("bfloat16") == 50e9
    assert set(DEVICES) >= {"H100", "A100", "V100", "CPU"}


def test_device_peak_without_fallback_raises():
    d = DeviceSpec("only-bf16", (("bfloat16", 1e12),), 1e9, 1e9)
    with pytest.raises(ValueError, match="no 'float32' fallback"):
        d.peak_flops("int32")


def test_device_canonical_order_and_round_trip():
    a = DeviceSpec("d", (("float32", 1e12), ("bfloat16", 2e12)), 1e9, 1e9)
    b = DeviceSpec("d", (("bfloat16", 2e12), ("float32", 1e12)), 1e9, 1e9)
    assert a == b
    for spec in DEVICES.values():
        assert DeviceSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(memory_bytes=0), "memory_bytes must be finite and > 0, got 0"),
        (dict(memory_bandwidth_bytes_per_s=-1.0), "memory_bandwidth_bytes_per_s"),
        (dict(memory_bandwidth_bytes_per_s=float("nan")), "memory_bandwidth_bytes_per_s"),
        (dict(matmul_efficiency=1.5), "matmul_efficiency must be a fraction"),
        (dict(peak_flops_per_s=(("float32", 0.0),)), r"peak_flops_per_s\['float32'\]"),
        (dict(peak_flops_per_s=()), "non-empty sequence"),
        (dict(name=""), "name must be a non-empty string"),
    ],
)
def test_device_bad_values_raise(kwargs, match):
    base = dict(
        name="d",
        peak_flops_per_s=(("float32", 1e12),),
        memory_bytes=1e9,
        memory_bandwidth_bytes_per_s=1e9,
    )
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DeviceSpec(**base)


def test_device_from_dict_is_strict():
    d = DEVICES["A100"].to_dict()
    d["turbo"] = True
    with pytest.raises(ValueError, match=r"unknown keys \['turbo'\]"):
        DeviceSpec.from_dict(d)
    d = DEVICES["A100"].to_dict()
    del d["memory_bytes"]
    with pytest.raises(ValueError, match=r"missing keys \['memory_bytes'\]"):
        DeviceSpec.from_dict(d)


# ------------------------------------------------------------------ links and clusters


@pytest.mark.parametrize(
    "bw, lat, match",
    [
        (0.0, 1e-6, "bandwidth_bytes_per_s must be finite and > 0, got 0.0"),
        (-5.0, 1e-6, "bandwidth_bytes_per_s"),
        (float("nan"), 1e-6, "bandwidth_bytes_per_s"),
        (float("inf"), 1e-6, "bandwidth_bytes_per_s"),
        ("fast", 1e-6, "must be a real number"),
        (1e9, -1e-6, "latency_s must be finite and >= 0"),
    ],
)
def test_link_bad_values_raise(bw, lat, match):
    with pytest.raises(ValueError, match=match):
        LinkSpec("bad", bw, lat)


def test_cluster_validation():
    dev = DEVICES["CPU"]
    with pytest.raises(ValueError, match="num_nodes = 2 but inter_node is None"):
        Cluster("c", dev, 2, 4, LINK)
    with pytest.raises(ValueError, match="num_nodes = 1 but inter_node"):
        Cluster("c", dev, 1, 4, LINK, SLOW)
    with pytest.raises(ValueError, match="devices_per_node must be >= 1, got 0"):
        Cluster("c", dev, 1, 0, LINK)
    with pytest.raises(ValueError, match="num_nodes must be >= 1, got -1"):
        Cluster("c", dev, -1, 8, LINK)
    with pytest.raises(ValueError, match="num_nodes must be an integer"):
        Cluster("c", dev, 1.5, 8, LINK)


def test_cluster_basics():
    c = Cluster.preset("4x8xH100")
    assert c.num_devices == 32
    assert (c.node_of(0), c.node_of(7), c.node_of(8), c.node_of(31)) == (0, 0, 1, 3)
    with pytest.raises(ValueError, match="device_index = 32 but the cluster has 32"):
        c.node_of(32)
    assert c.platform == "simulated"
    assert c.device == DEVICES["H100"]


def test_required_presets_exist_and_round_trip():
    assert set(REQUIRED_PRESETS) <= set(Cluster.presets())
    for name in Cluster.presets():
        c = Cluster.preset(name)
        assert c.name == name
        text = c.to_json()
        assert json.loads(text)["format"] == "alpa_lite.cluster/1"
        back = Cluster.from_json(text)
        assert back == c
        assert back.to_json() == text  # byte-identical re-serialisation
        assert back.fingerprint() == c.fingerprint()
        assert len(c.fingerprint()) == 16
    prints = {Cluster.preset(n).fingerprint() for n in Cluster.presets()}
    assert len(prints) == len(Cluster.presets())


def test_preset_sizes():
    sizes = {n: Cluster.preset(n).num_devices for n in REQUIRED_PRESETS}
    assert sizes == {
        "1xH100": 1,
        "8xH100": 8,
        "4x8xH100": 32,
        "8xA100": 8,
        "8x8xA100": 64,
        "8xV100": 8,
        "8x8xV100": 64,
        "geo-4": 32,
        "1024xA100": 1024,
    }


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match=r"unknown cluster preset 'DGX-9'.*8xH100"):
        Cluster.preset("DGX-9")


def test_v100_and_geo_links_are_per_device_shares():
    v = Cluster.preset("8x8xV100")
    # 25 Gbit/s per node = 25e9/8 bytes/s, shared by 8 GPUs.
    assert v.inter_node.bandwidth_bytes_per_s == pytest.approx(25e9 / 8 / 8)
    g = Cluster.preset("geo-4")
    # Slowest wide-area link 13 Mbit/s = 13e6/8 bytes/s per site, shared by 8 GPUs;
    # largest latency 277 ms.
    assert g.inter_node.bandwidth_bytes_per_s == pytest.approx(13e6 / 8 / 8)
    assert g.inter_node.latency_s == 0.277
    # A100 HDR: 192 GB/s per node busbw over 8 NICs.
    assert Cluster.preset("8x8xA100").inter_node.bandwidth_bytes_per_s == pytest.approx(24e9)


def test_from_json_errors_are_helpful():
    good = json.loads(Cluster.preset("8x8xA100").to_json())

    with pytest.raises(ValueError, match="not valid JSON"):
        Cluster.from_json("{not json")
    with pytest.raises(ValueError, match="expected a JSON object"):
        Cluster.from_json("[1, 2]")

    d = dict(good, format="alpa_lite.cluster/0")
    with pytest.raises(ValueError, match="field 'format'.*'alpa_lite.cluster/1'"):
        Cluster.from_json(json.dumps(d))

    d = dict(good)
    del d["num_nodes"]
    with pytest.raises(ValueError, match=r"missing keys \['num_nodes'\]"):
        Cluster.from_json(json.dumps(d))

    d = dict(good, colour="green")
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        Cluster.from_json(json.dumps(d))

    d = json.loads(json.dumps(good))
    d["inter_node"]["bandwidth_bytes_per_s"] = -1
    with pytest.raises(ValueError, match="field 'inter_node'.*bandwidth_bytes_per_s.*-1"):
        Cluster.from_json(json.dumps(d))

    d = json.loads(json.dumps(good))
    d["inter_node"] = None
    with pytest.raises(ValueError, match="num_nodes = 8 but inter_node is None"):
        Cluster.from_json(json.dumps(d))

    d = json.loads(json.dumps(good))
    d["device"]["memory_bytes"] = "lots"
    with pytest.raises(ValueError, match="field 'device'.*memory_bytes must be a real number"):
        Cluster.from_json(json.dumps(d))

    d = json.loads(json.dumps(good))
    d["devices_per_node"] = 0
    with pytest.raises(ValueError, match="devices_per_node must be >= 1, got 0"):
        Cluster.from_json(json.dumps(d))


def test_json_cluster_with_int_values_canonicalises():
    d = json.loads(Cluster.preset("8xH100").to_json())
    d["device"]["memory_bytes"] = 80000000000  # int instead of float
    c = Cluster.from_json(json.dumps(d))
    assert c == Cluster.preset("8xH100")
    assert c.to_json() == Cluster.preset("8xH100").to_json()


def test_local_cluster_on_cpu_devices():
    import jax

    devices = jax.devices()
    if devices[0].platform != "cpu":
        pytest.skip("Cluster.local() CPU test needs the CPU platform")
    c = Cluster.local()
    assert c.platform == "cpu"
    assert c.num_devices == len(devices)
    assert c.num_nodes == 1 and c.inter_node is None
    assert c.device == DEVICES["CPU"]
    if len(devices) == 8:
        assert c.devices_per_node == 8
    assert Cluster.from_json(c.to_json()) == c


class _FakeDevice:
    """Stands in for a jax Device: only the attributes Cluster.local() reads."""

    def __init__(self, platform, kind, process_index, memory_bytes=None):
        self.platform = platform
        self.device_kind = kind
        self.process_index = process_index
        self.memory_bytes = memory_bytes

    def memory_stats(self):
        return None if self.memory_bytes is None else {"bytes_limit": self.memory_bytes}


def test_local_cluster_maps_gpu_kinds_and_processes(monkeypatch):
    import jax

    # Two processes (hosts) of 8 H100s each.
    fake = [_FakeDevice("gpu", "NVIDIA H100 80GB HBM3", i // 8) for i in range(16)]
    monkeypatch.setattr(jax, "devices", lambda: fake)
    c = Cluster.local()
    assert (c.num_nodes, c.devices_per_node, c.platform) == (2, 8, "gpu")
    assert c.device == DEVICES["H100"]
    assert c.intra_node == Cluster.preset("8xH100").intra_node
    assert c.inter_node == Cluster.preset("4x8xH100").inter_node

    fake = [_FakeDevice("gpu", "Tesla V100-SXM2-16GB", 0) for _ in range(4)]
    monkeypatch.setattr(jax, "devices", lambda: fake)
    assert Cluster.local().device == DEVICES["V100"]

    fake = [_FakeDevice("cpu", "cpu", p) for p in (0, 1, 1)]
    monkeypatch.setattr(jax, "devices", lambda: fake)
    with pytest.raises(ValueError, match="unequal device counts"):
        Cluster.local()

    # Two CPU processes of 4 devices: a nominal loopback link between them.
    fake = [_FakeDevice("cpu", "cpu", i // 4) for i in range(8)]
    monkeypatch.setattr(jax, "devices", lambda: fake)
    c = Cluster.local()
    assert (c.num_nodes, c.devices_per_node) == (2, 4)
    assert c.inter_node is not None and c.inter_node.name == "cpu-loopback"


def test_local_cluster_gives_an_h200_its_datasheet_figures(monkeypatch):
    import jax

    fake = [_FakeDevice("gpu", "NVIDIA H200", 0) for _ in range(8)]    # JAX's device_kind
    monkeypatch.setattr(jax, "devices", lambda: fake)
    c = Cluster.local()
    assert c.device == DEVICES["H200"] and c.name == "local-gpu-1x8"
    # H200 datasheet: HBM3e 141 GB at 4.8 TB/s; Hopper compute as the H100 SXM.
    assert c.device.memory_bytes == 141e9
    assert c.device.memory_bandwidth_bytes_per_s == 4.8e12
    assert c.device.peak_flops("bfloat16") == c.device.peak_flops("float16") == 989e12
    assert c.device.peak_flops("float32") == DEVICES["H100"].peak_flops("float32")
    # NVLink 4 (900 GB/s bidirectional) between the 8 GPUs, as on the 8xH100 preset.
    assert c.intra_node == Cluster.preset("8xH100").intra_node and c.inter_node is None


def test_device_kinds_map_to_their_rows():
    from alpa_lite.cost_models.cluster import device_key

    assert device_key("gpu", "NVIDIA H200") == "H200"
    assert device_key("gpu", "NVIDIA H100 80GB HBM3") == "H100"
    assert device_key("cuda", "NVIDIA A100-SXM4-80GB") == "A100"
    assert device_key("gpu", "Tesla V100-SXM2-16GB") == "V100"
    assert device_key("cpu", "cpu") == "CPU"
    # A Grace Hopper superchip has other memory than an H200; a TPU no row at all.
    assert device_key("gpu", "NVIDIA GH200 480GB") is None
    assert device_key("tpu", "TPU v5 lite") is None


@pytest.mark.parametrize("platform,kind", [("gpu", "NVIDIA GeForce RTX 4090"),
                                           ("tpu", "TPU v5 lite")])
def test_local_cluster_says_how_to_describe_an_unknown_device(monkeypatch, platform, kind):
    import jax

    fake = [_FakeDevice(platform, kind, 0, memory_bytes=24e9) for _ in range(4)]
    monkeypatch.setattr(jax, "devices", lambda: fake)
    with pytest.raises(ValueError) as info:
        Cluster.local()
    message = str(info.value)
    for fragment in (f"device_kind {kind!r}", f"platform {platform!r}",
                     "alpa-lite calibrate -o cluster.json", "Cluster.to_json",
                     "alpa-lite clusters --json", "--cluster cluster.json",
                     "cluster=al.Cluster.from_json(", f'"platform": "{platform}"'):
        assert fragment in message, (fragment, message)

    # What calibration starts from, and what a calibrated cluster is checked against: the
    # devices' shape, with a placeholder device (memory as JAX reports it).
    local = Cluster.local(allow_unknown=True)
    assert (local.platform, local.num_nodes, local.devices_per_node) == (platform, 1, 4)
    assert local.device.name == f"{kind} (uncalibrated)"
    assert local.device.memory_bytes == 24e9
    described = dataclasses.replace(Cluster.preset("8xA100"), name="mine", devices_per_node=4,
                                    platform=platform)
    assert described.can_run_on(local)
    assert not Cluster.preset("8xA100").can_run_on(local)


# ------------------------------------------------------------------ mesh axis topology


def test_mesh_axis_topology_4x8_on_4x8():
    c = Cluster.preset("4x8xH100")
    inner = mesh_axis_topology(c, (4, 8), 1)
    assert (inner.size, inner.local_size, inner.inter_node) == (8, 8, None)
    outer = mesh_axis_topology(c, (4, 8), 0)
    # Devices 0, 8, 16, 24: one per node.
    assert (outer.size, outer.local_size) == (4, 1)
    assert outer.inter_node == c.inter_node
    assert mesh_axis_topology(c, (4, 8), -1) == inner


def test_mesh_axis_topology_8x4_on_4x8():
    c = Cluster.preset("4x8xH100")
    inner = mesh_axis_topology(c, (8, 4), 1)
    assert (inner.size, inner.local_size, inner.inter_node) == (4, 4, None)
    outer = mesh_axis_topology(c, (8, 4), 0)
    # Devices 0, 4 | 8, 12 | 16, 20 | 24, 28: 8 devices, 2 per node, on 4 nodes.
    assert (outer.size, outer.local_size, outer.num_nodes) == (8, 2, 4)
    assert outer.inter_node == c.inter_node


def test_mesh_axis_topology_submesh_and_errors():
    c = Cluster.preset("4x8xH100")
    # A (1, 4) submesh starting at device 4 stays in node 0.
    t = mesh_axis_topology(c, (1, 4), 1, device_offset=4)
    assert (t.size, t.local_size, t.inter_node) == (4, 4, None)
    # (2, 8) starting at node 2: axis 0 crosses nodes 2 and 3.
    t = mesh_axis_topology(c, (2, 8), 0, device_offset=16)
    assert (t.size, t.local_size) == (2, 1)
    # Unaligned: devices 6, 7 | 8 split unevenly -> priced as a flat inter-node ring.
    t = mesh_axis_topology(c, (3,), 0, device_offset=6)
    assert (t.size, t.local_size, t.inter_node) == (3, 1, c.inter_node)
    with pytest.raises(ValueError, match="needs 64 devices.*has 32"):
        mesh_axis_topology(c, (8, 8), 0)
    with pytest.raises(ValueError, match="needs 8 devices from device_offset 30"):
        mesh_axis_topology(c, (8,), 0, device_offset=30)
    with pytest.raises(ValueError, match="axis = 2 but mesh_shape"):
        mesh_axis_topology(c, (4, 8), 2)
    with pytest.raises(ValueError, match=r"mesh_shape\[1\] must be >= 1, got 0"):
        mesh_axis_topology(c, (4, 0), 0)
    with pytest.raises(ValueError, match="mesh_shape is empty"):
        mesh_axis_topology(c, (), 0)


def test_axis_topology_validation():
    with pytest.raises(ValueError, match="size = 6 is not a multiple of local_size = 4"):
        AxisTopology(6, 4, LINK, SLOW)
    with pytest.raises(ValueError, match="spans nodes and needs an inter_node"):
        AxisTopology(8, 4, LINK, None)
    with pytest.raises(ValueError, match="pass inter_node=None"):
        AxisTopology(4, 4, LINK, SLOW)


# ------------------------------------------------------------------ flat collectives


def test_ring_all_reduce_flat():
    t = all_reduce_time(M, FLAT4)
    # 2(n-1) alpha + 2(n-1)/n M/B with n = 4.
    assert t == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * 1e6 / 1e9)


def test_tree_butterfly_ps_all_reduce_flat():
    tree = all_reduce_time(M, FLAT4, AllReduceAlgorithm.TREE)
    # 2 log2(4) (alpha + M/B)
    assert tree == pytest.approx(2 * 2 * (1e-6 + 1e6 / 1e9))
    bf = all_reduce_time(M, FLAT4, AllReduceAlgorithm.BUTTERFLY)
    # log2(4) (alpha + M/B)
    assert bf == pytest.approx(2 * (1e-6 + 1e6 / 1e9))
    ps = all_reduce_time(M, FLAT4, AllReduceAlgorithm.PARAMETER_SERVER)
    # 2 (alpha + (n-1) M/B): the server's one link carries the 3 other devices' gradients.
    assert ps == pytest.approx(2 * (1e-6 + 3 * 1e6 / 1e9))
    # Non-power-of-two: ceil(log2 6) = 3 steps.
    six = AxisTopology(6, 6, LINK, None)
    assert all_reduce_time(M, six, AllReduceAlgorithm.BUTTERFLY) == pytest.approx(
        3 * (1e-6 + 1e6 / 1e9)
    )
    # Ring beats the others for P > 2 (seeds/003).
    assert all_reduce_time(M, FLAT4) < min(tree, bf, ps)


def test_gather_scatter_all_to_all_send_recv_flat():
    # (n-1) alpha + (n-1)/n M/B
    one_pass = 3 * 1e-6 + 3 / 4 * 1e6 / 1e9
    assert all_gather_time(M, FLAT4) == pytest.approx(one_pass)
    assert reduce_scatter_time(M, FLAT4) == pytest.approx(one_pass)
    assert all_to_all_time(M, FLAT4) == pytest.approx(one_pass)
    # alpha + M/B
    assert send_recv_time(M, LINK) == pytest.approx(1e-6 + 1e6 / 1e9)
    # reduce-scatter + all-gather = ring all-reduce.
    assert reduce_scatter_time(M, FLAT4) + all_gather_time(M, FLAT4) == pytest.approx(
        all_reduce_time(M, FLAT4)
    )


def test_size_one_and_zero_bytes_are_free():
    one = AxisTopology(1, 1, LINK, None)
    for algo in AllReduceAlgorithm:
        assert all_reduce_time(M, one, algo) == 0.0
        assert all_reduce_time(0, FLAT4, algo) == 0.0
    for kind in CollectiveKind:
        assert collective_time(kind, M, one) == 0.0
        assert collective_time(kind, 0.0, FLAT4) == 0.0
    assert send_recv_time(0, LINK) == 0.0


def test_negative_or_nan_bytes_raise():
    with pytest.raises(ValueError, match="nbytes must be finite and >= 0, got -1"):
        all_reduce_time(-1, FLAT4)
    with pytest.raises(ValueError, match="nbytes"):
        all_gather_time(float("nan"), FLAT4)
    with pytest.raises(ValueError, match="topo must be an AxisTopology"):
        all_reduce_time(M, LINK)


def test_collective_time_dispatch():
    assert collective_time(CollectiveKind.ALL_REDUCE, M, FLAT4) == all_reduce_time(M, FLAT4)
    assert collective_time(CollectiveKind.ALL_GATHER, M, FLAT4) == all_gather_time(M, FLAT4)
    assert collective_time(CollectiveKind.REDUCE_SCATTER, M, FLAT4) == reduce_scatter_time(
        M, FLAT4
    )
    assert collective_time(CollectiveKind.ALL_TO_ALL, M, FLAT4) == all_to_all_time(M, FLAT4)
    assert collective_time(CollectiveKind.SEND_RECV, M, FLAT4) == send_recv_time(M, LINK)
    assert CollectiveKind.ALL_REDUCE.value == "all-reduce"
    with pytest.raises(ValueError, match="kind must be a CollectiveKind"):
        collective_time("all-reduce", M, FLAT4)


# ------------------------------------------------------------------ hierarchical


def test_hierarchical_all_reduce():
    # 8 devices, 4 per node, 2 nodes.
    topo = AxisTopology(8, 4, LINK, SLOW)
    t = all_reduce_time(M, topo)
    reduce_scatter_in_node = 3 * 1e-6 + 3 / 4 * 1e6 / 1e9  # L = 4 on LINK
    ring_across_nodes = 2 * 1 * 1e-5 + 2 * 1 / 2 * (1e6 / 4) / 1e8  # N = 2 on SLOW, M/4
    all_gather_in_node = reduce_scatter_in_node
    assert t == pytest.approx(reduce_scatter_in_node + ring_across_nodes + all_gather_in_node)
    tree = all_reduce_time(M, topo, AllReduceAlgorithm.TREE)
    assert tree == pytest.approx(
        2 * reduce_scatter_in_node + 2 * 1 * (1e-5 + (1e6 / 4) / 1e8)
    )


def test_hierarchical_gather_scatter_all_to_all_send_recv():
    topo = AxisTopology(8, 4, LINK, SLOW)
    in_node = 3 * 1e-6 + 3 / 4 * 1e6 / 1e9  # L = 4, full M on LINK
    across = 1 * 1e-5 + 1 / 2 * (1e6 / 4) / 1e8  # N = 2, M/4 on SLOW
    assert all_gather_time(M, topo) == pytest.approx(across + in_node)
    assert reduce_scatter_time(M, topo) == pytest.approx(in_node + across)
    # All-to-all: 3/8 of M inside the node, 4/8 of M across nodes, concurrently.
    t_intra = 3 * 1e-6 + 3 / 8 * 1e6 / 1e9
    t_inter = 4 * 1e-5 + 4 / 8 * 1e6 / 1e8
    assert all_to_all_time(M, topo) == pytest.approx(max(t_intra, t_inter))
    # Point-to-point along a cross-node axis uses the slow link.
    assert collective_time(CollectiveKind.SEND_RECV, M, topo) == pytest.approx(1e-5 + 1e6 / 1e8)


def test_one_device_per_node_is_flat_on_inter_link():
    topo = AxisTopology(4, 1, LINK, SLOW)
    assert all_reduce_time(M, topo) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 1e6 / 1e8)
    assert all_gather_time(M, topo) == pytest.approx(3 * 1e-5 + 3 / 4 * 1e6 / 1e8)
    assert all_to_all_time(M, topo) == pytest.approx(3 * 1e-5 + 3 / 4 * 1e6 / 1e8)


def test_ring_all_reduce_reproduces_h100_busbw():
    # The preset's NVLink is fitted to nccl-tests on 8 H100s (bench/calibrate_links.py):
    # 1 GiB measured at 466 GB/s bus bandwidth, 1 KiB at 0.07 GB/s (~26 us: latency).
    c = Cluster.preset("8xH100")
    topo = mesh_axis_topology(c, (8,), 0)
    for nbytes, measured_busbw in ((2**30, 466.35e9), (2**10, 0.07e9)):
        t = all_reduce_time(nbytes, topo)
        busbw = nbytes / t * 2 * (8 - 1) / 8  # nccl-tests definition
        assert busbw == pytest.approx(measured_busbw, rel=0.3)


def test_inter_node_all_reduce_is_slower_than_intra():
    c = Cluster.preset("4x8xH100")
    nbytes = 2**30
    t_in = all_reduce_time(nbytes, mesh_axis_topology(c, (4, 8), 1))
    t_out = all_reduce_time(nbytes, mesh_axis_topology(c, (4, 8), 0))
    assert t_out > t_in
    # geo-4 across sites: latency alone is 2*(4-1)*0.277 s.
    g = Cluster.preset("geo-4")
    t_geo = all_reduce_time(1e6, mesh_axis_topology(g, (4, 8), 0))
    assert t_geo > 2 * 3 * 0.277


# ------------------------------------------------------------------ compute


def test_compute_time_roofline():
    h100 = DEVICES["H100"]
    # 8192^3 bf16 matmul: 1.1e12 FLOP, where the H100 curve is at its cap, the best a shape
    # scan reaches (792.1 TFLOP/s), plus one kernel launch (3 us).
    flops = 2 * 8192**3
    nbytes = 3 * 8192**2 * 2
    assert compute_time(flops, nbytes, h100, "bfloat16", True) == pytest.approx(
        2 * 8192**3 / 792.1e12 + 3e-6
    )
    # gelu on 1e8 bf16 elements: ~8 FLOP each, 2 bytes in + 2 out: memory bound at the
    # measured element-wise bandwidth (3.21 TB/s); no kernel unless the caller counts one.
    assert compute_time(8e8, 4e8, h100, "bfloat16", False) == pytest.approx(4e8 / 3.21e12)
    assert compute_time(8e8, 4e8, h100, "bfloat16", False, kernels=2) == pytest.approx(
        4e8 / 3.21e12 + 2 * 3e-6)
    # Elementwise compute-bound case uses elementwise_efficiency.
    assert compute_time(1e12, 1.0, h100, "float32", False) == pytest.approx(1e12 / (67e12 * 0.8))
    assert compute_time(0, 0, h100, "bfloat16", True) == 0.0
    with pytest.raises(ValueError, match="flops must be finite and >= 0"):
        compute_time(-1, 0, h100, "bfloat16", True)
    with pytest.raises(ValueError, match="bytes_accessed"):
        compute_time(1, math.inf, h100, "bfloat16", True)
