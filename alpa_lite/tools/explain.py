"""Why a plan is what it is: `alpa-lite explain plan.json [--op NAME]`.

Two levels, answered from different places:

- Stages (no `--op`): from the plan's serialised `Explanation`, written by the planner when
  it chose: for a single-stage `Auto` plan every logical mesh it solved; for an `Auto`
  pipeline the stage DP's alternatives (each chosen stage's other options, the pipeline
  with a boundary moved one layer, S equal stages) and the meshes the final whole-stage
  re-plan weighed. Nothing is planned again, so this is instant for any model size.
  Why serialise rather than re-plan: the search behind those numbers takes seconds to
  minutes (GPT-39B on 64 GPUs: 38 s) while its alternatives are a few hundred bytes, and a
  plan JSON can be explained on a machine that has neither the model nor the time.
- An operator (`--op NAME`): the intra-op problem of its stage is built again
  (`build_stage`, seconds) from the step (the plan's recorded source, or
  one named on the command line), the plan's shardings are mapped back onto that problem's
  strategy choices, and each strategy of the operator's ILP node is costed with
  `solvers.sharding_ilp.evaluate`, every other choice held as the plan has it. The
  problem is too large to serialise (tens of thousands of variables), and rebuilding it is
  the only way to cost strategies the solver did not pick.
- Stragglers (`--stragglers MODEL`): the plan's data-parallel replicas late by a delay
  model, and the expected step under synchronous all-reduce, dropping the k slowest and
  gradient coding (`cost_models.stragglers`), from the plan's own step-time breakdown
  (`straggler_inputs`). Only the first runs as SPMD; the other two are simulated.
"""

from __future__ import annotations

import dataclasses
import difflib
import io

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from alpa_lite.api import ParallelizedStep
from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.ir.graph import Role
from alpa_lite.ir.step_parts import split_step
from alpa_lite.cost_models import stragglers
from alpa_lite.plan import Plan, StagePlan, SyncCollective
from alpa_lite.plan.methods import Auto, DataParallel, Manual
from alpa_lite.plan.sharding import LogicalMesh, TensorSpec
from alpa_lite.plan.text import (
    bucket_sizes_table,
    choices_table,
    fmt_bytes,
    step_time_table,
    sync_buckets_line,
)
from alpa_lite.plan.timing import TimeKind
from alpa_lite.planning.intra_op import BuiltStage, StageOptions, build_stage
from alpa_lite.planning.pipeline import PipelinePlanner, forward_names, layer_node_ranges
from alpa_lite.planning.spmd import manual_pins
from alpa_lite.solvers.sharding_ilp import Solver, evaluate

KIND_TITLES = {
    "plan": "whole plans Auto weighed: one SPMD stage, the stage DP's pipeline per "
            "micro-batch count, the Megatron layouts (time: the whole step's estimate)",
    "mesh": "logical meshes planned whole (time: the stage's forward + backward of one "
            "micro-batch, or the whole step for a single stage)",
    "option": "the stage DP's options for these layers on this submesh (time: the stage's "
              "latency, summed over its layers)",
    "cut": "the DP's pipeline with a stage's last layer moved (time: pipeline latency, as "
           "above)",
    "stages": "whole pipelines under the stage DP's cost (time: pipeline latency = sum of "
              "stage latencies + (micro-batches - 1) x the slowest)",
}


def _console(buf) -> Console:
    return Console(file=buf, width=140, force_terminal=False, color_system=None)


def fmt_time(s: float) -> str:
    """Three significant digits in s, ms, µs or ns (explanations compare small numbers)."""
    if s == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def stage_text(plan: Plan, stage: int | None = None) -> str:
    """The stage-level explanation (module docstring) as text."""
    buf = io.StringIO()
    console = _console(buf)
    if stage is not None and not 0 <= stage < len(plan.stages):
        raise ValueError(f"--stage {stage}: the plan has stages 0..{len(plan.stages) - 1}")
    console.print(f"plan: {type(plan.method).__name__} on {plan.cluster_name}, "
                  f"{len(plan.stages)} stage(s), estimated step {fmt_time(plan.step_time_s)}")
    if plan.step_time is not None and stage is None:
        console.print(step_time_table(plan.step_time))
        for buckets in plan.sync_buckets:
            console.print(escape(sync_buckets_line(buckets)))
            if buckets.weighed:
                console.print(bucket_sizes_table(buckets))
    if plan.choices and stage is None:
        console.print(choices_table(plan))
    for s, st in enumerate(plan.stages):
        if stage is not None and s != stage:
            continue
        mesh = " x ".join(f"{n}={k}" for n, k in zip(st.axis_names, st.mesh_shape))
        what = f"layers {st.layers[0]}..{st.layers[1]}, " if plan.pipeline else ""
        console.print(f"\nstage {s}: {what}devices {st.devices[0]}..{st.devices[-1]}, mesh "
                      f"{mesh}{', remat' if st.remat else ''}")
    alts = plan.explanation.alternatives if plan.explanation is not None else ()
    if not alts:
        why = ("the method fixed the layout (Manual / DataParallel): there were no "
               "alternatives to weigh" if not isinstance(plan.method, Auto) else
               "this plan records no alternatives (made without them, e.g. by an older "
               "alpa_lite)")
        console.print(f"\nno alternatives recorded: {why}. `--op NAME` still explains an "
                      "operator's sharding.")
        return buf.getvalue()
    for kind in ("plan", "stages", "cut", "option", "mesh"):
        rows = [a for a in alts if a.kind == kind and (stage is None or a.stage in (-1, stage))]
        if not rows:
            continue
        console.print(f"\n{KIND_TITLES[kind]}")
        chosen = [a.time_s for a in rows if a.chosen and a.fits]
        table = Table(show_edge=False)
        for col in ("", "stage", "alternative", "time", "vs chosen", "memory/device", "fits"):
            table.add_column(col, justify="left" if col in ("", "alternative") else "right")
        for a in sorted(rows, key=lambda a: (a.stage, not a.fits, a.time_s)):
            ref = next((x.time_s for x in rows if x.chosen and x.stage == a.stage), None)
            if ref is None and chosen:
                ref = chosen[0]
            vs = f"{a.time_s / ref:.3f}x" if ref and a.fits and a.time_s > 0 else "-"
            table.add_row("*" if a.chosen else "", "all" if a.stage < 0 else str(a.stage),
                          escape(a.label), fmt_time(a.time_s) if a.time_s > 0 else "-", vs,
                          fmt_bytes(a.memory_bytes) if a.memory_bytes else "-",
                          "yes" if a.fits else "no")
        console.print(table)
    console.print("\n* = chosen. The stage DP chooses on its sum-over-layers estimate; the "
                  "final step time comes from planning each chosen stage whole and "
                  "simulating the schedule.")
    return buf.getvalue()


# ---- operators ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """One strategy of an operator's ILP node, with every other choice as the plan has it."""
    strategy: str           # the operator's own operand -> result specs and collectives
    op_compute_s: float     # the operator alone
    op_comm_s: float        # the collectives the operator's strategy implies
    node_s: float           # the ILP node: every operator sharing the choice (followers,
                            # the same operator in repeated layers), compute + collectives
    objective_s: float      # the whole stage's ILP objective (nodes + resharding edges)
    memory_bytes: float     # the ILP's per-device memory model
    chosen: bool


@dataclasses.dataclass(frozen=True)
class OpExplanation:
    stage: int
    op: str
    mesh: str
    shared_by: int                          # groups (repeated layers) tied to this choice
    strategies: tuple[StrategyCost, ...]    # the chosen first, then by objective
    memory_budget_bytes: float | None


def _check_cluster(plan: Plan, cluster: Cluster) -> None:
    if cluster.fingerprint() != plan.cluster_fingerprint:
        raise ValueError(f"the plan was made for cluster {plan.cluster_name!r} (fingerprint "
                         f"{plan.cluster_fingerprint}) but {cluster.name!r} has fingerprint "
                         f"{cluster.fingerprint()}; give the plan's own cluster")


def rebuild_stage(plan: Plan, step_fn, args, cluster: Cluster, stage: int = 0,
                  batch_argnums=None) -> BuiltStage:
    """The intra-op problem of `plan.stages[stage]`, built again from the step."""
    _check_cluster(plan, cluster)
    if plan.compression is not None:
        raise ValueError("explaining an operator of a compressed data-parallel plan is not "
                         "supported: its program runs per worker inside shard_map, not as "
                         "the intra-op problem planned here")
    if not 0 <= stage < len(plan.stages):
        raise ValueError(f"--stage {stage}: the plan has stages 0..{len(plan.stages) - 1}")
    st = plan.stages[stage]
    base = ParallelizedStep(step_fn, Auto(), None, batch_argnums)
    manual = tuple(st.axis_names) == ("dp", "tp")
    if plan.pipeline is None:
        traced = base.trace(*args)
        _check_program(plan.program_fingerprint, traced.fingerprint)
        graph = traced.graph
        names = {t.id: t.name for t in graph.tensors if t.role is not Role.ACTIVATION}
        mesh = LogicalMesh(tuple(st.mesh_shape), tuple(st.axis_names))
        if manual:
            dp, tp = st.mesh_shape
            pin, node_pin = manual_pins(graph, dp, tp,
                                        getattr(plan.method, "shard_optimizer_state", False),
                                        split_batch=isinstance(plan.method, DataParallel))
            return build_stage(graph, mesh, cluster, StageOptions(pin=pin, node_pin=node_pin,
                                                                  tensor_names=names))
        return build_stage(graph, mesh, cluster, StageOptions(tensor_names=names))
    p = plan.pipeline
    parts = split_step(step_fn, args, base.resolve_batch_argnums(len(args)), p.num_micro_batches)
    _check_program(plan.program_fingerprint, parts.outer.fingerprint)
    outer = parts.outer.graph
    names = {t.id: t.name for t in outer.tensors if t.role is not Role.ACTIVATION}
    planner = PipelinePlanner(parts, cluster, Solver.HIGHS, 60.0, forward_names(parts, names))
    bounds = layer_node_ranges(p.layer_starts, len(parts.forward.graph.nodes))
    a, b = st.layers
    if b >= len(bounds):
        raise ValueError(f"the plan's stage {stage} runs layers {a}..{b} but the step has "
                         f"{len(bounds)} layers; the step is not the one planned")
    prog = planner.layers_program(bounds, a, b)
    mesh = LogicalMesh(tuple(st.mesh_shape), tuple(st.axis_names), device_offset=st.devices[0])
    pins = Manual(dp=st.mesh_shape[0], tp=st.mesh_shape[1]) if manual else None
    # A memory-lean stage only narrowed the parameters' choices: its choice is in the
    # unpinned problem too, which also shows what the lean pin ruled out.
    return planner.build(prog, mesh, pins, False)


def _check_program(planned: str, now: str) -> None:
    if planned != now:
        raise ValueError(f"the step is not the one the plan was made for (program fingerprint "
                         f"{now}, the plan's {planned}): the model, its arguments or the "
                         "batch size changed; give the same ones (--target, --batch-size)")


def plan_choices(built: BuiltStage, st: StagePlan) -> tuple[int, ...]:
    """The strategy index of every ILP node under which the problem's operators get the
    shardings `st` records (its results, operand reshards and inputs)."""
    graph, units = built.graph, built.units
    off = units.offset
    result = dict(st.tensor_specs)
    result.update(zip(graph.inputs, st.input_specs))
    operands = {(n, p): spec for n, p, spec in st.operand_specs}

    def spec_of(tid: int) -> TensorSpec:
        return result.get(tid) or TensorSpec.replicated(len(graph.tensors[tid].shape))

    def matches(u: int, strategy) -> bool:
        if u < off:
            return strategy.out_specs[0] == spec_of(units.source_tensors[u])
        node = graph.nodes[u - off]
        if any(strategy.out_specs[k] != spec_of(t) for k, t in enumerate(node.outputs)):
            return False
        for pos, tid in enumerate(node.inputs):
            if tid is None or strategy.in_specs[pos] is None:
                continue
            if strategy.in_specs[pos] != operands.get((node.id, pos), spec_of(tid)):
                return False
        return True

    n_classes = len(built.problem.nodes)
    allowed: list[set[int] | None] = [None] * n_classes
    for gi, g in enumerate(built.groups):
        c = built.cls[gi]
        n = built.problem.nodes[c].num_strategies
        ok = {s for s in range(n)
              if all(matches(u, units.strategies[u][g.choice[u][s]]) for u in g.members)}
        allowed[c] = ok if allowed[c] is None else allowed[c] & ok
    if any(not a for a in allowed):
        bad = next(i for i, a in enumerate(allowed) if not a)
        raise ValueError(f"the plan's shardings are not a strategy choice of this stage's "
                         f"intra-op problem (node {built.problem.nodes[bad].name}): the plan "
                         "was made by another alpa_lite version or for another step")
    return tuple(min(a) for a in allowed)


def _find_unit(built: BuiltStage, name: str) -> int:
    graph, units = built.graph, built.units
    names = built.tensor_names or {}
    candidates: dict[str, int] = {}
    for node in graph.nodes:
        u = units.offset + node.id
        candidates[node.name] = u
        if node.scope:
            candidates[f"{node.name}@{node.scope}"] = u
    for tid, u in units.unit_of_source.items():
        candidates[names.get(tid, graph.tensors[tid].name)] = u
        candidates.setdefault(graph.tensors[tid].name, u)
    if name in candidates:
        return candidates[name]
    close = difflib.get_close_matches(name, list(candidates), n=5, cutoff=0.6)
    raise ValueError(f"no operator or input named {name!r} in this stage"
                     + (f"; close: {close}" if close else "")
                     + " (names are in the sharding table of alpa-lite show, e.g. "
                     "dot_general_12 or params/w1)")


def explain_op(plan: Plan, step_fn, args, cluster: Cluster, op: str, stage: int = 0,
               batch_argnums=None, top: int = 8) -> OpExplanation:
    """The chosen strategy of `op` and its runner-ups (module docstring)."""
    built = rebuild_stage(plan, step_fn, args, cluster, stage, batch_argnums)
    choices = plan_choices(built, plan.stages[stage])
    u = _find_unit(built, op)
    gi = built.group_of[u]
    c = built.cls[gi]
    g = built.groups[gi]
    node = built.problem.nodes[c]
    rows = []
    seen = set()
    for s in range(node.num_strategies):
        trial = list(choices)
        trial[c] = s
        node_cost, edge_cost, memory = evaluate(built.problem, trial)
        strategy = built.units.strategies[u][g.choice[u][s]]
        row = StrategyCost(strategy=strategy.describe(), op_compute_s=strategy.compute_s,
                           op_comm_s=strategy.comm_s, node_s=node.costs[s],
                           objective_s=node_cost + edge_cost, memory_bytes=memory,
                           chosen=s == choices[c])
        key = (row.strategy, round(row.objective_s, 15))
        if key in seen and not row.chosen:
            continue
        seen.add(key)
        rows.append(row)
    rows.sort(key=lambda r: (not r.chosen, r.objective_s))
    rows = rows[:1] + rows[1:top + 1]
    st = plan.stages[stage]
    budget = cluster.device.memory_bytes if plan.pipeline is None and \
        tuple(st.axis_names) != ("dp", "tp") else None
    return OpExplanation(stage=stage, op=op,
                         mesh=" x ".join(f"{n}={k}" for n, k in zip(st.axis_names, st.mesh_shape)),
                         shared_by=sum(1 for x in built.cls if x == c), strategies=tuple(rows),
                         memory_budget_bytes=budget)


def op_text(e: OpExplanation) -> str:
    """An `OpExplanation` as text."""
    buf = io.StringIO()
    console = _console(buf)
    chosen = e.strategies[0]
    console.print(f"{e.op} in stage {e.stage} (mesh {e.mesh})")
    console.print(f"chosen: {escape(chosen.strategy)}")
    shared = f", in {e.shared_by} repeated layers" if e.shared_by > 1 else ""
    console.print(f"  the operator: compute {fmt_time(chosen.op_compute_s)} + its "
                  f"collectives {fmt_time(chosen.op_comm_s)}; its ILP node (the operators "
                  f"that share this choice{shared}): {fmt_time(chosen.node_s)}; the "
                  f"stage's objective {fmt_time(chosen.objective_s)}")
    table = Table(show_edge=False, title="its strategies, every other choice as planned "
                  "(objective = every node's compute + collectives + resharding between them)")
    for col in ("", "strategy: operands -> result +collectives", "op compute", "op comm",
                "ILP node", "stage objective", "vs chosen", "memory"):
        table.add_column(col, justify="left" if col in ("", ) or col.startswith("strategy")
                         else "right", no_wrap=not col.startswith("strategy"))
    for r in e.strategies:
        fits = "" if e.memory_budget_bytes is None or r.memory_bytes <= e.memory_budget_bytes \
            else " (over budget)"
        delta = r.objective_s - chosen.objective_s
        table.add_row("*" if r.chosen else "", escape(r.strategy), fmt_time(r.op_compute_s),
                      fmt_time(r.op_comm_s), fmt_time(r.node_s), fmt_time(r.objective_s),
                      "-" if r.chosen else f"+{fmt_time(delta)}" if delta >= 0 else
                      f"-{fmt_time(-delta)}", fmt_bytes(r.memory_bytes) + fits)
    console.print(table)
    if len(e.strategies) == 1:
        console.print("no other strategy: the method's pins leave this operator one choice")
    return buf.getvalue()


# ---- stragglers ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StragglerInputs:
    """What the straggler model takes from a plan (`straggler_inputs`).

    Attributes:
      num_workers: the data-parallel replicas: the devices (or device groups) whose partial
        gradients the gradient all-reduce sums.
      workers_note: how `num_workers` was found.
      compute_s: T, a replica's step on its share of the batch: the plan's step less its
        gradient sync and optimizer update (compute, intra-op collectives, a pipeline's
        bubble and sends: everything that grows with the share).
      sync_s: the gradient sync the step waits for after the backward (the exposed part;
        the part hidden under the backward stays hidden under a late replica's backward).
      fixed_s: the optimizer update.
    """
    num_workers: int
    workers_note: str
    compute_s: float
    sync_s: float
    fixed_s: float


def data_parallel_replicas(plan: Plan) -> tuple[int, str]:
    """(replicas, how they were counted). A compressed plan: every device is a worker.
    Otherwise per stage, the mesh axes over which most of its gradient bytes are reduced
    (`Plan.gradient_sync`): a parameter's gradient is a partial sum over exactly the axes
    that split the batch, so their size is the number of replicas; a pipelined plan takes
    its stage with the most (a replica is then one device group per stage, late when any
    of them is)."""
    if plan.compression is not None:
        return (len(plan.stages[0].devices),
                "every device is a worker of the compressed exchange")
    best = (1, "no gradient is reduced across devices")
    for s, st in enumerate(plan.stages):
        by_axes: dict[tuple[str, ...], int] = {}
        for g in plan.gradient_sync:
            if g.stage == s and g.axes and g.collective is not SyncCollective.NONE:
                by_axes[g.axes] = by_axes.get(g.axes, 0) + g.nbytes * max(g.count, 1)
        if not by_axes:
            continue
        axes = max(by_axes, key=lambda a: (by_axes[a], a))
        size = dict(zip(st.axis_names, st.mesh_shape))
        n = 1
        for a in axes:
            n *= size[a]
        if n > best[0]:
            where = f"stage {s}'s " if len(plan.stages) > 1 else ""
            best = (n, f"{where}mesh axes {' x '.join(f'{a}={size[a]}' for a in axes)}, "
                       "over which the gradients are reduced")
    return best


def straggler_inputs(plan: Plan) -> StragglerInputs:
    """The replicas and the step's parts (`StragglerInputs`) from the plan's own estimate."""
    n, how = data_parallel_replicas(plan)
    total = plan.step_time_s
    if plan.step_time is not None:
        sync = plan.step_time.seconds(TimeKind.GRADIENT_SYNC) + \
            plan.step_time.seconds(TimeKind.COMPRESSION)
        fixed = plan.step_time.seconds(TimeKind.OPTIMIZER_UPDATE)
    else:   # a plan without its breakdown (an older alpa_lite): the engine's own parts
        fixed = plan.pipeline.apply_s if plan.pipeline is not None else 0.0
        if plan.compression is not None:
            sync = plan.compression.sync_s
        elif plan.pipeline is not None:
            sync = plan.pipeline.reduce_s
        else:
            sync = sum(g.time_s for g in plan.gradient_sync)
    sync = min(sync, total)
    fixed = min(fixed, total - sync)
    return StragglerInputs(num_workers=n, workers_note=how, compute_s=total - sync - fixed,
                           sync_s=sync, fixed_s=fixed)


def straggler_text(plan: Plan, delays: stragglers.DelayModel,
                   ks: tuple[int, ...] | None = None, samples: int = 20_000,
                   seed: int = 0) -> str:
    """The straggler table of a plan: one row per policy (`cost_models.stragglers`).

    Raises:
      ValueError: a k of `ks` the plan's replicas cannot drop or tolerate.
    """
    inp = straggler_inputs(plan)
    n = inp.num_workers
    buf = io.StringIO()
    console = _console(buf)
    console.print(f"\nstragglers: {n} data-parallel replica{'s' if n > 1 else ''} "
                  f"({inp.workers_note}), each late by {delays.describe()}", markup=False)
    console.print(f"  T = {fmt_time(inp.compute_s)} per replica (the plan's step less gradient "
                  f"sync and update), all-reduce {fmt_time(inp.sync_s)} (its exposed gradient "
                  f"sync), update {fmt_time(inp.fixed_s)}", markup=False)
    if n == 1:
        if ks:
            raise ValueError(f"k={','.join(map(str, ks))}: the plan has one "
                             "data-parallel replica, none to drop or code around")
        schemes = (stragglers.StragglerScheme(stragglers.StragglerPolicy.SYNC),)
        console.print("  one replica: nobody to drop or code around; its delay adds to "
                      "the step")
    else:
        schemes = stragglers.default_schemes(n, ks)
    rows = stragglers.expected_step_times(n, inp.compute_s, inp.sync_s, delays, schemes,
                                          fixed_s=inp.fixed_s, samples=samples, seed=seed)
    sync_s = rows[0].expected_step_s
    table = Table(show_edge=False)
    for col in ("policy", "expected step", "vs sync", "Monte Carlo", "waits", "+compute",
                "grad x", "SPMD", "notes"):
        table.add_column(col, justify="left" if col in ("policy", "notes", "SPMD")
                         else "right", no_wrap=col != "notes")
    for r in rows:
        table.add_row(r.scheme.label, fmt_time(r.expected_step_s),
                      f"{r.expected_step_s / sync_s:.3f}x" if sync_s > 0 else "-",
                      f"{fmt_time(r.monte_carlo_s)} ± {fmt_time(r.monte_carlo_stderr_s)}",
                      f"{r.waits_for}/{n}", fmt_time(r.extra_compute_s),
                      f"{r.gradient_scale:.4g}", "runs" if r.spmd_executable else "simulated",
                      escape(r.note))
    console.print(table)
    closed = rows[0].closed_form_s is not None
    console.print(
        "E[step] = load x T + E[r-th earliest delay of n] + all-reduce + update; "
        + ("exponential delays: E[r-th of n] = mean x (H_n - H_(n-r)) (Renyi), the Monte "
           "Carlo column a cross-check" if closed else "no closed form for measured "
           "delays: the expected step is the Monte Carlo mean")
        + f" ({samples} draws, seed {seed}). Dropping the k slowest rescales the sum of "
        "the others by n/(n-k) to stay unbiased (while lateness is independent of the "
        "data); coded: gradient coding, each replica computes s+1 shares and any n-s "
        "decode the exact gradient. Both are simulated only: every device must join each "
        "SPMD collective, so the SPMD program cannot leave the late ones out.", markup=False)
    return buf.getvalue()
