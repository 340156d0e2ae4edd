"""The H100 calibration, fitted to published JAX measurements (no GPU needed).

Reads `bench/data/h100_jax_sweep.json` (bf16 matmuls, gelu, softmax and a tiny jitted
call, measured on the lent H100 with JAX 0.11.2; bench/data/README.md) and fits, with the
same functions `alpa-lite calibrate` uses (`alpa_lite.cost_models.calibration`):

- the matmul efficiency curve, relative to the datasheet bf16 peak, 989 TFLOP/s (NVIDIA
  H100 SXM5 datasheet; `DEVICES["H100"]`). Each sweep row is one jitted call per matmul, so
  its time holds one call's dispatch; inside a train step matmuls do not pay a dispatch
  each (calibrate.py takes the dispatch off the same way). The fit therefore takes off the
  sweep's own `dispatch_tiny_jit` time (31.7 us) as the overhead, and drops the rows whose
  time is mostly that dispatch (under twice it: 8-60 TFLOP/s small shapes; they bound the
  kernel's time from above but do not measure it). Below the smallest remaining size the
  curve is clamped to its first point. The spec's `op_overhead_s` (per kernel inside a
  program) stays 0.0: the sweep does not measure it; `alpa-lite calibrate` on the GPU does;
- the memory bandwidth from the gelu and softmax rows (bf16, read + written:
  `2 * numel * 2` bytes), `t = c + bytes / B` (`fit_memory_bandwidth`).

The other figures stay the H100 preset's (memory size, fp32/fp64 peaks, NVLink). The result
is a cluster JSON for one H100, platform "gpu" (what `Cluster.local()` reports there), so
that on the GPU machine `--cluster bench/results/calibrated_1xH100.json` plans and runs.

The table compares, per matmul row, the measured time with the model's: `compute_time` of
the matmul (what the planner charges inside a step) plus the dispatch (what a lone call
costs, which the row measured).

    python bench/calibrate_h100.py          # writes bench/results/calibrated_1xH100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from alpa_lite.cost_models.calibration import (  # noqa: E402
    fit_matmul_efficiency_curve,
    fit_memory_bandwidth,
    matmul_efficiencies,
)
from alpa_lite.cost_models.cluster import Cluster  # noqa: E402
from alpa_lite.cost_models.compute import compute_time  # noqa: E402
from alpa_lite.cost_models.devices import DEVICES  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "h100_jax_sweep.json"
BF16_BYTES = 2


def load_rows(path: Path) -> list[dict]:
    rows = json.loads(path.read_text())["rows"]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def calibrated_cluster(rows: list[dict]) -> tuple[Cluster, dict]:
    """The calibrated 1xH100 cluster and the fit's numbers."""
    base = Cluster.preset("1xH100")
    h100 = DEVICES["H100"]
    peak = h100.peak_flops("bfloat16")
    dispatch = [r["s"] for r in rows if r["op"] == "dispatch_tiny_jit"]
    if len(dispatch) != 1:
        raise ValueError(f"{DATA}: expected one dispatch_tiny_jit row, got {len(dispatch)}")
    dispatch_s = dispatch[0]
    mm = [r for r in rows if r["op"] == "matmul_bf16"]
    flops = [2.0 * r["m"] * r["k"] * r["n"] for r in mm]
    seconds = [r["s"] for r in mm]
    curve = fit_matmul_efficiency_curve(flops, seconds, peak, overhead_s=dispatch_s)
    passes = [r for r in rows if r["op"] in ("gelu_bf16", "softmax_bf16")]
    nbytes = [2.0 * (r["numel"] if "numel" in r else math.prod(r["shape"])) * BF16_BYTES
              for r in passes]
    bandwidth, intercept = fit_memory_bandwidth(nbytes, [r["s"] for r in passes])
    device = dataclasses.replace(
        h100,
        name=f"{h100.name}-calibrated",
        memory_bandwidth_bytes_per_s=bandwidth,
        matmul_efficiency=max(e for _, e in curve),
        matmul_efficiency_curve=curve,
    )
    cluster = Cluster(name="1xH100-calibrated", device=device, num_nodes=1,
                      devices_per_node=1, intra_node=base.intra_node, platform="gpu")
    used = matmul_efficiencies(flops, seconds, peak, dispatch_s)
    fit = {"peak_flops_per_s": peak, "dispatch_s": dispatch_s,
           "matmul_rows": len(mm), "matmul_rows_used": int(sum(not math.isnan(e) for e in used)),
           "curve": [list(p) for p in curve], "memory_bandwidth_bytes_per_s": bandwidth,
           "memory_intercept_s": intercept,
           "memory_rows": [{"op": r["op"], "bytes": b, "s": r["s"],
                            "model_s": intercept + b / bandwidth}
                           for r, b in zip(passes, nbytes)]}
    return cluster, fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "calibrated_1xH100.json")
    ap.add_argument("--fit-out", type=Path,
                    default=_common.RESULTS_DIR / "calibrated_1xH100_fit.json",
                    help="the per-row comparison and the fit's numbers")
    args = ap.parse_args()
    rows = load_rows(args.data)
    cluster, fit = calibrated_cluster(rows)
    dev, dispatch_s = cluster.device, fit["dispatch_s"]
    peak = fit["peak_flops_per_s"]
    nominal = DEVICES["H100"]

    table, compared = [], []
    for r in (r for r in rows if r["op"] == "matmul_bf16"):
        f = 2.0 * r["m"] * r["k"] * r["n"]
        nbytes = (r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"]) * BF16_BYTES
        in_step = compute_time(f, nbytes, dev, "bfloat16", True)
        lone = dispatch_s + in_step
        old = dispatch_s + compute_time(f, nbytes, nominal, "bfloat16", True)
        # The fit's own rule for which rows measure the matmul rather than the dispatch.
        used = not math.isnan(matmul_efficiencies([f], [r["s"]], peak, dispatch_s)[0])
        compared.append({"m": r["m"], "k": r["k"], "n": r["n"], "flops": f, "measured_s": r["s"],
                         "model_in_step_s": in_step, "model_lone_call_s": lone,
                         "nominal_lone_call_s": old, "used_in_fit": used,
                         "error": lone / r["s"] - 1, "nominal_error": old / r["s"] - 1})
        table.append([f"{r['m']} x {r['k']} x {r['n']}", f"{f:.3g}", f"{r['s'] * 1e6:.1f}",
                      f"{f / r['s'] / 1e12:.0f}", f"{dev.matmul_efficiency_at(f):.3f}",
                      f"{in_step * 1e6:.1f}", f"{lone * 1e6:.1f}", f"{lone / r['s'] - 1:+.0%}",
                      f"{old / r['s'] - 1:+.0%}", "yes" if used else "no"])
    _common.print_table(
        f"H100 bf16 matmuls: measured (one jitted call each) vs the calibrated model "
        f"(peak {peak / 1e12:.0f} TFLOP/s, dispatch {dispatch_s * 1e6:.1f} us)",
        [("m x k x n", "left"), ("FLOPs", "right"), ("measured us", "right"),
         ("TFLOP/s", "right"), ("fitted eff", "right"), ("model in step us", "right"),
         ("model + dispatch us", "right"), ("error", "right"), ("nominal 0.75 error", "right"),
         ("in fit", "left")], table)
    _common.print_table("fitted matmul efficiency curve", [("FLOPs", "right"),
                                                           ("fraction of 989 TFLOP/s", "right")],
                        [[f"{f:.3g}", f"{e:.3f}"] for f, e in dev.matmul_efficiency_curve])
    _common.print_table(
        f"element-wise passes: B = {fit['memory_bandwidth_bytes_per_s'] / 1e12:.3g} TB/s, "
        f"c = {fit['memory_intercept_s'] * 1e6:.1f} us",
        [("op", "left"), ("bytes", "right"), ("measured us", "right"), ("model us", "right")],
        [[m["op"], f"{m['bytes']:.3g}", f"{m['s'] * 1e6:.1f}", f"{m['model_s'] * 1e6:.1f}"]
         for m in fit["memory_rows"]])

    def summary(key: str, rows_: list[dict]) -> dict:
        errs = [abs(c[key]) for c in rows_]
        return {"rows": len(errs), "median_abs_error": statistics.median(errs),
                "max_abs_error": max(errs)}

    used = [c for c in compared if c["used_in_fit"]]
    stats = {"calibrated_rows_in_fit": summary("error", used),
             "nominal_rows_in_fit": summary("nominal_error", used),
             "calibrated_all_rows": summary("error", compared),
             "nominal_all_rows": summary("nominal_error", compared)}
    for name, s in stats.items():
        print(f"{name}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, "
              f"max {s['max_abs_error']:.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(cluster.to_json() + "\n")
    _common.write_result(args.fit_out, {
        "benchmark": "calibrate_h100", "command": _common.command_line(),
        "date": _common.now_utc(), "code": _common.CODE_AT_START,
        "source": str(args.data.relative_to(_common.REPO_ROOT))
        if args.data.is_relative_to(_common.REPO_ROOT) else str(args.data),
        "cluster_json": str(args.out.name), "cluster_fingerprint": cluster.fingerprint(),
        "fit": fit, "summary": stats, "matmuls": compared})
    print(f"wrote {args.out} ({cluster.name}, fingerprint {cluster.fingerprint()}) and "
          f"{args.fit_out}")


if __name__ == "__main__":
    main()
