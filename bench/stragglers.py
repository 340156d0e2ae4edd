"""Stragglers: the expected step of synchronous all-reduce, of dropping the k slowest replicas
and of gradient coding (`alpa_lite.cost_models.stragglers`), for n = 8, 64 and 512
data-parallel replicas and a few delay models. These are model numbers, not measurements:
the simulator runs on any CPU (here a shared 2-core one) in seconds.

Where the step comes from: GPT-125M (float16, AdamW), `DataParallel()` planned for 8xA100
at 8 sequences per device (`step.plan` on abstract arguments, about a second); its own
step-time breakdown gives T (a replica's step less its gradient sync and optimizer update)
and the update, as `alpa-lite explain --stragglers` reads them (`explain.straggler_inputs`).
Weak scaling: every replica keeps its 8 sequences at 64 and 512 replicas, so T and the update
stay. The all-reduce is `cost_models.gradient_sync`'s dense hierarchical exchange of the
model's gradients over n A100s (n/8 nodes), charged whole after the last awaited replica
(no credit for overlap with the backward, unlike the plan's own estimate).

Delay models: exponential with mean 1, 10 and 100 ms (each replica late by its own draw,
the same whatever its load; T is about 78 ms), and a bimodal measured-style one: 1 replica
in 20 late by 200 ms, the others on time (mean 10 ms; `EmpiricalDelays`, Monte Carlo). The
column "coded s=1, x load" is gradient coding when the exponential part grows with the load
(Lee et al. 2018). Drop-k's rows buy their speed with a gradient of (n-k)/n of the batch
(variance x n/(n-k)); both drop-k and coded are simulated only: SPMD collectives need every device.

    python bench/stragglers.py [--samples 20000] [--out bench/results/stragglers.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (CODE_AT_START, RESULTS_DIR, command_line, machine, now_utc,  # noqa: E402
                     print_table, write_result)

WORKERS = (8, 64, 512)
MEAN_DELAYS_MS = (1.0, 10.0, 100.0)
PER_DEVICE_BATCH = 8
BIMODAL = (0.0,) * 19 + (0.200,)       # 1 in 20 replicas late by 200 ms: mean 10 ms


def plan_inputs():
    """GPT-125M DataParallel on 8xA100: the plan, its `StragglerInputs`, the gradient leaves
    and the planning time."""
    import jax
    import optax

    import alpa_lite as al
    from alpa_lite.cost_models.gradient_sync import GradientLeaf
    from alpa_lite.tools.explain import straggler_inputs
    from alpa_lite.tools.models import gpt

    cfg = dataclasses.replace(gpt.CONFIGS["125M"], dtype="float16")
    tx = optax.adamw(1e-4)
    cluster = al.Cluster.preset("8xA100")
    args = gpt.abstract_args(cfg, PER_DEVICE_BATCH * cluster.num_devices, tx)
    t0 = time.perf_counter()
    plan = al.parallelize(gpt.make_train_step(cfg, tx), method=al.DataParallel()).plan(
        *args, cluster=cluster)
    plan_s = time.perf_counter() - t0
    leaves = [GradientLeaf(tuple(x.shape), x.dtype.itemsize) for x in jax.tree.leaves(args[0])]
    return plan, straggler_inputs(plan), leaves, plan_s


def all_reduce_s(n: int, leaves) -> float:
    """The dense gradient exchange over n A100s, by `cost_models.gradient_sync`."""
    import alpa_lite as al
    from alpa_lite.compression import Dense
    from alpa_lite.cost_models.gradient_sync import gradient_sync
    cluster = al.Cluster.of_gpus("A100", num_nodes=n // 8)
    return gradient_sync(cluster, leaves, Dense(), "float16").total_s


def main(argv=None) -> None:
    from alpa_lite.cost_models.stragglers import (EmpiricalDelays, ShiftedExponential,
                                                  StragglerPolicy, StragglerScheme,
                                                  default_schemes, expected_step_times)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20_000, help="Monte Carlo draws")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "stragglers.json")
    args = parser.parse_args(argv)

    plan, inp, leaves, plan_s = plan_inputs()
    models = [(f"exp {m:g} ms", ShiftedExponential(m * 1e-3)) for m in MEAN_DELAYS_MS]
    models.append(("1 in 20 late 200 ms", EmpiricalDelays(BIMODAL, source="bimodal")))
    rows, table = [], []
    t0 = time.perf_counter()
    for n in WORKERS:
        sync = all_reduce_s(n, leaves)
        schemes = default_schemes(n)
        for label, model in models:
            est = expected_step_times(n, inp.compute_s, sync, model, schemes,
                                      fixed_s=inp.fixed_s, samples=args.samples, seed=0)
            scaled = None
            if isinstance(model, ShiftedExponential):
                scaled = expected_step_times(
                    n, inp.compute_s, sync, dataclasses.replace(model, scales_with_load=True),
                    (StragglerScheme(StragglerPolicy.CODED, 1),), fixed_s=inp.fixed_s,
                    samples=args.samples, seed=0)[0]
            base = est[0].expected_step_s
            worst = max((abs(e.monte_carlo_s - e.closed_form_s) / e.monte_carlo_stderr_s
                         for e in est if e.closed_form_s is not None
                         and e.monte_carlo_stderr_s > 0), default=None)
            by = {e.scheme.label: e for e in est}
            # The fastest of the policies whose gradient is the full batch's (sync, coded):
            # drop-k is faster still, with a smaller batch's gradient.
            best = min((e for e in est if e.scheme.policy is not StragglerPolicy.DROP_SLOWEST),
                       key=lambda e: e.expected_step_s)
            rows.append({
                "workers": n, "delay_model": label, "all_reduce_s": sync,
                "policies": [{"policy": e.scheme.policy.value, "k": e.scheme.k,
                              "expected_step_s": e.expected_step_s,
                              "closed_form_s": e.closed_form_s,
                              "monte_carlo_s": e.monte_carlo_s,
                              "monte_carlo_stderr_s": e.monte_carlo_stderr_s,
                              "gradient_scale": e.gradient_scale,
                              "extra_compute_s": e.extra_compute_s} for e in est],
                "coded_s1_delay_scaled_with_load_s":
                    None if scaled is None else scaled.expected_step_s,
                "fastest_exact": best.scheme.label,
                "monte_carlo_max_stderrs_from_closed_form": worst})

            def cell(key: str) -> str:
                e = by.get(key)
                return "-" if e is None else \
                    f"{e.expected_step_s * 1e3:.1f} ({e.expected_step_s / base:.2f}x)"
            k8 = n // 8
            table.append([str(n), label, f"{sync * 1e3:.2f}", f"{base * 1e3:.1f}",
                          cell("drop 1 slowest"), cell("drop 2 slowest"),
                          cell(f"drop {k8} slowest") if k8 > 2 else "-",
                          cell("coded, s=1"), cell("coded, s=2"),
                          "-" if scaled is None else
                          f"{scaled.expected_step_s * 1e3:.1f} "
                          f"({scaled.expected_step_s / base:.2f}x)",
                          best.scheme.label, "-" if worst is None else f"{worst:.1f}"])
    sim_s = time.perf_counter() - t0
    print_table(
        f"Expected step (ms, and vs sync) of GPT-125M data parallel on A100s, 8 sequences per "
        f"replica: T = {inp.compute_s * 1e3:.1f} ms, update {inp.fixed_s * 1e3:.1f} ms (the "
        f"8xA100 plan); all-reduce by the cost model",
        [("n", "right"), ("delays", "left"), ("all-reduce ms", "right"), ("sync", "right"),
         ("drop 1", "right"), ("drop 2", "right"), ("drop n/8", "right"),
         ("coded s=1", "right"), ("coded s=2", "right"), ("coded s=1, x load", "right"),
         ("fastest exact", "left"), ("MC |dev|/se", "right")],
        table,
        caption=f"Model numbers on a 2-core CPU ({args.samples} Monte Carlo draws, seed 0; "
                f"simulation {sim_s:.1f} s, planning {plan_s:.1f} s). MC |dev|/se: the "
                "largest distance of a Monte Carlo mean from its closed form, in standard "
                "errors. fastest exact: of the policies whose gradient is the whole batch's "
                "(sync, coded). drop-k and coded are simulated only (SPMD collectives need "
                "every device); drop-k's gradient covers (n-k)/n of the batch.")
    write_result(args.out, {
        "benchmark": "stragglers", "command": command_line(), "when": now_utc(),
        "machine": machine(), **CODE_AT_START,
        "note": "model numbers (cost_models.stragglers), not measurements",
        "plan": {"model": "GPT-125M float16 AdamW", "method": "DataParallel()",
                 "cluster": plan.cluster_name, "global_batch": PER_DEVICE_BATCH * 8,
                 "step_time_s": plan.step_time_s, "compute_s": inp.compute_s,
                 "exposed_sync_s": inp.sync_s, "update_s": inp.fixed_s,
                 "replicas": inp.num_workers, "plan_s": round(plan_s, 2)},
        "samples": args.samples, "seed": 0, "rows": rows})


if __name__ == "__main__":
    main()
