"""What alpa_lite's runtime costs per step: `al.Manual(dp=1, tp=1)` against plain `jax.jit`.

On ONE device the 1x1 plan shards nothing, so any difference in step time is the runtime's
own cost: the per-call Python work (flattening the arguments, the signature lookup, one
`device_put` per leaf) and whatever the equation-by-equation replay and its no-op sharding
constraints do to XLA's program. Both run the same GPT train step (optax.adamw) on the same
parameters and the same batch.

On CPU the full GPT-125M (seq 1024) takes many seconds per step on 2 cores, so by default
the sequence is shortened to 128 tokens and the batch is 1, in float32 (bfloat16 matmuls are
slow on CPU); the table caption and the JSON say so.

Method: each variant compiles and runs BURN_IN_STEPS untimed steps; then ROUNDS rounds, each
timing STEPS_PER_ROUND consecutive steps of each variant, the order alternating round to
round (jit first, then alpa first, ...) so a drift in machine load hits both alike. Every
step blocks on its loss (`block_until_ready`), so no per-call cost hides behind JAX's async
dispatch. Reported: the median ms/step over rounds, its min/max, overhead
% = (alpa / jit - 1) * 100 from the medians, and whether the two give identical losses.
On a shared 2-core machine a burst of other work can inflate one round's mean by tens of
percent, so two less burst-sensitive figures come with it: the median and the minimum over
all single steps.

The process must see exactly one device (so `al.Cluster.local()` has 1 device and
Manual(1, 1) uses all of it): `--xla_force_host_platform_device_count` is removed from
XLA_FLAGS before jax is imported.

Run:
    python bench/exec_overhead.py               # GPT-125M, seq 128, batch 1; ~2 min on 2 cores
    python bench/exec_overhead.py --rounds 3 --steps 3
Writes bench/results/exec_overhead.json (``--out`` to change).
"""

from __future__ import annotations

import os
import re

# One device: drop any forced host device count before jax (or examples/gpt.py, which would
# otherwise default it to 8) is imported. An empty XLA_FLAGS still counts as set.
os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                                 os.environ.get("XLA_FLAGS", "")).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.use_examples()

import gpt  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402

# Knobs -----------------------------------------------------------------------------------
SIZE = "125M"            # a key of gpt.CONFIGS
BATCH_SIZE = 1           # sequences per step
SEQ_LEN = 128            # shortened from the config's 1024 so a CPU step takes ~1 s
DTYPE = "float32"        # the named configs are bfloat16; float32 is the fast dtype on CPU
BURN_IN_STEPS = 2        # untimed steps after the compiling first call
ROUNDS = 5               # alternating measurement rounds
STEPS_PER_ROUND = 5      # consecutive steps timed per variant per round
LEARNING_RATE = 1e-3     # optax.adamw
SEED = 0
TARGET_OVERHEAD_PCT = 3.0  # goal, reported (not asserted)
# -----------------------------------------------------------------------------------------


def run_steps(step, state, batch, num_steps: int, losses: list, step_s: list | None = None):
    """`num_steps` steps, each blocked on its loss; returns (state, seconds in all).
    Each step's own seconds are appended to `step_s` when given."""
    params, opt_state = state
    t0 = last = time.perf_counter()
    for _ in range(num_steps):
        params, opt_state, loss = step(params, opt_state, batch)
        loss.block_until_ready()
        if step_s is not None:
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
        losses.append(loss)
    return (params, opt_state), time.perf_counter() - t0


def summary(ms_per_step: list[float], step_s: list[float]) -> dict:
    """Median/min/max over rounds of a round's mean ms/step, and the per-step times."""
    return {"median_ms": round(statistics.median(ms_per_step), 3),
            "min_ms": round(min(ms_per_step), 3), "max_ms": round(max(ms_per_step), 3),
            "rounds_ms": [round(x, 3) for x in ms_per_step],
            "step_median_ms": round(statistics.median(step_s) * 1e3, 3),
            "step_min_ms": round(min(step_s) * 1e3, 3),
            "steps_ms": [round(x * 1e3, 3) for x in step_s]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default=SIZE, choices=[k for k in gpt.CONFIGS])
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN,
                        help="sequence length (0: the config's own, 1024 for the named sizes)")
    parser.add_argument("--dtype", default=DTYPE, choices=("float32", "bfloat16", "config"),
                        help="parameter dtype ('config': the named config's)")
    parser.add_argument("--burn-in", type=int, default=BURN_IN_STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS_PER_ROUND, help="steps per round")
    parser.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "exec_overhead.json")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.rounds, args.steps) < 1 or args.burn_in < 0 or args.seq_len < 0:
        parser.error("--batch-size, --rounds and --steps must be >= 1; --burn-in, --seq-len >= 0")
    if jax.device_count() != 1:
        sys.exit(f"exec_overhead needs exactly one device, JAX sees {jax.device_count()} "
                 f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")

    base = gpt.CONFIGS[args.size]
    changes = {}
    if args.seq_len and args.seq_len != base.seq_len:
        changes["seq_len"] = args.seq_len
    if args.dtype != "config" and args.dtype != base.dtype:
        changes["dtype"] = args.dtype
    cfg = dataclasses.replace(base, **changes)
    tx = optax.adamw(LEARNING_RATE)
    train_step = gpt.make_train_step(cfg, tx)

    params_key, batch_key = jax.random.split(jax.random.key(SEED))
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, params_key)
    opt_state = jax.jit(tx.init)(params)
    batch = jax.jit(gpt.make_batch, static_argnums=(0, 1))(cfg, args.batch_size, batch_key)
    num_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    num_leaves = len(jax.tree_util.tree_leaves((params, opt_state, batch)))

    jit_step = jax.jit(train_step)
    alpa_step = al.parallelize(train_step, method=al.Manual(dp=1, tp=1))
    t0 = time.perf_counter()
    plan = alpa_step.plan(params, opt_state, batch)   # on al.Cluster.local(): one device
    plan_s = time.perf_counter() - t0

    variants = {"jit": jit_step, "alpa": alpa_step}
    states = {name: (params, opt_state) for name in variants}   # same start, nothing donated
    losses = {name: [] for name in variants}
    first_call_s, ms = {}, {name: [] for name in variants}
    step_s = {name: [] for name in variants}
    for name, step in variants.items():   # burn-in: compile + BURN_IN_STEPS steps
        states[name], first_call_s[name] = run_steps(step, states[name], batch, 1, losses[name])
        states[name], _ = run_steps(step, states[name], batch, args.burn_in, losses[name])
        print(f"  burn-in {name}: first call {first_call_s[name]:.2f} s", file=sys.stderr,
              flush=True)
    for r in range(args.rounds):
        order = ("jit", "alpa") if r % 2 == 0 else ("alpa", "jit")
        for name in order:
            states[name], dt = run_steps(variants[name], states[name], batch, args.steps,
                                         losses[name], step_s[name])
            ms[name].append(dt / args.steps * 1e3)
        print(f"  round {r + 1}/{args.rounds}: jit {ms['jit'][-1]:.1f} ms/step, "
              f"alpa {ms['alpa'][-1]:.1f} ms/step", file=sys.stderr, flush=True)

    loss_values = {name: np.array([float(x) for x in ls]) for name, ls in losses.items()}
    identical = bool(np.array_equal(loss_values["jit"], loss_values["alpa"]))
    max_abs_diff = float(np.max(np.abs(loss_values["jit"] - loss_values["alpa"])))
    stats = {name: summary(ms[name], step_s[name]) for name in variants}
    overhead_pct = (stats["alpa"]["median_ms"] / stats["jit"]["median_ms"] - 1) * 100
    # A second estimate, less sensitive to a burst of load inside one round:
    step_overhead_pct = (stats["alpa"]["step_median_ms"] / stats["jit"]["step_median_ms"]
                         - 1) * 100

    shape = (f"GPT-{args.size}, batch {args.batch_size}, seq {cfg.seq_len}"
             f"{' (shortened from ' + str(base.seq_len) + ')' if 'seq_len' in changes else ''}"
             f", {cfg.dtype}, {jax.default_backend()} x{jax.device_count()}")
    loss_cell = "identical" if identical else f"max |diff| {max_abs_diff:.2e}"
    rows = []
    for name, label in (("jit", "jax.jit(step)"), ("alpa", "al.Manual(dp=1, tp=1)")):
        s = stats[name]
        rows.append([label, f"{first_call_s[name]:.2f}", f"{s['median_ms']:.1f}",
                     f"{s['min_ms']:.1f}", f"{s['max_ms']:.1f}",
                     "-" if name == "jit" else f"{overhead_pct:+.2f}",
                     f"{s['step_median_ms']:.1f}",
                     "-" if name == "jit" else f"{step_overhead_pct:+.2f}",
                     f"{s['step_min_ms']:.1f}",
                     "-" if name == "jit" else loss_cell])
    _common.print_table(
        f"Execution overhead per step: {shape}",
        [("variant", "left"), ("first call s", "right"), ("median ms/step", "right"),
         ("min ms/step", "right"), ("max ms/step", "right"), ("overhead %", "right"),
         ("median of steps ms", "right"), ("overhead % (steps)", "right"),
         ("fastest step ms", "right"),
         ("losses vs jit", "left")],
        rows,
        caption=(f"{args.rounds} alternating rounds x {args.steps} steps each, every step "
                 f"blocked on its loss, after compile + {args.burn_in} burn-in steps. median/"
                 f"min/max over rounds of each round's mean ms/step; 'median of steps' over all "
                 f"{args.rounds * args.steps} single steps (fastest: their min). Overhead = "
                 f"(alpa/jit - 1)*100 of the medians (target within "
                 f"{TARGET_OVERHEAD_PCT:.0f}%). alpa's first call excludes planning "
                 f"({plan_s:.2f} s)."))

    result = {
        "benchmark": "exec_overhead",
        "date": _common.now_utc(),
        "command": _common.command_line(),
        "code": _common.CODE_AT_START,
        "machine": _common.machine(),
        "settings": {
            "model": f"GPT-{args.size}", "params": num_params, "argument_leaves": num_leaves,
            "batch_size": args.batch_size, "seq_len": cfg.seq_len,
            "config_seq_len": base.seq_len, "seq_len_shortened": "seq_len" in changes,
            "dtype": cfg.dtype, "config_dtype": base.dtype, "optimizer":
            f"optax.adamw({LEARNING_RATE})", "seed": SEED,
            "burn_in": f"1 compiling call + {args.burn_in} steps, untimed, per variant",
            "rounds": args.rounds, "steps_per_round": args.steps,
            "timing": "per round: perf_counter around steps_per_round consecutive steps, each "
                      "blocked on its loss; order alternates jit/alpa each round",
            "donation": "none (neither variant donates its arguments)",
            "target_overhead_pct": TARGET_OVERHEAD_PCT,
        },
        "alpa_plan": {"method": "Manual(dp=1, tp=1)", "cluster": plan.cluster_name,
                      "mesh_shape": list(plan.stages[0].mesh_shape), "plan_s": round(plan_s, 3)},
        "first_call_s": {k: round(v, 3) for k, v in first_call_s.items()},
        "jit": stats["jit"],
        "alpa": stats["alpa"],
        "overhead_pct": round(overhead_pct, 3),
        "overhead_pct_step_median": round(step_overhead_pct, 3),
        "losses_identical": identical,
        "losses_max_abs_diff": max_abs_diff,
        "losses": {k: v.tolist() for k, v in loss_values.items()},
    }
    _common.write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
