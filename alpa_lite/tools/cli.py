"""The `alpa-lite` command line: a thin layer over alpa_lite's Python functions.

    alpa-lite clusters                                   # presets: devices and links
    alpa-lite plan gpt-2.6b --cluster 8xV100 -o plan.json
    alpa-lite plan my_model.py:make_step --cluster cluster.json -o plan.json
    alpa-lite plan --list                                # the built-in models
    alpa-lite show plan.json [--png plan.png]            # tables; pictures
    alpa-lite compare gpt-2.6b --cluster 8xV100          # auto vs the Megatron grid, ranked
    alpa-lite explain plan.json [--op NAME]              # why each stage / sharding
    alpa-lite explain plan.json --stragglers exp:20      # late replicas: sync, drop-k, coded
    alpa-lite calibrate -o mycluster.json [--quick]      # measure the local devices
    alpa-lite launch -n 2 --cpu-devices 4 train.py ...   # N local JAX processes

Each command parses its arguments, calls the function that does the work
(`alpa_lite.tools.targets.load_target`, `ParallelizedStep.plan`, `alpa_lite.tools.compare.compare`,
`alpa_lite.tools.report.show_text`, `alpa_lite.tools.pictures.save`, `alpa_lite.tools.explain`,
`alpa_lite.tools.calibrate.calibrate`) and
prints the result with rich. Exit codes: 0 success; 2 bad usage or input (an unknown model
or preset, a missing or malformed file, a plan for another cluster or version); 1 the
planner found no plan. Errors are one line on stderr, without a traceback.

While planning, a progress display on stderr shows the phases (trace, layer clustering,
intra-op ILPs solved / queued, the stage DP, and for `compare` the plans made) when stderr
is a terminal; `--verbose` prints one line per finished phase instead, for logs.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import threading
import time
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

PROG = "alpa-lite"


class UsageError(ValueError):
    """Bad command-line input: exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (exit 2), without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _stdout() -> Console:
    # At least 150 columns, terminal or pipe: rich would otherwise squeeze the compare table
    # into 80 and cut its numbers short; a narrow terminal wraps the lines instead.
    width = max(150, Console().width if sys.stdout.isatty() else 0)
    return Console(width=width, highlight=False, soft_wrap=False)


# ---- progress ------------------------------------------------------------------------------


class _ProgressDisplay:
    """A `progress(phase, done, total)` callback drawn on stderr: a live rich display on a
    terminal, one line per finished phase with --verbose, nothing otherwise."""

    def __init__(self, verbose: bool):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        self.live = None
        self.verbose = verbose
        self.lock = threading.Lock()
        self.tasks: dict[str, int] = {}
        self.last: tuple[str, int, int] | None = None
        self.t0 = time.perf_counter()
        err = Console(stderr=True)
        if err.is_terminal:
            # Elapsed, then the time left in the phase at its pace so far (a phase
            # whose total grows as it goes, such as the intra-op ILPs, re-estimates).
            self.live = Progress(SpinnerColumn(), TextColumn("{task.description:<16}"),
                                 BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("left"), TimeRemainingColumn(),
                                 console=err, transient=True)

    def __enter__(self):
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.stop()
        else:
            self._flush()

    def _flush(self) -> None:
        if self.verbose and self.last is not None:
            phase, done, total = self.last
            print(f"{PROG}: {phase}: {done}/{total} [{time.perf_counter() - self.t0:.1f} s]",
                  file=sys.stderr, flush=True)
        self.last = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self.lock:
            if self.live is not None:
                if phase == "plans":
                    # A new plan of compare: its planning phases start again.
                    for name, task in list(self.tasks.items()):
                        if name != "plans":
                            self.live.remove_task(task)
                            del self.tasks[name]
                if phase not in self.tasks:
                    self.tasks[phase] = self.live.add_task(phase, total=max(total, 1))
                self.live.update(self.tasks[phase], completed=done, total=max(total, 1))
                return
            if self.last is not None and self.last[0] != phase:
                self._flush()
            self.last = (phase, done, total)


# ---- loading inputs ------------------------------------------------------------------------


def _cluster(text: str | None):
    """A preset name, a cluster JSON file, or "local" (the devices JAX sees)."""
    from alpa_lite.cost_models.cluster import Cluster
    if text is None or text == "local":
        return Cluster.local()
    if text in Cluster.presets():
        return Cluster.preset(text)
    path = pathlib.Path(text)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise UsageError(f"no such cluster file: {text}")
        try:
            return Cluster.from_json(path.read_text())
        except ValueError as e:
            raise UsageError(f"{text}: {e}") from None
    raise UsageError(f"unknown cluster {text!r}: use a preset ({', '.join(Cluster.presets())}), "
                     "a cluster JSON file, or local (see alpa-lite clusters)")


def _load_plan(text: str):
    from alpa_lite.plan import Plan
    path = pathlib.Path(text)
    if not path.is_file():
        raise UsageError(f"no such plan file: {text}")
    try:
        return Plan.from_json(path.read_text())
    except ValueError as e:
        raise UsageError(f"{text}: {e}") from None


def _target(args, cluster):
    from alpa_lite.tools.targets import load_target
    return load_target(args.target, batch_size=args.batch_size, dtype=args.dtype,
                       cluster=cluster)


def _micro_batches(text: str):
    if text in ("auto", "none"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, 'auto' or 'none', "
                                         f"got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ---- commands ------------------------------------------------------------------------------


def cmd_clusters(args) -> int:
    from alpa_lite.cost_models.cluster import Cluster
    out = _stdout()
    if args.json:
        if args.json not in Cluster.presets():
            raise UsageError(f"unknown cluster preset {args.json!r}; presets: "
                             f"{', '.join(Cluster.presets())}")
        out.print(Cluster.preset(args.json).to_json(), markup=False, highlight=False)
        return 0
    out.print(clusters_table())
    out.print("A cluster JSON file (alpa-lite clusters --json NAME writes one to start from) "
              "can be given to --cluster in place of a preset name.")
    return 0


def clusters_table() -> Table:
    """The presets: devices, memory, peak FLOP/s and links."""
    from alpa_lite.cost_models.cluster import Cluster
    table = Table(title="cluster presets")
    for col, just in (("name", "left"), ("devices", "right"), ("device", "left"),
                      ("memory", "right"), ("TFLOP/s fp16/bf16/fp32", "right"),
                      ("inside a node", "left"), ("between nodes", "left")):
        table.add_column(col, justify=just, no_wrap=True)

    def link(spec):
        if spec is None:
            return "-"
        bw = spec.bandwidth_bytes_per_s
        rate = f"{bw / 1e9:.3g} GB/s" if bw >= 1e9 else f"{bw / 1e6:.3g} MB/s"
        lat = spec.latency_s
        delay = f"{lat * 1e6:.3g} µs" if lat < 1e-3 else f"{lat * 1e3:.3g} ms"
        return f"{spec.name} {rate}, {delay}"

    for name in Cluster.presets():
        c = Cluster.preset(name)
        dev = c.device
        peaks = " / ".join(f"{dev.peak_flops(d) / 1e12:.4g}"
                           for d in ("float16", "bfloat16", "float32"))
        table.add_row(name, f"{c.num_nodes} x {c.devices_per_node}", dev.name,
                      f"{dev.memory_bytes / 1e9:.0f} GB", peaks, link(c.intra_node),
                      link(c.inter_node))
    return table


def _method(args, num_devices: int):
    """The method the plan command asks for."""
    from alpa_lite.plan.methods import Auto, DataParallel, Manual
    if args.method != "manual" and (args.dp or args.tp or args.pp or args.remat):
        raise UsageError(f"--dp/--tp/--pp/--remat set the layout of --method manual, not "
                         f"--method {args.method}")
    if args.zero and args.method != "dp":
        raise UsageError("--zero shards the optimizer state of --method dp")
    m = args.micro_batches
    if args.method == "dp":
        if m not in (None, "auto", "none", 1):
            raise UsageError("--micro-batches needs --method auto or manual")
        return DataParallel(shard_optimizer_state=args.zero)
    if args.method == "manual":
        if m in ("auto", "none"):
            raise UsageError("--method manual takes a number of --micro-batches")
        tp, pp = args.tp or 1, args.pp or 1
        dp = args.dp or max(1, num_devices // (tp * pp))
        if dp * tp * pp != num_devices:
            raise UsageError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp} devices, but "
                             f"the cluster has {num_devices}; choose degrees whose product is "
                             f"{num_devices}")
        return Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=m or 1,
                      schedule=args.schedule or "1f1b", remat=args.remat)
    if m == "none":
        if args.schedule is not None:
            raise UsageError("--schedule is for pipelines; --micro-batches none plans one "
                             "SPMD stage")
        return Auto(pipeline=False)
    # A number pipelines with exactly that many micro-batches; without one the planner
    # weighs one SPMD stage against pipelines over the micro-batch counts.
    return Auto(num_micro_batches=m if isinstance(m, int) else None, schedule=args.schedule)


def cmd_plan(args) -> int:
    from alpa_lite.api import ParallelizedStep
    from alpa_lite.plan import Explanation
    from alpa_lite.tools.report import brief_text
    out = _stdout()
    if args.list:
        out.print(builtin_table())
        return 0
    if args.target is None:
        raise UsageError("name a model to plan: a built-in (see alpa-lite plan --list) or "
                         "file.py:make_step")
    cluster = _cluster(args.cluster)
    target = _target(args, cluster)
    method = _method(args, cluster.num_devices)
    step = ParallelizedStep(target.step_fn, method, None, target.batch_argnums)
    with _ProgressDisplay(args.verbose) as progress:
        plan = step.plan(*target.args, cluster=cluster, progress=progress)
    old = plan.explanation
    plan = _with_source(plan, Explanation(old.alternatives if old else (), target.source))
    out.print(f"{target.name}: batch {target.batch_size}, planned for {cluster.name} "
              f"({cluster.num_devices} devices)", markup=False)
    out.print(brief_text(plan), markup=False, highlight=False)
    if args.output:
        pathlib.Path(args.output).write_text(plan.to_json())
        out.print(f"wrote {args.output}; alpa-lite show {args.output} prints every sharding",
                  markup=False)
    return 0


def _with_source(plan, explanation):
    import dataclasses
    return dataclasses.replace(plan, explanation=explanation)


def builtin_table() -> Table:
    from alpa_lite.tools.targets import DEFAULT_BATCH, builtin_sizes
    table = Table(title="built-in models", caption=f"batch: the default, min(the size's own, "
                  f"{DEFAULT_BATCH}); --batch-size to change", caption_justify="left")
    for col in ("name", "layers", "hidden", "dtype", "batch"):
        table.add_column(col, justify="left" if col in ("name", "dtype") else "right")
    for name, cfg in builtin_sizes().items():
        hidden = getattr(cfg, "hidden", None) or getattr(cfg, "num_channels", "-")
        table.add_row(name, str(getattr(cfg, "num_layers", "-")), str(hidden), cfg.dtype,
                      str(min(cfg.batch_size, DEFAULT_BATCH)))
    return table


def cmd_show(args) -> int:
    from alpa_lite.tools.report import show_text
    plan = _load_plan(args.plan)
    cluster = None
    if args.cluster is not None:
        cluster = _cluster(args.cluster)
        _check_plan_cluster(plan, cluster)
    out = _stdout()
    out.print(show_text(plan, max_rows=args.max_rows), markup=False, highlight=False)
    for path in (args.png, args.svg):
        if path is None:
            continue
        from alpa_lite.tools import pictures
        try:
            pictures.save(plan, path, cluster, panels=tuple(args.panels.split(",")),
                          dpi=args.dpi)
        except ImportError as e:
            raise UsageError(str(e)) from None
        out.print(f"wrote {path}", markup=False)
    return 0


def _check_plan_cluster(plan, cluster) -> None:
    if cluster.fingerprint() != plan.cluster_fingerprint:
        raise UsageError(f"{plan.cluster_name!r} is the cluster this plan was made for, not "
                         f"{cluster.name!r} (fingerprints {plan.cluster_fingerprint} and "
                         f"{cluster.fingerprint()}); plan again for {cluster.name!r}")


def compare_table(rows, measured: bool = False, top: int | None = None) -> Table:
    """The rows of `alpa_lite.tools.compare` as a rich table (what `alpa-lite compare` prints):
    the first `top` rows, or all."""
    shown = rows if top is None else rows[:top]
    caption = None if len(shown) == len(rows) else \
        f"{len(rows) - len(shown)} more rows not shown (--top)"
    table = Table(title="plans ranked by estimated step time (those that fit device memory "
                        "first)", caption=caption, caption_justify="left")
    cols = ["#", "plan", "stages", "m", "remat", "est. step", "samples/s", "TFLOP/s/dev",
            "memory/dev", "fits", "vs best manual"]
    if measured:
        cols.insert(6, "measured")
    for c in cols:
        table.add_column(c, justify="left" if c in ("plan", "stages", "fits", "remat")
                         else "right", no_wrap=True)
    for i, r in enumerate(shown, 1):
        if r.error:
            cells = [str(i), r.label, "-", str(r.num_micro_batches), "-", "-", "-", "-", "-",
                     "no plan", "-"]
            if measured:
                cells.insert(6, "-")
            table.add_row(*map(escape, cells))
            continue
        cells = [str(i), r.label, r.stages, str(r.num_micro_batches),
                 "yes" if r.remat else "no", _ms(r.step_time_s), f"{r.samples_per_s:.4g}",
                 f"{r.model_tflops_per_device:.3g}", f"{r.peak_memory_bytes / 2**30:.2f} GiB",
                 "yes" if r.fits else "no",
                 f"{r.speedup_vs_best_manual:.2f}x"
                 if r.fits and math.isfinite(r.speedup_vs_best_manual) else "-"]
        if measured:
            cells.insert(6, _ms(r.measured_step_s) if r.measured_step_s is not None else "-")
        table.add_row(*map(escape, cells))
    return table


def _ms(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.4g} ms"


def compare_summary(rows) -> str:
    """One line: the best auto plan against the best manual one."""
    auto = [r for r in rows if r.kind == "auto" and not r.error and r.fits]
    manual = [r for r in rows if r.kind != "auto" and not r.error and r.fits]
    if not auto or not manual:
        return ("no auto plan fits" if not auto else "no manual plan fits") + \
            " device memory, so there is no speed-up to report"
    a, m = min(auto, key=lambda r: r.step_time_s), min(manual, key=lambda r: r.step_time_s)
    return (f"best auto ({a.label}) {_ms(a.step_time_s)} vs best manual ({m.label}) "
            f"{_ms(m.step_time_s)}: auto is {m.step_time_s / a.step_time_s:.2f}x "
            f"{'faster' if a.step_time_s <= m.step_time_s else 'the speed'}")


def rows_json(rows) -> str:
    """Rows as JSON (no plans; infinite and NaN numbers as null)."""
    import dataclasses

    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return json.dumps([{k: clean(v) for k, v in dataclasses.asdict(
        dataclasses.replace(r, plan=None)).items() if k != "plan"} for r in rows], indent=1)


def cmd_compare(args) -> int:
    from alpa_lite.tools.compare import compare
    cluster = _cluster(args.cluster)
    target = _target(args, cluster)
    real = None
    if args.measure:
        if target.make_real_args is None:
            raise UsageError(f"--measure needs real arrays: {target.no_real_args}")
        real = target.make_real_args()
    with _ProgressDisplay(args.verbose) as progress:
        rows = compare(target.step_fn, *target.args, cluster=cluster,
                       micro_batches=tuple(args.micro_batches),
                       batch_argnums=target.batch_argnums, progress=progress,
                       measure=args.measure, measure_steps=args.steps, real_args=real)
    out = _stdout()
    out.print(f"{target.name}: batch {target.batch_size} on {cluster.name} "
              f"({cluster.num_devices} devices); estimates from alpa_lite's cost model",
              markup=False)
    out.print(compare_table(rows, measured=args.measure, top=args.top))
    out.print(compare_summary(rows), markup=False)
    refused = [r for r in rows if r.error]
    for r in refused[:args.max_refused]:
        reason = r.error if len(r.error) <= 300 else r.error[:300] + " ..."
        out.print(f"  no plan for {r.label}: {reason}", markup=False)
    if len(refused) > args.max_refused:
        out.print(f"  ... {len(refused) - args.max_refused} more without a plan (--json has "
                  "every reason)", markup=False)
    out.print("model FLOPs per step (forward + backward, from the traced graph): "
              f"{rows[0].model_flops / 1e12:.4g} TFLOP", markup=False)
    if args.json:
        pathlib.Path(args.json).write_text(rows_json(rows))
    return 0


def cmd_explain(args) -> int:
    from alpa_lite.tools import explain
    plan = _load_plan(args.plan)
    if args.cluster is not None:
        cluster = _cluster(args.cluster)
        _check_plan_cluster(plan, cluster)
    else:
        cluster = None
    delays, ks = _straggler_args(args)
    out = _stdout()
    if args.op is None:
        if args.target or args.batch_size or args.dtype:
            raise UsageError("--target/--batch-size/--dtype rebuild the step for --op")
        text = explain.stage_text(plan, args.stage)
        if delays is not None:
            try:
                text += explain.straggler_text(plan, delays, ks)
            except ValueError as err:
                raise UsageError(f"--straggler-k: {err}") from None
        out.print(text, markup=False, highlight=False)
        return 0
    if delays is not None:
        raise UsageError("--stragglers simulates the plan's data-parallel replicas; leave "
                         "out --op (it explains one operator)")
    if cluster is None:
        from alpa_lite.cost_models.cluster import Cluster
        if plan.cluster_name not in Cluster.presets():
            raise UsageError(f"the plan's cluster {plan.cluster_name!r} is not a preset: give "
                             "its JSON file with --cluster to rebuild the stage")
        cluster = Cluster.preset(plan.cluster_name)
        _check_plan_cluster(plan, cluster)
    from alpa_lite.tools.targets import load_target, target_from_source
    if args.target:
        target = load_target(args.target, args.batch_size, args.dtype, cluster)
    else:
        source = plan.explanation.source if plan.explanation is not None else ()
        target = target_from_source(source, cluster)
    stage = args.stage or 0
    with _ProgressDisplay(args.verbose):
        try:
            e = explain.explain_op(plan, target.step_fn, target.args, cluster, args.op, stage,
                                   target.batch_argnums)
        except ValueError as err:
            raise UsageError(str(err)) from None
    out.print(explain.op_text(e), markup=False, highlight=False)
    return 0


def _straggler_args(args):
    """(delay model or None, ks or None) of explain's --stragglers / --straggler-k."""
    from alpa_lite.cost_models.stragglers import parse_delay_model
    if args.stragglers is None:
        if args.straggler_k is not None:
            raise UsageError("--straggler-k needs --stragglers MODEL (e.g. --stragglers exp:20)")
        return None, None
    try:
        delays = parse_delay_model(args.stragglers)
    except ValueError as e:
        raise UsageError(f"--stragglers: {e}") from None
    if args.straggler_k is None:
        return delays, None
    try:
        ks = tuple(int(k) for k in args.straggler_k.split(","))
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise UsageError(f"--straggler-k {args.straggler_k!r}: expected positive integers "
                         "separated by commas, e.g. --straggler-k 1,4")
    return delays, tuple(sorted(set(ks)))


def cmd_calibrate(args) -> int:
    from alpa_lite.tools.calibrate import calibrate
    out = _stdout()
    with _ProgressDisplay(args.verbose) as progress:
        cluster, report = calibrate(quick=args.quick, progress=progress)
    for table in calibration_tables(report):
        out.print(table)
    pathlib.Path(args.output).write_text(cluster.to_json() + "\n")
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    out.print(f"{cluster.name}: {cluster.num_nodes} x {cluster.devices_per_node} "
              f"{report.device_kind} devices calibrated in {report.elapsed_s:.1f} s; wrote "
              f"{args.output} (use it with --cluster {args.output})"
              + (f" and {args.report}" if args.report else ""), markup=False)
    return 0


def calibration_tables(report) -> list[Table]:
    """What `alpa-lite calibrate` prints: matmul timings and the fitted efficiency curve,
    element-wise passes and memory bandwidth, collective timings and the fitted links."""
    def rate(x: float) -> str:
        return f"{x / 1e12:.4g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.4g} GFLOP/s"

    def dur(s: float) -> str:
        return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} µs"

    n = report.devices_per_process
    mm = Table(title=f"matmuls ({report.dtype}; {n} device{'s' if n > 1 else ''} of a process "
                     f"at once; per device, dispatch {dur(report.dispatch_s)} taken off)",
               caption=f"peak {rate(report.peak_flops_per_s)} ({report.peak_source}); "
                       f"op_overhead_s {dur(report.op_overhead_s)} per matmul (the "
                       f"{report.matmuls[0].m}^3 chain); efficiency = FLOPs / (peak x (time - "
                       f"overhead)); cv: coefficient of variation of the timed calls",
               caption_justify="left")
    for col in ("m x k x n", "FLOPs", "time/matmul", "rate", "efficiency", "chain", "cv"):
        mm.add_column(col, justify="left" if col == "m x k x n" else "right", no_wrap=True)
    from alpa_lite.cost_models.calibration import matmul_efficiencies
    effs = matmul_efficiencies([s.flops for s in report.matmuls],
                               [s.seconds for s in report.matmuls], report.peak_flops_per_s,
                               report.op_overhead_s)
    for s, e in zip(report.matmuls, effs):
        mm.add_row(f"{s.m} x {s.k} x {s.n}", f"{s.flops:.3g}", dur(s.seconds),
                   rate(s.flops_per_s), "-" if math.isnan(e) else f"{e:.3f}", str(s.repeats),
                   f"{s.cv:.2f}")
    curve = Table(title="fitted matmul efficiency curve (interpolated in log FLOPs, clamped "
                        "at the ends)")
    curve.add_column("FLOPs / matmul / device", justify="right")
    curve.add_column("fraction of peak", justify="right")
    for f, e in report.matmul_efficiency_curve:
        curve.add_row(f"{f:.3g}", f"{e:.3f}")
    mem = Table(title=f"element-wise passes (x + 1, per device): memory bandwidth "
                      f"{report.memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s, fixed "
                      f"{dur(report.memory_intercept_s)} per pass")
    for col in ("bytes read + written", "time/pass", "GB/s", "chain", "cv"):
        mem.add_column(col, justify="right", no_wrap=True)
    for s in report.memory:
        mem.add_row(f"{s.nbytes:.3g}", dur(s.seconds), f"{s.nbytes / s.seconds / 1e9:.3g}",
                    str(s.repeats), f"{s.cv:.2f}")
    links = Table(title="collectives (each fitted with its own formula, cost_models/"
                        "collectives.py; the all-reduce fit is the link's own alpha and B)",
                  caption="bytes as the model counts them: an all-gather's result, a "
                          "reduce-scatter's input, the per-device buffer of the others",
                  caption_justify="left")
    for col in ("link", "collective", "n", "bytes", "measured", "fitted", "error", "cv"):
        links.add_column(col, justify="left" if col in ("link", "collective") else "right",
                         no_wrap=True)
    for r in report.links:
        for s, err in zip(r.samples, r.relative_errors):
            links.add_row(r.level, r.collective, str(r.group_size), f"{s.nbytes:.3g}",
                          dur(s.seconds), dur(s.seconds * (1 + err)), f"{err:+.0%}",
                          f"{s.cv:.2f}")
        links.add_row(r.level, f"{r.collective} fit", "", "", "",
                      f"alpha {dur(r.link.latency_s)}",
                      f"B {r.link.bandwidth_bytes_per_s / 1e9:.3g} GB/s", "", end_section=True)
    if not report.links:
        links.caption = "no link timed: one device per process (the nominal links are kept)"
    return [mm, curve, mem, links]


# ---- parser and main -----------------------------------------------------------------------


def cmd_launch(args) -> int:
    from alpa_lite.tools.launch import launch, script_command
    try:
        command = script_command(args.script, args.script_args)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    try:
        results = launch(command, args.num_processes,
                         None if args.no_cpu else args.cpu_devices, timeout_s=args.timeout,
                         echo=sys.stdout)
    except TimeoutError as e:
        print(f"{PROG} launch: {str(e).splitlines()[0]}", file=sys.stderr)
        return 124      # timeout(1)'s status for a command it stopped
    failed = [r for r in results if not r.ok]
    # When one process dies, the others stop because of it: the first to end is the cause.
    first = min(failed, key=lambda r: r.elapsed_s) if failed else None
    for r in results:
        note = " (the first to fail)" if r is first and len(failed) > 1 else ""
        print(f"{PROG} launch: {r.describe()}{note}", file=sys.stderr)
    if first is None:
        return 0
    # The first failure's status, so a script's own exit code reaches the caller (a
    # process killed by a signal gives 1).
    return first.returncode if first.returncode > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Alpa-style auto-parallelization planner for JAX "
                     "train steps: plan, show, compare and explain plans.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("clusters", help="the cluster presets, their devices and links")
    p.add_argument("--json", metavar="NAME", help="print preset NAME as cluster JSON")
    p.set_defaults(run=cmd_clusters)

    def target_args(p, needed=True):
        p.add_argument("target", nargs=None if needed else "?",
                       help="a built-in model (alpa-lite plan --list) or file.py[:make_step]")
        p.add_argument("--cluster", default=None,
                       help="a preset (alpa-lite clusters), a cluster JSON file, or local "
                            "(default: the devices JAX sees)")
        p.add_argument("--batch-size", type=_positive, default=None,
                       help="global batch of a built-in model (default: min(its batch, 64))")
        p.add_argument("--dtype", default=None,
                       help="dtype of a built-in model (default: its own; bfloat16 models "
                            "use float16 on devices without bfloat16 tensor cores, V100)")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="print each planning phase as it ends (on a terminal a live "
                            "display is shown anyway)")

    p = sub.add_parser("plan", help="plan a built-in model or your own step")
    target_args(p, needed=False)
    p.add_argument("--list", action="store_true", help="list the built-in models")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--method", choices=("auto", "dp", "manual"), default="auto",
                   help="auto: the planner chooses; dp: data parallel; manual: --dp x --tp "
                        "x --pp (default: auto)")
    p.add_argument("--dp", type=_positive, help="manual: data-parallel degree")
    p.add_argument("--tp", type=_positive, help="manual: tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=_positive, help="manual: pipeline stages (default 1)")
    p.add_argument("--micro-batches", type=_micro_batches, default=None,
                   help="auto: 'auto' (default: the planner weighs one SPMD stage "
                        "against pipelines and chooses the micro-batch count), 'none' (one "
                        "SPMD stage) or a number; manual: a number (default 1)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default=None,
                   help="pipeline schedule (default: auto chooses; manual uses 1f1b)")
    p.add_argument("--remat", action="store_true", help="manual: recompute activations")
    p.add_argument("--zero", action="store_true",
                   help="dp: shard the optimizer state (ZeRO stage 1)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("show", help="a plan's stages, shardings, collectives, memory and "
                                    "step-time breakdown; pictures")
    p.add_argument("plan", help="a plan JSON file")
    p.add_argument("--png", help="write the timeline, device mesh and breakdown pictures here")
    p.add_argument("--svg", help="the same pictures as SVG")
    p.add_argument("--panels", default="timeline,mesh,breakdown",
                   help="which pictures, top to bottom (default: timeline,mesh,breakdown)")
    p.add_argument("--dpi", type=_positive, default=110, help="PNG resolution (default 110)")
    p.add_argument("--cluster", help="check the plan is for this cluster (preset or JSON)")
    p.add_argument("--max-rows", type=_positive, default=40,
                   help="sharding table rows per stage (default 40)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("compare", help="auto plans against every Megatron-style manual plan")
    target_args(p)
    p.add_argument("--micro-batches", type=_positive, nargs="+", default=[1, 4, 16],
                   help="micro-batch counts to try (default: 1 4 16)")
    p.add_argument("--measure", action="store_true",
                   help="also run each plan that fits on the local devices (--cluster local)")
    p.add_argument("--steps", type=_positive, default=3, help="timed steps per plan (--measure)")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--top", type=_positive, default=None,
                   help="print only the first TOP rows of the table (default: all)")
    p.add_argument("--max-refused", type=int, default=5,
                   help="configurations without a plan whose reason is printed (default 5)")
    p.set_defaults(run=cmd_compare)

    p = sub.add_parser("explain", help="why each stage / sharding was chosen, and what it beat")
    p.add_argument("plan", help="a plan JSON file")
    p.add_argument("--op", help="an operator or input of the sharding table (alpa-lite show)")
    p.add_argument("--stage", type=int, default=None, help="the stage (default: all; --op: 0)")
    p.add_argument("--cluster", help="the plan's cluster, if not a preset (JSON file)")
    p.add_argument("--target", help="the step, if the plan does not record it")
    p.add_argument("--batch-size", type=_positive, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--stragglers", metavar="MODEL",
                   help="also tabulate the expected step when data-parallel replicas are "
                        "late: sync all-reduce, dropping the k slowest, gradient coding "
                        "(the last two simulated only). MODEL: exp:MEAN[:scaled] (exponential "
                        "delay, MEAN in ms, or with s/us, e.g. exp:20) or samples:FILE"
                        "[:scaled] (measured delays in ms)")
    p.add_argument("--straggler-k", metavar="K,...",
                   help="--stragglers: the k dropped and s tolerated, e.g. 1,4 (default: "
                        "1, 2 and replicas/8)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("calibrate", help="measure the local devices (matmul efficiency, "
                                         "memory bandwidth, links) and write a cluster JSON")
    p.add_argument("-o", "--output", required=True,
                   help="write the calibrated cluster JSON here (give it to --cluster)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and sizes, 3 timed calls each (~3x faster, noisier)")
    p.add_argument("--report", help="also write every timing and fit as JSON here")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each measuring phase as it ends")
    p.set_defaults(run=cmd_calibrate)

    p = sub.add_parser("launch", help="run a script as N JAX processes on this machine "
                                      "(tests, laptops); the script calls "
                                      "alpa_lite.runtime.distributed.initialize()")
    p.add_argument("-n", "--num-processes", type=_positive, default=2,
                   help="processes to start (default 2)")
    p.add_argument("--cpu-devices", type=_positive, default=4,
                   help="virtual CPU devices per process (default 4)")
    p.add_argument("--no-cpu", action="store_true",
                   help="leave the platform alone (e.g. one GPU per process) instead of "
                        "virtual CPU devices")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop every process after this many seconds (default: none)")
    p.add_argument("script", help="the Python script every process runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments passed on to the script")
    p.set_defaults(run=cmd_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit code (module docstring)."""
    args = build_parser().parse_args(argv)
    from alpa_lite.errors import PlanningError
    from alpa_lite.tools.targets import TargetError
    try:
        return args.run(args)
    except KeyboardInterrupt:
        # Planning writes its output only at the end: nothing was written. The solver
        # threads are told to stop (`planning.pipeline`); a solve already running ends
        # on its own, within its time limit.
        print(f"{PROG}: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
        return 130
    except (UsageError, TargetError) as e:
        return _fail(e, 2)
    except PlanningError as e:
        return _fail(e, 1)
    except ValueError as e:     # a bad value the library rejected (e.g. Manual(dp=3) on 8)
        return _fail(e, 2)


def _fail(e: Exception, code: int) -> int:
    message = " ".join(str(e).split())
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def console_main() -> None:
    """The `alpa-lite` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
