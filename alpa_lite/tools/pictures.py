"""Pictures of a plan (matplotlib, PNG or SVG): what `alpa-lite show --png` draws.

- `draw_timeline`: the pipeline as a Gantt chart, one row per stage: every micro-batch's
  forward, recomputation and backward from the schedule simulator (`plan_report.simulate_plan`,
  the same numbers as the plan's estimate), the activation / gradient transfers between
  stages on a thin lane between their rows, and the optimizer update at the end; white is
  idle time, the pipeline bubble. A single-stage plan is one row: compute, then
  communication (the estimate adds them; no overlap is modelled).
- `draw_mesh`: the cluster's devices, one row per node, coloured by the stage that runs on
  them, each device labelled with its coordinates in its stage's logical mesh.
- `draw_breakdown`: per stage, a bar of compute and of each kind of collective (and the
  send to the next stage), per micro-batch for pipelines. The plan records costs per stage,
  not per layer, so the bars are per stage.

`save(plan, path)` puts all three in one figure; the suffix of `path` picks the format.
Only `matplotlib.figure.Figure` is used (no pyplot), so nothing global changes in a program
that has its own matplotlib set up.
"""

from __future__ import annotations

import pathlib

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.pipeline_schedule import TaskKind
from alpa_lite.plan import Plan
from alpa_lite.plan.methods import describe
from alpa_lite.tools.report import simulate_plan, step_breakdown

KIND_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#8172b3",
                "transfer": "#55a868", "update": "#937860", "compute": "#4c72b0"}
# Collective kinds (per mesh axis): reds, purples, yellows, greys, cyans; never the blue of
# compute or the green of sends.
COMM_COLOURS = ("#c44e52", "#8172b3", "#ccb974", "#64b5cd", "#8c8c8c", "#e5ae38",
                "#da8bc3", "#937860", "#a1c9f4", "#ff9f9b", "#d0bbff", "#fab0e4")
FORMATS = (".png", ".svg")


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install 'alpa_lite[viz]'") from None
    return Figure


def _stage_colours(n: int):
    import matplotlib
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def draw_timeline(plan: Plan, ax) -> None:
    """The Gantt chart (module docstring) on a matplotlib Axes."""
    from matplotlib.patches import Patch

    if plan.pipeline is None:
        b = step_breakdown(plan)
        scale, unit = _time_unit(b.step_time_s)
        st = b.stages[0]
        ax.barh(0, st.compute_s * scale, left=0, height=0.6, color=KIND_COLOURS["compute"],
                edgecolor="white")
        left = st.compute_s
        for k, (name, t) in enumerate(st.comm_by_kind):
            ax.barh(0, t * scale, left=left * scale, height=0.6,
                    color=COMM_COLOURS[k % len(COMM_COLOURS)], edgecolor="white", label=name)
            left += t
        ax.set_yticks([0], ["stage 0"])
        ax.set_ylim(-0.6, 0.6)
        ax.set_xlim(0, b.step_time_s * scale * 1.01 if b.step_time_s else 1)
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(f"one step: compute {st.compute_s * scale:.3g} {unit} + communication "
                     f"{st.comm_s * scale:.3g} {unit} (single stage, no pipeline)",
                     fontsize=10)
        handles = [Patch(color=KIND_COLOURS["compute"], label="compute")] + \
            [Patch(color=COMM_COLOURS[k % len(COMM_COLOURS)], label=name)
             for k, (name, _) in enumerate(st.comm_by_kind)]
        ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
                  frameon=False)
        return
    p = plan.pipeline
    sim = simulate_plan(plan)
    total = sim.step_time_s + p.reduce_s + p.apply_s
    scale, unit = _time_unit(total)
    S = len(plan.stages)
    height = 0.62
    y_of = {s: S - 1 - s for s in range(S)}     # stage 0 on top
    min_label = total * scale / 60              # bars narrower than this get no number
    ends = {}
    for task in sim.tasks:
        y = y_of[task.stage]
        width = task.duration_s * scale
        ax.barh(y, width, left=task.start_s * scale, height=height,
                color=KIND_COLOURS[task.kind.value], edgecolor="white", linewidth=0.6)
        if width >= min_label:
            ax.text((task.start_s + task.duration_s / 2) * scale, y, str(task.micro_batch),
                    ha="center", va="center", fontsize=7, color="white")
        ends[(task.stage, task.micro_batch, task.kind)] = task.end_s
    # Transfers, on a lane between the rows of the two stages they join.
    for s in range(S - 1):
        send = p.send_s[s]
        if send <= 0:
            continue
        lane = (y_of[s] + y_of[s + 1]) / 2
        for i in range(p.num_micro_batches):
            for start in (ends.get((s, i, TaskKind.FORWARD)),
                          ends.get((s + 1, i, TaskKind.BACKWARD))):
                if start is not None:
                    ax.barh(lane, send * scale, left=start * scale, height=0.16,
                            color=KIND_COLOURS["transfer"], linewidth=0)
    if p.apply_s > 0:
        for s in range(S):
            ax.barh(y_of[s], p.apply_s * scale, left=(sim.step_time_s + p.reduce_s) * scale,
                    height=height,
                    color=KIND_COLOURS["update"], edgecolor="white", linewidth=0.6)
    ax.set_yticks([y_of[s] for s in range(S)],
                  [f"stage {s}\n{'x'.join(map(str, st.mesh_shape))}"
                   for s, st in enumerate(plan.stages)], fontsize=8)
    ax.set_ylim(-0.6, S - 0.4)
    ax.set_xlim(0, total * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"pipeline timeline: {S} stage(s), {p.num_micro_batches} micro-batches, "
                 f"{p.schedule}, bubble {sim.bubble_fraction:.1%} (white), step "
                 f"{total * scale:.4g} {unit}", fontsize=10)
    kinds = [("forward", "forward"), ("backward", "backward")]
    if any(st.remat for st in plan.stages):
        kinds.append(("recompute", "recompute"))
    if any(x > 0 for x in p.send_s):
        kinds.append(("transfer", "activation /\ngradient transfer"))
    if p.apply_s > 0:
        kinds.append(("update", "optimizer update"))
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=label) for k, label in kinds],
              loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)


def _cluster_shape(plan: Plan, cluster: Cluster | None) -> tuple[int, int]:
    """(nodes, devices per node) of the plan's cluster: the given cluster, else the preset
    of that name, else one row of the plan's devices."""
    if cluster is None and plan.cluster_name in Cluster.presets():
        cluster = Cluster.preset(plan.cluster_name)
    if cluster is not None and cluster.fingerprint() == plan.cluster_fingerprint:
        return cluster.num_nodes, cluster.devices_per_node
    n = max(d for st in plan.stages for d in st.devices) + 1
    return 1, n


def draw_mesh(plan: Plan, ax, cluster: Cluster | None = None) -> None:
    """The device grid coloured by stage (module docstring) on a matplotlib Axes."""
    from matplotlib.patches import Patch, Rectangle

    nodes, per_node = _cluster_shape(plan, cluster)
    colours = _stage_colours(len(plan.stages))
    where = {}
    for s, st in enumerate(plan.stages):
        cols = st.mesh_shape[-1] if st.mesh_shape else 1
        for k, d in enumerate(st.devices):
            where[d] = (s, (k // cols, k % cols) if len(st.mesh_shape) == 2 else (k,))
    for d in range(nodes * per_node):
        node, col = divmod(d, per_node)
        y = nodes - 1 - node
        s, coord = where.get(d, (None, None))
        face = colours[s] if s is not None else "#eeeeee"
        ax.add_patch(Rectangle((col + 0.05, y + 0.05), 0.9, 0.9, facecolor=face,
                               edgecolor="black", linewidth=0.8))
        text = f"{d}" if s is None else f"dev {d}\n{coord}"
        ax.text(col + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                color="white" if s is not None else "black")
    ax.set_xlim(0, per_node)
    ax.set_ylim(0, nodes)
    ax.set_xticks([])
    ax.set_yticks([nodes - 1 - n + 0.5 for n in range(nodes)],
                  [f"node {n}" for n in range(nodes)], fontsize=8)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    handles = []
    for s, st in enumerate(plan.stages):
        mesh = " x ".join(f"{n}={k}" for n, k in zip(st.axis_names, st.mesh_shape))
        layers = f"\nlayers {st.layers[0]}..{st.layers[1]}" if plan.pipeline else ""
        handles.append(Patch(color=colours[s], label=f"stage {s}: {mesh}{layers}"
                             f"{', remat' if st.remat else ''}"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              frameon=False, ncol=1 if len(handles) <= 8 else 2)
    ax.set_title(f"devices of {plan.cluster_name} by stage (label: device, coordinates in "
                 "its stage's logical mesh)", fontsize=10)


def draw_breakdown(plan: Plan, ax) -> None:
    """Compute and communication per stage (module docstring) on a matplotlib Axes."""
    from matplotlib.patches import Patch

    b = step_breakdown(plan)
    kinds = list(dict.fromkeys(name for st in b.stages for name, _ in st.comm_by_kind))
    comm_colour = {k: COMM_COLOURS[i % len(COMM_COLOURS)] for i, k in enumerate(kinds)}
    longest = max((st.compute_s + st.comm_s + st.send_s for st in b.stages), default=0.0)
    scale, unit = _time_unit(longest or 1.0)
    S = len(b.stages)
    for st in b.stages:
        y = S - 1 - st.stage
        left = 0.0
        segments = [("compute", st.compute_s, KIND_COLOURS["compute"])]
        segments += [(k, t, comm_colour[k]) for k, t in st.comm_by_kind]
        if st.send_s:
            segments.append(("send", st.send_s, KIND_COLOURS["transfer"]))
        for _, t, colour in segments:
            ax.barh(y, t * scale, left=left * scale, height=0.6, color=colour,
                    edgecolor="white", linewidth=0.6)
            left += t
        share = st.comm_s / (st.compute_s + st.comm_s) if st.compute_s + st.comm_s else 0
        ax.text(left * scale, y, f"  collectives {share:.0%}", va="center", fontsize=8)
    ax.set_yticks([S - 1 - s for s in range(S)], [f"stage {s}" for s in range(S)], fontsize=8)
    ax.set_xlim(0, longest * scale * 1.2 if longest else 1)
    per = "per micro-batch, forward + backward" if plan.pipeline else "per step"
    ax.set_xlabel(f"time ({unit}), {per}")
    ax.set_title("compute vs communication per stage (the plan records costs per stage, "
                 "not per layer)", fontsize=10)
    handles = [Patch(color=KIND_COLOURS["compute"], label="compute")]
    handles += [Patch(color=comm_colour[k], label=k) for k in kinds]
    if any(st.send_s for st in b.stages):
        handles.append(Patch(color=KIND_COLOURS["transfer"], label="send to next stage"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              frameon=False)


def figure(plan: Plan, cluster: Cluster | None = None,
           panels: tuple[str, ...] = ("timeline", "mesh", "breakdown")):
    """A matplotlib Figure with the chosen panels, top to bottom."""
    Figure = _figure_class()
    unknown = [p for p in panels if p not in ("timeline", "mesh", "breakdown")]
    if unknown or not panels:
        raise ValueError(f"panels must be among 'timeline', 'mesh', 'breakdown', got {panels}")
    S = len(plan.stages)
    nodes, per_node = _cluster_shape(plan, cluster)
    rows = min(S, 16) if plan.pipeline is not None else 0.5   # a single stage: one thin bar
    heights = {"timeline": 1.4 + 0.5 * rows, "mesh": 0.8 + 0.55 * min(nodes, 16),
               "breakdown": 1.2 + 0.35 * min(S, 16)}
    fig = Figure(figsize=(12, sum(heights[p] for p in panels) + 0.8 * len(panels)),
                 layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False,
                        height_ratios=[heights[p] for p in panels])[:, 0]
    for ax, panel in zip(axes, panels):
        if panel == "timeline":
            draw_timeline(plan, ax)
        elif panel == "mesh":
            draw_mesh(plan, ax, cluster)
        else:
            draw_breakdown(plan, ax)
    fig.suptitle(f"alpa_lite plan: {describe(plan.method)} on {plan.cluster_name}, "
                 f"estimated step {plan.step_time_s * 1e3:.4g} ms", fontsize=11)
    return fig


def save(plan: Plan, path, cluster: Cluster | None = None,
         panels: tuple[str, ...] = ("timeline", "mesh", "breakdown"), dpi: int = 110) -> None:
    """Writes the figure to `path` (.png or .svg)."""
    path = pathlib.Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"picture file {path} must end in .png or .svg")
    figure(plan, cluster, panels).savefig(path, dpi=dpi)
