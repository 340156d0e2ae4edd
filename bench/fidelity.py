"""Cost-model fidelity: each plan's estimated step time beside its measured one.

CPU mode (default; 8 virtual CPU devices on this machine): calibrate the local devices with
`alpa_lite.tools.calibrate.calibrate` (matmul efficiency curve, per-matmul overhead, memory
bandwidth, the intra-process all-reduce link), then plan a small GPT (examples/gpt.py; the
`--hidden/--layers/--seq/--vocab/--batch-size` knobs, default H=128, L=2, T=64, V=512,
batch 16, float32: 10-100 ms per step here) every way of `cpu_methods` for the calibrated
cluster, run each plan, and compare:

- `plan.step_time_s`, the estimate `alpa-lite compare` ranks by, for the calibrated cluster
  and for the nominal `Cluster.local()` (the same method planned for it: "nominal est.");
- the measured median step time of `--rounds` rounds, every plan timed once per round in
  turn, so a change in machine load hits all plans alike; the coefficient of variation
  (CV) of its steps;
- error = estimate / measured - 1, and Spearman's rank correlation between estimates and
  measurements over the plans (does the estimate rank the plans in the measured order?);
- for single-stage plans, the collectives the plan predicts beside those in the compiled
  HLO (`alpa_lite.runtime.hlo.collectives_in_hlo`): the count the runtime actually runs.

Two controls are timed in every round with the plans, to tell cost-model error from the
machine (other work on a shared 2-core machine slows everything it overlaps):

- a probe: a chain of 8 matmuls of 256 x 128 x 512 per device on all devices (the
  calibration's own kind of measurement), its time per matmul beside the calibrated
  model's price for it (`compute_time`): probe ratio = measured / model, ~1 when the
  machine is as it was during calibration;
- the same train step under plain `jax.jit`, parameters replicated and the batch split
  over the devices (the data-parallel layout without alpa_lite's runtime).

H100 block point (every run, and alone with `--h100-block-only`; no GPU needed): the
published plain-jit measurement of one transformer block's gradient step on one H100
(/work/shared/data/h100_jax_probe.json, HARDWARE.md: batch 8, seq 2048, hidden 2048, 16
heads, naive attention, bfloat16; 13.75 ms, model FLOPs 5.77e12 = the block's forward +
backward) beside the estimate for the same block (`examples/gpt.py` pieces, a loss over the
block output, gradients of the block's parameters) planned DataParallel on the `1xH100`
preset (its matmul curve, element-wise bandwidth and kernel launch cost come from
micro-benchmarks, `cost_models/devices.py`; this measurement is not among them). One
device: only the compute model is tested. The model FLOPs are checked against the probe's
before the estimate is reported. Beside it, the same graph priced per traced equation (every
operand and result through memory, the pricing before fused kernels) and per fused kernel
(`alpa_lite.planning.fusion`, what the planner charges).

GPU mode (`--device gpu`, for the lent H100; it cannot run on this machine): one device,
plans that differ in batch size, micro-batch count and recomputation (`gpu_methods`) for
GPT-125M (bf16, seq 1024), priced on the calibrated H100 cluster
(`bench/results/calibrated_1xH100.json` from bench/calibrate_h100.py, or `--calibrate` to
measure the device live), compared per sample (step time / batch) so that plans of
different batch sizes rank on one scale. The GPU machine has no PuLP (HARDWARE.md): carry
its wheel, as the device README says, since every plan solves an intra-op ILP.

Run:
    python bench/fidelity.py                      # CPU: ~3 min on 2 cores
    python bench/fidelity.py --quick              # quick calibration, 3 rounds
    python bench/fidelity.py --device gpu         # on the H100 machine
    python bench/fidelity.py --h100-block-only    # the H100 block point alone (~10 s)
Writes bench/results/fidelity_cpu.json (GPU: fidelity_gpu.json; ``--out`` to change).
"""

from __future__ import annotations

import argparse
import os
import sys

# The device count must be set before jax is imported: parse --device first.
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
_DEVICE = _pre.parse_known_args()[0].device
if _DEVICE == "cpu":
    # 8 virtual CPU devices (tests/conftest.py does the same), unless the caller chose.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.use_examples()

import gpt  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from alpa_lite.cost_models.cluster import Cluster  # noqa: E402
from alpa_lite.runtime.hlo import collectives_in_hlo  # noqa: E402
from alpa_lite.tools.calibrate import calibrate, matmul_chain  # noqa: E402

H100_CLUSTER = _common.RESULTS_DIR / "calibrated_1xH100.json"
# Published plain-jit block measurement (module docstring); bench/data/README.md.
H100_PROBE = Path(__file__).resolve().parent / "data" / "h100_jax_probe.json"
# The probe's block (HARDWARE.md): batch 8, seq 2048, hidden 2048, 16 heads, bfloat16.
H100_BLOCK = dict(batch=8, seq=2048, hidden=2048, heads=16, dtype="bfloat16")


def h100_block_point() -> dict:
    """The H100 block point of the module docstring: estimate vs the published 13.75 ms."""
    import json

    import jax.numpy as jnp
    probe = json.loads(H100_PROBE.read_text())
    b, t, h = H100_BLOCK["batch"], H100_BLOCK["seq"], H100_BLOCK["hidden"]
    dtype = jnp.dtype(H100_BLOCK["dtype"])
    cfg = gpt.Config(vocab_size=1024, seq_len=t, hidden=h, num_layers=1,
                     num_heads=H100_BLOCK["heads"], dtype=H100_BLOCK["dtype"])
    block_params = jax.eval_shape(lambda k: gpt.init_params(cfg, k)["blocks"][0],
                                  jax.random.key(0))

    def block(p, x):                  # one GPT block, pre-LN, as gpt.forward's loop body
        x = x + gpt.causal_self_attention(p["attn"], gpt.layer_norm(p["ln_1"], x), cfg.num_heads)
        return x + gpt.mlp(p["mlp"], gpt.layer_norm(p["ln_2"], x))

    def loss(p, x):                   # a scalar over the block output: forward + backward
        return jnp.mean(jnp.square(block(p, x).astype(jnp.float32)))

    def grad_step(params, x):
        return al.value_and_grad(loss)(params, x)

    x = jax.ShapeDtypeStruct((b, t, h), dtype)
    cluster = Cluster.preset("1xH100")
    # batch_argnums=(): x is an activation already on the device, as in the probe's
    # plain-jit step; a batch would add its host-to-device copy (67 MB, 2.7 ms) to the
    # estimate, which the measurement does not contain.
    step = al.parallelize(grad_step, method=al.DataParallel(), cluster=cluster,
                          batch_argnums=())
    plan = step.plan(block_params, x, cluster=cluster)
    graph = step.trace(block_params, x).graph
    matmul_flops = sum(n.flops for n in graph.nodes if n.primitive == "dot_general")
    if abs(matmul_flops / probe["model_flops"] - 1) > 0.01:
        raise ValueError(f"the block's matmul FLOPs {matmul_flops:.4g} do not match the "
                         f"probe's model FLOPs {probe['model_flops']:.4g}: check the sizes")
    measured = probe["block_step_s"]
    fusion = fusion_diagnostic(graph, cluster)
    return {"source": str(H100_PROBE.relative_to(_common.REPO_ROOT)),
            "cluster": cluster.name, "block": H100_BLOCK,
            "loss": "mean(square(block(x))) in float32; gradients of the block parameters",
            "matmul_flops": matmul_flops, "probe_model_flops": probe["model_flops"],
            "graph_nodes": len(graph.nodes),
            "estimated_s": plan.step_time_s, "estimated_compute_s": plan.compute_s,
            "measured_s": measured, "error": plan.step_time_s / measured - 1.0,
            "fusion_analysis": dict(fusion, error=fusion["fused_s"] / measured - 1.0)}


def fusion_diagnostic(graph, cluster: Cluster) -> dict:
    """One device's step priced two ways from the same graph: per traced equation (each
    pays all its operand and result bytes and no launch: the pricing before fused kernels)
    and per fused kernel (`alpa_lite.planning.fusion.fuse`'s traffic, and the device's
    launch cost per kernel: what the planner charges, unsharded)."""
    from alpa_lite.cost_models.compute import compute_time
    from alpa_lite.planning.fusion import fuse
    from alpa_lite.planning.strategies import MATMUL, node_compute_time
    fused = fuse(graph, row_reductions_fuse=cluster.platform != "cpu")
    dev = cluster.device
    per_eq = fused_s = 0.0
    for n in graph.nodes:
        dtype = graph.tensors[n.outputs[0]].dtype if n.outputs else "float32"
        per_eq += compute_time(n.flops, n.bytes_accessed, dev, dtype, n.primitive in MATMUL)
        fused_s += node_compute_time(n, fused, dev, dtype)
    return {"per_equation_s": per_eq, "fused_s": fused_s,
            "per_equation_bytes": sum(n.bytes_accessed for n in graph.nodes),
            "fused_bytes": sum(fused.bytes_accessed), "elementwise_kernels": fused.num_kernels,
            "kernel_overhead_s": dev.op_overhead_s}


def print_h100_block(r: dict) -> None:
    print(f"H100 block point ({r['cluster']}): estimated {r['estimated_s'] * 1e3:.2f} ms vs "
          f"measured {r['measured_s'] * 1e3:.2f} ms (plain jit), error {r['error']:+.0%}; "
          f"matmul FLOPs {r['matmul_flops']:.4g} (probe {r['probe_model_flops']:.4g})",
          flush=True)
    f = r["fusion_analysis"]
    print(f"  the same graph per fused kernel: {f['fused_s'] * 1e3:.2f} ms "
          f"({f['elementwise_kernels']} element-wise kernels x "
          f"{f['kernel_overhead_s'] * 1e6:.1f} us, {f['fused_bytes'] / 1e9:.1f} GB moved); "
          f"per traced equation (the pricing before fused kernels): "
          f"{f['per_equation_s'] * 1e3:.2f} ms ({f['per_equation_bytes'] / 1e9:.1f} GB), "
          f"error {f['per_equation_s'] / r['measured_s'] - 1:+.0%}", flush=True)


def cpu_methods() -> list[tuple[str, Any]]:
    """The multi-device plans compared on 8 CPU devices."""
    M = al.Manual
    return [
        ("DataParallel dp8", al.DataParallel()),
        ("ZeRO dp8", al.DataParallel(shard_optimizer_state=True)),
        ("dp4 tp2", M(dp=4, tp=2)),
        ("dp2 tp4", M(dp=2, tp=4)),
        ("dp1 tp8", M(dp=1, tp=8)),
        ("dp4 pp2 m2", M(dp=4, pp=2, num_micro_batches=2)),
        ("dp4 pp2 m4", M(dp=4, pp=2, num_micro_batches=4)),
        ("dp4 pp2 m4 remat", M(dp=4, pp=2, num_micro_batches=4, remat=True)),
        ("dp2 tp2 pp2 m2", M(dp=2, tp=2, pp=2, num_micro_batches=2)),
        ("Auto", al.Auto(pipeline=False)),   # one SPMD stage, as these rows were measured
    ]


def gpu_methods(batch_sizes: tuple[int, ...]) -> list[tuple[str, int, Any]]:
    """Single-device plan choices: (label, batch size, method)."""
    out = []
    for b in batch_sizes:
        out.append((f"B{b} m1", b, al.Manual(dp=1, tp=1)))
        for m in (2, 4, 8):
            if b % m:
                continue
            for remat in (False, True):
                out.append((f"B{b} m{m}{' remat' if remat else ''}", b,
                            al.Manual(dp=1, tp=1, num_micro_batches=m, remat=remat)))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):         # average the ranks of ties
            r[x == v] = r[x == v].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclasses.dataclass
class Case:
    label: str
    method: Any
    step: Any                       # the ParallelizedStep, planned for the calibrated cluster
    args: tuple
    batch: int
    plan: Any
    nominal_est_s: float | None
    times_s: list[float] = dataclasses.field(default_factory=list)
    compile_s: float = 0.0
    collectives: dict | None = None


def build_case(label, method, train_step, args, batch, cluster, nominal) -> Case:
    step = al.parallelize(train_step, method=method, cluster=cluster)
    plan = step.plan(*args, cluster=cluster)
    nominal_est = None
    if nominal is not None:
        nominal_est = al.parallelize(train_step, method=method).plan(
            *args, cluster=nominal).step_time_s
    # Placed once where the plan wants them, as a training loop holds them (each step's
    # results are the next step's arguments), and as the plain-jit control is timed.
    args = jax.device_put(args, step.input_shardings(*args))
    case = Case(label, method, step, args, batch, plan, nominal_est)
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))          # compiles
    case.compile_s = time.perf_counter() - t0
    jax.block_until_ready(step(*args))          # warm-up
    if plan.pipeline is None and plan.compression is None:
        hlo = step.compile(*args).compiled_text(*args)
        compiled = collectives_in_hlo(hlo)
        case.collectives = {
            "planned": sum(c.count for st in plan.stages for c in st.collectives),
            "compiled": len(compiled),
            "compiled_tensors": sum(c.num_results for c in compiled)}
    return case


PROBE_SHAPE = (256, 128, 512)  # per device; a size the calibration sweep also times
PROBE_CHAIN = 8


def make_probe(cluster: Cluster):
    """(call, model seconds per matmul): the probe of the module docstring."""
    from jax.sharding import Mesh

    from alpa_lite.cost_models.compute import compute_time
    m, k, n = PROBE_SHAPE
    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    fn, args = matmul_chain(mesh, PROBE_SHAPE, np.float32, PROBE_CHAIN)
    jax.block_until_ready(fn(*args))
    nbytes = 4 * (m * k + k * n + m * n)
    model_s = compute_time(2.0 * m * k * n, nbytes, cluster.device, "float32", True)
    return (lambda: jax.block_until_ready(fn(*args))), model_s


def time_rounds(cases: list[Case], rounds: int, controls: dict) -> dict:
    """Each round times one step of every case and every control, in turn (module
    docstring); returns the controls' times."""
    times = {name: [] for name in controls}
    for r in range(rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        for c in order:
            t0 = time.perf_counter()
            jax.block_until_ready(c.step(*c.args))
            c.times_s.append(time.perf_counter() - t0)
        for name, call in controls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return times


def plain_jit_step(train_step, args):
    """The step under jax.jit, parameters and optimizer state replicated, batch split."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params, opt_state, batch = args
    rep_, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    placed = (jax.device_put(params, rep_), jax.device_put(opt_state, rep_),
              jax.device_put(batch, split))
    fn = jax.jit(train_step)
    jax.block_until_ready(fn(*placed))
    jax.block_until_ready(fn(*placed))
    return lambda: jax.block_until_ready(fn(*placed))


def summarise(cases: list[Case], per_sample: bool) -> tuple[list[dict], dict]:
    rows = []
    for c in cases:
        med = statistics.median(c.times_s)
        est = c.plan.step_time_s
        comm = sum(st.comm_s for st in c.plan.stages)
        rows.append({
            "plan": c.label, "method": repr(c.method), "batch": c.batch,
            "stages": len(c.plan.stages),
            "mesh": [list(st.mesh_shape) for st in c.plan.stages],
            "estimated_s": est, "estimated_compute_s": c.plan.compute_s,
            "estimated_comm_s": comm,
            "nominal_estimated_s": c.nominal_est_s,
            "measured_median_s": med, "measured_min_s": min(c.times_s),
            "measured_cv": statistics.pstdev(c.times_s) / med,
            "times_s": c.times_s, "compile_s": c.compile_s,
            "error": est / med - 1.0,
            "nominal_error": None if c.nominal_est_s is None else c.nominal_est_s / med - 1.0,
            "collectives": c.collectives})
    scale = [1.0 / r["batch"] if per_sample else 1.0 for r in rows]
    est = [r["estimated_s"] * s for r, s in zip(rows, scale)]
    meas = [r["measured_median_s"] * s for r, s in zip(rows, scale)]
    errs = [abs(r["error"]) for r in rows]
    summary = {
        "compared_per": "sample" if per_sample else "step",
        "spearman_calibrated": spearman(est, meas),
        "median_abs_error_calibrated": statistics.median(errs),
        "mean_measured_cv": statistics.mean(r["measured_cv"] for r in rows),
        "best_measured": rows[int(np.argmin(meas))]["plan"],
        "best_estimated": rows[int(np.argmin(est))]["plan"]}
    if all(r["nominal_estimated_s"] is not None for r in rows):
        nom = [r["nominal_estimated_s"] * s for r, s in zip(rows, scale)]
        summary["spearman_nominal"] = spearman(nom, meas)
        summary["median_abs_error_nominal"] = statistics.median(
            abs(r["nominal_error"]) for r in rows)
    return rows, summary


def print_rows(title: str, rows: list[dict], summary: dict) -> None:
    def ms(s):
        return "-" if s is None else f"{s * 1e3:.1f}"
    table = []
    for r in rows:
        coll = r["collectives"]
        table.append([r["plan"], str(r["batch"]), ms(r["estimated_s"]),
                      f"{ms(r['estimated_compute_s'])} / {ms(r['estimated_comm_s'])}",
                      ms(r["measured_median_s"]), f"{r['measured_cv']:.2f}",
                      f"{r['error']:+.0%}", ms(r["nominal_estimated_s"]),
                      "-" if r["nominal_error"] is None else f"{r['nominal_error']:+.0%}",
                      "-" if coll is None else f"{coll['planned']} / {coll['compiled']}"])
    caption = (f"Spearman (estimate vs measured, per {summary['compared_per']}): calibrated "
               f"{summary['spearman_calibrated']:.2f}"
               + (f", nominal {summary['spearman_nominal']:.2f}"
                  if "spearman_nominal" in summary else "")
               + f"; median |error| calibrated {summary['median_abs_error_calibrated']:.0%}"
               + (f", nominal {summary['median_abs_error_nominal']:.0%}"
                  if "median_abs_error_nominal" in summary else "")
               + f"; fastest measured {summary['best_measured']}, estimated "
                 f"{summary['best_estimated']}")
    if "probe" in summary:
        pr, pj = summary["probe"], summary["plain_jit_dp"]
        caption += (f"\ncontrols: probe matmul {'x'.join(map(str, pr['shape_per_device']))} "
                    f"per device: model {pr['model_s'] * 1e6:.0f} us, measured during the "
                    f"rounds {pr['measured_median_s'] * 1e6:.0f} us (ratio "
                    f"{pr['ratio_measured_over_model']:.2f}); plain jax.jit DP step "
                    f"{pj['measured_median_s'] * 1e3:.1f} ms (CV {pj['measured_cv']:.2f})")
    _common.print_table(title, [
        ("plan", "left"), ("batch", "right"), ("est. ms", "right"),
        ("est. compute / comm ms", "right"), ("measured ms", "right"), ("CV", "right"),
        ("error", "right"), ("nominal est. ms", "right"), ("nominal error", "right"),
        ("collectives planned / compiled", "right")], table, caption)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="quick calibration and 3 rounds")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed steps per plan (default 9; --quick 3)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16, help="CPU mode's global batch")
    ap.add_argument("--gpu-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--cluster", type=Path, default=None,
                    help="a calibrated cluster JSON (GPU default: " f"{H100_CLUSTER.name})")
    ap.add_argument("--calibrate", action="store_true",
                    help="GPU mode: calibrate the device live instead of loading --cluster")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--h100-block-only", action="store_true",
                    help="only the H100 block point (printed and written to --out, default "
                         "fidelity_h100_block.json)")
    args = ap.parse_args()
    if args.h100_block_only:
        r = h100_block_point()
        print_h100_block(r)
        out = args.out or _common.RESULTS_DIR / "fidelity_h100_block.json"
        _common.write_result(out, {"benchmark": "fidelity_h100_block",
                                   "command": _common.command_line(), "date": _common.now_utc(),
                                   "code": _common.CODE_AT_START, "h100_block": r})
        print(f"wrote {out}")
        return
    rounds = args.rounds or (3 if args.quick else 9)
    tx = optax.adamw(1e-3)
    started = time.perf_counter()

    calibration = None
    if args.device == "cpu":
        if args.cluster is not None:
            cluster = Cluster.from_json(args.cluster.read_text())
        else:
            cluster, report = calibrate(quick=args.quick)
            calibration = report.to_dict()
        cfg = gpt.Config(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
                         num_layers=args.layers, num_heads=args.heads, dtype="float32",
                         batch_size=args.batch_size)
        plans = [(label, args.batch_size, m) for label, m in cpu_methods()]
        nominal = Cluster.local()
    else:
        if args.calibrate:
            cluster, report = calibrate(quick=args.quick)
            calibration = report.to_dict()
        else:
            cluster = Cluster.from_json((args.cluster or H100_CLUSTER).read_text())
        cfg = gpt.CONFIGS["125M"]
        plans = gpu_methods(tuple(args.gpu_batch_sizes))
        nominal = Cluster.local()
    print(f"{cluster.name}: {cluster.num_devices} x {cluster.device.name}; GPT H={cfg.hidden} "
          f"L={cfg.num_layers} T={cfg.seq_len} V={cfg.vocab_size} {cfg.dtype}; "
          f"{len(plans)} plans, {rounds} rounds", flush=True)

    train_step = gpt.make_train_step(cfg, tx)
    params = gpt.init_params(cfg, jax.random.key(0))
    opt_state = tx.init(params)
    batches = {}
    cases, refused = [], []
    for label, batch, method in plans:
        if batch not in batches:
            batches[batch] = gpt.make_batch(cfg, batch, jax.random.key(batch))
        try:
            case = build_case(label, method, train_step, (params, opt_state, batches[batch]),
                              batch, cluster, nominal)
        except (al.PlanningError, ValueError) as e:
            refused.append({"plan": label, "error": " ".join(str(e).split())})
            print(f"  {label}: no plan ({refused[-1]['error'][:200]})", flush=True)
            continue
        cases.append(case)
        print(f"  {label}: estimated {case.plan.step_time_s * 1e3:.1f} ms, compiled in "
              f"{case.compile_s:.1f} s", flush=True)
    probe, probe_model_s = make_probe(cluster) if args.device == "cpu" else (None, None)
    controls = {}
    if probe is not None:
        controls["probe"] = probe
        controls["plain jax.jit DP"] = plain_jit_step(
            train_step, (params, opt_state, batches[args.batch_size]))
    control_times = time_rounds(cases, rounds, controls)
    rows, summary = summarise(cases, per_sample=args.device == "gpu")
    if probe is not None:
        # Per matmul: (call - dispatch) / chain, the calibration's own arithmetic.
        dispatch_s = calibration["dispatch_s"] if calibration else 0.0
        per_op = [(t - dispatch_s) / PROBE_CHAIN for t in control_times["probe"]]
        jit_times = control_times["plain jax.jit DP"]
        summary["probe"] = {
            "shape_per_device": list(PROBE_SHAPE), "chain": PROBE_CHAIN,
            "model_s": probe_model_s, "measured_median_s": statistics.median(per_op),
            "ratio_measured_over_model": statistics.median(per_op) / probe_model_s,
            "per_round_s": per_op}
        summary["plain_jit_dp"] = {"measured_median_s": statistics.median(jit_times),
                                   "measured_cv": statistics.pstdev(jit_times)
                                   / statistics.median(jit_times), "times_s": jit_times}
    print_rows(f"Estimated vs measured step time: GPT on {cluster.name} "
               f"({jax.device_count()} x {jax.devices()[0].device_kind})", rows, summary)
    summary["h100_block"] = h100_block_point()
    print_h100_block(summary["h100_block"])
    out = args.out or _common.RESULTS_DIR / f"fidelity_{args.device}.json"
    _common.write_result(out, {
        "benchmark": "fidelity", "command": _common.command_line(), "date": _common.now_utc(),
        "machine": _common.machine(), "code": _common.CODE_AT_START,
        "settings": {"device": args.device, "rounds": rounds, "quick": args.quick,
                     "gpt": dataclasses.asdict(cfg), "optimizer": "optax.adamw(1e-3)"},
        "cluster": json_cluster(cluster), "calibration": calibration,
        "summary": summary, "plans": rows, "refused": refused,
        "elapsed_s": time.perf_counter() - started})
    print(f"wrote {out}")


def json_cluster(cluster: Cluster) -> dict:
    import json
    return json.loads(cluster.to_json())


if __name__ == "__main__":
    main()
