"""How long `step.plan(...)` takes: trace, build the sharding problem, solve it.

Every timing is the whole `step.plan(*abstract_args, cluster=...)` call, measured with
`time.perf_counter` around it, on a fresh train step and a fresh `al.parallelize` object each
time, so no trace or plan is reused. The arguments are `jax.ShapeDtypeStruct`s: nothing is
allocated and nothing runs; the cluster is a preset, not the local devices.

The headline case is GPT-1.3B (24 layers) at batch 8 on 8xH100 with `al.Auto()`. The named
configs keep their bfloat16 parameters; the batch sizes are explicit because the examples'
defaults are Alpa's global batches (1024), too large for one stage without micro-batches.

A burn-in plans the tiny GPT once (untimed) so that imports and JAX's own caches are warm;
then each case is planned --repeats times and the run with the median wall time is reported.

Run:
    python bench/planning_time.py            # 6 cases x 3 repeats; ~2 min on 2 cores
    python bench/planning_time.py --quick    # GPT-350M only
Writes bench/results/planning_time.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.use_examples()

import gpt  # noqa: E402
import jax  # noqa: E402
import moe  # noqa: E402
import optax  # noqa: E402
import wide_resnet  # noqa: E402

import alpa_lite as al  # noqa: E402

# Knobs -----------------------------------------------------------------------------------
# (label, example module, size key, batch size, cluster preset, method)
CASES = (
    ("GPT-1.3B", gpt, "1.3B", 8, "8xH100", "auto"),   # the headline case
    ("GPT-350M", gpt, "350M", 8, "8xH100", "auto"),
    ("GPT-2.6B", gpt, "2.6B", 8, "8xH100", "auto"),
    ("MoE-380M", moe, "380M", 8, "8xH100", "auto"),
    ("WResNet-250M", wide_resnet, "250M", 32, "8xH100", "auto"),
    ("GPT-1.3B", gpt, "1.3B", 8, "8xH100", "manual-2x4"),
)
QUICK_CASES = ("GPT-350M",)           # --quick keeps only these labels (Auto)
HEADLINE = ("GPT-1.3B", "auto")
HEADLINE_TARGET_S = 20.0              # headline goal on a 2-core machine (not asserted)
REPEATS = 3                           # plans per case; the median run is reported
LEARNING_RATE = 1e-3                  # optax.adamw; only the optimizer-state shapes matter here
BURN_IN = (gpt, "tiny", 4, "8xH100")  # planned once, untimed, before the cases
# -----------------------------------------------------------------------------------------

METHODS = {
    "auto": ("Auto", lambda: al.Auto()),
    "manual-2x4": ("Manual(dp=2, tp=4)", lambda: al.Manual(dp=2, tp=4)),
}


def plan_once(module, cfg, batch_size: int, tx, cluster, method_key: str):
    """(wall seconds, plan) of one `step.plan` call on a fresh parallelized step."""
    args = module.abstract_args(cfg, batch_size, tx)
    step = al.parallelize(module.make_train_step(cfg, tx), method=METHODS[method_key][1]())
    t0 = time.perf_counter()
    plan = step.plan(*args, cluster=cluster)
    return time.perf_counter() - t0, plan


def count_params(module, cfg) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(module.abstract_params(cfg)))


def plan_record(plan) -> dict:
    s = plan.stats
    return {
        "trace_s": round(s.trace_s, 3), "build_s": round(s.build_s, 3),
        "solve_s": round(s.solve_s, 3),
        "nodes_before_merge": s.nodes_before_merge, "groups_after_merge": s.nodes_after_merge,
        "ilp_nodes": s.ilp_nodes, "ilp_variables": s.ilp_variables,
        "ilp_constraints": s.ilp_constraints,
        "candidates": [{"mesh_shape": m, "est_step_ms": round(t * 1e3, 3)}
                       for m, t in s.candidates],
        "num_stages": len(plan.stages),
        "mesh_shape": list(plan.stages[0].mesh_shape),
        "est_step_ms": round(plan.step_time_s * 1e3, 3),
        "est_compute_ms": round(plan.compute_s * 1e3, 3),
        "est_comm_ms": round(plan.comm_s * 1e3, 3),
        "peak_memory_gib": round(plan.peak_memory_bytes / 2**30, 3),
    }


def run_case(label, module, size, batch_size, cluster_name, method_key, tx, repeats) -> dict:
    cfg = module.CONFIGS[size]
    cluster = al.Cluster.preset(cluster_name)
    runs = []
    for _ in range(repeats):
        wall_s, plan = plan_once(module, cfg, batch_size, tx, cluster, method_key)
        runs.append({"wall_s": round(wall_s, 3), **plan_record(plan)})
    walls = [r["wall_s"] for r in runs]
    median_run = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
    print(f"  done: {label} {METHODS[method_key][0]} on {cluster_name} "
          f"({', '.join(f'{w:.2f}' for w in walls)} s)", file=sys.stderr, flush=True)
    return {
        "model": label, "size": size, "example": Path(module.__file__).stem,
        "params": count_params(module, cfg), "dtype": cfg.dtype, "batch_size": batch_size,
        "num_layers": getattr(cfg, "num_layers", None),
        "cluster": cluster_name, "method": METHODS[method_key][0],
        "wall_s_median": round(statistics.median(walls), 3),
        "wall_s_min": min(walls), "wall_s_max": max(walls), "wall_s_runs": walls,
        "reported_run": median_run,   # the run with the median wall time
        "runs": runs,
    }


def print_results(rows: list[dict], repeats: int) -> None:
    columns = [("model", "left"), ("dtype", "left"), ("batch", "right"), ("cluster", "left"),
               ("method", "left"), ("wall s", "right"), ("trace s", "right"),
               ("build s", "right"), ("solve s", "right"), ("nodes before merge", "right"),
               ("groups after merge", "right"), ("ILP nodes (tied)", "right"),
               ("ILP vars", "right"), ("constraints", "right"), ("mesh", "left"),
               ("est. step ms", "right"), ("peak GiB", "right")]
    table_rows = []
    for r in rows:
        p = r["reported_run"]
        table_rows.append([
            r["model"], r["dtype"], str(r["batch_size"]), r["cluster"], r["method"],
            f"{r['wall_s_median']:.2f}", f"{p['trace_s']:.2f}", f"{p['build_s']:.2f}",
            f"{p['solve_s']:.2f}", str(p["nodes_before_merge"]), str(p["groups_after_merge"]),
            str(p["ilp_nodes"]), str(p["ilp_variables"]), str(p["ilp_constraints"]),
            "x".join(map(str, p["mesh_shape"])), f"{p['est_step_ms']:.1f}",
            f"{p['peak_memory_gib']:.2f}"])
    caption = (f"wall s: median of {repeats} step.plan calls (fresh al.parallelize each); "
               "trace/build/solve and the rest are from that median run. "
               "ILP nodes: after tying repeated layers.")
    _common.print_table("Planning time (step.plan, abstract arguments)", columns, table_rows,
                        caption)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_CASES)}")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="plans per case; the median is reported (default: %(default)s)")
    parser.add_argument("--out", type=Path,
                        default=_common.RESULTS_DIR / "planning_time.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    cases = [c for c in CASES if not args.quick or (c[0] in QUICK_CASES and c[5] == "auto")]
    tx = optax.adamw(LEARNING_RATE)

    started = time.perf_counter()
    module, size, batch_size, cluster_name = BURN_IN
    burn_in_s, _ = plan_once(module, module.CONFIGS[size], batch_size, tx,
                             al.Cluster.preset(cluster_name), "auto")
    print(f"  burn-in: GPT-{size} on {cluster_name} ({burn_in_s:.2f} s, not reported)",
          file=sys.stderr, flush=True)
    rows = [run_case(*case, tx, args.repeats) for case in cases]
    print_results(rows, args.repeats)

    headline = next((r for r in rows if (r["model"], r["method"]) ==
                     (HEADLINE[0], METHODS[HEADLINE[1]][0])), None)
    if headline is not None:
        print(f"headline {headline['model']} ({headline['num_layers']} layers) batch "
              f"{headline['batch_size']} on {headline['cluster']}, {headline['method']}: "
              f"{headline['wall_s_median']:.2f} s median (target < {HEADLINE_TARGET_S:.0f} s "
              f"on {os.cpu_count()} cores)")

    result = {
        "benchmark": "planning_time",
        "date": _common.now_utc(),
        "command": _common.command_line(),
        "code": _common.CODE_AT_START,
        "machine": {**_common.machine(), "highspy": _common.package_version("highspy"),
                    "pulp": _common.package_version("pulp")},
        "settings": {"repeats": args.repeats, "quick": args.quick,
                     "optimizer": f"optax.adamw({LEARNING_RATE})",
                     "arguments": "jax.ShapeDtypeStruct (abstract; nothing allocated)",
                     "timed": "whole step.plan(...) call, time.perf_counter, fresh "
                              "al.parallelize object and train step per run",
                     "burn_in": f"one untimed plan of GPT-{size} batch {batch_size} on "
                                f"{cluster_name} ({burn_in_s:.3f} s)",
                     "headline": {"model": HEADLINE[0], "method": METHODS[HEADLINE[1]][0],
                                  "target_s": HEADLINE_TARGET_S}},
        "cases": rows,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    _common.write_result(args.out, result)
    print(f"wrote {args.out} ({result['wall_time_s']} s)")


if __name__ == "__main__":
    main()
