"""Whole-stage memory estimate vs what XLA compiles: per device, on 8 virtual CPU devices.

For small MLPs and GPTs under DataParallel, ZeRO (shard_optimizer_state), Manual dp x tp
and Auto, the plan's `StagePlan.memory` (alpa_lite.planning.memory) is compared with the
compiled program's `memory_analysis()`: argument + output + temp - alias bytes, which is
what one device allocates for one step (XLA may place a temporary in an output buffer
before the output is written, so this is an upper bound on its true peak). The estimate
walks the traced program in order with each tensor's per-device share; it does not see
XLA's fusion (fused element-wise intermediates never exist), so it tends to err high.

Pipelined plans are left out: they run several programs (forward, backward, reduction,
update per stage) and hold activations between them, which no single `memory_analysis`
shows.

    python bench/memory_fidelity.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from _common import (CODE_AT_START, RESULTS_DIR, command_line, machine, now_utc,  # noqa: E402
                     print_table, write_result)
from alpa_lite.tools.models import gpt, mlp  # noqa: E402

TARGET = 0.25      # |estimate / measured - 1| we aim for

METHODS = (
    ("DataParallel", al.DataParallel()),
    ("ZeRO dp=8", al.DataParallel(shard_optimizer_state=True)),
    ("Manual 2x4", al.Manual(dp=2, tp=4)),
    ("Manual 1x8", al.Manual(dp=1, tp=8)),
    ("Auto", al.Auto(pipeline=False)),   # one SPMD stage, as these rows were measured
)


def models(quick: bool):
    """(label, model module, config, batch size)."""
    base = mlp.CONFIGS[next(iter(mlp.CONFIGS))]
    out = [("MLP 4x512, batch 256", mlp, dataclasses.replace(
        base, in_dim=512, hidden=512, out_dim=512, num_layers=4), 256),
        ("GPT tiny, batch 16", gpt, gpt.CONFIGS["tiny"], 16)]
    if not quick:
        out += [("MLP 2x1024, batch 64", mlp, dataclasses.replace(
            base, in_dim=1024, hidden=1024, out_dim=1024, num_layers=2), 64),
            ("GPT tiny, batch 64", gpt, gpt.CONFIGS["tiny"], 64)]
    return out


def measure(module, cfg, batch: int, method) -> dict:
    tx = optax.adam(1e-3)
    params = module.init_params(cfg, jax.random.PRNGKey(0))
    args = (params, tx.init(params), module.make_batch(cfg, batch, jax.random.PRNGKey(1)))
    step = al.parallelize(module.make_train_step(cfg, tx), method=method)
    exe = step.compile(*args)
    est = exe.plan.stages[0].memory
    ma = exe.stage.compiled(jax.tree_util.tree_leaves(args)).memory_analysis()
    measured = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                - ma.alias_size_in_bytes)
    return {"mesh": list(exe.plan.stages[0].mesh_shape),
            "estimate": est.to_json(),
            "xla": {"argument_bytes": ma.argument_size_in_bytes,
                    "output_bytes": ma.output_size_in_bytes,
                    "temp_bytes": ma.temp_size_in_bytes,
                    "alias_bytes": ma.alias_size_in_bytes},
            "measured_bytes": measured, "ratio": est.total / measured}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two models only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "memory_fidelity.json")
    args = parser.parse_args(argv)
    rows = []
    for label, module, cfg, batch in models(args.quick):
        for mlabel, method in METHODS:
            r = measure(module, cfg, batch, method)
            rows.append({"model": label, "method": mlabel, **r})
    kib = lambda b: f"{b / 1024:,.0f}"   # noqa: E731
    print_table(
        "Estimated vs compiled peak memory per device (KiB), 8 virtual CPU devices, Adam",
        [("model", "left"), ("method", "left"), ("mesh", "left"), ("params", "right"),
         ("grads", "right"), ("opt state", "right"), ("activations", "right"),
         ("workspace", "right"), ("estimate", "right"), ("XLA arg", "right"),
         ("XLA out", "right"), ("XLA temp", "right"), ("XLA total", "right"),
         ("ratio", "right")],
        [[r["model"], r["method"], "x".join(map(str, r["mesh"])),
          kib(r["estimate"]["params"]), kib(r["estimate"]["grads"]),
          kib(r["estimate"]["optimizer_state"]), kib(r["estimate"]["activations"]),
          kib(r["estimate"]["workspace"]), kib(r["estimate"]["total"]),
          kib(r["xla"]["argument_bytes"]), kib(r["xla"]["output_bytes"]),
          kib(r["xla"]["temp_bytes"]), kib(r["measured_bytes"]),
          f"{r['ratio']:.2f}" + ("" if abs(r["ratio"] - 1) <= TARGET else " *")]
         for r in rows],
        caption=f"* outside the +/-{TARGET:.0%} target. XLA total = arg + out + temp - alias.")
    within = sum(abs(r["ratio"] - 1) <= TARGET for r in rows)
    print(f"{within}/{len(rows)} rows within +/-{TARGET:.0%}")
    write_result(args.out, {"benchmark": "memory_fidelity", "command": command_line(),
                            "when": now_utc(), "machine": machine(), **CODE_AT_START,
                            "target": TARGET, "rows": rows})


if __name__ == "__main__":
    main()
