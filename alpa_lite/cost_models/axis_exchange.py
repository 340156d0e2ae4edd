"""The time of a stage's gradient exchange over one group of mesh axes, compressed or not.

In a hybrid plan (data parallelism beside tensor or pipeline parallelism) a stage's
gradients are accumulated per device and exchanged once per step over the stage's
data-parallel (accumulation) axes. Every device holds a shard of each gradient (its
tensor-parallel block, or the whole gradient without tensor parallelism) and exchanges it
with the devices that hold the same shard on the other replicas: a flat group of
`workers` devices.

A compressed exchange is priced as the compressor's own collective on that group:

    bytes_s    = wire_bytes(shard) / bandwidth of the slowest link the group crosses
    latency_s  = latency_hops(workers) x that link's latency, once per step (XLA
                 combines the leaves' collectives)
    compress_s = memory_passes x 4 bytes x numel / memory bandwidth + flops / peak

A full-precision gradient goes through the stage's hierarchical all-reduce
(`plan.sharding.CommModel.all_reduce`), priced by the caller. A gradient is worth
compressing only where its compressed bytes and compression take less time than its
full-precision bytes on the same link (`worth_compressing`): small tensors (biases, norms)
stay dense, as Deep Gradient Compression keeps them (Lin et al. 2018, section 3.3).

The compressor is duck-typed (`alpa_lite.compression.Compressor`): this module needs no JAX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from alpa_lite.cost_models.cluster import LinkSpec
from alpa_lite.cost_models.collectives import AxisTopology
from alpa_lite.cost_models.devices import DeviceSpec


@dataclass(frozen=True)
class ShardCost:
    """One gradient shard's share of a compressed exchange (latency aside)."""
    wire_bytes: float         # per device, sent
    dense_wire_bytes: float   # the same in a full-precision ring all-reduce
    bytes_s: float            # wire_bytes on the group's slowest link
    dense_bytes_s: float      # dense_wire_bytes on that link
    compress_s: float         # compressing and decompressing on the device

    @property
    def worth_compressing(self) -> bool:
        return self.bytes_s + self.compress_s < self.dense_bytes_s


def group_link(topologies: Sequence[AxisTopology]) -> LinkSpec:
    """The slowest link a flat group over these axes crosses: the inter-node link where
    any axis spans nodes, else the intra-node one (a ring is as fast as its slowest hop)."""
    inter = [t.inter_node for t in topologies if t.inter_node is not None]
    if inter:
        return min(inter, key=lambda link: link.bandwidth_bytes_per_s)
    return min((t.intra_node for t in topologies), key=lambda link: link.bandwidth_bytes_per_s)


def shard_cost(compressor: Any, shape: tuple[int, ...], itemsize: int, workers: int,
               link: LinkSpec, device: DeviceSpec, dtype: str = "float32") -> ShardCost:
    """The compressed exchange of one gradient shard of `shape` among `workers` devices."""
    numel = math.prod(shape)
    wire = compressor.wire_bytes(numel, itemsize, workers, shape=shape)
    dense = 2 * (workers - 1) / workers * numel * itemsize
    compress = (compressor.memory_passes * numel * 4 / device.memory_bandwidth_bytes_per_s
                + compressor.flops(shape) / device.peak_flops(dtype))
    bw = link.bandwidth_bytes_per_s
    return ShardCost(wire_bytes=wire, dense_wire_bytes=dense, bytes_s=wire / bw,
                     dense_bytes_s=dense / bw, compress_s=compress)


def exchange_latency(compressor: Any, workers: int, link: LinkSpec) -> float:
    """The link latencies one compressed exchange pays in sequence, once per step."""
    return compressor.latency_hops(workers) * link.latency_s if workers > 1 else 0.0
