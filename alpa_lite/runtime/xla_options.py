"""XLA compiler options that carry out a plan's gradient buckets (`plan.timing.SyncBuckets`).

Set per compiled executable (`jax.jit(..., compiler_options=...)`), never through
`XLA_FLAGS`, so one process can run plans with different bucket sizes side by side.
What a plan's buckets need depends on who cuts them (`BucketIssue`) and on the backend:

GPU, reductions placed by the partitioner (`XLA_COMBINER`): XLA's all-reduce and
reduce-scatter combiners take the plan's bucket size as their threshold (they combine
independent collectives while the combined bytes stay within it: the rule the cost model
buckets by), and the latency-hiding scheduler runs each combined collective
asynchronously beside the rest of the backward. XLA forms its groups in its own
instruction order, which follows the backward, so they are the planned buckets where that
order is the formation order. The threshold covers every all-reduce of the program, the
intra-op ones of tensor parallelism too (independent ones, the only kind combined, are
rare on a critical path). It is never XLA's default value itself: at exactly that value
the newer `GpuAllReduceCombiner` ignores it and picks a threshold by its own heuristics.

GPU, reductions issued by the runtime (`RUNTIME`): one all-reduce per bucket is already in
the program, so XLA's combiner is turned off (it could merge small buckets) and the
latency-hiding scheduler on.

CPU. XLA:CPU has no latency-hiding scheduler or asynchronous collectives, and its combiner
(`CpuAllReduceCombiner` in `xla/service/cpu/cpu_compiler.cc`) merges every independent
all-reduce up to a hard-coded ``int64 max`` bytes and 256 operands; no debug option reads
that threshold (``xla_gpu_all_reduce_combine_threshold_bytes`` is ignored there). So
reductions the partitioner places are combined into one all-reduce after the backward,
whatever the plan's bucket size: nothing is passed (a plan made for a CPU cluster chooses
one bucket anyway: nothing overlaps). Reductions the runtime issues per bucket keep their
buckets only with that pass disabled (``xla_disable_hlo_passes``), and then XLA:CPU's
scheduler places each bucket's all-reduce as soon as its gradients exist, between the
backward's remaining operators (`tests/test_sync_buckets.py` reads it off the HLO).
"""

from __future__ import annotations

from alpa_lite.cost_models.overlap import XLA_COMBINE_THRESHOLD_BYTES
from alpa_lite.plan import BucketIssue, SyncBuckets

__all__ = ["CPU_COMBINER_PASS", "GPU_COMBINER_PASSES", "GPU_PLATFORMS", "bucket_options"]

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# The name of XLA:CPU's all-reduce combiner pass.
CPU_COMBINER_PASS = "cpu-all-reduce-combiner"
# The GPU all-reduce combiner's pass name: `GpuAllReduceCombiner` (2024 on), and the
# generic `AllReduceCombiner` GPU pipelines ran before it (disabling a pass that is not in
# the pipeline does nothing).
GPU_COMBINER_PASSES = ("gpu-all-reduce-combiner", "all-reduce-combiner")


def bucket_options(buckets: SyncBuckets | None, platform: str) -> dict[str, bool | int | str]:
    """The compiler options for a program that runs `buckets`' reductions on `platform`
    (a `jax.Device.platform`: "cpu", "gpu", "cuda", "rocm", "tpu"); {} where nothing is
    needed or nothing applies (module docstring)."""
    if buckets is None or not buckets.buckets:
        return {}
    if platform in GPU_PLATFORMS:
        if buckets.issue is BucketIssue.RUNTIME:
            return {"xla_gpu_enable_latency_hiding_scheduler": True,
                    "xla_disable_hlo_passes": ",".join(GPU_COMBINER_PASSES)}
        threshold = int(buckets.bucket_bytes)
        if threshold == XLA_COMBINE_THRESHOLD_BYTES:
            threshold += 1          # the default value means "use heuristics" (docstring)
        return {"xla_gpu_enable_latency_hiding_scheduler": True,
                "xla_gpu_all_reduce_combine_threshold_bytes": threshold,
                "xla_gpu_reduce_scatter_combine_threshold_bytes": threshold}
    if platform == "cpu" and buckets.issue is BucketIssue.RUNTIME and \
            len(buckets.buckets) > 1:
        return {"xla_disable_hlo_passes": CPU_COMBINER_PASS}
    return {}
