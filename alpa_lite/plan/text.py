"""`Plan.summary()`: the plan as text a person can read (tables drawn by rich)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from alpa_lite.plan.methods import describe
from alpa_lite.plan.timing import StepTime


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def plan_summary(plan, max_rows: int = 40) -> str:
    """Renders the plan: header, per stage the sharding table and the collectives."""
    buf = io.StringIO()
    console = Console(file=buf, width=110, force_terminal=False, color_system=None)
    console.print(f"alpa_lite plan  method={describe(plan.method)}  cluster={plan.cluster_name}")
    if plan.compression is not None:
        c = plan.compression
        buckets = plan.sync_buckets_of(0)
        workers = len(plan.stages[0].devices)
        where = (f"{buckets.num_buckets} all-reduce(s) over all {workers} workers, each "
                 f"issued as its bucket's gradients exist ({fmt_time(buckets.exposed_s)} of "
                 f"{fmt_time(buckets.total_s)} after the backward)" if buckets is not None
                 else f"between {c.num_workers} nodes, full precision inside each node"
                 if c.hierarchical else f"over the {c.num_workers} workers of axis {c.axis}")
        console.print(f"estimated step {fmt_time(c.step_time_s)} = compute "
                      f"{fmt_time(c.compute_s)} + gradient exchange {fmt_time(c.sync_s)}"
                      f"{' (delayed)' if c.delay else ''}; peak memory "
                      f"{fmt_bytes(plan.peak_memory_bytes)} per device")
        console.print(f"gradient exchange: {escape(c.description)}, {where}; "
                      f"{fmt_bytes(c.wire_bytes)} per worker per step against "
                      f"{fmt_bytes(c.dense_wire_bytes)} uncompressed; saves "
                      f"{fmt_time(c.saved_s)} per step")
        if len(c.candidates) > 1:
            table = Table(show_edge=False)
            for col in ("exchange", "est. step", "fits"):
                table.add_column(col)
            for label, t, fits in sorted(c.candidates, key=lambda r: r[1]):
                table.add_row(escape(label), fmt_time(t), "yes" if fits else "no")
            console.print(table)
    elif plan.pipeline is None:
        console.print(f"estimated step {fmt_time(plan.step_time_s)}; "
                      f"peak memory {fmt_bytes(plan.peak_memory_bytes)} per device")
    else:
        console.print(f"estimated step {fmt_time(plan.step_time_s)} (schedule simulated); "
                      f"peak memory {fmt_bytes(plan.peak_memory_bytes)} per device")
    if plan.step_time is not None:
        console.print(step_time_table(plan.step_time))
    if plan.choices:
        console.print(choices_table(plan))
    if plan.pipeline is not None:
        p = plan.pipeline
        console.print(f"pipeline: {len(plan.stages)} stage(s), {plan.schedule}, "
                      f"{len(p.layer_starts)} layers, bubble {p.bubble_fraction:.1%}")
        stages = Table(show_edge=False)
        for col in ("stage", "layers", "devices", "mesh", "forward", "backward", "remat",
                    "memory/device"):
            stages.add_column(col)
        for i, st in enumerate(plan.stages):
            mesh = " x ".join(str(s) for s in st.mesh_shape)
            stages.add_row(str(i), f"{st.layers[0]}..{st.layers[1]}",
                           f"{st.devices[0]}..{st.devices[-1]}", mesh, fmt_time(st.forward_s),
                           fmt_time(st.backward_s), "yes" if st.remat else "no",
                           fmt_bytes(st.peak_memory_bytes))
        console.print(stages)
    if plan.pipeline is not None and plan.pipeline.batch_draws:
        console.print(f"random draws along the batch: {plan.pipeline.batch_draws}, each "
                      "micro-batch drawing its rows of the whole batch's draw (as jax.jit)")
    if plan.pipeline is not None and plan.pipeline.aux:
        console.print("aux outputs over micro-batches: "
                      + ", ".join(str(a) for a in plan.pipeline.aux))
    if plan.unsharded_primitives:
        console.print("replicated (no sharding rule): " + ", ".join(plan.unsharded_primitives))
    for note in plan.notes:
        console.print(f"traced: {escape(note)}")
    if plan.gradient_sync:
        console.print(gradient_sync_table(plan))
        for buckets in plan.sync_buckets:
            console.print(escape(sync_buckets_line(buckets)))
            console.print(sync_buckets_table(buckets))
        for i, st in enumerate(plan.stages):
            if st.accumulate_note:
                console.print(f"stage {i} reduces its gradients in every backward: "
                              f"{escape(st.accumulate_note)}")
    for i, st in enumerate(plan.stages):
        mesh = " x ".join(f"{n}={s}" for n, s in zip(st.axis_names, st.mesh_shape))
        console.print(f"\nstage {i}: devices {st.devices[0]}..{st.devices[-1]}  mesh {mesh}")
        table = Table(title=None, show_edge=False)
        table.add_column("tensor")
        table.add_column("sharding")
        for name, spec in st.shardings[:max_rows]:
            table.add_row(escape(name), escape(str(spec)))
        if len(st.shardings) > max_rows:
            table.add_row(f"... {len(st.shardings) - max_rows} more", "")
        console.print(table)
        coll = Table(show_edge=False)
        for col in ("collective", "mesh axes", "bytes/op", "count", "time"):
            coll.add_column(col)
        for c in st.collectives:
            coll.add_row(c.kind, ",".join(c.axes), fmt_bytes(c.nbytes), str(c.count),
                         fmt_time(c.time_s))
        if not st.collectives:
            coll.add_row("(none)", "", "", "", "")
        console.print(coll)
    return buf.getvalue()


def step_time_table(step_time: StepTime) -> Table:
    """Where the estimated step time goes: each line of the critical path with its share,
    then the work that ran beside it (not added)."""
    total = step_time.total_s or 1.0
    table = Table(title="where the step time goes", show_edge=False)
    for col in ("", "time", "share", "how"):
        table.add_column(col)
    for line in step_time.lines:
        table.add_row(line.kind.value, fmt_time(line.seconds), f"{line.seconds / total:.0%}",
                      escape(line.note))
    for line in step_time.hidden:
        table.add_row(f"({line.kind.value})", fmt_time(line.seconds), "hidden",
                      escape(line.note))
    return table


def gradient_sync_table(plan) -> Table:
    """Gradient sync, one row per stage and way of syncing: how many parameters, where
    they accumulate, over which axes they are reduced, with which collective and
    compressor, how often per step."""
    rows: dict[tuple, list] = {}
    for g in plan.gradient_sync:
        key = (g.stage, g.accumulation.value, ",".join(g.axes) or "-", g.collective.value,
               g.compressor or "-", g.count)
        entry = rows.setdefault(key, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += g.nbytes
        entry[2] += g.time_s
    table = Table(title="gradient sync", show_edge=False)
    for col in ("stage", "params", "accumulated", "axes", "collective", "compressor",
                "bytes/device", "per step", "time"):
        table.add_column(col)
    for (stage, acc, axes, kind, comp, count), (n, nbytes, t) in sorted(rows.items()):
        table.add_row(str(stage), str(n), acc, axes, kind, escape(comp), fmt_bytes(nbytes),
                      f"{count}x", fmt_time(t) if t else "-")
    return table


_ISSUED_BY = {"xla-combiner": "XLA's combiner cuts them at this size on GPUs (latency-hiding "
                               "scheduler on); XLA:CPU combines all into one",
              "runtime": "alpa_lite issues one all-reduce per bucket, in this order (a "
                         "compressed plan's estimate prices the exchange after the "
                         "backward)"}


def sync_buckets_line(buckets) -> str:
    """One line on a stage's gradient buckets (`plan.timing.SyncBuckets`): the chosen size
    against the runner-up, what is left exposed, and who cuts the buckets when it runs."""
    b = buckets
    runner = (f"; runner-up {fmt_bytes(b.runner_up_bytes)}: {b.runner_up_buckets} bucket(s), "
              f"{fmt_time(b.runner_up_exposed_s)} exposed" if b.runner_up_bytes else "")
    return (f"gradient buckets, stage {b.stage}: {b.num_buckets} of at most "
            f"{fmt_bytes(b.bucket_bytes)} (a larger gradient alone), issued in the order the "
            f"backward forms them; {fmt_time(b.exposed_s)} of {fmt_time(b.total_s)} exposed "
            f"after the backward ends at {fmt_time(b.backward_end_s)}{runner}; "
            f"{_ISSUED_BY[b.issue.value]}")


def sync_buckets_table(buckets) -> Table:
    """A stage's gradient buckets in the order they are issued: the gradients in each, its
    bytes, when its last gradient is formed and when its reduction ends (estimates, from
    the step's start)."""
    table = Table(title="gradient buckets", show_edge=False)
    for col in ("bucket", "gradients", "bytes/device", "ready", "reduced by"):
        table.add_column(col)
    for i, k in enumerate(buckets.buckets):
        names = ", ".join(k.grads[:4]) + (f" +{len(k.grads) - 4} more" if len(k.grads) > 4
                                          else "")
        table.add_row(str(i), escape(names or "-"), fmt_bytes(k.nbytes), fmt_time(k.ready_s),
                      fmt_time(k.end_s))
    return table


def bucket_sizes_table(buckets) -> Table:
    """Every bucket size the planner weighed for a stage (`SyncBuckets.weighed`): the
    buckets it cuts and the reduction it leaves exposed after the backward."""
    table = Table(title=f"bucket sizes weighed, stage {buckets.stage}", show_edge=False)
    for col in ("size", "buckets", "exposed", ""):
        table.add_column(col)
    for nbytes, exposed, count in buckets.weighed:
        table.add_row(fmt_bytes(nbytes), str(count), fmt_time(exposed),
                      "chosen" if nbytes == buckets.bucket_bytes else "")
    return table


def choices_table(plan) -> Table:
    """What the planner chose where the method left it open (or the user fixed it), and
    the runner-up each choice beat, with its whole-step estimate where it was planned."""
    table = Table(title="choices", show_edge=False)
    for col in ("", "chosen", "by", "runner-up", "its step", "note"):
        table.add_column(col)
    for c in plan.choices:
        if not c.runner_up:
            other = "-"
        elif c.runner_up_s is not None:
            other = f"{fmt_time(c.runner_up_s)} ({c.runner_up_s / c.time_s:.2f}x)" \
                if c.time_s > 0 else fmt_time(c.runner_up_s)
        else:
            other = "does not fit" if not c.runner_up_fits else "see note"
        table.add_row(c.what, escape(c.value), "user" if c.by_user else "planner",
                      escape(c.runner_up or "-"), other, escape(c.note))
    return table
