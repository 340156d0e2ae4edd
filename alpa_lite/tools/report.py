"""Where a plan's estimated step time goes: per-stage breakdown, the simulated timeline,
and the text `alpa-lite show` prints (the plan's summary plus the breakdown).

Everything here is computed from the `Plan` alone (a plan loaded from JSON will do): a
pipelined plan's timeline is the schedule simulator re-run on the stage times and sends the
plan records, which reproduces its estimate exactly; a single-stage plan's estimate is
compute + communication (the cost model does not overlap them).
"""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console
from rich.table import Table

from alpa_lite.cost_models.pipeline_schedule import (
    ScheduleResult,
    StageTiming,
    schedule_from_name,
    simulate,
)
from alpa_lite.plan import Plan
from alpa_lite.plan.methods import describe
from alpa_lite.plan.text import choices_table, fmt_bytes, fmt_time


@dataclasses.dataclass(frozen=True)
class StageBreakdown:
    """One stage's share of the step. Pipelined plans: per micro-batch times, then the
    stage's busy and idle time over the whole simulated step. Single stage: per step."""
    stage: int
    compute_s: float
    comm_s: float
    comm_by_kind: tuple[tuple[str, float], ...]     # (collective kind and axes, seconds)
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    send_s: float = 0.0          # its activations to the next stage (gradients come back alike)
    busy_s: float = 0.0          # over the step: forwards, recomputes and backwards
    idle_s: float = 0.0          # over the step: the pipeline bubble on this stage
    memory_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    step_time_s: float
    stages: tuple[StageBreakdown, ...]
    pipeline_s: float            # the simulated forward/backward part (pipelines)
    apply_s: float               # the optimizer update after the last backward (pipelines)
    reduce_s: float              # the once-per-step gradient reduction (pipelines)
    bubble_fraction: float


def simulate_plan(plan: Plan) -> ScheduleResult:
    """The pipeline's timeline, re-simulated from the plan (pipelined plans only)."""
    p = plan.pipeline
    if p is None:
        raise ValueError("a single-stage plan has no pipeline timeline; see step_breakdown")
    S = len(plan.stages)
    timings = [StageTiming(forward_s=st.forward_s, backward_s=st.backward_s,
                           send_activation_s=p.send_s[s] if s < S - 1 else 0.0,
                           send_gradient_s=p.send_s[s - 1] if s > 0 else 0.0, remat=st.remat)
               for s, st in enumerate(plan.stages)]
    return simulate(timings, p.num_micro_batches, schedule_from_name(p.schedule))


def _by_kind(stage) -> tuple[tuple[str, float], ...]:
    out: dict[str, float] = {}
    for c in stage.collectives:
        key = f"{c.kind}({','.join(c.axes)})"
        out[key] = out.get(key, 0.0) + c.time_s
    return tuple(sorted(out.items(), key=lambda kv: -kv[1]))


def step_breakdown(plan: Plan) -> StepBreakdown:
    """The plan's estimate taken apart (module docstring)."""
    if plan.pipeline is None:
        stages = tuple(StageBreakdown(s, st.compute_s, st.comm_s, _by_kind(st),
                                      memory_bytes=st.peak_memory_bytes)
                       for s, st in enumerate(plan.stages))
        return StepBreakdown(plan.step_time_s, stages, 0.0, 0.0, 0.0, 0.0)
    p = plan.pipeline
    sim = simulate_plan(plan)
    stages = []
    for s, st in enumerate(plan.stages):
        busy = sim.busy_s[s]
        stages.append(StageBreakdown(
            s, st.compute_s, st.comm_s, _by_kind(st), forward_s=st.forward_s,
            backward_s=st.backward_s, recompute_s=st.forward_s if st.remat else 0.0,
            send_s=p.send_s[s] if s < len(p.send_s) else 0.0, busy_s=busy,
            idle_s=sim.step_time_s - busy, memory_bytes=st.peak_memory_bytes))
    return StepBreakdown(sim.step_time_s + p.reduce_s + p.apply_s, tuple(stages),
                         sim.step_time_s, p.apply_s, p.reduce_s, sim.bubble_fraction)


def breakdown_text(plan: Plan, width: int = 110) -> str:
    """The step-time breakdown as tables."""
    b = step_breakdown(plan)
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print("\nstep-time breakdown")
    if plan.compression is not None:
        c = plan.compression
        console.print(f"  compute {fmt_time(c.compute_s)} + gradient exchange "
                      f"{fmt_time(c.sync_s)} = {fmt_time(c.step_time_s)}")
        return buf.getvalue()
    if plan.pipeline is None:
        table = Table(show_edge=False)
        for col in ("stage", "part", "time", "share"):
            table.add_column(col, justify="left" if col == "part" else "right")
        for st in b.stages:
            total = st.compute_s + st.comm_s
            parts = [("compute", st.compute_s)] + list(st.comm_by_kind)
            for name, t in parts:
                table.add_row(str(st.stage), name, fmt_time(t),
                              f"{t / total:.1%}" if total > 0 else "-")
        console.print(table)
        console.print(f"  step = compute + communication = {fmt_time(b.step_time_s)} "
                      "(no overlap modelled)")
        return buf.getvalue()
    table = Table(show_edge=False, caption="per micro-batch: forward, backward, recompute, "
                  "send (to the next stage), compute, communication; per step: busy, bubble",
                  caption_justify="left")
    cols = ("stage", "forward", "backward", "recompute", "send", "compute", "comm", "busy",
            "bubble", "memory/device")
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for st in b.stages:
        table.add_row(str(st.stage), fmt_time(st.forward_s), fmt_time(st.backward_s),
                      fmt_time(st.recompute_s) if st.recompute_s else "-",
                      fmt_time(st.send_s) if st.send_s else "-", fmt_time(st.compute_s),
                      fmt_time(st.comm_s), fmt_time(st.busy_s), fmt_time(st.idle_s),
                      fmt_bytes(st.memory_bytes))
    console.print(table)
    console.print(f"  step = simulated {plan.pipeline.schedule} pipeline "
                  f"{fmt_time(b.pipeline_s)} (bubble {b.bubble_fraction:.1%}) + gradient "
                  f"reduction {fmt_time(b.reduce_s)} + optimizer update "
                  f"{fmt_time(b.apply_s)} = {fmt_time(b.step_time_s)}")
    return buf.getvalue()


def show_text(plan: Plan, max_rows: int = 40) -> str:
    """What `alpa-lite show` prints: stages, shardings, collectives, memory, breakdown."""
    return plan.summary(max_rows=max_rows) + breakdown_text(plan)


def brief_text(plan: Plan) -> str:
    """A few lines: method, estimate, memory and the stages (what `alpa-lite plan` prints;
    `show` prints everything)."""
    buf = io.StringIO()
    console = Console(file=buf, width=150, force_terminal=False, color_system=None)
    console.print(f"method {describe(plan.method)}")
    console.print(f"estimated step {fmt_time(plan.step_time_s)}; peak memory "
                  f"{fmt_bytes(plan.peak_memory_bytes)} per device; {plan.schedule}")
    table = Table(show_edge=False)
    for col in ("stage", "layers", "devices", "mesh", "remat", "compute", "comm",
                "collectives", "memory/device"):
        table.add_column(col, justify="left" if col in ("mesh", "collectives") else "right",
                         no_wrap=True)
    for s, st in enumerate(plan.stages):
        mesh = " x ".join(f"{n}={k}" for n, k in zip(st.axis_names, st.mesh_shape))
        kinds = sorted({c.kind for c in st.collectives})
        table.add_row(str(s), f"{st.layers[0]}..{st.layers[1]}" if plan.pipeline else "all",
                      f"{st.devices[0]}..{st.devices[-1]}", mesh, "yes" if st.remat else "no",
                      fmt_time(st.compute_s), fmt_time(st.comm_s),
                      ", ".join(kinds) or "none", fmt_bytes(st.peak_memory_bytes))
    console.print(table)
    if plan.pipeline is not None:
        console.print("(pipelined: compute and comm per micro-batch, forward + backward)")
    if plan.choices:
        console.print(choices_table(plan))
    return buf.getvalue()
