"""Where gradient compression pays: GPT data parallel on NVLink, Ethernet and wide-area clusters.

For each cluster preset, GPT-1.3B (bf16 on H100, fp16 on V100, Adam) is planned as data
parallelism over every device, without compression and with each exchange method, and with
`compression=AutoCompression(allow=common_lossy())`, the planner's own choice. Everything
is the cost model (`cost_models.gradient_sync` on top of the data-parallel plan's ILP
estimate; the exact all-reduce in buckets during the backward, only what outlasts it
counted), from `jax.ShapeDtypeStruct`s: nothing runs.

Expected: on clusters whose links are all fast (NVLink inside nodes, InfiniBand between
them) the exchange is a small part of the step and "auto" keeps the exact all-reduce; on
`geo-4` (four 8-GPU sites over 13 Mbit/s, 277 ms links) the exchange dominates and "auto"
picks a compressor or delayed averaging, which must be at least 3x faster than synchronous
uncompressed data parallelism.

Run:
    python bench/compression_where.py
    python bench/compression_where.py --clusters geo-4 --batch 64
Writes bench/results/compression_where.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.use_examples()

import gpt  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from alpa_lite import compression as C  # noqa: E402

METHODS = [
    C.Dense(), C.Cast("bf16"), C.TopK(0.01), C.DGC(0.999, momentum=0.0), C.PowerSGD(rank=4),
    C.OneBit(), C.SignSGD(), C.TernGrad(), C.QSGD(levels=8), C.DelayedAveraging(delay=4),
    C.DelayedAveraging(delay=4, compressor=C.PowerSGD(rank=4)),
    C.DelayedAveraging(delay=4, compressor=C.DGC(0.999, momentum=0.0)),
]


def label(method) -> str:
    return "none (all-reduce)" if method == C.Dense() else method.describe().split(":")[0]


def plan(cfg, batch, cluster, compression):
    tx = optax.adamw(1e-4)
    step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.DataParallel(),
                          compression=compression)
    return step.plan(*gpt.abstract_args(cfg, batch, tx), cluster=cluster)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--clusters", nargs="*", default=["4x8xH100", "8x8xV100", "geo-4"])
    ap.add_argument("--batch", type=int, default=128, help="global batch (sequences)")
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "compression_where.json")
    args = ap.parse_args()
    results, rows = [], []
    for name in args.clusters:
        cluster = al.Cluster.preset(name)
        cfg = gpt.CONFIGS[args.size]
        if cluster.device.name.startswith("V100"):    # no bfloat16 on V100
            cfg = dataclasses.replace(cfg, dtype="float16")
        t0 = time.perf_counter()
        chosen = plan(cfg, args.batch, cluster, C.AutoCompression(allow=C.common_lossy()))
        auto_s = time.perf_counter() - t0
        base = None
        for method in METHODS:
            c = plan(cfg, args.batch, cluster, method).compression
            base = base or c.step_time_s
            results.append({"cluster": name, "method": label(method),
                            "config": C.to_config(method), "step_time_s": c.step_time_s,
                            "compute_s": c.compute_s, "exchange_s": c.sync_s,
                            "wire_bytes": c.wire_bytes, "dense_wire_bytes": c.dense_wire_bytes,
                            "speedup_vs_uncompressed": base / c.step_time_s,
                            "fits": c.candidates[0][2]})
            rows.append([name, label(method), f"{c.step_time_s:.3f}", f"{c.compute_s:.3f}",
                         f"{c.sync_s:.3f}", f"{c.dense_wire_bytes / max(c.wire_bytes, 1):.0f}x",
                         f"{base / c.step_time_s:.2f}x"])
        a = chosen.compression
        results.append({"cluster": name, "method": "auto", "chosen": a.description,
                        "step_time_s": a.step_time_s, "saved_s": a.saved_s,
                        "speedup_vs_uncompressed": a.uncompressed_step_time_s / a.step_time_s,
                        "planning_s": auto_s})
        rows.append([name, f"AUTO -> {a.description.split(':')[0]}", f"{a.step_time_s:.3f}",
                     f"{a.compute_s:.3f}", f"{a.sync_s:.3f}",
                     f"{a.dense_wire_bytes / max(a.wire_bytes, 1):.0f}x",
                     f"{a.uncompressed_step_time_s / a.step_time_s:.2f}x"])
        print(rows[-1], flush=True)
    _common.print_table(
        f"GPT-{args.size} data parallel, batch {args.batch}: estimated step by gradient "
        "exchange (cost model)",
        [("cluster", "left"), ("exchange", "left"), ("step s", "right"),
         ("compute s", "right"), ("exchange s", "right"), ("bytes saved", "right"),
         ("vs uncompressed", "right")], rows)
    _common.write_result(args.out, {
        "benchmark": "compression_where", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "model": f"gpt-{args.size}", "batch": args.batch, "results": results})


if __name__ == "__main__":
    main()
