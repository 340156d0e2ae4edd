"""Models written as their libraries' docs write them, planned and run by alpa_lite.

Part 1, on 8 virtual CPU devices: every builder of examples/library_models.py (flax.nnx,
Equinox, Hugging Face Flax GPT-2 and BERT, an optax chain in fp32 and bf16, a Flax linen
transformer under nn.scan(nn.remat(...)) with dropout on, a Flax BatchNorm CNN; a builder
whose library is not installed is skipped) under DataParallel, Auto, Manual(dp=2, tp=4)
and Manual(dp=4, pp=2, num_micro_batches=2). Per model and plan:

  - exact: one step equals plain `jax.jit` of the undecorated step at the tolerances of
    tests/test_library_models.py (loss rtol 1e-5; params rtol 1e-4, atol 1e-6; the bf16
    model at that file's mixed-precision tolerances), with the largest absolute error of
    the loss and of the parameters (the step's first result);
  - plan s: wall time of `step.plan(*args)` on a fresh `al.parallelize` (tracing included);
  - sharded: the fraction of parameter bytes (leaves of args[0], weighted by nbytes) whose
    input sharding (`step.input_shardings(*args)`) is not fully replicated. A pipeline
    stage's share of the layers is not counted: a weight held whole by each device of
    its stage counts as replicated;
  - H100 est: `plan.step_time_s` of the same step planned for 8xH100
    (`Cluster.of_gpus("H100", 1, 8)`), and its ratio to the model's DataParallel plan
    there. At these tiny sizes (kilobytes of weights, a batch of 8 to 16) every estimate
    is a few kernel launches and collective latencies: latency-dominated, so the ratios
    say little about real models. Part 2 is for that.

A plan that is refused (a micro-batched plan of the BatchNorm CNN: a batch statistic is
not a sum over micro-batches) is listed with its refusal, not run.

Part 2, planned only (nothing allocated, no device needed): Hugging Face Flax GPT-2 small
(124M; batch 32 x 512 tokens) and BERT-base (110M, masked LM; batch 32 x 128), built with
`_do_init=False`, parameters `jax.eval_shape(lambda: model.init_weights(key, (1, seq)))`,
AdamW state by `jax.eval_shape(tx.init, params)`, the batch `jax.ShapeDtypeStruct`s, under
DataParallel, Auto (one SPMD stage, `Auto(pipeline=False)`), Manual(dp=2, tp=4),
Manual(dp=4, pp=2, num_micro_batches=4) and plain `Auto()` (pipelines and micro-batch
counts weighed as well) for 8xH100: estimated step time and its ratio to DataParallel,
per-device memory estimate, fraction of parameter bytes sharded (read from the plan's input specs: a mesh axis of
more than one device splits the leaf), planning time.

    python bench/real_models.py [--quick]

--quick: DataParallel and Auto only, and GPT-2 only in part 2.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import importlib  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import alpa_lite as al  # noqa: E402
from _common import (CODE_AT_START, RESULTS_DIR, command_line, machine, now_utc,  # noqa: E402
                     print_table, use_examples, write_result)
from alpa_lite.cost_models.cluster import Cluster  # noqa: E402
from alpa_lite.errors import PlanningError  # noqa: E402

use_examples()
import library_models as lm  # noqa: E402

TINY_METHODS = (
    ("DataParallel", al.DataParallel()),
    ("Auto", al.Auto(pipeline=False)),   # one SPMD stage, as these rows were measured
    ("Manual 2x4", al.Manual(dp=2, tp=4)),
    ("dp4 x pp2, m=2", al.Manual(dp=4, pp=2, num_micro_batches=2)),
)
FULL_METHODS = (
    ("DataParallel", al.DataParallel()),
    ("Auto", al.Auto(pipeline=False)),   # one SPMD stage, as these rows were measured
    ("Manual 2x4", al.Manual(dp=2, tp=4)),
    ("dp4 x pp2, m=4", al.Manual(dp=4, pp=2, num_micro_batches=4)),
    # Plain Auto(), as a user writes it: pipelines and micro-batch counts weighed too (what
    # that costs in planning time, for the same or a better plan).
    ("Auto(), pipelines", al.Auto()),
)
FULL_MODELS = (   # (label, kind, batch, sequence length)
    ("GPT-2 small 124M, 32x512", "gpt2", 32, 512),
    ("BERT-base 110M, 32x128", "bert", 32, 128),
)
MIXED = {"optax_chain_bf16"}      # compared at tests/test_library_models.py's bf16 tolerances


# ---- what the plans shard --------------------------------------------------------------

def _nbytes(leaf) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def sharded_fraction_local(step, args) -> float:
    """Parameter bytes whose input sharding on the local devices is not fully replicated."""
    leaves, treedef = jax.tree_util.tree_flatten(args[0])
    shardings = treedef.flatten_up_to(step.input_shardings(*args)[0])
    # (An Equinox model's functions are held static: no sharding, no bytes.)
    pairs = [(x, s) for x, s in zip(leaves, shardings) if hasattr(x, "shape")]
    total = sum(_nbytes(x) for x, _ in pairs)
    return sum(_nbytes(x) for x, s in pairs if not s.is_fully_replicated) / total


def sharded_fraction_plan(plan, args) -> float:
    """The same, read from the plan (for clusters one does not have): parameter leaves are
    the first leaves of the flattened arguments; a leaf is sharded where its spec names a
    mesh axis of more than one device of the stage that holds it."""
    leaves = lm.array_leaves(args[0])      # the plan holds no non-array leaf
    if plan.pipeline is not None:
        where = [(plan.stages[p.stage], p.spec) for p in plan.pipeline.inputs[:len(leaves)]]
    else:
        where = [(plan.stages[0], spec) for spec in plan.stages[0].input_specs[:len(leaves)]]
    assert len(where) == len(leaves), (len(where), len(leaves))

    def split(stage, spec) -> bool:
        sizes = dict(zip(stage.axis_names, stage.mesh_shape))
        return any(sizes[a] > 1 for a in spec.axes())

    total = sum(_nbytes(x) for x in leaves)
    return sum(_nbytes(x) for x, (st, sp) in zip(leaves, where) if split(st, sp)) / total


def meshes(plan) -> str:
    return " + ".join("x".join(map(str, s.mesh_shape)) for s in plan.stages)


# ---- part 1: tiny models, run --------------------------------------------------------

def compare(out, ref, mixed: bool) -> dict:
    loss_err = abs(float(out[2]) - float(ref[2]))
    same_tree = jax.tree.structure(out[0]) == jax.tree.structure(ref[0]) and \
        lm.other_leaves(out[0]) == lm.other_leaves(ref[0])
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
             for a, b in zip(lm.array_leaves(out[0]), lm.array_leaves(ref[0]))]
    param_err = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    if mixed:   # tests/test_library_models.py::_assert_mixed_close (less its AdamW-mu check)
        exact = (np.allclose(out[2], ref[2], rtol=2 ** -7, atol=0)
                 and all(np.allclose(a, b, rtol=0,
                                     atol=2 * 1e-3 * (1 + 0.01 * np.abs(b).max()) + 1e-6)
                         for a, b in pairs))
    else:
        exact = (np.allclose(out[2], ref[2], rtol=1e-5, atol=0)
                 and all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs))
    return {"exact": bool(exact and same_tree), "loss_abs_err": loss_err,
            "param_max_abs_err": param_err, "tolerance": "bf16" if mixed else "fp32"}


def tiny_row(name: str, case, ref, label: str, method, h100: Cluster) -> dict:
    row = {"model": name, "method": label}
    step = al.parallelize(case.step, method=method)
    t0 = time.perf_counter()
    try:
        plan = step.plan(*case.args)
    except PlanningError as e:
        return {**row, "refused": str(e)}
    row["plan_s"] = time.perf_counter() - t0
    row["mesh"] = meshes(plan)
    try:
        out = step(*case.args)
    except Exception as e:    # noqa: BLE001 - a failure is a result here
        return {**row, "error": f"{type(e).__name__}: {e}"}
    row.update(compare(out, ref, name in MIXED))
    row["sharded_fraction"] = sharded_fraction_local(step, case.args)
    row["sharded_fraction_from_plan"] = sharded_fraction_plan(plan, case.args)
    try:
        row["h100_step_s"] = al.parallelize(case.step, method=method,
                                            cluster=h100).plan(*case.args).step_time_s
    except PlanningError as e:
        row["h100_refused"] = str(e)
    return row


def part1(methods, h100: Cluster) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    for name, (lib, build) in lm.BUILDERS.items():
        try:
            importlib.import_module(lib)
        except ImportError:
            skipped.append(f"{name} ({lib} not installed)")
            continue
        case = build()
        ref = case.reference_jit(case.step)(*case.args)
        for label, method in methods:
            r = tiny_row(name, case, ref, label, method, h100)
            rows.append(r)
            print(f"  {name:24s} {label:16s} "
                  + ("refused" if "refused" in r else "error" if "error" in r
                     else f"exact={r['exact']} plan {r['plan_s']:.2f}s"), flush=True)
    for name in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == name]
        dp = next((r.get("h100_step_s") for r in mine if r["method"] == "DataParallel"), None)
        for r in mine:
            if dp and r.get("h100_step_s"):
                r["h100_vs_dp"] = r["h100_step_s"] / dp
    return rows, skipped


def _first_sentence(text: str, n: int = 60) -> str:
    s = text.split(": the ")[0].split(". ")[0]
    return s if len(s) <= n else s[:n - 3] + "..."


def print_part1(rows: list[dict], skipped: list[str]) -> None:
    def fmt(r):
        if "refused" in r:
            return [r["model"], r["method"], "refused", "", "", "", "", "", "", "",
                    _first_sentence(r["refused"])]
        if "error" in r:
            return [r["model"], r["method"], "ERROR", "", "", f"{r['plan_s']:.2f}", "",
                    r["mesh"], "", "", _first_sentence(r["error"])]
        h100 = (f"{r['h100_step_s'] * 1e3:.3f}" if "h100_step_s" in r else "refused")
        return [r["model"], r["method"],
                "yes" if r["exact"] else "NO",
                f"{r['loss_abs_err']:.1e}", f"{r['param_max_abs_err']:.1e}",
                f"{r['plan_s']:.2f}", f"{r['sharded_fraction']:.0%}", r["mesh"], h100,
                f"{r['h100_vs_dp']:.2f}" if "h100_vs_dp" in r else "",
                "bf16 tolerances" if r["tolerance"] == "bf16" else ""]
    print_table(
        "Library models on 8 virtual CPU devices vs jax.jit; estimates for 8xH100",
        [("model", "left"), ("plan", "left"), ("exact", "left"), ("|d loss|", "right"),
         ("max |d param|", "right"), ("plan s", "right"), ("sharded", "right"),
         ("mesh", "left"), ("H100 est ms", "right"), ("vs DP", "right"), ("note", "left")],
        [fmt(r) for r in rows],
        caption="exact: at tests/test_library_models.py's tolerances. sharded: parameter "
                "bytes not fully replicated. H100 est: plan.step_time_s for 8xH100 (tiny "
                "sizes: latency-dominated)."
                + (f" Skipped: {', '.join(skipped)}." if skipped else ""))
    for r in rows:
        if "refused" in r or "error" in r:
            print(f"{r['model']}, {r['method']}: {r.get('refused') or r.get('error')}")


# ---- part 2: GPT-2 small and BERT-base, planned for 8xH100 ----------------------------

def part2(models, methods, h100: Cluster) -> list[dict]:
    rows = []
    try:
        importlib.import_module("transformers")
    except ImportError:
        print("part 2 skipped: transformers is not installed")
        return rows
    for label, kind, batch, seq in models:
        case = lm.hf_full_size(kind, batch, seq)
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(case.args[0]))
        for mlabel, method in methods:
            row = {"model": label, "method": mlabel, "params": params, "batch": batch,
                   "seq": seq}
            t0 = time.perf_counter()
            try:
                plan = al.parallelize(case.step, method=method, cluster=h100).plan(*case.args)
            except PlanningError as e:
                rows.append({**row, "refused": str(e)})
                continue
            row.update(plan_s=time.perf_counter() - t0, step_s=plan.step_time_s,
                       mesh=meshes(plan), peak_memory_bytes=plan.peak_memory_bytes,
                       sharded_fraction=sharded_fraction_plan(plan, case.args))
            rows.append(row)
            print(f"  {label:26s} {mlabel:16s} {row['step_s'] * 1e3:8.2f} ms "
                  f"plan {row['plan_s']:.1f}s", flush=True)
        dp = next((r.get("step_s") for r in rows
                   if r["model"] == label and r["method"] == "DataParallel"), None)
        for r in rows:
            if r["model"] == label and dp and r.get("step_s"):
                r["vs_dp"] = r["step_s"] / dp
    return rows


def print_part2(rows: list[dict]) -> None:
    def fmt(r):
        if "refused" in r:
            return [r["model"], r["method"], "refused", "", "", "", "", "",
                    _first_sentence(r["refused"])]
        return [r["model"], r["method"], f"{r['step_s'] * 1e3:.2f}",
                f"{r['vs_dp']:.2f}" if "vs_dp" in r else "", r["mesh"],
                f"{r['peak_memory_bytes'] / 2 ** 30:.1f}", f"{r['sharded_fraction']:.0%}",
                f"{r['plan_s']:.1f}", ""]
    print_table(
        "Full-size Hugging Face models planned for 8xH100 from shapes (AdamW)",
        [("model", "left"), ("plan", "left"), ("est. step ms", "right"),
         ("vs DP", "right"), ("mesh", "left"), ("mem GiB/dev", "right"),
         ("sharded", "right"), ("plan s", "right"), ("note", "left")],
        [fmt(r) for r in rows],
        caption="est. step: plan.step_time_s. mem: the plan's per-device peak estimate. "
                "sharded: parameter bytes split over a mesh axis of >1 device.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="DataParallel and Auto only; GPT-2 only in part 2")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/real_models.json "
                             "(real_models_quick.json with --quick)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS_DIR / ("real_models_quick.json" if args.quick
                                     else "real_models.json")
    t_start = time.perf_counter()
    h100 = Cluster.of_gpus("H100", 1, 8)
    tiny_methods = TINY_METHODS[:2] if args.quick else TINY_METHODS
    full_methods = FULL_METHODS[:2] if args.quick else FULL_METHODS
    full_models = FULL_MODELS[:1] if args.quick else FULL_MODELS

    print("part 1: library models on 8 virtual CPU devices", flush=True)
    rows1, skipped = part1(tiny_methods, h100)
    print("part 2: full-size models planned for 8xH100", flush=True)
    rows2 = part2(full_models, full_methods, h100)
    print_part1(rows1, skipped)
    print_part2(rows2)
    wall = time.perf_counter() - t_start
    exact = [r for r in rows1 if "exact" in r]
    differ = [f"{r['model']} {r['method']}" for r in exact
              if abs(r["sharded_fraction"] - r["sharded_fraction_from_plan"]) > 1e-9]
    if differ:
        print(f"sharded fraction from the plan differs from input_shardings: {differ}")
    print(f"{sum(r['exact'] for r in exact)}/{len(exact)} run plans equal jax.jit; "
          f"{sum('refused' in r for r in rows1)} refused, {sum('error' in r for r in rows1)} "
          f"failed; wall time {wall:.0f} s")
    write_result(out, {"benchmark": "real_models", "command": command_line(),
                       "when": now_utc(), "machine": machine(), **CODE_AT_START,
                       "cluster_estimated": h100.name, "wall_s": wall,
                       "skipped": skipped, "library_models": rows1, "full_size": rows2})


if __name__ == "__main__":
    main()
