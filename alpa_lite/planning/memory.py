"""Whole-stage memory: what one device of a stage holds at its peak, from the traced program
and the plan's shardings, and the planner's check that a plan fits its budget.

The intra-op ILP's memory model is linear in the strategy choice, so it only counts the
tensors live at the *unsharded* program's peak (`intra_op._live_at_peak`). Once the
shardings are chosen the whole stage can be estimated properly:

- every tensor costs `nbytes / num_shards(spec)` per device, with the spec the plan gives
  it (an argument's input spec, an operator result's constraint, a result's output spec);
- `stage_memory` walks the program in its (topological) order: arguments are held all
  step (the caller owns them), a value lives from its producer to its last reader, a step
  result from its producer to the end; a result tied to an argument (new parameters, new
  optimizer state) takes a buffer of its own unless the runtime donates the argument
  (`donate_tied`; the SPMD runtime does not); an operand the plan reshards for one reader
  (an all-gathered weight) is a transient buffer at that reader. The peak over the walk is
  the estimate, split by role (`MemoryEstimate`);
- `pipeline_stage_memory` is a pipelined stage: its parameters, one gradient accumulator
  per parameter, its optimizer state (split like the parameters), the stash the schedule
  holds (1F1B: min(stages - stage index, m) micro-batches; GPipe: all m; each the stage's
  inputs, plus the residuals unless it recomputes) and, as workspace, what one
  micro-batch's forward and backward need beyond that (the stage program's own walk).

What it leaves out: XLA fuses element-wise chains, so some intermediates the walk counts
never exist (the estimate errs high), and XLA may order operators differently from the
trace. `bench/memory_fidelity.py` compares it with `Compiled.memory_analysis()`.

`solve_within_memory` is the planner's guarantee: it re-solves the ILP with a budget
tightened by the overshoot until the whole-stage estimate fits, or raises PlanningError.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from alpa_lite.errors import MemoryBudgetError, PlanningError, detached, kept_answer
from alpa_lite.ir.graph import OpGraph, Role, per_graph
from alpa_lite.plan import StagePlan
from alpa_lite.plan.memory import MemoryEstimate, format_bytes
from alpa_lite.plan.sharding import LogicalMesh, TensorSpec, itemsize

_PARAMS, _GRADS, _OPT, _ACTS = "params", "grads", "optimizer_state", "activations"


def local_bytes(graph: OpGraph, tid: int, spec: TensorSpec | None, mesh: LogicalMesh) -> float:
    """Per-device bytes of tensor `tid` stored with `spec` (None: replicated)."""
    t = graph.tensors[tid]
    shards = spec.num_shards(mesh) if spec is not None else 1
    return t.size * itemsize(t.dtype) / shards


def _category(role: Role) -> str:
    return {Role.PARAM: _PARAMS, Role.GRAD: _GRADS, Role.OPT_STATE: _OPT}.get(role, _ACTS)


def stage_memory(graph: OpGraph, mesh: LogicalMesh, input_specs, output_specs,
                 tensor_specs, operand_specs=(), donate_tied: bool = False,
                 categories: Mapping[int, str] | None = None) -> MemoryEstimate:
    """The peak per-device memory of one SPMD program under the given shardings.

    Args:
      graph: the traced program (node order is the order assumed to run).
      mesh: the stage's logical mesh.
      input_specs, output_specs: per `graph.inputs` / `graph.outputs` entry.
      tensor_specs: (tensor id, spec) of operator results; a result without one is
        counted replicated.
      operand_specs: (node, operand position, spec) reshards; each is a transient buffer
        while that node runs.
      donate_tied: a result tied to an argument reuses the argument's buffer (the runtime
        donates it); False: it is a buffer of its own.
      categories: tensor id -> "params" / "grads" / "optimizer_state" / "activations",
        overriding the tensor's role (for stage programs whose inputs carry no roles).

    Returns:
      The `MemoryEstimate` at the walk's peak (`micro_batches_held` 1).
    """
    spec: dict[int, TensorSpec] = dict(tensor_specs)
    spec.update(zip(graph.inputs, input_specs))
    life = _lifetimes(graph)
    shards = np.ones(len(graph.tensors))
    counts: dict[TensorSpec, int] = {}
    for tid, sp in spec.items():
        if sp is not None:
            n = counts.get(sp)
            if n is None:
                n = counts[sp] = sp.num_shards(mesh)
            shards[tid] = n
    size = life.nbytes / shards
    # Step results: their buffer has the output spec, held from the producer to the end
    # (a tied one is free when donated; an argument passed straight through costs nothing).
    result_size: dict[int, float] = {}
    for out_pos, tid in enumerate(graph.outputs):
        if life.born[tid] < 0:
            continue
        donated = donate_tied and graph.output_ties[out_pos] is not None
        b = 0.0 if donated else local_bytes(graph, tid, output_specs[out_pos], mesh)
        result_size[tid] = max(result_size.get(tid, 0.0), b)
    for tid, b in result_size.items():
        size[tid] = b       # the result's own buffer replaces its operator's value
    transient = np.zeros(len(graph.nodes))
    for n, pos, sp in operand_specs:
        tid = graph.nodes[n].inputs[pos]
        if tid is not None:
            transient[n] += local_bytes(graph, tid, sp, mesh)
    category = life.category
    if categories:
        category = category.copy()
        for tid, c in categories.items():
            category[tid] = _CATEGORIES.index(c)
    return _peak(life, size, category, transient)


def memory_floor(graph: OpGraph, num_devices: int,
                 max_shards: Mapping[int, int] | None = None) -> MemoryEstimate:
    """The least whole-stage estimate (`stage_memory`) any sharding of `graph` over
    `num_devices` devices can reach: the same walk with every tensor split that many ways,
    or as many as `max_shards` allows it (a device never holds less of a tensor), results
    tied to arguments in buffers of their own as `stage_memory` counts them by default.
    Cheap, so a plan whose floor is over budget is refused before any ILP is built."""
    life = _lifetimes(graph)
    shards = np.full(len(graph.tensors), float(num_devices))
    for tid, n in (max_shards or {}).items():
        shards[tid] = n
    return _peak(life, life.nbytes / shards, life.category, np.zeros(len(graph.nodes)))


_CATEGORIES = (_PARAMS, _GRADS, _OPT, _ACTS)


@dataclasses.dataclass(frozen=True)
class _Lifetimes:
    """Per tensor id of one graph, what `stage_memory`'s walk needs whatever the shardings:
    its whole bytes, its category (an index into `_CATEGORIES`: by role, and a result
    tied to an argument, a new parameter, takes the argument's), and the nodes it is live
    over: an argument all step (`born` -1), a node's result from its producer to its last
    reader (`dies`; a step result to the end, a result nothing reads at its producer
    only), a tensor no node computes and no argument (`born` -2) never."""
    nbytes: np.ndarray
    category: np.ndarray
    born: np.ndarray
    dies: np.ndarray


@per_graph
def _lifetimes(graph: OpGraph) -> _Lifetimes:
    T, N = len(graph.tensors), len(graph.nodes)
    nbytes = np.array([t.size * itemsize(t.dtype) for t in graph.tensors], dtype=float)
    category = np.array([_CATEGORIES.index(_category(t.role)) for t in graph.tensors],
                        dtype=int)
    for out_pos, tie in enumerate(graph.output_ties):
        if tie is not None:
            category[graph.outputs[out_pos]] = category[graph.inputs[tie]]
    born = np.full(T, -2, dtype=int)
    dies = np.full(T, -2, dtype=int)
    for node in graph.nodes:
        for t in node.outputs:
            born[t] = dies[t] = node.id
        for t in node.inputs:
            if t is not None:
                dies[t] = max(dies[t], node.id)
    for t in graph.outputs:
        dies[t] = N - 1
    born[list(graph.inputs)] = -1
    return _Lifetimes(nbytes, category, born, dies)


def _peak(life: _Lifetimes, size: np.ndarray, category: np.ndarray,
          transient: np.ndarray) -> MemoryEstimate:
    """`stage_memory`'s walk: arguments held throughout, a value from its producer to its
    last reader, plus each node's transient buffers; the peak (its first node), split by
    category."""
    args = life.born == -1
    held = np.bincount(category[args], size[args], minlength=len(_CATEGORIES))
    at_peak, work = held, 0.0
    N = len(transient)
    made = life.born >= 0
    if N:
        delta = np.zeros(N + 1)
        np.add.at(delta, life.born[made], size[made])
        np.add.at(delta, life.dies[made] + 1, -size[made])
        total = np.cumsum(delta[:N]) + transient
        n = int(np.argmax(total))
        if total[n] > 0:
            live = made & (life.born <= n) & (life.dies >= n)
            at_peak = held + np.bincount(category[live], size[live],
                                         minlength=len(_CATEGORIES))
            work = float(transient[n])
    return MemoryEstimate(params=float(at_peak[0]), grads=float(at_peak[1]),
                          optimizer_state=float(at_peak[2]), activations=float(at_peak[3]),
                          workspace=work)


def stage_plan_memory(graph: OpGraph, stage: StagePlan, mesh: LogicalMesh,
                      donate_tied: bool = False) -> MemoryEstimate:
    """`stage_memory` of a single-stage plan's stage (the SPMD runtime donates nothing)."""
    return stage_memory(graph, mesh, stage.input_specs, stage.output_specs,
                        stage.tensor_specs, stage.operand_specs, donate_tied)


def held_micro_batches(schedule: str, num_stages: int, stage_index: int, m: int) -> int:
    """Micro-batches whose activations stage `stage_index` holds at once: 1F1B starts a
    backward once the warm-up forwards reach the last stage, so min(stages - index, m);
    GPipe runs every forward first, so m."""
    if schedule == "1f1b":
        return min(num_stages - stage_index, m)
    return m


def pipeline_stage_memory(fb: OpGraph, mesh: LogicalMesh, specs: Mapping[int, TensorSpec],
                          params, acts, residuals, param_grads, opt_state_ratio: float,
                          micro_batches_held: int, remat: bool,
                          operand_specs=()) -> MemoryEstimate:
    """The peak per-device memory of one pipelined stage (module docstring).

    Args:
      fb: the stage's forward-and-backward program for one micro-batch.
      mesh: the stage's logical mesh.
      specs: tensor id -> spec of every tensor of `fb` the plan places (inputs included).
      params, acts, residuals, param_grads: `fb` tensor ids of the stage's parameters,
        other inputs, values kept from forward to backward, and parameter gradients.
      opt_state_ratio: optimizer state bytes per parameter byte (Adam: 2), split like the
        parameters.
      micro_batches_held: `held_micro_batches(...)`.
      remat: the backward recomputes the forward: only the inputs are stashed.
    """
    def size(t):
        return local_bytes(fb, t, specs.get(t), mesh)

    p = sum(size(t) for t in params)
    g = sum(size(t) for t in param_grads)
    stash = sum(size(t) for t in acts) + (0.0 if remat else sum(size(t) for t in residuals))
    cats = {t: _PARAMS for t in params} | {t: _ACTS for t in fb.inputs if t not in set(params)}
    one = stage_memory(fb, mesh, [specs.get(t) for t in fb.inputs],
                       [specs.get(t) for t in fb.outputs],
                       [(t, s) for t, s in specs.items()], operand_specs, categories=cats)
    workspace = max(one.total - one.params - stash, 0.0)
    return MemoryEstimate(params=p, grads=g, optimizer_state=p * opt_state_ratio,
                          activations=stash * micro_batches_held, workspace=workspace,
                          micro_batches_held=micro_batches_held)


def over_budget_message(what: str, estimate: MemoryEstimate, budget: float, remedy: str) -> str:
    return (f"{what} needs {estimate.describe()} per device by the whole-stage memory "
            f"estimate, above the budget of {format_bytes(budget)} per device. {remedy}")


def solve_within_memory(built, budget: float, estimate, tries: int = 4,
                        solved: dict | None = None):
    """Solves `built` (an `intra_op.BuiltStage`) so that `estimate(result)`, the whole-stage
    memory of the plan it returns, is within `budget` bytes per device.

    The ILP's own memory model is approximate (bytes live at the unsharded program's peak),
    so a plan within its budget may not fit as a whole: then the ILP's budget is lowered by
    the overshoot and the stage solved again, up to `tries` times.

    `solved`: `built`'s solutions (or the PlanningError) by ILP budget, kept by the caller
    for the next call on the same problem with another `estimate` (a solve depends on the
    problem and the budget alone).

    Returns:
      (StageResult, MemoryEstimate) of the first plan that fits.

    Raises:
      PlanningError: no plan the ILP finds fits; the message gives the estimate, the budget
        and what to change.
    """
    solved = {} if solved is None else solved
    ilp_budget = budget
    est = None
    for _ in range(tries):
        if ilp_budget not in solved:
            try:
                solved[ilp_budget] = built.solve(ilp_budget)
            except PlanningError as e:
                solved[ilp_budget] = detached(e)
        res = kept_answer(solved[ilp_budget])
        est = estimate(res)
        if est.total <= budget:
            return res, est
        nxt = min(ilp_budget, res.memory_bytes) - (est.total - budget)
        if nxt < built.min_memory_bytes or nxt <= 0:
            break
        ilp_budget = nxt
    raise MemoryBudgetError(over_budget_message(
        f"the best plan on mesh {built.mesh.shape}", est, budget,
        "The planner re-solved with the budget tightened by the overshoot and found nothing "
        "that fits. Use more devices, a smaller batch, more micro-batches or remat, or raise "
        "memory_budget_bytes"), est.total)
