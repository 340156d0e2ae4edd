"""Gradients reduced once per step in pipelined plans: what the compiled programs move, and
what the cost model charges.

Part 1 (8 virtual CPU devices, compiled HLO): the tiny GPT, batch 32, `Manual(dp=4, pp=2,
num_micro_batches=m)`. The plan accumulates each stage's gradients per device and reduces
them once; the same plan with accumulation switched off (`accumulate_axes=()` on every
stage, which the runtime executes as written: the backward reduces over dp itself) is the
per-micro-batch baseline. The bytes are read from the compiled programs
(`executable.collectives`), counted per step.

Part 2 (cost model): full-size GPTs on cluster presets under a Megatron grid point; the
stage gradient reduction once per step (`PipelineSpec.reduce_s`) against the same
reduction once per micro-batch (m x), and the step estimate.

    python bench/gradient_sync.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from _common import (CODE_AT_START, RESULTS_DIR, command_line, machine, now_utc,  # noqa: E402
                     print_table, write_result)
from alpa_lite.plan import Accumulation  # noqa: E402
from alpa_lite.tools.models import gpt  # noqa: E402

BATCH = 32
MICRO_BATCHES = (2, 4, 8)
SCALE_CASES = (   # (size, cluster, dp, tp, pp, micro-batches, global batch)
    ("1.3B", "8xV100", 2, 2, 2, 16, 64),
    ("2.6B", "8x8xV100", 8, 4, 2, 32, 512),
    ("6.7B", "8x8xA100", 8, 4, 2, 64, 1024),
)


def all_reduce_bytes(collectives) -> int:
    return sum(c.nbytes * c.count for c in collectives if c.kind == "all-reduce")


def compiled_case(m: int) -> dict:
    cfg = gpt.CONFIGS["tiny"]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = gpt.init_params(cfg, jax.random.PRNGKey(0))
    args = (params, tx.init(params), gpt.make_batch(cfg, BATCH, jax.random.PRNGKey(1)))
    step = al.parallelize(gpt.make_train_step(cfg, tx),
                          method=al.Manual(dp=4, pp=2, num_micro_batches=m))
    plan = step.plan(*args)
    once = step.compile(*args).collectives(*args)
    baseline_plan = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(st, accumulate_axes=(), local_loss_scale=1.0)
                           for st in plan.stages))
    baseline = step.with_plan(baseline_plan)
    every = baseline.compile(*args).collectives(*args)
    grad_bytes = sum(g.nbytes for g in plan.gradient_sync)
    return {"micro_batches": m, "gradient_bytes_per_device": grad_bytes,
            "local_stages": sum(bool(st.accumulate_axes) for st in plan.stages),
            "all_reduce_bytes_once": all_reduce_bytes(once),
            "all_reduce_bytes_per_micro_batch": all_reduce_bytes(every),
            "reduction_programs_once": sorted({c.program for c in once
                                               if "reduction" in c.program})}


def scale_case(size, cluster_name, dp, tp, pp, m, batch) -> dict:
    cfg = dataclasses.replace(gpt.CONFIGS[size], dtype="float16")
    tx = optax.adamw(1e-4)
    step = al.parallelize(gpt.make_train_step(cfg, tx),
                          method=al.Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=m))
    t0 = time.perf_counter()
    plan = step.plan(*gpt.abstract_args(cfg, batch, tx), cluster=al.Cluster.preset(cluster_name))
    plan_s = time.perf_counter() - t0
    p = plan.pipeline
    local = [g for g in plan.gradient_sync if g.accumulation is Accumulation.LOCAL]
    return {"model": f"GPT-{size}", "cluster": cluster_name, "dp": dp, "tp": tp, "pp": pp,
            "micro_batches": m, "global_batch": batch, "plan_s": round(plan_s, 2),
            "local_stages": sum(bool(st.accumulate_axes) for st in plan.stages),
            "gradients_local": len(local), "gradients": len(plan.gradient_sync),
            "reduce_once_s": p.reduce_s, "reduce_per_micro_batch_s": m * p.reduce_s,
            "step_s": p.step_time_s,
            "notes": [st.accumulate_note for st in plan.stages if st.accumulate_note]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="part 1 only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gradient_sync.json")
    args = parser.parse_args(argv)
    compiled = [compiled_case(m) for m in MICRO_BATCHES]
    print_table(
        "Manual(dp=4, pp=2), tiny GPT, batch 32, 8 CPU devices: all-reduce bytes per step "
        "per device, from the compiled programs",
        [("m", "right"), ("stages accumulating", "right"), ("gradient bytes", "right"),
         ("reduce once", "right"), ("reduce per micro-batch", "right"), ("ratio", "right")],
        [[str(r["micro_batches"]), str(r["local_stages"]),
          f"{r['gradient_bytes_per_device']:,}", f"{r['all_reduce_bytes_once']:,}",
          f"{r['all_reduce_bytes_per_micro_batch']:,}",
          f"{r['all_reduce_bytes_per_micro_batch'] / max(r['all_reduce_bytes_once'], 1):.1f}x"]
         for r in compiled])
    scale = [] if args.quick else [scale_case(*c) for c in SCALE_CASES]
    if scale:
        print_table(
            "Cost model: the stage gradient reduction once per step vs once per micro-batch",
            [("model", "left"), ("cluster", "left"), ("dp x tp x pp, m", "left"),
             ("stages accumulating", "right"), ("reduce once", "right"),
             ("per micro-batch", "right"), ("est. step", "right"), ("plan s", "right")],
            [[r["model"], r["cluster"], f"{r['dp']}x{r['tp']}x{r['pp']}, {r['micro_batches']}",
              f"{r['local_stages']}/{r['pp']}", f"{r['reduce_once_s'] * 1e3:.1f} ms",
              f"{r['reduce_per_micro_batch_s'] * 1e3:.1f} ms", f"{r['step_s']:.3f} s",
              f"{r['plan_s']:.1f}"] for r in scale])
    write_result(args.out, {"benchmark": "gradient_sync", "command": command_line(),
                            "when": now_utc(), "machine": machine(), **CODE_AT_START,
                            "compiled": compiled, "cost_model": scale})


if __name__ == "__main__":
    main()
