"""Inter-op search: planning time of Auto(num_micro_batches=m), and its plan against the best
Megatron-style manual plan, on the Alpa benchmark ladder (simulated V100 clusters).

For each case (model, GPUs) the cluster is the first GPUs of the `8x8xV100` preset (one node
up to 8 GPUs, then whole nodes); models run in float16 as in Alpa's V100 benchmarks. Every
plan is made from `jax.ShapeDtypeStruct`s: nothing is allocated, nothing runs.

- auto: `Auto(num_micro_batches=m)` for each m in the micro-batch set, and `Auto(pipeline=False)` (one
  SPMD stage without micro-batches, planned like Manual(pp=1, m=1)); the fastest estimated
  step is reported, with the wall time of that one planning call and its phases.
- megatron: every `Manual(dp, tp, pp, num_micro_batches=m)` with dp x tp x pp = GPUs, tp
  within a node, layers split evenly, over the same micro-batch set, with and without
  recomputation, the best step kept.
  Manual plans with pp = 1 and m = 1 are the single-stage plans of the foundation.
  Plans that do not fit in device memory are skipped (the cost model's memory estimate);
  the same estimate applies to auto plans.

Both sides are costed by the same cost model (ILP objective per stage, schedule simulator),
so the comparison is on equal terms; it is an estimate, not a measurement.

Run:
    python bench/pipeline_search.py --quick        # GPT 350M/1, 1.3B/4, MoE 380M/1
    python bench/pipeline_search.py                # the whole ladder (long on 2 cores)
    python bench/pipeline_search.py --cases gpt:2.6B:8 moe:380M:1
    python bench/pipeline_search.py --auto-only --micro-batches 64 --batch 1024 \
        --cases gpt:39B:64 gpt:175B:1024:A100 --out bench/results/pipeline_search_time.json
Writes bench/results/pipeline_search.json (``--out`` to change).
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
import moe  # noqa: E402
import optax  # noqa: E402
import wide_resnet  # noqa: E402

import alpa_lite as al  # noqa: E402

MODULES = {"gpt": gpt, "moe": moe, "wide_resnet": wide_resnet}
# The Alpa paper's weak-scaling ladder (OSDI 2022, Table 4).
LADDER = [("gpt", "350M", 1), ("gpt", "1.3B", 4), ("gpt", "2.6B", 8),
          ("gpt", "6.7B", 16), ("gpt", "15B", 32), ("gpt", "39B", 64),
          ("moe", "380M", 1), ("moe", "690M", 2), ("moe", "1.3B", 4), ("moe", "2.4B", 8),
          ("moe", "10B", 16), ("moe", "27B", 32), ("moe", "70B", 64),
          ("wide_resnet", "250M", 1), ("wide_resnet", "500M", 2), ("wide_resnet", "1B", 4),
          ("wide_resnet", "2B", 8), ("wide_resnet", "4B", 16), ("wide_resnet", "6.8B", 32),
          ("wide_resnet", "13B", 64)]
QUICK = [("gpt", "350M", 1), ("gpt", "1.3B", 4), ("moe", "380M", 1)]


def cluster_of(gpus: int, device: str = "V100") -> al.Cluster:
    base = al.Cluster.preset(f"8x8x{device}")
    return dataclasses.replace(base, name=f"{gpus}x{device}", num_nodes=max(1, gpus // 8),
                               devices_per_node=min(8, gpus),
                               inter_node=base.inter_node if gpus > 8 else None)


def megatron_grid(gpus: int, per_node: int):
    for pp in range(1, gpus + 1):
        for tp in range(1, per_node + 1):
            if gpus % (pp * tp) == 0 and per_node % tp == 0:
                yield gpus // (pp * tp), tp, pp


def plan_once(mod, cfg, batch, method, cluster):
    tx = optax.adamw(1e-4)
    step = al.parallelize(mod.make_train_step(cfg, tx), method=method)
    t0 = time.perf_counter()
    plan = step.plan(*mod.abstract_args(cfg, batch, tx), cluster=cluster)
    return plan, time.perf_counter() - t0


def fits(plan, cluster) -> bool:
    return plan.peak_memory_bytes <= cluster.device.memory_bytes


def run_case(name, size, gpus, batch, micro_batches, device="V100", grid=True):
    mod = MODULES[name]
    # V100s have no bfloat16: Alpa's V100 runs used float16.
    cfg = mod.CONFIGS[size]
    if device == "V100":
        cfg = dataclasses.replace(cfg, dtype="float16")
    cluster = cluster_of(gpus, device)
    best_auto = None
    # Auto() (one SPMD stage, no micro-batches: the foundation's planner) is the auto
    # counterpart of Manual(pp=1, m=1), which the grid plans the same way.
    for m in ([None] if grid else []) + list(micro_batches):
        try:
            method = al.Auto(num_micro_batches=m) if m else al.Auto(pipeline=False)
            plan, wall = plan_once(mod, cfg, batch, method, cluster)
        except (al.PlanningError, ValueError) as e:   # e.g. a micro-batch the model refuses
            print(f"  auto m={m}: {e}"[:200])
            continue
        if best_auto is None or plan.step_time_s < best_auto[0].step_time_s:
            best_auto = (plan, wall, m)
    best_manual = None
    tried = 0
    for dp, tp, pp in megatron_grid(gpus, cluster.devices_per_node) if grid else ():
        for m, remat in ((m, r) for m in micro_batches for r in (False, True)):
            if (batch // m) % dp or (remat and pp == 1 and m == 1):
                continue
            try:
                plan, _ = plan_once(mod, cfg, batch, al.Manual(dp=dp, tp=tp, pp=pp,
                                                               num_micro_batches=m, remat=remat),
                                    cluster)
            except (al.PlanningError, ValueError):
                continue
            tried += 1
            if not fits(plan, cluster):
                continue
            if best_manual is None or plan.step_time_s < best_manual[0].step_time_s:
                best_manual = (plan, (dp, tp, pp, m, remat))
    return {"model": name, "size": size, "gpus": gpus, "device": device, "batch": batch,
            "auto": None if best_auto is None else _describe(best_auto[0]) | {
                "plan_wall_s": best_auto[1], "num_micro_batches": best_auto[2]},
            "megatron": None if best_manual is None else _describe(best_manual[0]) | {
                "dp_tp_pp_m_remat": list(best_manual[1])},
            "megatron_plans_tried": tried}


def _describe(plan) -> dict:
    s = plan.stats
    return {"step_time_s": plan.step_time_s, "stages": len(plan.stages),
            "stage_meshes": [list(st.mesh_shape) for st in plan.stages],
            "stage_layers": [list(st.layers) for st in plan.stages],
            "remat": [st.remat for st in plan.stages],
            "peak_memory_gib": plan.peak_memory_bytes / 2**30,
            "trace_s": s.trace_s, "ilp_build_s": s.build_s, "ilp_solve_s": s.solve_s,
            "dp_s": s.dp_s, "layers": s.num_layers, "layer_ilps": s.layer_ilps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", nargs="*",
                    help="model:size:gpus[:device], e.g. gpt:2.6B:8 or gpt:175B:1024:A100")
    ap.add_argument("--auto-only", action="store_true",
                    help="plan only with Auto (planning time), not the Megatron grid")
    ap.add_argument("--batch", type=int, default=64,
                    help="global batch (sequences / images) of every case")
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "pipeline_search.json")
    args = ap.parse_args()
    cases = [tuple(c.split(":")) for c in args.cases] if args.cases else \
        QUICK if args.quick else LADDER
    rows, results = [], []
    for case in cases:
        name, size, gpus = case[0], case[1], int(case[2])
        device = case[3] if len(case) > 3 else "V100"
        r = run_case(name, size, gpus, args.batch, args.micro_batches, device,
                     grid=not args.auto_only)
        results.append(r)
        a, g = r["auto"], r["megatron"]
        speedup = g["step_time_s"] / a["step_time_s"] if a and g else float("nan")
        rows.append([f"{name}-{size}", f"{gpus} {device}",
                     f"{a['plan_wall_s']:.1f}" if a else "-",
                     f"{a['trace_s']:.1f}/{a['ilp_build_s']:.1f}/{a['ilp_solve_s']:.1f}/"
                     f"{a['dp_s']:.2f}" if a else "-",
                     f"{a['layers']}/{a['layer_ilps']}" if a else "-",
                     f"{a['step_time_s'] * 1e3:.1f} ({a['stages']} st, m={a['num_micro_batches']})"
                     if a else "none fits",
                     f"{g['step_time_s'] * 1e3:.1f} {tuple(g['dp_tp_pp_m_remat'])}" if g else "none fits",
                     f"{speedup:.2f}x"])
        print(rows[-1], flush=True)
    _common.print_table(
        "Inter-op search on simulated V100 clusters (estimates, same cost model for both)",
        [("case", "left"), ("GPUs", "right"), ("auto plan s", "right"),
         ("trace/build/solve/DP s", "right"), ("layers/ILPs", "right"),
         ("auto step ms", "right"), ("best Megatron ms (dp,tp,pp,m,remat)", "right"),
         ("Megatron/auto", "right")], rows)
    _common.write_result(args.out, {
        "benchmark": "pipeline_search", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "batch": args.batch, "micro_batches": args.micro_batches, "cases": results})


if __name__ == "__main__":
    main()
