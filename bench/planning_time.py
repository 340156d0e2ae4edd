"""How long `step.plan(...)` takes with `al.Auto()` and nothing set, per model x cluster
(and, for the "-one-stage" case, `Auto(pipeline=False)`; with --num-micro-batches M,
`Auto(num_micro_batches=M)`, the count a user fixed).

Every timing is one whole `step.plan(*abstract_args, cluster=...)` call in a fresh
process (a fresh `al.parallelize`, nothing reused in memory), with the disk cache off
("cold") or warm from the run before ("warm": the second plan of the same step). The
arguments are `jax.ShapeDtypeStruct`s: nothing is allocated and nothing runs; the clusters
are presets or `Cluster.of_gpus`, not the local devices. Each case runs under a time limit
(--limit, default 600 s); a case over it is reported as such.

Per case: the median wall time of --repeats cold plans (and their spread), the phases of
the median run (trace; intra-op ILP build and solve, summed over the worker processes; stage
DP), the intra-op problems solved, those answered by an identical layer's solve, those read
from the disk cache, the whole plans `Auto()` weighed, the plan chosen and its estimated
step, the planner process's peak resident memory (its workers not counted), a warm plan's
wall time, and where asked (--exhaustive, ladders up to 16 GPUs) the
estimated step of `Auto(exhaustive=True)`: every micro-batch count, every layer solved on
its own, nothing pruned.

Run:
    python bench/planning_time.py --cases gpt-1.3b gpt-39b          # the headline cases
    python bench/planning_time.py --ladder gpt --exhaustive         # a ladder, with checks
    python bench/planning_time.py --quick                           # GPT-1.3B only
    python bench/planning_time.py --cases gpt-39b --num-micro-batches 1024   # a fixed count
Writes bench/results/planning_time.json (--out to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# Knobs -----------------------------------------------------------------------------------
# name -> (example module, size, global batch, cluster, float16 on V100s, target s)
CASES = {
    "gpt-1.3b": ("gpt", "1.3B", 8, "8xH100", 5.0),
    # The "single stage" target: Auto(pipeline=False).
    "gpt-1.3b-one-stage": ("gpt", "1.3B", 8, "8xH100", 5.0),
    "gpt-39b": ("gpt", "39B", 1024, "V100:64", 10.0),         # Alpa's 39B on 64 V100s
    "gpt-175b": ("gpt", "175B", 1536, "A100:1024", 60.0),     # Megatron's 175B, 1024 A100s
    "gpt-1t": ("gpt", "1008B", 3072, "A100:3072", 120.0),     # Megatron's 1T, 3072 A100s
}
# The Alpa paper's weak-scaling ladders (OSDI 2022, Table 4), on V100 nodes of 8.
LADDERS = {
    "gpt": [("350M", 1), ("1.3B", 4), ("2.6B", 8), ("6.7B", 16), ("15B", 32), ("39B", 64)],
    "moe": [("380M", 1), ("690M", 2), ("1.3B", 4), ("2.4B", 8), ("10B", 16), ("27B", 32),
            ("70B", 64)],
    "wide_resnet": [("250M", 1), ("500M", 2), ("1B", 4), ("2B", 8), ("4B", 16),
                    ("6.8B", 32), ("13B", 64)],
}
LADDER_BATCH = {"gpt": 1024, "moe": 1024, "wide_resnet": 1536}   # Alpa's global batches
LADDER_TARGET_S = 60.0          # each ladder in total
EXHAUSTIVE_MAX_GPUS = 16
REPEATS = 3
LIMIT_S = 600
# -----------------------------------------------------------------------------------------


def cluster_for(spec: str):
    """A preset name, or "KIND:GPUS": that many GPUs in nodes of 8 (fewer: one node)."""
    import alpa_lite as al
    if ":" not in spec:
        return al.Cluster.preset(spec)
    kind, gpus = spec.split(":")
    gpus = int(gpus)
    if gpus <= 8:
        return al.Cluster.of_gpus(kind, num_nodes=1, devices_per_node=gpus)
    return al.Cluster.of_gpus(kind, num_nodes=gpus // 8)


def worker(spec: dict) -> dict:
    """One plan in this process: what the parent prints."""
    _common.use_examples()
    import importlib

    import optax

    import alpa_lite as al
    mod = importlib.import_module(spec["module"])
    cfg = mod.CONFIGS[spec["size"]]
    cluster = cluster_for(spec["cluster"])
    if cluster.device.name.startswith("V100"):   # V100s have no bfloat16 (Alpa used fp16)
        cfg = dataclasses.replace(cfg, dtype="float16")
    tx = optax.adamw(1e-4)
    method = al.Auto(exhaustive=spec.get("exhaustive", False),
                     pipeline=False if spec.get("one_stage") else None,
                     num_micro_batches=spec.get("num_micro_batches"))
    step = al.parallelize(mod.make_train_step(cfg, tx), method=method)
    args = mod.abstract_args(cfg, spec["batch"], tx)
    t0 = time.perf_counter()
    try:
        plan = step.plan(*args, cluster=cluster)
    except al.PlanningError as e:
        return {"wall_s": time.perf_counter() - t0, "error": " ".join(str(e).split())[:400]}
    wall = time.perf_counter() - t0
    s = plan.stats
    return {"wall_s": wall, "trace_s": s.trace_s, "build_s": s.build_s, "solve_s": s.solve_s,
            "dp_s": s.dp_s, "layer_ilps": s.layer_ilps, "reused": s.layer_ilps_reused,
            "cache_hits": s.layer_cache_hits, "plan_cache_hit": s.plan_cache_hit,
            "plans_weighed": s.plans_weighed, "est_step_s": plan.step_time_s,
            "stages": len(plan.stages),
            "micro_batches": plan.pipeline.num_micro_batches if plan.pipeline else 1,
            "meshes": [list(st.mesh_shape) for st in plan.stages],
            "remat": [st.remat for st in plan.stages],
            "peak_gib": plan.peak_memory_bytes / 2**30,
            "budget_gib": cluster.device.memory_bytes / 2**30,
            # The planner process's own peak (Linux reports KiB), its workers not counted.
            "planner_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run(spec: dict, limit_s: float, cache: str | None) -> dict:
    """`worker(spec)` in a fresh process under `limit_s`; cache: None (off) or a folder."""
    env = os.environ | {"ALPA_LITE_CACHE": "off" if cache is None else "on"}
    if cache is not None:
        env["ALPA_LITE_CACHE_DIR"] = cache
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                             capture_output=True, text=True, env=env, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"wall_s": time.perf_counter() - t0, "error": f"over the {limit_s:.0f} s limit"}
    if out.returncode != 0:
        return {"wall_s": time.perf_counter() - t0, "error": out.stderr.strip()[-400:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(label: str, spec: dict, repeats: int, limit_s: float, exhaustive: bool,
            warm: bool = True) -> dict:
    cold = []
    for _ in range(repeats):
        r = run(spec, limit_s, None)
        cold.append(r)
        print(f"  {label}: cold {r['wall_s']:.1f} s {r.get('error', '')[:100]}",
              file=sys.stderr, flush=True)
        if "error" in r:
            break
    median = sorted(cold, key=lambda r: r["wall_s"])[(len(cold) - 1) // 2]
    row = {"case": label, **spec, "cold_runs_s": [round(r["wall_s"], 2) for r in cold],
           "cold_median_s": statistics.median(r["wall_s"] for r in cold), "median_run": median}
    if "error" not in median and warm:
        with tempfile.TemporaryDirectory() as folder:
            run(spec, limit_s, folder)                  # fills the cache
            row["warm"] = run(spec, limit_s, folder)    # the second plan of the same step
    if "error" not in median and exhaustive:
        row["exhaustive"] = run(spec | {"exhaustive": True}, limit_s, None)
    return row


def table(rows: list[dict]) -> None:
    cols = [("case", "left"), ("cluster", "left"), ("cold s (median)", "right"),
            ("runs", "right"), ("trace/build/solve/DP s", "right"),
            ("ILPs solved/reused", "right"), ("plans", "right"), ("plan", "left"),
            ("est. step s", "right"), ("peak/budget GiB", "right"),
            ("planner RSS GiB", "right"), ("warm s", "right"),
            ("exhaustive est. s", "right"), ("target s", "right")]
    out = []
    for r in rows:
        m = r["median_run"]
        if "error" in m:
            out.append([r["case"], r["cluster"], f"{r['cold_median_s']:.1f}", "", "", "", "",
                        m["error"][:60], "", "", "", "", "", f"{r['target_s']:.0f}"])
            continue
        ex = r.get("exhaustive")
        warm = r.get("warm", {})
        out.append([
            r["case"], r["cluster"], f"{r['cold_median_s']:.1f}",
            " ".join(f"{x:.1f}" for x in r["cold_runs_s"]),
            f"{m['trace_s']:.1f}/{m['build_s']:.1f}/{m['solve_s']:.1f}/{m['dp_s']:.1f}",
            f"{m['layer_ilps']}/{m['reused']}", str(m["plans_weighed"]),
            f"{m['stages']} st x m={m['micro_batches']}",
            f"{m['est_step_s']:.4g}", f"{m['peak_gib']:.1f}/{m['budget_gib']:.1f}",
            f"{m['planner_rss_gib']:.2f}" if "planner_rss_gib" in m else "-",
            f"{warm['wall_s']:.1f}{' hit' if warm.get('plan_cache_hit') else ''}"
            if "wall_s" in warm else "-",
            "-" if ex is None else ex.get("error", f"{ex.get('est_step_s', 0):.4g}")[:30],
            f"{r['target_s']:.0f}"])
    _common.print_table("Planning time, Auto() with nothing set (2-core CPU machine)", cols, out,
                        "build and solve are summed over the worker processes; warm: the same "
                        "plan again with the disk cache of the run before")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="*", default=[], choices=sorted(CASES))
    ap.add_argument("--ladder", nargs="*", default=[], choices=sorted(LADDERS))
    ap.add_argument("--quick", action="store_true", help="GPT-1.3B only")
    ap.add_argument("--exhaustive", action="store_true",
                    help=f"also Auto(exhaustive=True) on ladder rungs up to "
                         f"{EXHAUSTIVE_MAX_GPUS} GPUs")
    ap.add_argument("--max-gpus", type=int, default=None,
                    help="ladders: only the rungs with at most this many GPUs")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--no-warm", action="store_true",
                    help="skip the warm (disk cache) runs: two more plans per case")
    ap.add_argument("--num-micro-batches", type=int, default=None,
                    help="--cases: Auto(num_micro_batches=M), the count a user fixed, "
                         "in place of the search over counts")
    ap.add_argument("--limit", type=float, default=LIMIT_S, help="seconds per plan")
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "planning_time.json")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    cases = ["gpt-1.3b"] if args.quick else args.cases
    if not cases and not args.ladder:
        cases = ["gpt-1.3b", "gpt-39b"]
    rows = []
    for name in cases:
        module, size, batch, cluster, target = CASES[name]
        spec = {"module": module, "size": size, "batch": batch, "cluster": cluster,
                "one_stage": name.endswith("-one-stage")}
        if args.num_micro_batches is not None:
            spec["num_micro_batches"] = args.num_micro_batches
        rows.append(measure(name, spec, args.repeats, args.limit, False, not args.no_warm)
                    | {"target_s": target})
    ladders = {}
    for name in args.ladder:
        rungs = []
        for size, gpus in LADDERS[name]:
            if args.max_gpus is not None and gpus > args.max_gpus:
                continue
            spec = {"module": name, "size": size, "batch": LADDER_BATCH[name],
                    "cluster": f"V100:{gpus}"}
            rungs.append(measure(f"{name}-{size}/{gpus}", spec, args.repeats, args.limit,
                                 args.exhaustive and gpus <= EXHAUSTIVE_MAX_GPUS,
                                 not args.no_warm)
                         | {"target_s": LADDER_TARGET_S})
        total = sum(r["cold_median_s"] for r in rungs)
        ladders[name] = {"total_cold_median_s": total, "target_s": LADDER_TARGET_S}
        print(f"{name} ladder: {total:.1f} s in total (target {LADDER_TARGET_S:.0f} s)")
        rows.extend(rungs)
    table(rows)
    _common.write_result(args.out, {
        "benchmark": "planning_time", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "repeats": args.repeats, "limit_s": args.limit, "rows": rows, "ladders": ladders})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
