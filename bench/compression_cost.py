"""What compressing a gradient costs: compress + decompress time per compressor, measured.

For each compressor of `alpa_lite.compression`, `compressor.reduce` runs on ONE worker: a
`jax.shard_map` over a 1-device mesh with axis "dp" (num_workers=1), so the collectives
move nothing and what is timed is the local work, encoding and decoding (plus the state
update: residuals, momentum). The gradient is a float32 matrix of `--numel` entries
(default 100M = 10_000 x 10_000 on an accelerator, 10M = 3_162 x 3_162 on CPU: 100M on a
2-core CPU takes minutes per compressor); times are also scaled linearly to 100M entries
("per 100M"), which assumes the cost is linear in the size (top-k's is not quite).

Method: jit, one call to compile (reported), `--warmup` untimed calls, then `--repeats`
timed calls, each blocking on every output (`jax.block_until_ready`); the median is
reported with min and max. Beside the measurement, the cost model's estimate for the same
tensor (`memory_passes` float32 passes at the device's memory bandwidth plus `flops` at its
float32 peak, as `cost_models.gradient_sync` prices it) on this device's spec and on an H100.

DGC's selection alone: its sampled threshold (the k-th largest of a 1% random sample,
adjusted by counting, then the k positions gathered by `jnp.nonzero(size=k)`:
`alpa_lite.compression.sparse._select_by_sampled_threshold`), the threshold estimate alone
(sample + top-k of the sample), and a full `jax.lax.top_k` of the same |v|, for sparsity
0.999 (k = numel / 1000). The target stated for the sampled threshold is < 1 ms per 100M
floats on an H100; on CPU the numbers are only what the CPU gives.

Beside them: the time a dense ring all-reduce of 400 MB (100M float32) takes on each cluster
preset's links by the alpha-beta model, 2 (n-1) alpha + 2 (n-1)/n * B / beta, with n the
devices of a node for the intra-node link and the nodes for the inter-node link. The main
table divides the measured per-100M compress time by four of them.

The process sees one device: `--xla_force_host_platform_device_count` is removed from
XLA_FLAGS before jax is imported.

Run:
    python bench/compression_cost.py                 # 10M on CPU, 100M on GPU
    python bench/compression_cost.py --numel 100000000 --repeats 10
    python bench/compression_cost.py --numel 1000000 --repeats 3     # a fast check
Writes bench/results/compression_cost.json (``--out`` to change; the backend and device are
recorded in it, so a GPU run should write another file, e.g. compression_cost_h100.json).
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                                 os.environ.get("XLA_FLAGS", "")).strip()

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P

import alpa_lite as al  # noqa: E402
from alpa_lite import compression as C  # noqa: E402
from alpa_lite.compression.base import count_of  # noqa: E402
from alpa_lite.compression.sparse import _select_by_sampled_threshold  # noqa: E402
from alpa_lite.cost_models.devices import DEVICES, DeviceSpec  # noqa: E402

PER_100M = 100_000_000
ALL_REDUCE_BYTES = 4 * PER_100M           # 400 MB: 100M float32
DGC_SPARSITY = 0.999
# (preset, link) pairs shown beside each compressor in the main table.
KEY_LINKS = [("8xH100", "intra"), ("4x8xH100", "inter"), ("8x8xV100", "inter"),
             ("geo-4", "inter")]
LINK_SHORT = {("8xH100", "intra"): "NVL", ("4x8xH100", "inter"): "IB",
              ("8x8xV100", "inter"): "eth", ("geo-4", "inter"): "WAN"}


def compressors() -> list[tuple[str, C.Compressor]]:
    return [("dense (psum)", C.Dense()), ("bf16 cast", C.Cast("bf16")),
            ("top-k 1% EF", C.TopK(0.01)), ("random-k 1% EF", C.RandomK(0.01)),
            ("DGC 99.9%", C.DGC(sparsity=DGC_SPARSITY)), ("PowerSGD r2", C.PowerSGD(rank=2)),
            ("1-bit SGD EF", C.OneBit()), ("signSGD vote", C.SignSGD()),
            ("TernGrad", C.TernGrad()), ("QSGD 8 lv", C.QSGD(levels=8))]


def gradient_shape(numel: int) -> tuple[int, int]:
    side = math.isqrt(numel)
    return side, numel // side


def time_calls(fn: Callable, args: tuple, warmup: int, repeats: int) -> dict[str, Any]:
    """Compile time, then the median / min / max seconds of `repeats` blocking calls."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return {"first_call_s": first, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "times_s": times}


def single_worker_reduce(comp: C.Compressor, mesh: Mesh) -> Callable:
    """jit(shard_map(reduce)) on one worker: (grad[None], state[None], key) -> (sum, state)."""
    def worker(grad, state, key):
        total, state = comp.reduce(grad[0], jax.tree.map(lambda a: a[0], state),
                                   axis_name="dp", num_workers=1, phase=(), shared_key=key,
                                   worker_key=key)
        return total[None], jax.tree.map(lambda a: a[None], state)
    return jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("dp"), P("dp"), P()),
                                 out_specs=(P("dp"), P("dp"))))


def model_compress_s(comp: C.Compressor, shape: tuple[int, ...], device: DeviceSpec) -> float:
    """The cost model's compress + decompress time for one leaf (cost_models.gradient_sync)."""
    numel = math.prod(shape)
    return (comp.memory_passes * numel * 4 / device.memory_bandwidth_bytes_per_s
            + comp.flops(shape) / device.peak_flops("float32"))


def ring_all_reduce_s(nbytes: float, n: int, link) -> float:
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s


def link_rows() -> list[dict[str, Any]]:
    rows = []
    for name in al.Cluster.presets():
        cluster = al.Cluster.preset(name)
        for where, link, n in (("intra", cluster.intra_node, cluster.devices_per_node),
                               ("inter", cluster.inter_node, cluster.num_nodes)):
            if link is None or n < 2:
                continue
            rows.append({"preset": name, "where": where, "link": link.name, "n": n,
                         "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                         "latency_s": link.latency_s,
                         "all_reduce_400MB_s": ring_all_reduce_s(ALL_REDUCE_BYTES, n, link)})
    return rows


def local_device_spec() -> tuple[str, DeviceSpec]:
    try:
        cluster = al.Cluster.local()
        return cluster.device.name, cluster.device
    except ValueError:
        return "CPU", DEVICES["CPU"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=None,
                    help="gradient entries (default: 100M on an accelerator, 10M on CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--methods", nargs="*", default=None, help="labels (default: all)")
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "compression_cost.json")
    args = ap.parse_args()
    backend = jax.default_backend()
    numel = args.numel or (10_000_000 if backend == "cpu" else PER_100M)
    shape = gradient_shape(numel)
    numel = math.prod(shape)
    scale = PER_100M / numel
    device = jax.devices()[0]
    spec_name, spec = local_device_spec()
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    links = link_rows()
    key_links = {(r["preset"], r["where"]): r for r in links}
    grad = jax.random.normal(jax.random.key(0), (1, *shape), jnp.float32)
    key = jax.random.key(1)
    print(f"{backend} {device.device_kind}: gradient {shape} float32 = {numel * 4 / 1e6:.0f} MB",
          flush=True)

    results = []
    for label, comp in compressors():
        if args.methods and label not in args.methods:
            continue
        state = jax.tree.map(lambda a: a[None], comp.init_state(shape, jnp.float32))
        timing = time_calls(single_worker_reduce(comp, mesh), (grad, state, key),
                            args.warmup, args.repeats)
        del state
        r = {"method": label, "config": C.to_config(comp), "description": comp.describe(),
             "shape": list(shape), **timing,
             "median_s_per_100M": timing["median_s"] * scale,
             "model_s_this_device": model_compress_s(comp, shape, spec),
             "model_s_per_100M_this_device": model_compress_s(comp, shape, spec) * scale,
             "model_s_per_100M_H100": model_compress_s(comp, gradient_shape(PER_100M),
                                                       DEVICES["H100"]),
             "wire_bytes_per_100M_8_workers": comp.wire_bytes(
                 PER_100M, 4, 8, shape=gradient_shape(PER_100M)),
             "compress_over_all_reduce": {
                 f"{p}/{w}": timing["median_s"] * scale
                 / key_links[(p, w)]["all_reduce_400MB_s"] for p, w in KEY_LINKS}}
        results.append(r)
        print(f"  {label}: {timing['median_s'] * 1e3:.1f} ms (first call "
              f"{timing['first_call_s']:.1f} s)", flush=True)

    # DGC's selection: sampled threshold vs a full top-k.
    magnitude = jnp.abs(grad.reshape(-1))
    k = count_of(numel, 1 - DGC_SPARSITY)
    samples = min(numel, max(math.ceil(numel * C.DGC().sample_ratio),
                             math.ceil(2 / (1 - DGC_SPARSITY))))

    def estimate(m, key):
        sample = m[jax.random.randint(key, (samples,), 0, numel)]
        return jax.lax.top_k(sample, max(1, round(samples * k / numel)))[0][-1]

    selection = []
    for label, fn, fargs in [
            ("sampled threshold: estimate only", jax.jit(estimate), (magnitude, key)),
            ("sampled threshold: estimate + adjust + gather k",
             jax.jit(lambda m, key: _select_by_sampled_threshold(m, k, samples, key)),
             (magnitude, key)),
            ("full jax.lax.top_k", jax.jit(lambda m: jax.lax.top_k(m, k)[1]), (magnitude,))]:
        timing = time_calls(fn, fargs, args.warmup, args.repeats)
        selection.append({"method": label, "k": k, "samples": samples, **timing,
                          "median_s_per_100M": timing["median_s"] * scale})
        print(f"  {label}: {timing['median_s'] * 1e3:.2f} ms", flush=True)

    def ms(s):
        return f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:,.0f}"

    link_head = [(f"/AR {p} {LINK_SHORT[p, w]}", "right") for p, w in KEY_LINKS]
    _common.print_table(
        f"Compress + decompress, one worker, {shape[0]}x{shape[1]} float32 "
        f"({numel / 1e6:.3g}M) on {backend} ({device.device_kind})",
        [("method", "left"), ("compile s", "right"), ("median ms", "right"),
         ("min-max ms", "right"), ("ms/100M", "right"), ("model here", "right"),
         ("model H100", "right"), ("wire MB n=8", "right"), *link_head],
        [[r["method"], f"{r['first_call_s']:.1f}", ms(r["median_s"]),
          f"{ms(r['min_s'])}-{ms(r['max_s'])}", ms(r["median_s_per_100M"]),
          ms(r["model_s_per_100M_this_device"]), ms(r["model_s_per_100M_H100"]),
          f"{r['wire_bytes_per_100M_8_workers'] / 1e6:.1f}",
          *[f"{v:.3g}" for v in r["compress_over_all_reduce"].values()]] for r in results],
        caption="ms/100M: the median scaled linearly to 100M entries. model here / H100: the "
                f"cost model's memory-pass + flop estimate, ms per 100M, on {spec_name} / on "
                "an H100. wire MB n=8: bytes one of 8 workers sends for 100M entries. /AR: "
                "ms/100M divided by a dense ring all-reduce of 400 MB on that preset's link "
                "(alpha-beta model, last table): NVL 8xH100 NVLink (n=8), IB 4x8xH100 "
                "InfiniBand (n=4), eth 8x8xV100 25 Gbit/s (n=8), WAN geo-4 (n=4).")
    _common.print_table(
        f"DGC selection, sparsity {DGC_SPARSITY} (k = {k:,}, {samples:,} samples) on |v| of "
        f"{numel / 1e6:.3g}M normal floats",
        [("selection", "left"), ("compile s", "right"), ("median ms", "right"),
         ("min-max ms", "right"), ("ms / 100M", "right")],
        [[s["method"], f"{s['first_call_s']:.1f}", ms(s["median_s"]),
          f"{ms(s['min_s'])}-{ms(s['max_s'])}", ms(s["median_s_per_100M"])]
         for s in selection])
    _common.print_table(
        "Dense ring all-reduce of 400 MB (100M float32) by preset link, alpha-beta model",
        [("preset", "left"), ("link", "left"), ("where", "left"), ("n", "right"),
         ("GB/s per device", "right"), ("latency us", "right"), ("all-reduce ms", "right")],
        [[r["preset"], r["link"], r["where"], str(r["n"]),
          f"{r['bandwidth_bytes_per_s'] / 1e9:.4g}", f"{r['latency_s'] * 1e6:.3g}",
          ms(r["all_reduce_400MB_s"])] for r in links])
    _common.write_result(args.out, {
        "benchmark": "compression_cost", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "backend": backend, "device": str(device), "device_kind": device.device_kind,
        "cost_model_device": spec_name,
        "settings": {"numel": numel, "shape": list(shape), "dtype": "float32",
                     "workers": 1, "warmup": args.warmup, "repeats": args.repeats,
                     "dgc_sparsity": DGC_SPARSITY, "all_reduce_bytes": ALL_REDUCE_BYTES},
        "compressors": results, "dgc_selection": selection, "all_reduce_links": links})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
