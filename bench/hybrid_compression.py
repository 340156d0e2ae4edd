"""Hybrid plans across slow links: Auto() with and without AutoCompression.

For each model x cluster, the step is planned twice from `jax.ShapeDtypeStruct`s (nothing
runs; every number is the cost model):

* `Auto()` with no compression: the planner's best uncompressed plan (one stage or a
  pipeline);
* `Auto()` with `compression=AutoCompression(allow=common_lossy())`: pure data parallelism
  with each allowed exchange, weighed against the Megatron dp x tp x pp layouts with
  compressed data parallelism (`planning.hybrid_search`), keeping the fastest that fits.

The table gives both estimates, the layout and compressor chosen, what the chosen plan's
exchange would take uncompressed (its stages' full-precision all-reduce), its peak memory
against the budget, and the time to plan.

Run:
    python bench/hybrid_compression.py                      # GPT-6.7B on geo-4, GPT-1.3B on 8x8xV100
    python bench/hybrid_compression.py --cases gpt-6.7b-geo4
Writes bench/results/hybrid_compression.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.use_examples()

import gpt  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from alpa_lite import compression as C  # noqa: E402

# name -> (GPT size, global batch, cluster preset). geo-4: four sites of 8 V100s over
# 13-63 Mbit/s WAN links; 8x8xV100: nodes of 8 V100 (NVLink) over 25 Gbit/s Ethernet.
CASES = {
    "gpt-6.7b-geo4": ("6.7B", 64, "geo-4"),
    "gpt-1.3b-8x8xv100": ("1.3B", 256, "8x8xV100"),
}


def plan_once(size: str, batch: int, cluster_name: str, compression) -> dict:
    cluster = al.Cluster.preset(cluster_name)
    cfg = dataclasses.replace(gpt.CONFIGS[size], dtype="float16")   # V100: no bfloat16
    tx = optax.adamw(1e-4)
    step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.Auto(),
                          compression=compression)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = step.plan(*gpt.abstract_args(cfg, batch, tx), cluster=cluster)
    except al.PlanningError as e:
        return {"error": " ".join(str(e).split())[:300], "plan_s": time.perf_counter() - t0}
    out = {"plan_s": time.perf_counter() - t0, "step_s": plan.step_time_s,
           "peak_gib": plan.peak_memory_bytes / 2**30,
           "budget_gib": cluster.device.memory_bytes / 2**30,
           "stages": len(plan.stages),
           "meshes": [list(s.mesh_shape) for s in plan.stages],
           "micro_batches": plan.pipeline.num_micro_batches if plan.pipeline else 1}
    if plan.compression is not None:
        out["layout"] = f"data parallel x {plan.compression.num_workers}"
        out["exchange"] = plan.compression.description.split(":")[0]
        out["exchange_s"] = plan.compression.sync_s
        out["dense_exchange_s"] = plan.compression.dense_sync_s
    else:
        exchanges = [s.exchange for s in plan.stages if s.exchange is not None]
        layout = next((c.value for c in plan.choices if c.what == "layout"), None)
        out["layout"] = layout or (f"{len(plan.stages)} stage(s), meshes "
                                   f"{[tuple(s.mesh_shape) for s in plan.stages]}")
        out["exchange"] = (C.from_config(exchanges[0].method).describe().split(":")[0]
                           if exchanges else "none")
        out["exchange_s"] = max((e.sync_s for e in exchanges), default=0.0)
        out["dense_exchange_s"] = max((e.dense_sync_s for e in exchanges), default=0.0)
        runner = next((c for c in plan.choices if c.what == "layout"), None)
        if runner is not None:
            out["runner_up"] = runner.runner_up
            out["runner_up_s"] = runner.runner_up_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=sorted(CASES), choices=sorted(CASES))
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "hybrid_compression.json")
    args = ap.parse_args()
    rows, table = [], []
    for name in args.cases:
        size, batch, cluster = CASES[name]
        plain = plan_once(size, batch, cluster, None)
        print(f"{name}: uncompressed done ({plain['plan_s']:.0f} s)", file=sys.stderr, flush=True)
        auto = plan_once(size, batch, cluster, C.AutoCompression(allow=C.common_lossy()))
        print(f"{name}: AutoCompression done ({auto['plan_s']:.0f} s)", file=sys.stderr,
              flush=True)
        rows.append({"case": name, "size": size, "batch": batch, "cluster": cluster,
                     "uncompressed": plain, "auto_compression": auto})

        def est(r):
            return r.get("error", "")[:40] or f"{r['step_s']:.4g}"
        table.append([name, cluster, est(plain), plain.get("layout", "")[:40], est(auto),
                      auto.get("layout", "")[:48], auto.get("exchange", "")[:30],
                      f"{auto.get('exchange_s', 0):.3g} / {auto.get('dense_exchange_s', 0):.3g}",
                      f"{auto.get('peak_gib', 0):.1f}/{auto.get('budget_gib', 0):.1f}",
                      f"{plain['plan_s']:.0f} / {auto['plan_s']:.0f}"])
    _common.print_table(
        "Auto() across slow links, without and with AutoCompression (cost model; planned on "
        "the 2-core CPU machine)",
        [("case", "left"), ("cluster", "left"), ("no compression: step s", "right"),
         ("its plan", "left"), ("AutoCompression: step s", "right"), ("its plan", "left"),
         ("exchange", "left"), ("exchange s (compressed / dense)", "right"),
         ("peak/budget GiB", "right"), ("plan s (plain / auto)", "right")],
        table, "step estimates from the cost model; nothing runs")
    _common.write_result(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
