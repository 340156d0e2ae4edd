"""Gradient buckets: the size the planner chooses against one bucket and XLA's default, and
where the compiled programs put the reductions.

Part 1 (cost model): data-parallel GPTs on cluster presets (`DataParallel()`, Adam, the
batch below); per plan the exposed gradient sync (what is left after the backward ends)
and the step estimate with one bucket for every gradient, with XLA's default 30 MiB
combine threshold, and with the size the planner chose (`Plan.sync_buckets`). The other
lines of the step do not depend on the bucket size, so a size's step is the plan's step
with its exposed sync in place of the chosen one.

Part 2 (cost model): the same GPTs with `compression=Dense()`, the per-worker engine that
issues its full-precision exchange itself, bucket by bucket during the backward: its
buckets (chosen on the engine's own backward, which runs no other collective), what they
leave exposed, and the step estimate next to the exchange priced after the backward (the
estimate before this engine's buckets were priced).

Part 3 (8 virtual CPU devices, compiled HLO): a 4-layer MLP (four 4 MiB weights, batch
4096) planned for 8xH100, whose chosen buckets are one per weight, compiled here two
ways: as the data-parallel plan runs (the partitioner places the reductions; XLA:CPU
combines them into one whatever the plan says), and with a full-precision exchange the
runtime issues itself (`compression=Dense()`: one all-reduce per bucket, in the plan's
order). From each compiled entry computation: the gradient all-reduces, their bytes and
schedule positions, and the position of the backward's last operator.

    python bench/sync_buckets.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from _common import (CODE_AT_START, RESULTS_DIR, command_line, machine, now_utc,  # noqa: E402
                     print_table, write_result)
from alpa_lite import compression as C  # noqa: E402
from alpa_lite.cost_models.overlap import XLA_COMBINE_THRESHOLD_BYTES  # noqa: E402
from alpa_lite.runtime.executable import compile_plan  # noqa: E402
from alpa_lite.runtime.hlo import entry_schedule  # noqa: E402
from alpa_lite.tools.models import gpt  # noqa: E402

MiB = 2 ** 20
# (model, cluster, global batch in sequences of 1024 tokens): 8, 4 and 2 sequences a GPU on
# the H100s, one on the V100s (16 GB).
CASES = (
    ("125M", "8xH100", 64), ("350M", "8xH100", 32), ("1.3B", "8xH100", 16),
    ("125M", "8x8xV100", 64), ("350M", "8x8xV100", 64), ("1.3B", "8x8xV100", 64),
)
QUICK_CASES = CASES[:1] + CASES[3:4]


def _planned(size: str, cluster_name: str, batch: int, compression=None):
    """GPT-`size`'s `DataParallel()` plan for the preset (Adam), and its seconds to plan."""
    cfg = gpt.CONFIGS[size]
    tx = optax.adam(1e-4)
    step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.DataParallel(),
                          compression=compression)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a plan that does not fit says so in "fits"
        plan = step.plan(*gpt.abstract_args(cfg, batch, tx),
                         cluster=al.Cluster.preset(cluster_name))
    return plan, time.perf_counter() - t0


def model_case(size: str, cluster_name: str, batch: int) -> dict:
    cfg = gpt.CONFIGS[size]
    cluster = al.Cluster.preset(cluster_name)
    plan, plan_s = _planned(size, cluster_name, batch)
    (b,) = plan.sync_buckets
    step_s = plan.step_time_s

    def at(nbytes: float) -> dict:
        size_bytes, exposed, buckets = b.weighed_at(nbytes)
        return {"bucket_bytes": size_bytes, "buckets": buckets, "exposed_s": exposed,
                "step_s": step_s - b.exposed_s + exposed}
    return {"model": f"GPT-{size}", "cluster": cluster_name, "global_batch": batch,
            "dtype": cfg.dtype, "gradients": len(plan.gradient_sync),
            "gradient_bytes_per_device": sum(g.nbytes for g in plan.gradient_sync),
            "backward_end_s": b.backward_end_s, "sync_total_s": b.total_s,
            "one_bucket": at(float("inf")), "xla_default": at(XLA_COMBINE_THRESHOLD_BYTES),
            "chosen": {"bucket_bytes": b.bucket_bytes, "buckets": b.num_buckets,
                       "exposed_s": b.exposed_s, "step_s": step_s},
            "runner_up": {"bucket_bytes": b.runner_up_bytes, "buckets": b.runner_up_buckets,
                          "exposed_s": b.runner_up_exposed_s},
            "weighed": [list(w) for w in b.weighed], "plan_s": round(plan_s, 2),
            "peak_memory_gib": plan.peak_memory_bytes / 2**30,
            "fits": plan.peak_memory_bytes <= cluster.device.memory_bytes}


def engine_case(size: str, cluster_name: str, batch: int) -> dict:
    plan, _ = _planned(size, cluster_name, batch, C.Dense())
    (b,) = plan.sync_buckets
    c = plan.compression
    return {"model": f"GPT-{size}", "cluster": cluster_name, "global_batch": batch,
            "compute_s": c.compute_s, "exchange_s": b.total_s, "exposed_s": b.exposed_s,
            "bucket_bytes": b.bucket_bytes, "buckets": b.num_buckets,
            "step_s": c.step_time_s, "after_backward_step_s": c.compute_s + c.dense_sync_s}


def _mlp_step(batch: int, width: int, depth: int):
    def loss(p, x):
        h = x
        for i in range(depth):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(jnp.square(h))

    tx = optax.sgd(0.1)

    def step(p, s, x):
        value, g = al.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    p = {f"w{i}": jax.ShapeDtypeStruct((width, width), jnp.float32) for i in range(depth)}
    return step, (p, jax.eval_shape(tx.init, p),
                  jax.ShapeDtypeStruct((batch, width), jnp.float32))


def _schedule_summary(sched, backward_ops, min_bytes: int) -> dict:
    reductions = [op for op in sched if op.opcode in ("all-reduce", "all-reduce-start")
                  and op.nbytes >= min_bytes]
    last = max(op.position for op in backward_ops)
    return {"instructions": len(sched), "gradient_all_reduces": len(reductions),
            "all_reduce_bytes": [op.nbytes for op in reductions],
            "all_reduce_positions": [op.position for op in reductions],
            "last_backward_position": last,
            "before_last_backward": sum(op.position < last for op in reductions)}


def hlo_case() -> dict:
    step_fn, args = _mlp_step(4096, 1024, 4)
    cluster = al.Cluster.preset("8xH100")
    out = {"model": "MLP 4 x (1024x1024) f32, batch 4096", "planned_for": cluster.name}
    # The plan as it runs: reductions placed by the partitioner.
    step = al.parallelize(step_fn, method=al.DataParallel())
    plan = step.plan(*args, cluster=cluster)
    (b,) = plan.sync_buckets
    out["plan_buckets"] = b.num_buckets
    out["plan_bucket_bytes"] = [k.nbytes for k in b.buckets]
    exe = compile_plan(plan, step.program(plan, *args), jax.devices())
    sched = entry_schedule(exe.compiled_text(*args))
    # The replayed program names operators after the plan's nodes: its backward is told
    # by its matmuls (the weight gradients are the last of them).
    backward = [op for op in sched if op.opcode in ("dot", "fusion")
                and "dot_general" in op.op_name]
    out["partitioner"] = _schedule_summary(sched, backward, MiB) | {
        "compiler_options": exe.compiler_options}
    # The runtime issuing the plan's buckets itself (a full-precision exchange).
    step = al.parallelize(step_fn, method=al.DataParallel(), compression=C.Dense())
    plan = step.plan(*args, cluster=cluster)
    exe = compile_plan(plan, step.program(plan, *args), jax.devices())
    real = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), args)
    sched = entry_schedule(exe.hlo(*real))
    out["runtime"] = _schedule_summary(sched, [op for op in sched if op.is_backward_compute],
                                       MiB) | {"compiler_options": exe.compiler_options,
                                               "issue": plan.sync_buckets[0].issue.value}
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _size(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two models only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sync_buckets.json")
    args = parser.parse_args(argv)
    cases = [model_case(*c) for c in (QUICK_CASES if args.quick else CASES)]
    print_table(
        "DataParallel GPTs (Adam, seq 1024): exposed gradient sync and step estimate by "
        "bucket size (cost model)",
        [("model", "left"), ("cluster", "left"), ("batch", "right"), ("grad MiB", "right"),
         ("sync total ms", "right"), ("one bucket: exposed / step ms", "right"),
         ("XLA 30 MiB: buckets, exposed / step ms", "right"),
         ("chosen: size, buckets, exposed / step ms", "right"), ("runner-up", "right"),
         ("fits", "left"), ("plan s", "right")],
        [[r["model"], r["cluster"], str(r["global_batch"]),
          f"{r['gradient_bytes_per_device'] / MiB:.0f}", _ms(r["sync_total_s"]),
          f"{_ms(r['one_bucket']['exposed_s'])} / {_ms(r['one_bucket']['step_s'])}",
          f"{r['xla_default']['buckets']}, {_ms(r['xla_default']['exposed_s'])} / "
          f"{_ms(r['xla_default']['step_s'])}",
          f"{_size(r['chosen']['bucket_bytes'])}, {r['chosen']['buckets']}, "
          f"{_ms(r['chosen']['exposed_s'])} / {_ms(r['chosen']['step_s'])}",
          (f"{_size(r['runner_up']['bucket_bytes'])}: {_ms(r['runner_up']['exposed_s'])}"
           if r["runner_up"]["bucket_bytes"] else "-"),
          "yes" if r["fits"] else f"no ({r['peak_memory_gib']:.0f} GiB)", f"{r['plan_s']:.1f}"]
         for r in cases])
    engines = [engine_case(*c) for c in (QUICK_CASES if args.quick else CASES)]
    print_table(
        "compression=Dense(): the per-worker engine's own buckets (cost model)",
        [("model", "left"), ("cluster", "left"), ("exchange ms", "right"),
         ("buckets", "right"), ("exposed ms", "right"), ("step ms", "right"),
         ("exchange after the backward: step ms", "right")],
        [[e["model"], e["cluster"], _ms(e["exchange_s"]),
          f"{e['buckets']} of {_size(e['bucket_bytes'])}", _ms(e["exposed_s"]),
          _ms(e["step_s"]), _ms(e["after_backward_step_s"])] for e in engines])
    hlo = hlo_case()
    rows = []
    for how in ("partitioner", "runtime"):
        h = hlo[how]
        rows.append([how, str(h["compiler_options"] or "-"), str(h["gradient_all_reduces"]),
                     ", ".join(_size(n) for n in h["all_reduce_bytes"]),
                     ", ".join(map(str, h["all_reduce_positions"])),
                     str(h["last_backward_position"]), str(h["before_last_backward"])])
    print_table(
        f"{hlo['model']} planned for {hlo['planned_for']} ({hlo['plan_buckets']} buckets of "
        f"{', '.join(_size(n) for n in hlo['plan_bucket_bytes'])}), compiled on "
        f"{jax.device_count()} {jax.default_backend().upper()} devices: gradient all-reduces "
        "in the scheduled entry computation",
        [("reductions placed by", "left"), ("compiler options", "left"),
         ("all-reduces", "right"), ("bytes", "left"), ("positions", "left"),
         ("last backward op", "right"), ("before it", "right")], rows)
    write_result(args.out, {"benchmark": "sync_buckets", "command": command_line(),
                            "when": now_utc(), "machine": machine(), **CODE_AT_START,
                            "cost_model": cases, "dense_engine": engines, "hlo": hlo})


if __name__ == "__main__":
    main()
