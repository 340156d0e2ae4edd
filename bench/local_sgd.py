"""Local SGD against synchronous SGD at equal (simulated) wall-clock on a slow link.

8 data-parallel workers (the 8 virtual CPU devices) train the digits MLP of
bench/compression_convergence.py (its data, model and batch stream are imported, not
copied: 1438 training / 359 test images, MLP 64-128-10, batches of 128 = 16 per worker,
mean cross-entropy) with SGD, momentum 0.9 and a constant learning rate (0.1: the schedule
of compression_convergence.py decays over a fixed step count, and here each method takes as
many steps as fit in the time budget).

Methods, each `al.parallelize(step, method=al.DataParallel(), compression=...)`:
- sync SGD: `Dense()`, the exact all-reduce of the gradients every step;
- local SGD H = 4 and H = 16: `LocalSGD(every=H)`, parameters averaged exactly;
- post-local SGD: `LocalSGD(every=16, warmup_steps=W)`, W synchronous steps first, W the
  number of synchronous steps that fill `--warmup-fraction` (25%) of the budget;
- local SGD H = 4 with the delta since the last average compressed: top-k 1% (error
  feedback) and PowerSGD rank 2.

Simulated time. The training runs on the CPU devices; its clock is simulated from the plan
of the same step for a slow-link cluster: 8 nodes of one V100 each, joined by a
`--gbps` (1 Gbit/s) link with `--latency-us` (100 us) per message. Per step:
- compute: `plan.compression.compute_s`, the cost model's estimate of the step on a V100
  for one worker's 16 examples (not measured: the CPU devices say nothing about a V100);
- plus the exchange the step makes, from the plan: sync SGD every step
  (`compression.sync_s`); local SGD only on an averaging step, one average
  (`compression.sync_s` x H: the plan amortizes it over H steps); a warm-up step the exact
  gradient all-reduce (`compression.dense_sync_s`).
Accuracy is measured on the test set after every step whose parameters all workers agree
on (every synchronous step, every averaging step): the model a job would checkpoint.

Budget: the simulated time sync SGD takes for `--sync-steps` (150) steps; every method
trains until its next step would pass it. Reported per method over `--seeds` (3) seeds
(a seed sets the initialisation and the batch order; the runtime's random choices repeat):
the test accuracy of the last agreed model within the budget, and the simulated time to
first reach each of `--targets` (95% and 97%) test accuracy (resolution: one evaluation
interval; a mean only when every seed reached it).

Run (2 shared CPU cores):
    python bench/local_sgd.py            # 3 seeds (~2 min)
    python bench/local_sgd.py --quick    # 1 seed, budget of 60 sync steps
Writes bench/results/local_sgd.json (--quick: local_sgd_quick.json; --out to change).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Sets XLA_FLAGS to 8 virtual CPU devices before jax is imported.
import compression_convergence as cc  # noqa: E402, I001

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from alpa_lite import compression as C  # noqa: E402
from alpa_lite.cost_models import DEVICES, Cluster, LinkSpec  # noqa: E402

LR, MOMENTUM = 0.1, 0.9
SYNC_STEPS, QUICK_SYNC_STEPS = 150, 60
SEEDS = 3
TARGETS_PCT = (95.0, 97.0)
WARMUP_FRACTION = 0.25


def slow_cluster(gbps: float, latency_us: float) -> Cluster:
    """8 nodes of one V100 joined by a `gbps` link of `latency_us` per message."""
    v100 = Cluster.of_gpus("V100", 1, 1)
    link = LinkSpec(f"eth-{gbps:g}gbit", gbps * 1e9 / 8, latency_us * 1e-6)
    return Cluster(name=f"8x1xV100-{gbps:g}gbit-{latency_us:g}us", device=DEVICES["V100"],
                   num_nodes=8, devices_per_node=1, intra_node=v100.intra_node,
                   inter_node=link)


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    compression: Any            # Dense() or a LocalSGD setting


def methods(warmup_steps: int) -> list[Method]:
    return [
        Method("sync SGD", C.Dense()),
        Method("local SGD H=4", C.LocalSGD(every=4)),
        Method("local SGD H=16", C.LocalSGD(every=16)),
        Method(f"post-local H=16 (W={warmup_steps})",
               C.LocalSGD(every=16, warmup_steps=warmup_steps)),
        Method("local H=4, top-k 1% delta", C.LocalSGD(every=4, compressor=C.TopK(0.01))),
        Method("local H=4, PowerSGD r2 delta",
               C.LocalSGD(every=4, compressor=C.PowerSGD(rank=2))),
    ]


@dataclasses.dataclass(frozen=True)
class Clock:
    """Simulated seconds of each kind of step, from the plan (module docstring)."""
    compute_s: float
    sync_step_s: float          # a step that exchanges its gradients (sync, warm-up)
    average_s: float            # local SGD: one parameter average (0 for sync SGD)
    amortized_step_s: float     # the plan's step time (local SGD: after warm-up)

    def step_s(self, method, t: int) -> float:
        if not isinstance(method, C.LocalSGD) or method.is_warmup(t):
            return self.sync_step_s
        return self.compute_s + (self.average_s if method.averages_at(t) else 0.0)


def clock_of(spec, method) -> Clock:
    if isinstance(method, C.LocalSGD):
        return Clock(spec.compute_s, spec.compute_s + spec.dense_sync_s,
                     spec.sync_s * method.every, spec.step_time_s)
    return Clock(spec.compute_s, spec.step_time_s, 0.0, spec.step_time_s)


def agreed(method, t: int) -> bool:
    """Whether every worker holds the same parameters after step t."""
    return not isinstance(method, C.LocalSGD) or method.is_warmup(t) or method.averages_at(t)


def run_method(method: Method, step, clock: Clock, budget_s: float, seeds: list[int],
               data, targets: list[float]) -> dict[str, Any]:
    init, apply = cc.MODELS["mlp"]
    tx = optax.sgd(LR, momentum=MOMENTUM)
    forward = jax.jit(apply)

    def accuracy(params) -> float:
        host = jax.device_get(params)
        return float(np.mean(np.argmax(np.asarray(forward(host, data["x_test"])), -1)
                             == data["y_test"])) * 100

    # Enough batches for the cheapest step kind to fill the budget.
    max_steps = int(budget_s / clock.compute_s) + 1
    runs = []
    for seed in seeds:
        step.reset_compression_state(seed=0)    # step count 0; the runtime's keys repeat
        params = init(jax.random.key(seed))
        opt_state = tx.init(params)
        curve = [(0.0, 0, accuracy(params))]
        now, t, t0 = 0.0, 0, time.perf_counter()
        for idx in cc.batches(seed, cc.TRAIN_SIZE, max_steps):
            dt = clock.step_s(method.compression, t)
            if now + dt > budget_s * (1 + 1e-9):       # float sums of equal steps
                break
            params, opt_state, loss = step(params, opt_state,
                                           (data["x_train"][idx], data["y_train"][idx]))
            loss.block_until_ready()
            now += dt
            if agreed(method.compression, t):
                curve.append((now, t + 1, accuracy(params)))
            t += 1
        reached = {f"{g:g}": next(((s, k) for s, k, a in curve if a >= g), None)
                   for g in targets}
        run = {"seed": seed, "steps": t, "accuracy_at_budget": curve[-1][2],
               "time_to_target_s": {g: r[0] if r else None for g, r in reached.items()},
               "steps_to_target": {g: r[1] if r else None for g, r in reached.items()},
               "wall_s": time.perf_counter() - t0,
               "curve": [[round(s, 6), k, round(a, 3)] for s, k, a in curve]}
        runs.append(run)
        hits = ", ".join(f"{g}% at {r[0] * 1e3:.1f} ms (step {r[1]})" if r else
                         f"{g}% not reached" for g, r in reached.items())
        print(f"  {method.label} seed {seed}: {t} steps, {run['accuracy_at_budget']:.2f}% at "
              f"budget; {hits} ({run['wall_s']:.1f} s)", flush=True)
    accs = [r["accuracy_at_budget"] for r in runs]
    out = {"accuracy_mean": statistics.fmean(accs), "accuracy_std": statistics.pstdev(accs),
           "accuracy_min": min(accs), "accuracy_max": max(accs), "runs": runs,
           "reached_target": {}, "time_to_target_mean_s": {}}
    for g in (f"{g:g}" for g in targets):
        times = [r["time_to_target_s"][g] for r in runs]
        out["reached_target"][g] = sum(x is not None for x in times)
        out["time_to_target_mean_s"][g] = (statistics.fmean(times)
                                           if all(x is not None for x in times) else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sync-steps", type=int, default=None,
                    help=f"budget: sync SGD's time for this many steps ({SYNC_STEPS})")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds 0..n-1 ({SEEDS})")
    ap.add_argument("--targets", type=float, nargs="+", default=list(TARGETS_PCT),
                    help="test accuracies to time, %%")
    ap.add_argument("--gbps", type=float, default=1.0, help="link bandwidth, Gbit/s")
    ap.add_argument("--latency-us", type=float, default=100.0, help="per message, us")
    ap.add_argument("--warmup-fraction", type=float, default=WARMUP_FRACTION,
                    help="post-local SGD: share of the budget spent synchronous")
    ap.add_argument("--quick", action="store_true", help="1 seed, a 60-sync-step budget")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sync_steps = a.sync_steps or (QUICK_SYNC_STEPS if a.quick else SYNC_STEPS)
    seeds = list(range(a.seeds or (1 if a.quick else SEEDS)))
    out = a.out or _common.RESULTS_DIR / ("local_sgd_quick.json" if a.quick else
                                          "local_sgd.json")

    data = cc.load_data()
    init, apply = cc.MODELS["mlp"]
    loss_fn = cc.make_loss(apply)
    tx = optax.sgd(LR, momentum=MOMENTUM)

    def train_step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sim = slow_cluster(a.gbps, a.latency_us)
    example = init(jax.random.key(0))
    x0 = (data["x_train"][:cc.BATCH], data["y_train"][:cc.BATCH])

    def planned(compression):
        step = al.parallelize(train_step, method=al.DataParallel(), compression=compression)
        spec = step.plan(example, tx.init(example), x0, cluster=sim).compression
        return step, spec, clock_of(spec, compression)

    sync_step, sync_spec, sync_clock = planned(C.Dense())
    budget_s = sync_steps * sync_clock.sync_step_s
    warmup = round(a.warmup_fraction * sync_steps)
    print(f"cluster {sim.name}: sync step {sync_clock.sync_step_s * 1e3:.3f} ms (compute "
          f"{sync_clock.compute_s * 1e6:.1f} us, cost model); budget {budget_s * 1e3:.1f} ms "
          f"= {sync_steps} sync steps; seeds {seeds}", flush=True)

    rows = []
    t_start = time.perf_counter()
    for m in methods(warmup):
        step, spec, clock = ((sync_step, sync_spec, sync_clock) if m.compression == C.Dense()
                             else planned(m.compression))
        print(f"{m.label}: {spec.description}", flush=True)
        row = {"method": m.label, "config": C.to_config(m.compression),
               "plan_description": spec.description, "compute_s": clock.compute_s,
               "sync_step_s": clock.sync_step_s, "average_s": clock.average_s,
               "planned_step_s": clock.amortized_step_s, "wire_bytes_per_step": spec.wire_bytes,
               "dense_wire_bytes_per_step": spec.dense_wire_bytes}
        row.update(run_method(m, step, clock, budget_s, seeds, data, a.targets))
        rows.append(row)
    goals = [f"{g:g}" for g in a.targets]
    for r in rows:
        r["speedup_to_target"] = {}
        for g in goals:
            base, t = rows[0]["time_to_target_mean_s"][g], r["time_to_target_mean_s"][g]
            r["speedup_to_target"][g] = base / t if base and t else None

    def to_target(r, g) -> str:
        t, x = r["time_to_target_mean_s"][g], r["speedup_to_target"][g]
        if t is None:
            return f"{r['reached_target'][g]}/{len(seeds)} reached"
        return f"{t * 1e3:.1f}" + (f" ({x:.1f}x)" if x else "")

    table = [[r["method"], f"{r['planned_step_s'] * 1e3:.3f}",
              f"{r['average_s'] * 1e3:.3f}" if r["average_s"] else "-",
              f"{statistics.fmean(x['steps'] for x in r['runs']):.0f}",
              f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f}",
              f"{r['accuracy_min']:.2f}..{r['accuracy_max']:.2f}",
              *[to_target(r, g) for g in goals]] for r in rows]
    _common.print_table(
        f"Local SGD vs sync SGD, 8 workers, digits MLP, budget {budget_s * 1e3:.1f} ms simulated "
        f"on {sim.name}",
        [("method", "left"), ("step ms (planned)", "right"), ("one average ms", "right"),
         ("steps in budget", "right"), ("test acc % at budget", "right"),
         ("min..max", "right"),
         *[(f"ms to {g}% (speedup)", "right") for g in goals]],
        table,
        caption=f"simulated time per step = compute {sync_clock.compute_s * 1e6:.1f} us (cost "
                f"model, V100) + the planned exchange that step makes; {len(seeds)} seed(s); "
                f"accuracy of the workers' agreed model")
    _common.write_result(out, {
        "benchmark": "local_sgd", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "config": {"sync_steps": sync_steps, "budget_s": budget_s, "seeds": seeds,
                   "targets_pct": a.targets, "lr": LR, "momentum": MOMENTUM,
                   "batch": cc.BATCH, "workers": cc.WORKERS, "warmup_steps": warmup,
                   "cluster": {"name": sim.name, "gbps": a.gbps, "latency_us": a.latency_us,
                               "device": "V100"}},
        "rows": rows, "wall_s": time.perf_counter() - t_start})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
