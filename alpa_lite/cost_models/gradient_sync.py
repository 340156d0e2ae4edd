"""The time of a data-parallel gradient exchange, plain or compressed, and of a step with it.

Data parallelism over a whole cluster: every device is a worker holding all parameters.
Across nodes the exchange is hierarchical, as the runtime does it:

1. inside each node, a full-precision ring reduce-scatter of each gradient leaf along its
   first dimension (leaves whose first dimension the node's devices do not divide are
   all-reduced whole instead);
2. between nodes, each device exchanges its shard with its counterparts on the other nodes,
   through the exchange method (a plain all-reduce, or a compressor);
3. inside each node, a ring all-gather of the summed shards.

On one node, step 2 runs among the node's devices and steps 1 and 3 vanish.

The exchange method is duck-typed (``alpa_lite.compression.Compressor``): this module uses
its ``wire_bytes`` (bytes one worker sends for one leaf), ``latency_hops`` (link latencies
paid in sequence), ``memory_passes`` and ``flops`` (the work of compressing). Latencies are
charged once per step per phase, since XLA combines the leaves' collectives.

Delayed averaging (``delay`` D >= 1): the exchange of step i's gradients may take D steps.
Its latency overlaps D steps of computation; its bytes do not (the link carries one step's
worth of bytes per step however many exchanges are in flight), so

    step = max(compute + compress, bytes_time, (latency_time + bytes_time) / D).

Local SGD (``every`` H >= 1, ``compression.LocalSGD``): no gradient is exchanged; once
every H steps the workers exchange their parameters (or compressed deltas, float32) by the
same hierarchical exchange, synchronously after that step's local update. The estimate is
the steady state after any synchronous warm-up, the exchange amortized over the H steps:

    step = compute + exchange / H

(a step that averages takes compute + exchange, the H - 1 others compute alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from alpa_lite.cost_models.cluster import Cluster, LinkSpec


@dataclass(frozen=True)
class GradientLeaf:
    """One gradient leaf: its global shape and the bytes of one element."""
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SyncEstimate:
    """Seconds of one step's gradient exchange, by part, and its traffic."""
    intra_s: float          # full-precision reduce-scatter + all-gather inside nodes
    bytes_s: float          # the exchange's bytes on its link
    latency_s: float        # the exchange's link latencies
    compress_s: float       # compressing and decompressing on the device
    wire_bytes: float       # per worker per step, sent in the exchange
    dense_wire_bytes: float  # the same for an uncompressed all-reduce

    @property
    def total_s(self) -> float:
        """The exchange done synchronously, after the backward pass."""
        return self.intra_s + self.bytes_s + self.latency_s + self.compress_s


def exchange_layout(cluster: Cluster, leaf: GradientLeaf) -> tuple[tuple[int, ...], int, str]:
    """(shape each worker exchanges, number of exchanging workers, link) for one leaf:
    the node's shard between nodes, the whole leaf among one node's devices."""
    local, nodes = cluster.devices_per_node, cluster.num_nodes
    if nodes == 1:
        return leaf.shape, local, "intra"
    if local > 1 and leaf.shape and leaf.shape[0] % local == 0:
        return (leaf.shape[0] // local,) + tuple(leaf.shape[1:]), nodes, "inter"
    return leaf.shape, nodes, "inter"


def gradient_sync(cluster: Cluster, leaves: Sequence[GradientLeaf], exchange: Any,
                  dtype: str = "float32") -> SyncEstimate:
    """The exchange of `leaves` over all of `cluster`'s devices with method `exchange`.

    Args:
      cluster: the cluster; every device is a data-parallel worker.
      leaves: the gradient leaves.
      exchange: a compressor (``alpa_lite.compression``); ``Dense()`` is the plain all-reduce.
      dtype: the dtype whose peak FLOP/s prices the compressor's arithmetic.
    """
    from_dense = _Dense()
    local = cluster.devices_per_node
    intra_link: LinkSpec = cluster.intra_node
    link = intra_link if cluster.num_nodes == 1 else cluster.inter_node
    intra = wire = dense_wire = passes_bytes = flops = 0.0
    workers = cluster.num_devices if cluster.num_nodes == 1 else cluster.num_nodes
    sharded_any = whole_any = False
    for leaf in leaves:
        shape, n, where = exchange_layout(cluster, leaf)
        numel = math.prod(shape)
        wire += exchange.wire_bytes(numel, leaf.itemsize, n, shape=shape)
        dense_wire += from_dense.wire_bytes(numel, leaf.itemsize, n)
        passes_bytes += exchange.memory_passes * numel * 4
        flops += exchange.flops(shape)
        if where == "inter" and local > 1:
            # Reduce-scatter then all-gather, or an all-reduce of the whole leaf: the same
            # ring bytes; they are separate phases for the latency below.
            intra += (2 * (local - 1) / local * leaf.numel * leaf.itemsize
                      / intra_link.bandwidth_bytes_per_s)
            if shape != leaf.shape:
                sharded_any = True
            else:
                whole_any = True
    if sharded_any or whole_any:
        intra += 2 * (local - 1) * intra_link.latency_s * (sharded_any + whole_any)
    device = cluster.device
    compress = (passes_bytes / device.memory_bandwidth_bytes_per_s
                + flops / device.peak_flops(dtype))
    return SyncEstimate(intra_s=intra, bytes_s=wire / link.bandwidth_bytes_per_s,
                        latency_s=exchange.latency_hops(workers) * link.latency_s if leaves
                        else 0.0,
                        compress_s=compress, wire_bytes=wire, dense_wire_bytes=dense_wire)


def step_time(compute_s: float, sync: SyncEstimate, delay: int = 0, every: int = 1) -> float:
    """A step's time: `compute_s` (everything but the gradient exchange) plus the exchange,
    synchronous (`delay` 0) or delayed by `delay` steps, or, for local SGD, run once every
    `every` steps and amortized over them (module docstring)."""
    if every < 1:
        raise ValueError(f"every must be >= 1 (steps between exchanges), got {every!r}")
    if delay and every > 1:
        raise ValueError("an exchange is either delayed (delay > 0) or run every few steps "
                         f"(every > 1), not both; got delay={delay}, every={every}")
    if delay == 0:
        return compute_s + sync.total_s / every
    link_s = sync.intra_s + sync.bytes_s
    return max(compute_s + sync.compress_s, link_s, (link_s + sync.latency_s) / delay)


class _Dense:
    """The plain ring all-reduce's bytes (kept here so this module needs no JAX)."""

    @staticmethod
    def wire_bytes(numel: int, itemsize: int, num_workers: int) -> float:
        return 2 * (num_workers - 1) / num_workers * numel * itemsize
