"""Pipelined plans: layers -> stages x submeshes (the stage DP) -> intra-op ILP per stage.

`make_pipeline_plan(parts, method, cluster)` plans a step split by `pipeline_program`:

- `Manual(dp, tp, pp, ...)`: the layers are split evenly (or as `layer_ranges` says) over pp
  stages of dp x tp devices each, and every stage gets the Megatron layout of the
  single-stage planner.
- `Auto(num_micro_batches=m)`: Alpa's inter-op search. Every layer is planned alone on every
  logical mesh of every submesh shape (identical layers, e.g. transformer blocks, are solved
  once: they share a structural hash); a stage's cost on a logical mesh is the sum over its
  layers, with and without recomputation; `solvers.stage_dp` picks the stages, submeshes
  and meshes with the least pipeline latency within device memory. The chosen stages are
  then planned whole, which is what the runtime executes and the estimate reports.

A stage's estimate is its forward+backward ILP objective for one micro-batch (compute and
the collectives its shardings imply); the step time is the schedule simulator's, with the
activation transfers between stages, and the optimizer update each stage runs on its share
(priced per fused kernel, as the single-stage planner prices it).

An Auto pipeline is returned only when every stage's whole-stage memory estimate fits: a
stage that overshoots sends the stage DP back with its budget lowered by the overshoot, and
so does one the whole-stage re-plan could fit only by making it slower than the DP weighed
it, the faster pipeline kept (`settle_stages`). Layer solutions are memoised by structure
within a plan, shared by the candidates of one search (`PlannerPool`) and kept on disk
across plans (`planning.cache`).
A Manual layout's memory floor (`manual_memory_floor`) lets a search skip layouts that
cannot fit without solving any ILP; likewise an `Auto` count whose layers, each split
over all the devices of its stage, fit no pipeline is refused before any ILP
(`_refuse_below_floor`: the stage DP on those floors, a relaxation of the DP on the plans).
A layer's memory-lean problem is its fastest one with the parameters' strategies cut to
their finest splits (`BuiltStage.restricted`), solved in the same worker task: one build
per layer and mesh.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Callable, Mapping, Sequence

import numpy as np

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.collectives import send_recv_time
from alpa_lite.cost_models.pipeline_schedule import (
    StageTiming,
    schedule_from_name,
    simulate,
)
from alpa_lite.errors import MemoryBudgetError, PlanningError, detached, kept_answer
from alpa_lite.ir.batch import batch_dims
from alpa_lite.ir.graph import Role
from alpa_lite.ir.op_rules import DimLabels, enumerate_assignments
from alpa_lite.ir.step_parts import (
    StageProgram,
    StepParts,
    stage_program,
)
from alpa_lite.plan import (
    Alternative,
    Choice,
    Explanation,
    PipelineSpec,
    Plan,
    PlanningStats,
    StagePlan,
)
from alpa_lite.plan.memory import MemoryEstimate, format_bytes
from alpa_lite.plan.methods import Auto, Manual
from alpa_lite.plan.plan import AuxCombination, Combine
from alpa_lite.plan.sharding import CommModel, LogicalMesh, TensorSpec, itemsize
from alpa_lite.planning.cache import (
    cache_dir,
    cache_key,
    load_object,
    mesh_cluster,
    save_object,
)
from alpa_lite.planning.fusion import fuse
from alpa_lite.planning.gradient_sync import (
    PlannedStage,
    batch_axes,
    grad_reduction_ops,
    gradient_nodes,
    stage_sync,
)
from alpa_lite.planning.stage_exchange import ExchangeRequest
from alpa_lite.planning.intra_op import (
    AmortizedReductions,
    BuiltStage,
    MeshMemo,
    StageOptions,
    StageResult,
    build_stage,
)
from alpa_lite.planning.layers import forward_layers
from alpa_lite.planning.memory import (
    held_micro_batches,
    memory_floor,
    pipeline_stage_memory,
    solve_within_memory,
)
from alpa_lite.planning.spmd import manual_pins, solver_for
from alpa_lite.planning.strategies import node_compute_time
from alpa_lite.planning.step_time import pipeline_step_time
from alpa_lite.planning.update_placement import place_update
from alpa_lite.planning.workers import map_forked, stream_forked, usable_cores
from alpa_lite.progress import CLUSTER, DP, ILPS, Progress, report
from alpa_lite.solvers.stage_dp import (
    NoFeasiblePipelineError,
    OptionColumns,
    StageOptionGrid,
    SubmeshShape,
    range_pairs,
    solve_stage_dp,
    submesh_shapes,
)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One range on one logical mesh: what the DP and the estimate need."""
    result: StageResult
    forward_s: float
    backward_s: float
    param_bytes: float      # per device: params, gradient accumulators, optimizer state
    weight_bytes: float     # per device: the params alone
    act_bytes: float        # per device, per micro-batch in flight, without recomputation
    input_bytes: float      # per device, per micro-batch in flight, with recomputation
    output_bytes: float     # whole activations handed to the next stage, per micro-batch
    grad_sync_s: float = 0.0   # the parameter gradients' reductions inside one backward
    reduce_once_s: float = 0.0  # the same bytes reduced once, one collective per kind and axes

    def search_backward_s(self, m: int) -> float:
        """The backward as the search weighs it per micro-batch: a stage that accumulates
        its gradients reduces them once per step, in one collective, so each of the m
        micro-batches carries 1/m of that in place of its own reductions
        (`planning.gradient_sync` settles it for the chosen stages)."""
        return self.backward_s - self.grad_sync_s + self.reduce_once_s / m

    def search_time_s(self, m: int, remat: bool) -> float:
        """One micro-batch's forward and backward as the search weighs it (with `remat`,
        the forward runs again in the backward)."""
        return self.forward_s * (2 if remat else 1) + self.search_backward_s(m)


@dataclasses.dataclass(frozen=True)
class Solved:
    """One intra-op job's answer as `PipelinePlanner._solve` gives it: the plan's cost or
    why there is none, whether an ILP was solved for it or the disk cache had it, and the
    ILP's build and solve time."""
    answer: "StageCost | PlanningError"
    solved: bool = False
    cache_hit: bool = False
    build_s: float = 0.0
    solve_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class FitProblem:
    """The whole-stage problem `PipelinePlanner.fit_within` last built: its job key
    (structure, mesh, layout, lean), the built problem, and its solutions by ILP memory
    budget (filled in by `solve_within_memory`)."""
    key: tuple
    built: BuiltStage
    solved: dict


@dataclasses.dataclass(frozen=True)
class PlannerWork:
    """A `PipelinePlanner`'s counters (`PipelinePlanner.counters`); a difference of two is
    the work done between them."""
    ilps: int
    build_s: float
    solve_s: float
    asked: int
    cache_hits: int

    def __sub__(self, other: "PlannerWork") -> "PlannerWork":
        return PlannerWork(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                     dataclasses.astuple(other))))


class PipelinePlanner:
    def __init__(self, parts: StepParts, cluster: Cluster, solver, time_limit_s: float,
                 names: Mapping[int, str], progress: Progress | None = None,
                 exhaustive: bool = False):
        self.parts = parts
        self.progress = progress
        # A Manual layout keeps every batch-carrying value split over dp (compressed data
        # parallelism exchanges each replica's gradients: the ILP may not gather the batch
        # to skip the exchange, as it may on a slow link otherwise).
        self.split_batch = False
        self.queued = 0         # intra-op problems asked for, and those done (for progress)
        self.done = 0
        self.cluster = cluster
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.names = names
        fwd = parts.forward.graph
        self.fwd_bdims = batch_dims(fwd)
        self.opt_ratio = _opt_state_ratio(parts)
        self.programs: dict[tuple, StageProgram] = {}     # by (start, stop, cuts)
        self.costs: dict[tuple, StageCost] = {}
        self.ilps = 0           # intra-op problems solved
        self.build_s = 0.0
        self.solve_s = 0.0
        self.memos: dict[tuple, MeshMemo] = {}
        self.options: dict[tuple, tuple[StageCost, StageCost]] = {}   # `_layer_options`
        # Logical meshes (shape, axis names) whose memory-lean layer plans cannot help at
        # a budget of at least the bytes held here (`lean_pruned_at`): a stage search
        # again at a lowered budget (`settle_stages`) plans them where they now can.
        self.lean_pruned: dict[tuple, float] = {}
        self.asked: set[tuple] = set()     # (range, mesh, pins) plans asked for
        self.dims: dict = {}               # reuse key -> every dimension size of its tensors
        self.cache_hits = 0                # of them, read from the disk cache
        # `fit_within`'s answers: a stage search that re-plans after a stage overshot often
        # picks some of the same stages again, and re-solving them gives the same answer.
        self.fitted: dict[tuple, tuple[StageCost, MemoryEstimate] | PlanningError] = {}
        # `_amortized_fit`'s answers, by job, accumulation axes, micro-batches, held
        # micro-batches, remat and budget: the re-planned stage (unmoved), or None.
        self.amortized: dict[tuple, tuple[StageCost, MemoryEstimate] | None] = {}
        # The problem the last fit built, and its solutions by ILP budget: the stages of a
        # pipeline that share a structure and a mesh shape (a Megatron layout's middle
        # stages) differ only in the micro-batches they hold, so they fit one problem,
        # and its first solve, at the budget itself, is the same for all of them. Only
        # the last is kept: a problem holds a whole stage's strategies.
        self.fit_problem: FitProblem | None = None
        # Exhaustive: every layer range solved on its own, nothing pruned (for checking
        # that reuse and pruning lose nothing).
        self.exhaustive = exhaustive

    def counters(self) -> "PlannerWork":
        """The work done so far: intra-op problems solved, their build and solve time,
        plans asked for, and those read from the disk cache."""
        return PlannerWork(self.ilps, self.build_s, self.solve_s, len(self.asked),
                           self.cache_hits)

    def reuse_key(self, prog: StageProgram):
        """What intra-op plans are memoised by: the range's structure (identical layers
        are one problem), or with `exhaustive` the range itself."""
        return (prog.structure, id(prog)) if self.exhaustive else prog.structure

    def job_key(self, prog: StageProgram, mesh: LogicalMesh, manual: Manual | None,
                lean: bool) -> tuple:
        """What an intra-op plan of a range on a logical mesh is memoised by (`cost`,
        `prefetch`, `fit_within`): its reuse key, the mesh's shape and axes, the pins."""
        return (self.reuse_key(prog), mesh.shape, mesh.axis_names, manual, lean)

    def layer_mesh(self, prog: StageProgram, mesh: LogicalMesh) -> LogicalMesh:
        """The mesh whose intra-op plan of `prog` is the plan on `mesh`: `mesh` itself, or,
        where its outer axis divides no dimension of any of the program's tensors, the
        mesh without it. A split needs the axis (alone or with the other) to divide the
        dimension, so nothing splits over such an axis: every device along it runs the
        whole program on the same values, and the plan on (a, b) has the strategies,
        costs and per-device memory of the plan on (1, b), whose inner axis is the same
        devices of a node. (GPT-175B's dimensions are 2^a 3^b 5^c with b, c <= 2: on 1024
        A100s, 1,256 of its 1,545 layer-mesh pairs plan as one node.) With `exhaustive`,
        every mesh is planned."""
        if self.exhaustive or mesh.shape[0] == 1:
            return mesh
        key = self.reuse_key(prog)
        if key not in self.dims:
            self.dims[key] = frozenset(d for t in prog.fb.graph.tensors for d in t.shape)
        if any(d % mesh.shape[0] == 0 for d in self.dims[key]):
            return mesh
        return LogicalMesh((1,) + mesh.shape[1:], mesh.axis_names, mesh.device_offset)

    def program(self, start: int, stop: int, cuts: Sequence[int] = ()) -> StageProgram:
        """The stage program of forward nodes [start, stop); `cuts`: the layer starts
        inside it (`stage_program` chains the layers' programs)."""
        key = (start, stop, tuple(cuts))
        if key not in self.programs:
            self.programs[key] = stage_program(self.parts.forward, start, stop, cuts)
        return self.programs[key]

    def layers_program(self, bounds: Sequence[tuple[int, int]], a: int, b: int
                       ) -> StageProgram:
        """The stage program of layers a..b (`bounds`: each layer's node range)."""
        return self.program(bounds[a][0], bounds[b][1], layer_cuts(bounds, a, b))

    def seeds(self, prog: StageProgram) -> dict[int, int | None]:
        """Batch dimension of each fb input that is not a parameter (cotangents follow their
        outputs)."""
        seeds: dict[int, int | None] = {}
        for t_fb, t in zip(prog.fb_acts, prog.acts):
            seeds[t_fb] = self.fwd_bdims.get(t)
        diff_outs = [t for t, d in zip(prog.outputs, prog.diff_outputs) if d]
        for t_fb, t in zip(prog.fb_cts, diff_outs):
            seeds[t_fb] = self.fwd_bdims.get(t)
        return seeds

    def input_names(self, prog: StageProgram) -> dict[int, str]:
        """The step's names for the stage's parameters and inputs (fb tensor id -> name)."""
        fb = prog.fb.graph
        return {t_fb: self.names.get(t, fb.tensors[t_fb].name)
                for t_fb, t in zip(fb.inputs, prog.params + prog.acts)}

    def _renamed(self, cost: StageCost, prog: StageProgram) -> StageCost:
        """A memoised plan with this range's own input names in its sharding table (the
        table starts with the stage inputs, in order)."""
        st = cost.result.stage
        names = self.input_names(prog)
        fb_inputs = prog.fb.graph.inputs
        table = tuple((names.get(fb_inputs[i], n), spec) if i < len(fb_inputs) else (n, spec)
                      for i, (n, spec) in enumerate(st.shardings))
        stage = dataclasses.replace(st, shardings=table)
        return dataclasses.replace(cost, result=dataclasses.replace(cost.result, stage=stage))

    def cost(self, prog: StageProgram, mesh: LogicalMesh, manual: Manual | None,
             lean: bool = False) -> StageCost:
        """The intra-op plan of a range on a logical mesh, memoised by structure: the
        fastest, or with `lean` the fastest with every parameter split as finely as the mesh
        allows (the memory-lean option; its gradient and optimizer state follow it).
        Submeshes are placed node-aligned (`_place`), where a block's links do not depend
        on where it starts, so one plan serves every offset (its device list is moved)."""
        key = self.job_key(prog, mesh, manual, lean)
        self.asked.add((id(prog), mesh.shape, mesh.axis_names, manual, lean))
        if key not in self.costs:
            self._queue(1)
            self._record(key, self._solve(prog, mesh, manual, lean))
        cost = kept_answer(self.costs[key])
        return self._renamed(_moved(cost, mesh.device_offset), prog)

    def prefetch(self, jobs) -> None:
        """Plans the (program, mesh, manual, lean) jobs `cost` has not memoised, on every
        usable core (`planning.workers`: forked processes, since the build is Python). The
        jobs of one logical mesh go to one worker, in one task, so that they share the
        mesh's memo (strategies and reshard costs) as they would here; what a worker adds to
        a memo is not sent back, so a later round's workers build it again. Each job is
        planned exactly as `cost` would, alone; a job that cannot be planned is remembered,
        and `cost` raises its error."""
        todo = {}
        for prog, mesh, manual, lean in jobs:
            key = self.job_key(prog, mesh, manual, lean)
            if key not in self.costs:
                todo.setdefault(key, (key, prog, mesh, manual, lean))
        if not todo:
            return
        self._queue(len(todo))
        by_mesh: dict[tuple, list] = {}
        for job in todo.values():
            by_mesh.setdefault((job[2].shape, job[2].axis_names), []).append(job)
        tasks = list(by_mesh.values())
        if len(tasks) < usable_cores():
            # Fewer meshes than cores (a pipeline's stages fitted whole, often all on one
            # mesh shape): a task per job, so that every core plans; the memo a task
            # would share is rebuilt per worker.
            tasks = [[job] for job in todo.values()]

        def solve_task(task):
            return [self._solve(*job[1:]) for job in task]

        def record(i, outcome):
            for job, solved in zip(tasks[i], outcome.get()):
                self._record(job[0], solved)

        map_forked(solve_task, tasks, record)

    def run_walks(self, walks: Sequence, jobs: Sequence[tuple]) -> list:
        """Each walk (a generator that yields the (program, mesh, manual, lean) job it is
        about to read with `cost`, and returns its result) run to its end; their results,
        in order. `jobs`: every job any walk may yield, repeats allowed (the workers fork
        knowing them).

        The jobs are planned on every usable core as the walks ask for them: a walk goes
        on as soon as its own job is answered, so the cores stay busy while any walk has a
        job to plan (a walk reads only its own jobs, so this decides what running the
        walks one after another would). A job two walks ask for is planned once."""
        distinct = {self.job_key(*job): job for job in jobs}
        keys = list(distinct)
        index = {key: i for i, key in enumerate(keys)}
        results: list = [None] * len(walks)
        waiting: dict[int, tuple] = {}        # walk -> the job key it waits on
        asked: set[tuple] = set()

        def advance(w: int) -> None:
            while True:
                try:
                    job = next(walks[w])
                except StopIteration as stop:
                    results[w] = stop.value
                    waiting.pop(w, None)
                    return
                key = self.job_key(*job)
                if key not in self.costs:
                    if key not in index:
                        raise AssertionError(f"a walk asked for a job not given: {key}")
                    waiting[w] = key
                    return

        def ask() -> list[int]:
            new = [index[k] for k in dict.fromkeys(waiting.values()) if k not in asked]
            asked.update(keys[i] for i in new)
            self._queue(len(new))
            return new

        def answered(i: int, outcome) -> list[int]:
            self._record(keys[i], outcome.get())
            for w in [w for w, k in waiting.items() if k == keys[i]]:
                advance(w)
            return ask()

        for w in range(len(walks)):
            advance(w)
        stream_forked(lambda job: self._solve(*job), list(distinct.values()), ask(),
                      answered, expected=len(waiting))
        return results

    def lean_pruned_at(self, mesh: LogicalMesh, budget: float) -> bool:
        """Whether `mesh`'s memory-lean layer plans cannot help a stage search at
        `budget` (`prefetch_layers` found every layer's fastest plan fits it)."""
        need = self.lean_pruned.get((mesh.shape, mesh.axis_names))
        return need is not None and need <= budget

    def prefetch_layers(self, progs, meshes, in_flight: int | None, budget: float) -> None:
        """Every distinct layer of `progs` (all the layers of the step) planned on each of
        `meshes`, fastest and memory-lean, as `_layer_options` asks for them, on every
        usable core: one task per mesh. A task solves the mesh's fastest plans, decides
        whether the lean ones can help (not where every layer's fastest plan, all in one
        stage holding `in_flight` micro-batches, fits `budget`: a lean plan is never faster,
        it only saves memory; `in_flight` None: they always may), and derives each lean
        problem it needs from the fastest one it built (`BuiltStage.restricted`). The
        meshes whose lean plans cannot help go to `lean_pruned`, with the memory that
        decided it."""
        count = collections.Counter(self.reuse_key(prog) for prog in progs)
        first = {self.reuse_key(prog): prog for prog in reversed(progs)}
        distinct = [(key, first[key], n) for key, n in count.items()]

        # Per mesh, the mesh each distinct layer is planned on (`layer_mesh`).
        homes = {mesh: [self.layer_mesh(prog, mesh) for _, prog, _ in distinct]
                 for mesh in meshes}

        def job_key(i: int, mesh, lean: bool) -> tuple:
            at = homes[mesh][i]
            return (distinct[i][0], at.shape, at.axis_names, None, lean)

        tasks = [mesh for mesh in meshes if not self.lean_pruned_at(mesh, budget)
                 and any(job_key(i, mesh, lean) not in self.costs
                         for i in range(len(distinct)) for lean in (False, True))]
        if not tasks:
            return
        self._queue(2 * len(distinct) * len(tasks))

        def known(key) -> Solved | None:
            return Solved(self.costs[key]) if key in self.costs else None

        def layer_task(mesh):
            builds: dict = {}       # per mesh planned on: a lean problem derives from its own

            def solve(i: int, lean: bool) -> Solved:
                at = homes[mesh][i]
                return self._solve(distinct[i][1], at, None, lean,
                                   builds.setdefault(at.shape, {}))

            fast = [known(job_key(i, mesh, False)) or solve(i, False)
                    for i in range(len(distinct))]
            answers = [f.answer for f in fast]
            need = sum(n * (a.param_bytes + in_flight * a.act_bytes)
                       for (_, _, n), a in zip(distinct, answers)) \
                if in_flight is not None and all(isinstance(a, StageCost) for a in answers) \
                else None
            pruned = need is not None and need <= budget
            # The fastest plan stands for the lean one where it already splits every
            # parameter finest (or where there is no plan), as `_layer_options` takes it.
            lean = [None if pruned else
                    known(job_key(i, mesh, True)) or
                    (Solved(f.answer) if not isinstance(f.answer, StageCost)
                     or _params_finest(prog, f.answer, homes[mesh][i])
                     else solve(i, True))
                    for i, ((_, prog, _), f) in enumerate(zip(distinct, fast))]
            return fast, lean, need if pruned else None

        def record(mesh, outcome):
            fast, lean, need = outcome.get()
            if need is not None:
                self.lean_pruned[(mesh.shape, mesh.axis_names)] = need
            for i, (f, l) in enumerate(zip(fast, lean)):
                for kind, solved in ((False, f), (True, l)):
                    k = job_key(i, mesh, kind)
                    if solved is None or k in self.costs:
                        self.done += 1
                    else:
                        self._record(k, solved)
            report(self.progress, ILPS, self.done, self.queued)

        # A mesh whose outer axis splits nothing of a layer takes that layer's plans from
        # the mesh without the axis (`layer_mesh`): those meshes are planned first, so
        # that the others read their answers instead of planning them again.
        whole, rest = [], []
        for mesh in tasks:
            (whole if all(at == mesh for at in homes[mesh]) else rest).append(mesh)
        for group in (whole, rest):
            map_forked(layer_task, group,
                       lambda i, outcome, group=group: record(group[i], outcome))

    def _queue(self, n: int) -> None:
        if n:
            self.queued += n
            done, total = self.done, self.queued
            report(self.progress, ILPS, done, total)

    def _solve(self, prog: StageProgram, mesh: LogicalMesh, manual: Manual | None,
               lean: bool, builds: dict | None = None) -> Solved:
        """One job's answer, from the disk cache or planned; changes nothing of the
        planner's but the mesh memo (it may run in a worker: `_record` files it).
        `builds`: problems built in this task, by program id; a memory-lean job derives its
        problem from the fastest one's there (`BuiltStage.restricted`), and a fastest job
        leaves its problem there."""
        disk = None if self.exhaustive or cache_dir() is None else cache_key(
            "layer", prog.structure, mesh.shape, mesh.axis_names, repr(manual), lean,
            mesh_cluster(self.cluster, mesh.num_devices), self.opt_ratio, self.solver,
            self.time_limit_s, sorted(self.seeds(prog).items()), self.split_batch)
        cached = load_object("layers", disk) if disk else None
        if isinstance(cached, StageCost):
            return Solved(cached, cache_hit=True)
        try:
            base = (builds or {}).get(id(prog)) if lean and manual is None else None
            built = self.build(prog, mesh, manual, lean, base)
            if builds is not None and not lean:
                builds[id(prog)] = built
            res = built.solve()
        except PlanningError as e:
            return Solved(detached(e), solved=True)      # solved, and found nothing
        cost = self.cost_of(prog, mesh, res)
        if disk:
            save_object("layers", disk, cost)
        return Solved(cost, solved=True, build_s=res.build_s, solve_s=res.solve_s)

    def _record(self, key, solved: Solved) -> None:
        self.costs[key] = solved.answer
        self.ilps += solved.solved
        self.build_s += solved.build_s
        self.solve_s += solved.solve_s
        self.cache_hits += solved.cache_hit
        self.done += 1
        done, total = self.done, self.queued
        report(self.progress, ILPS, done, total)

    def fit_within(self, prog: StageProgram, mesh: LogicalMesh, manual: Manual | None,
                   lean: bool, held: int, remat: bool,
                   budget: float) -> tuple[StageCost, MemoryEstimate]:
        """The range's plan on `mesh` re-solved with the ILP's budget tightened until its
        whole-stage estimate holding `held` micro-batches fits `budget`
        (`solve_within_memory`), and that estimate. Memoised like `cost`, by structure and
        mesh shape (the estimate depends on nothing else), failures included: the fit is
        deterministic, so asking again gives the same answer. Consecutive fits of one
        structure and mesh (a pipeline's stages, holding different micro-batch counts)
        share the built problem and its solutions by ILP budget (`fit_problem`).

        Raises:
          PlanningError: no plan the tightened ILP finds fits (the same error each time).
        """
        key = self.job_key(prog, mesh, manual, lean) + (held, remat, budget)
        if key not in self.fitted:
            def estimate(res: StageResult) -> MemoryEstimate:
                return stage_estimate(self, prog, self.cost_of(prog, mesh, res), mesh, held,
                                      remat)
            base = self.job_key(prog, mesh, manual, lean)
            if self.fit_problem is None or self.fit_problem.key != base:
                self.fit_problem = None     # (let the last go before building the next)
                self.fit_problem = FitProblem(base, self.build(prog, mesh, manual, lean), {})
            try:
                res, est = solve_within_memory(self.fit_problem.built, budget, estimate,
                                               solved=self.fit_problem.solved)
                self.fitted[key] = (self.cost_of(prog, mesh, res), est)
            except PlanningError as e:
                self.fitted[key] = detached(e)
        cost, est = kept_answer(self.fitted[key])
        return self._renamed(_moved(cost, mesh.device_offset), prog), est

    def build(self, prog: StageProgram, mesh: LogicalMesh, manual: Manual | None,
              lean: bool, fastest: BuiltStage | None = None,
              amortized: AmortizedReductions | None = None) -> BuiltStage:
        """The intra-op problem of a range on a logical mesh, as `cost` plans it (built,
        not solved: `cost` solves it, `explain` shows it). The memory-lean problem is the
        fastest one with each parameter's strategies cut to its finest splits
        (`BuiltStage.restricted`): from `fastest` where the caller has it built, which
        saves a second build. `amortized`: gradient reductions weighed as once per step
        (`_amortized_fit`)."""
        fb = prog.fb.graph
        pin = node_pin = None
        if manual is not None:
            pin, node_pin = manual_pins(fb, manual.dp, manual.tp, False, self.seeds(prog),
                                        split_batch=self.split_batch)
        elif lean:
            base = fastest or self.build(prog, mesh, None, False, amortized=amortized)
            built = base.restricted(most_split_params(fb, mesh))
            # Its build time: the restriction, and the fastest problem's where built for it.
            return built if fastest else \
                dataclasses.replace(built, build_s=built.build_s + base.build_s)
        memo = self.memos.setdefault((mesh.shape, mesh.axis_names),
                                     MeshMemo.for_mesh(mesh, self.cluster))
        options = StageOptions(pin=pin, node_pin=node_pin, solver=self.solver,
                               time_limit_s=self.time_limit_s,
                               tensor_names=self.input_names(prog),
                               param_memory_factor=2.0 + self.opt_ratio,
                               amortized=amortized)
        return build_stage(fb, mesh, self.cluster, options, memo)

    def cost_of(self, prog: StageProgram, mesh: LogicalMesh, res: StageResult) -> StageCost:
        """The `StageCost` of one solved intra-op plan of a range."""
        fb = prog.fb.graph
        st = res.stage
        spec = dict(st.tensor_specs)
        for t, s in zip(fb.inputs, st.input_specs):
            spec[t] = s

        def local(t):
            tt = fb.tensors[t]
            return tt.size * itemsize(tt.dtype) / spec[t].num_shards(mesh)

        params = sum(local(t) for t in prog.fb_params)
        # Each accumulator as the plan places its gradient (a reduce-scattered gradient is
        # split finer than its parameter), as `stage_estimate` counts them: the stage
        # search's layer sums and the whole-stage estimate use the same terms.
        grads = sum(local(t) for t in prog.fb_param_grads)
        inputs = sum(local(t) for t in prog.fb_acts)
        residual = sum(local(t) for t in prog.residuals)
        by_node = dict(res.node_collectives)
        # The forward is its own operators' compute and collectives; the backward is the
        # rest. (A split by FLOP share put the backward's gradient reductions partly in the
        # forward, and a stage whose accumulation drops them was left a backward of zero.)
        forward_s = sum(res.node_compute_s[i] + sum(c.time_s for c in by_node.get(i, ()))
                        for i in prog.fwd_nodes)
        out_bytes = sum(self.parts.forward.graph.tensors[t].nbytes for t in prog.outputs)
        sync = {id(c): c for g in prog.fb_param_grads
                for _, c in grad_reduction_ops(fb, by_node, g)}
        combined: dict[tuple, int] = {}
        for c in sync.values():
            combined[(c.kind, c.axes)] = combined.get((c.kind, c.axes), 0) + c.nbytes
        comm = CommModel(self.cluster, mesh)
        return StageCost(result=res, forward_s=forward_s, backward_s=st.total_s - forward_s,
                         param_bytes=params * (1.0 + self.opt_ratio) + grads,
                         weight_bytes=params, act_bytes=inputs + residual,
                         input_bytes=inputs, output_bytes=out_bytes,
                         grad_sync_s=sum(c.time_s for c in sync.values()),
                         reduce_once_s=sum(comm.op(kind, nbytes, axes).time_s
                                           for (kind, axes), nbytes in combined.items()))


def stage_estimate(planner: PipelinePlanner, prog: StageProgram, cost: StageCost,
                   mesh: LogicalMesh, held: int, remat: bool) -> MemoryEstimate:
    """The whole-stage memory of a range's plan holding `held` micro-batches
    (`planning.memory.pipeline_stage_memory`)."""
    st = cost.result.stage
    specs = dict(st.tensor_specs)
    specs.update(zip(prog.fb.graph.inputs, st.input_specs))
    return pipeline_stage_memory(prog.fb.graph, mesh, specs, prog.fb_params, prog.fb_acts,
                                 prog.residuals, prog.fb_param_grads, planner.opt_ratio,
                                 held, remat, st.operand_specs)


def _fit_stage(planner: PipelinePlanner, prog: StageProgram, cost: StageCost,
               mesh: LogicalMesh, manual: Manual | None, lean: bool, held: int, remat: bool,
               budget: float, s: int) -> tuple[StageCost, MemoryEstimate]:
    """The stage's plan if its whole-stage estimate fits `budget`, else the range planned
    again with the ILP's budget tightened by the overshoot (`solve_within_memory`).

    Raises:
      PlanningError: no plan of the range on `mesh` fits.
    """
    est = stage_estimate(planner, prog, cost, mesh, held, remat)
    if est.total <= budget:
        return cost, est
    try:
        return planner.fit_within(prog, mesh, manual, lean, held, remat, budget)
    except PlanningError as e:
        if manual is None:
            raise MemoryBudgetError(f"pipeline stage {s} (holding {held} micro-batch(es) of "
                                    f"activations): {e}",
                                    getattr(e, "peak_bytes", est.total)) from None
        # A Manual layout is the user's: the plan is made, flagged by its estimate.
        warnings.warn(f"{manual!r}: pipeline stage {s} does not fit: {e}", stacklevel=4)
        return cost, est


def most_split_params(graph, mesh: LogicalMesh):
    """An input pin allowing each parameter only its finest splits over `mesh`."""
    axes = [(n, mesh.axis_size(n)) for n in mesh.sharded_axes()]
    finest: dict[int, int] = {}
    for t in graph.tensors_with_role(Role.PARAM):
        labels = tuple(range(len(t.shape)))
        dl = DimLabels((labels,), (labels,), dict(zip(labels, t.shape)))
        finest[t.id] = max((TensorSpec(tuple(a.get(l, ()) for l in labels)).num_shards(mesh)
                            for a in enumerate_assignments(dl, axes)), default=1)

    def pin(t, spec) -> bool:
        return t.role is not Role.PARAM or spec.num_shards(mesh) == finest[t.id]
    return pin


def _moved(cost: StageCost, offset: int) -> StageCost:
    st = cost.result.stage
    if st.devices[0] == offset:
        return cost
    stage = dataclasses.replace(st, devices=tuple(range(offset, offset + len(st.devices))))
    return dataclasses.replace(cost, result=dataclasses.replace(cost.result, stage=stage))


def _params_finest(prog: StageProgram, cost: StageCost, mesh: LogicalMesh) -> bool:
    """Whether a plan already splits every parameter as finely as the mesh allows."""
    pin = most_split_params(prog.fb.graph, mesh)
    spec = dict(zip(prog.fb.graph.inputs, cost.result.stage.input_specs))
    return all(pin(prog.fb.graph.tensors[t], spec[t]) for t in prog.fb_params)


def _opt_state_ratio(parts: StepParts) -> float:
    """Optimizer state bytes per parameter byte (Adam: 2), from the step's inputs."""
    g = parts.outer.graph
    node = g.nodes[parts.grad_node]
    param_ids = {node.inputs[i] for i in parts.call.grad_leaves}
    params = sum(g.tensors[t].nbytes for t in param_ids)
    other = sum(t.nbytes for t in g.tensors_with_role(Role.OPT_STATE) if t.id not in param_ids)
    return other / params if params else 0.0


def layer_node_ranges(starts: tuple[int, ...], n: int) -> list[tuple[int, int]]:
    ends = list(starts[1:]) + [n]
    return list(zip(starts, ends))


def layer_cuts(bounds: Sequence[tuple[int, int]], a: int, b: int) -> tuple[int, ...]:
    """Where layers a..b (`bounds`: each layer's node range) meet: the `cuts` of their
    stage program."""
    return tuple(bounds[i][0] for i in range(a + 1, b + 1))


def _send_time(cluster: Cluster, nbytes: float, a: StagePlan, b: StagePlan) -> float:
    """Moving a stage's outputs to the next submesh: every byte crosses once, spread over
    the device pairs of the smaller submesh, on the link that joins the two."""
    if nbytes == 0:
        return 0.0
    same_node = {cluster.node_of(d) for d in a.devices} == {cluster.node_of(d) for d in b.devices} \
        and len({cluster.node_of(d) for d in a.devices}) == 1
    link = cluster.intra_node if same_node or cluster.inter_node is None else cluster.inter_node
    pairs = min(len(a.devices), len(b.devices))
    return send_recv_time(nbytes / pairs, link)


def _place(cluster: Cluster, sizes: list[int]) -> list[int]:
    """First device of each stage's block: blocks aligned to their size inside a node (or to
    whole nodes), so a submesh never straddles nodes when it need not; largest first."""
    n, M = cluster.num_devices, cluster.devices_per_node
    free = [True] * n
    offsets = [0] * len(sizes)
    for s in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = sizes[s]
        align = size if size <= M and M % size == 0 else (M if size % M == 0 else 1)
        for start in range(0, n - size + 1, align):
            if all(free[start:start + size]):
                break
        else:
            raise PlanningError(f"cannot place submeshes of sizes {sizes} on {n} devices")
        free[start:start + size] = [False] * size
        offsets[s] = start
    return offsets


def _logical_shapes(sub: SubmeshShape) -> list[tuple[int, int]]:
    """Logical (dp, tp) meshes of a submesh: every factorisation inside one node, but (n, 1),
    which is (1, n) with its one axis named differently (the same devices in one group: the
    same problem, as `spmd.auto_mesh_shapes` takes it); across nodes, tp within a node
    (splitting a layer's matmuls over the network is never cheaper than splitting the batch
    there)."""
    n = sub.num_devices
    if sub.num_nodes == 1:
        return [(n // t, t) for t in range(1, n + 1) if n % t == 0 and (t > 1 or n == 1)]
    M = sub.devices_per_node
    return [(n // t, t) for t in range(1, M + 1) if M % t == 0]


class PlannerPool:
    """The `PipelinePlanner`s of one search, one per split of the step and planning
    setting: the candidates a search weighs at one micro-batch count (the stage DP's
    pipeline and the textbook layouts) share their stage programs, layer solutions and
    mesh memos instead of making them again."""

    def __init__(self):
        self.planners: dict[tuple, PipelinePlanner] = {}

    def forget(self, parts: StepParts) -> None:
        """Drops the planners of `parts` (every setting), and what they hold."""
        for key in [k for k in self.planners if k[0] == id(parts)]:
            del self.planners[key]

    def planner(self, parts: StepParts, cluster: Cluster, solver, time_limit_s: float,
                names: Mapping[int, str], progress: Progress | None, exhaustive: bool,
                split_batch: bool) -> PipelinePlanner:
        # (A planner keeps its parts alive, so their id is not reused while it is here.)
        key = (id(parts), cluster.fingerprint(), solver, time_limit_s, exhaustive, split_batch)
        found = self.planners.get(key)
        if found is None:
            found = PipelinePlanner(parts, cluster, solver, time_limit_s, names, progress,
                                    exhaustive)
            found.split_batch = split_batch
            self.planners[key] = found
        return found


def make_pipeline_plan(parts: StepParts, method, cluster: Cluster, traced_fingerprint: str,
                       input_signature, tensor_names: Mapping[int, str] | None = None,
                       progress: Progress | None = None, compression=None,
                       pool: PlannerPool | None = None) -> Plan:
    """Plans a pipelined step (module docstring). `progress` hears of the layer clustering,
    each intra-op problem solved and the stage DP (`alpa_lite.progress`).

    `compression` (a compressor or `AutoCompression`): each stage exchanges its
    accumulated gradients over its data-parallel axes through the compressor
    `planning.stage_exchange` chooses for it (`StagePlan.exchange`); with AutoCompression
    a lossy exchange is kept only where it makes the whole step `min_speedup` times
    faster than the full-precision all-reduce.

    `pool`: the planners of a search, to reuse what earlier candidates of the same split
    planned (the plan is the same; its statistics count only this plan's new work)."""
    exchange = None if compression is None else ExchangeRequest.of(compression)
    fwd = parts.forward
    n_nodes = len(fwd.graph.nodes)
    m = parts.num_micro_batches
    names = forward_names(parts, tensor_names or {})
    user_method = method
    schedule_open = isinstance(method, Auto) and method.schedule is None
    if schedule_open:   # searched as 1F1B, then weighed against GPipe on the chosen stages
        method = dataclasses.replace(method, schedule="1f1b")
    planner = _planner(parts, method, cluster, names, progress, pool,
                       split_batch=exchange is not None)
    before = planner.counters()
    alternatives: list[Alternative] = []
    if isinstance(method, Manual):
        if method.num_devices != cluster.num_devices:
            raise ValueError(f"{method!r}: dp x tp x pp = {method.num_devices} but the cluster "
                             f"{cluster.name!r} has {cluster.num_devices} devices")
        report(progress, CLUSTER, 0, 1)
        starts, ranges = _manual_layers(fwd, method)
        report(progress, CLUSTER, 1, 1)
        L = len(starts)
        per = method.dp * method.tp
        bounds = layer_node_ranges(starts, n_nodes)
        chosen = []
        for s, (a, b) in enumerate(ranges):
            mesh = LogicalMesh((method.dp, method.tp), ("dp", "tp"), device_offset=s * per)
            chosen.append(((a, b), mesh, method.remat, False))
        dp_stats = None
        stages, costs, progs, estimates = _fit_stages(planner, method, bounds, chosen, m)
    elif isinstance(method, Auto):
        report(progress, CLUSTER, 0, 1)
        starts = forward_layers(fwd, num_layers=method.num_layers)
        report(progress, CLUSTER, 1, 1)
        L = len(starts)
        bounds = layer_node_ranges(starts, n_nodes)
        chosen, dp_stats, (stages, costs, progs, estimates) = _auto_stages(
            planner, method, cluster, bounds, m, alternatives)
    else:
        raise TypeError(f"pipelined plans need al.Auto or al.Manual, got {method!r}")
    S = len(stages)
    # Gradients: accumulated per device and reduced once per step where the stage's batch
    # axes split nothing else (planning.gradient_sync).
    syncs = [stage_sync(parts, PlannedStage(s, progs[s], mesh, costs[s].result, stages[s]),
                        cluster, planner.fwd_bdims, planner.input_names(progs[s]), exchange)
             for s, (_, mesh, _, _) in enumerate(chosen)]
    for s, sync in enumerate(syncs):
        stages[s] = sync.stage
    for s, est in enumerate(estimates):    # stage_sync rebuilds the stage record
        stages[s] = dataclasses.replace(stages[s], peak_memory_bytes=est.total, memory=est)
    sends = [_send_time(cluster, costs[s].output_bytes, stages[s], stages[s + 1])
             for s in range(S - 1)]
    # Stage s sends its outputs to s + 1, and the gradient of its inputs (the same bytes)
    # back to s - 1.
    timings = [StageTiming(forward_s=st.forward_s, backward_s=st.backward_s,
                           send_activation_s=sends[s] if s < S - 1 else 0.0,
                           send_gradient_s=sends[s - 1] if s > 0 else 0.0, remat=st.remat)
               for s, st in enumerate(stages)]
    sim = simulate(timings, m, schedule_from_name(method.schedule))
    choices = [_schedule_choice(planner, method, progs, costs, stages, timings, sim, m,
                                by_user=not schedule_open),
               _remat_choice(stages, alternatives, by_user=isinstance(method, Manual))]
    # Each stage reduces its accumulated gradients after its own last backward, side by side
    # with the others' remaining work (planning.step_time says what is left exposed).
    update_stages, inputs = place_update(parts, progs, stages)
    # After the last backward every stage applies its share of the update at once.
    apply_s = _update_time(planner, update_stages, costs, progs)
    schedule = schedule_from_name(method.schedule)
    breakdown = pipeline_step_time(stages, timings, sim, m, schedule,
                                   [sy.reduce_s for sy in syncs], apply_s)
    if any(sy.uncompressed is not None for sy in syncs):
        plain = [sy.uncompressed or sy for sy in syncs]
        dense = pipeline_step_time(stages, timings, sim, m, schedule,
                                   [sy.reduce_s for sy in plain], apply_s)
        if not exchange.explicit and dense.total_s < exchange.min_speedup * breakdown.total_s:
            # Lossy exchange not worth its accuracy cost on this step: exact all-reduce.
            syncs, breakdown = plain, dense
        for s, sy in enumerate(syncs):
            ex = sy.stage.exchange
            est = dataclasses.replace(stages[s].memory, compression_state=ex.state_bytes
                                      if ex is not None else 0.0)
            stages[s] = dataclasses.replace(stages[s], exchange=ex, memory=est,
                                            peak_memory_bytes=est.total)
    sync_records = [r for sy in syncs for r in sy.records]
    reduce_s = [sy.reduce_s for sy in syncs]
    spec = PipelineSpec(num_micro_batches=m, schedule=method.schedule, layer_starts=tuple(starts),
                        loss_scale=parts.loss_scale, forward_fingerprint=fwd.fingerprint,
                        step_time_s=breakdown.total_s,
                        bubble_fraction=sim.bubble_fraction, send_s=tuple(sends),
                        apply_s=apply_s, reduce_s=max(reduce_s),
                        update_stages=update_stages, inputs=inputs,
                        aux=tuple(AuxCombination(Combine(r.combine.value), r.axis, r.updates)
                                  for r in parts.aux),
                        batch_draws=sum(parts.batch_draws))
    unsharded = tuple(sorted({p for c in costs for p in c.result.unsharded_primitives}))
    work = planner.counters() - before
    stats = PlanningStats(
        build_s=work.build_s, solve_s=work.solve_s,
        nodes_before_merge=sum(c.result.nodes_before_merge for c in costs),
        nodes_after_merge=sum(c.result.nodes_after_merge for c in costs),
        ilp_nodes=sum(c.result.ilp_nodes for c in costs),
        ilp_variables=sum(c.result.ilp_variables for c in costs),
        ilp_constraints=sum(c.result.ilp_constraints for c in costs),
        num_layers=L, layer_ilps=work.ilps,
        layer_ilps_reused=work.asked - work.ilps - work.cache_hits,
        layer_cache_hits=work.cache_hits,
        dp_s=dp_stats.solve_time_s if dp_stats else 0.0,
        dp_t_max_tried=dp_stats.t_max_tried if dp_stats else 0,
        dp_cost_queries=dp_stats.cost_queries if dp_stats else 0)
    step_s = breakdown.total_s
    return Plan(method=user_method, cluster_name=cluster.name,
                cluster_fingerprint=cluster.fingerprint(), program_fingerprint=traced_fingerprint,
                input_signature=input_signature, stages=tuple(stages),
                unsharded_primitives=unsharded, pipeline=spec, stats=stats,
                explanation=Explanation(tuple(alternatives)) if alternatives else None,
                gradient_sync=tuple(sync_records), step_time=breakdown,
                notes=tuple(dict.fromkeys(parts.outer.notes + fwd.notes)),
                choices=tuple(dataclasses.replace(c, time_s=step_s) for c in choices))


def _planner(parts: StepParts, method, cluster: Cluster, names: Mapping[int, str],
             progress: Progress | None, pool: PlannerPool | None,
             split_batch: bool) -> PipelinePlanner:
    """The planner `method` plans with: the pool's for this split and setting, or a new one."""
    exhaustive = isinstance(method, Auto) and method.exhaustive
    return (pool or PlannerPool()).planner(parts, cluster, solver_for(method.solver),
                                           method.time_limit_s, names, progress, exhaustive,
                                           split_batch)


def _manual_layers(fwd, method: Manual) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """A Manual layout's layers (first forward node of each) and its stages' layer
    ranges: `layer_ranges`, or the layers split evenly over pp."""
    pp = method.pp
    if method.layer_ranges is None or fwd.boundaries:
        starts = forward_layers(fwd, min_layers=pp)
    else:   # the ranges say how many layers to cluster into
        starts = forward_layers(fwd, num_layers=method.layer_ranges[-1][1] + 1)
    L = len(starts)
    if pp > L:
        raise PlanningError(f"pp={pp} stages but the loss function has only {L} layers; "
                            f"use pp <= {L} or mark more layers with al.mark_layer_boundary")
    ranges = method.layer_ranges or _even_split(L, pp)
    if ranges[-1][1] != L - 1:
        raise PlanningError(f"layer_ranges {ranges} end at layer {ranges[-1][1]} but the "
                            f"loss function has {L} layers (0..{L - 1}); cover them all")
    return starts, ranges


def manual_memory_floor(parts: StepParts, method: Manual, cluster: Cluster,
                        tensor_names: Mapping[int, str] | None = None,
                        pool: PlannerPool | None = None, stop_above: float = math.inf) -> float:
    """The least peak memory per device (whole-stage estimate) of the Manual layout's
    fullest stage, whatever the ILP chooses inside it: parameters and their gradients split
    at most tp ways (a Manual layout never splits a weight over dp), every other tensor at
    most dp x tp ways (`planning.memory.memory_floor`), the stash held for the schedule's
    micro-batches in flight. Costs the stages' programs (shared through `pool` with the
    plan that may follow), no ILP: a search refuses a layout whose floor is over budget
    without planning it. Stages are costed fullest stash first, and the first whose floor
    is over `stop_above` ends the walk: the floor returned is then that stage's, over
    `stop_above` and at most the layout's (the rest of its stages are not traced).

    It bounds `pipeline_stage_memory` from below term by term: that estimate is the
    parameters, gradients and optimizer state, `held` stashes and the one-micro-batch walk
    beyond the parameters and one stash, so at least the walk's total plus the gradients,
    the optimizer state and held - 1 stashes."""
    fwd = parts.forward
    starts, ranges = _manual_layers(fwd, method)
    bounds = layer_node_ranges(starts, len(fwd.graph.nodes))
    planner = _planner(parts, method, cluster, forward_names(parts, tensor_names or {}), None,
                       pool, split_batch=False)
    per = method.dp * method.tp
    held = [held_micro_batches(method.schedule, len(ranges), s, parts.num_micro_batches)
            for s in range(len(ranges))]
    worst = 0.0
    for s in sorted(range(len(ranges)), key=lambda s: -held[s]):
        a, b = ranges[s]
        prog = planner.layers_program(bounds, a, b)
        fb = prog.fb.graph
        weights = {t: method.tp for t in prog.fb_params + prog.fb_param_grads}

        def size(t: int) -> float:
            return fb.tensors[t].nbytes / weights.get(t, per)

        walk = memory_floor(fb, per, weights).total
        stash = sum(size(t) for t in prog.fb_acts) + \
            (0.0 if method.remat else sum(size(t) for t in prog.residuals))
        worst = max(worst, walk + sum(size(t) for t in prog.fb_param_grads)
                    + planner.opt_ratio * sum(size(t) for t in prog.fb_params)
                    + stash * (held[s] - 1))
        if worst > stop_above:
            break
    return worst


def _schedule_choice(planner: PipelinePlanner, method, progs, costs, stages, timings,
                     sim, m: int, by_user: bool) -> Choice:
    """The schedule against the other one on the same stages: its simulated pipeline and
    its peak memory (GPipe: every stage holding all m micro-batches' activations).

    Only the method's schedule is planned (`Auto` with none set plans 1F1B: the stage DP's
    memory model is 1F1B's, where a stage holds at most its distance to the end in
    micro-batches). The other is re-simulated on the chosen stages and its figures given
    in the note: GPipe can simulate a little faster (its forwards run back to back), but
    it holds m micro-batches per stage, which is why it is not the default."""
    other = "gpipe" if method.schedule == "1f1b" else "1f1b"
    other_sim = simulate(timings, m, schedule_from_name(other))
    budget = (method.memory_budget_bytes if isinstance(method, Auto) else None) or \
        planner.cluster.device.memory_bytes
    S = len(stages)
    peak = max(stage_estimate(planner, progs[s], costs[s], _stage_mesh(stages[s]),
                              held_micro_batches(other, S, s, m), stages[s].remat).total
               for s in range(S))
    return Choice("schedule", method.schedule, sim.step_time_s, runner_up=other,
                  runner_up_s=None, runner_up_fits=peak <= budget, by_user=by_user,
                  note=f"{other}: pipeline {other_sim.step_time_s * 1e3:.3f} ms against "
                       f"{sim.step_time_s * 1e3:.3f} ms, peak {format_bytes(peak)} per device "
                       "on the same stages")


def _update_time(planner: PipelinePlanner, update_stages, costs, progs) -> float:
    """The optimizer update's time: each stage runs its operators of it (`place_update`),
    priced as the single-stage planner prices them (fused kernels, each paying the
    device's per-kernel overhead, and their memory traffic), split as finely as the stage
    splits its parameters and optimizer state; the stages run side by side."""
    parts, cluster = planner.parts, planner.cluster
    outer = parts.outer.graph
    fusion = fuse(outer, row_reductions_fuse=cluster.platform != "cpu")
    shards = []
    for c, prog in zip(costs, progs):
        whole = sum(prog.fb.graph.tensors[t].nbytes for t in prog.fb_params)
        shards.append(max(1.0, whole / c.weight_bytes) if c.weight_bytes > 0 else 1.0)
    per_stage = [0.0] * len(progs)
    for nid, s in zip(parts.apply_nodes, update_stages):
        node = outer.nodes[nid]
        dtype = outer.tensors[node.outputs[0]].dtype if node.outputs else "float32"
        per_stage[s] += node_compute_time(node, fusion, cluster.device, dtype, shards[s])
    return max(per_stage, default=0.0)


def _stage_mesh(st: StagePlan) -> LogicalMesh:
    return LogicalMesh(tuple(st.mesh_shape), tuple(st.axis_names),
                       device_offset=st.devices[0])


def _remat_choice(stages, alternatives: list[Alternative], by_user: bool) -> Choice:
    """Which stages recompute their forward, and the best whole-stage option of the other
    kind that the final re-plan weighed (`_polish`'s "mesh" alternatives)."""
    on = [str(s) for s, st in enumerate(stages) if st.remat]
    value = f"stages {', '.join(on)}" if on else "none"
    flipped = [a for a in alternatives if a.kind == "mesh" and a.stage >= 0
               and (" remat" in a.label) != stages[a.stage].remat and a.time_s > 0]
    if not flipped:
        return Choice("remat", value, 0.0, by_user=by_user,
                      note="" if by_user else "per stage, chosen by the stage DP")
    best = min(flipped, key=lambda a: (not a.fits, a.time_s))
    st = stages[best.stage]
    return Choice("remat", value, 0.0,
                  runner_up=f"stage {best.stage} {'without' if st.remat else 'with'} remat",
                  runner_up_fits=best.fits,
                  note=f"stage {best.stage}: {best.label} {best.time_s * 1e3:.3f} ms per "
                       f"micro-batch against {st.total_s * 1e3:.3f} ms chosen")


FIT_ATTEMPTS = 4
"""Stage searches an Auto pipeline may take: each after the first runs the stage DP with its
budget lowered by the overshoot of a stage that did not fit whole as the DP chose it."""


class NoPipelineError(PlanningError):
    """The stage DP found no pipeline within the budget it was given (a stage search's
    answer, not a failure: `settle_stages` stops searching)."""


@dataclasses.dataclass(frozen=True)
class StageSearch:
    """One stage search (the DP at one budget, its stages polished and fitted whole) and
    how it came out: the pipeline (`chosen`, the DP's statistics, the fitted stages and
    what was weighed, as `_auto_stages` returns them), its latency by the DP's formula on
    the whole stages' times, and `overshoot_bytes`, the largest whole-stage peak over the
    budget of a stage planned as the DP chose it where polish took a slower plan that fits
    (None: polish gave up no time)."""
    chosen: list
    dp_stats: object
    fitted: tuple
    weighed: list
    latency_s: float
    overshoot_bytes: float | None


def settle_stages(search: Callable[[float], StageSearch], budget: float, m: int,
                  attempts: int = FIT_ATTEMPTS) -> StageSearch:
    """The fastest pipeline of up to `attempts` stage searches (`search(dp_budget)`), the
    first at `budget`. `search` raises NoPipelineError where the DP finds no pipeline
    within its budget, MemoryBudgetError where a stage of its pipeline does not fit.

    The DP sums its layers' memory; a whole stage can need more (the resharding between
    layers, workspace). Where a chosen stage does not fit even after polish and the fit
    tried its other meshes, remat and a tighter ILP budget (`search` raises
    MemoryBudgetError), the DP runs again with its budget lowered by that stage's
    overshoot, so it cuts the layers another way, recomputes, or takes a bigger submesh.

    Where every stage fits only because polish gave up time to fit one (the DP's choice was
    over the budget whole, and the stage now recomputes, splits its parameters finer or
    takes another mesh), the pipeline is not the one the DP weighed: that stage can become
    the slowest and set the pace of every micro-batch (GPT-175B on 1024 A100s at 256
    micro-batches: two stages fell back to remat, 0.128 s per micro-batch against the
    DP's 0.10 s, and the step went to 36.5 s). So the DP runs again with its budget lowered
    by that overshoot, and the faster pipeline is kept, while searching again helps.

    Raises:
      MemoryBudgetError: no search made a pipeline that fits; `peak_bytes` is the smallest
        peak any tried stage reached.
    """
    dp_budget = budget
    smallest = math.inf
    last: Exception | None = None
    searches = 0
    best: StageSearch | None = None
    for _ in range(attempts):
        searches += 1
        try:
            found = search(dp_budget)
        except MemoryBudgetError as e:
            last = e
            smallest = min(smallest, e.peak_bytes)
            if best is not None:
                break
            # A stage overshot by e.peak_bytes / budget: ask the DP for that much less.
            dp_budget *= budget / e.peak_bytes * 0.98
            continue
        except NoPipelineError as e:
            last = e
            break
        if best is not None and found.latency_s >= best.latency_s:
            break
        best = found
        if found.overshoot_bytes is None:
            break
        dp_budget *= budget / found.overshoot_bytes * 0.98
    if best is not None:
        return best
    peak = f"; the smallest stage peak reached was {format_bytes(smallest)}" \
        if smallest < math.inf else ""
    raise MemoryBudgetError(
        f"no pipeline with {m} micro-batch(es) fits {format_bytes(budget)} per device "
        f"after {searches} stage search(es){peak}: {str(last).rstrip('.')}. Use more "
        "micro-batches, more devices or a smaller batch, or raise memory_budget_bytes",
        smallest if smallest < math.inf else getattr(last, "peak_bytes", math.inf))


def _auto_stages(planner: PipelinePlanner, method: Auto, cluster: Cluster, bounds, m: int,
                 alternatives: list[Alternative]):
    """The stage DP's pipeline, its stages re-planned whole and fitted to the budget
    (`settle_stages`). A plan is returned only when every stage's whole-stage estimate fits.

    Raises:
      MemoryBudgetError: no pipeline with these micro-batches fits; `peak_bytes` is the
        smallest peak any tried stage reached.
    """
    budget = method.memory_budget_bytes or cluster.device.memory_bytes

    def search(dp_budget: float) -> StageSearch:
        weighed: list[Alternative] = []
        try:
            dp_chosen, dp_stats = _search(planner, method, cluster, bounds, m, weighed,
                                          dp_budget)
        except PlanningError as e:
            raise NoPipelineError(str(e)) from None
        chosen = _polish(planner, method, cluster, bounds, dp_chosen, m, dp_budget, weighed)
        fitted = _fit_stages(planner, method, bounds, chosen, m)
        return StageSearch(chosen, dp_stats, fitted, weighed,
                           _dp_latency(chosen, fitted[1], m),
                           _polished_overshoot(planner, method, bounds, dp_chosen, chosen,
                                               fitted[1], m, budget))

    best = settle_stages(search, budget, m)
    alternatives.extend(best.weighed)
    return best.chosen, best.dp_stats, best.fitted


def _dp_latency(chosen, costs: Sequence[StageCost], m: int) -> float:
    """The stage DP's pipeline latency (sum + (m - 1) x the slowest) on the whole stages'
    times."""
    t = [c.search_time_s(m, remat) for (_, _, remat, _), c in zip(chosen, costs)]
    return sum(t) + (m - 1) * max(t)


def _polished_overshoot(planner: PipelinePlanner, method: Auto, bounds, dp_chosen, chosen,
                        costs: Sequence[StageCost], m: int, budget: float) -> float | None:
    """The largest whole-stage peak, over the budget, of a stage planned as the DP chose it
    where `_polish` took a slower plan that fits instead (None: no such stage)."""
    S = len(chosen)
    worst = None
    for s, (dp_choice, choice, fitted) in enumerate(zip(dp_chosen, chosen, costs)):
        if choice == dp_choice:
            continue
        (a, b), mesh, remat, lean = dp_choice
        prog = planner.layers_program(bounds, a, b)
        key = planner.job_key(prog, mesh, None, lean)
        # A DP choice `_polish` did not plan lost, by its layer sum, to a plan that fits:
        # polish gave up no time on it.
        if key not in planner.costs or isinstance(planner.costs[key], PlanningError):
            continue
        cost = planner.cost(prog, mesh, None, lean)
        if fitted.search_time_s(m, choice[2]) <= cost.search_time_s(m, remat):
            continue        # polish found a faster plan, not a slower one that fits
        peak = stage_estimate(planner, prog, cost, mesh,
                              held_micro_batches(method.schedule, S, s, m), remat).total
        if peak > budget and (worst is None or peak > worst):
            worst = peak
    return worst


def _fit_stages(planner: PipelinePlanner, method, bounds, chosen, m: int):
    """Each chosen (layers, mesh, remat, lean) planned whole and fitted to the budget
    (`_fit_stage`): the stage records, their costs, programs and memory estimates."""
    budget = (method.memory_budget_bytes if isinstance(method, Auto) else None) or \
        planner.cluster.device.memory_bytes
    manual = method if isinstance(method, Manual) else None
    progs = [planner.layers_program(bounds, a, b) for (a, b), _, _, _ in chosen]
    # The stages' whole plans on every core at once (a Manual layout's are all new).
    planner.prefetch((prog, mesh, manual, lean)
                     for prog, (_, mesh, _, lean) in zip(progs, chosen))
    stages, costs, estimates = [], [], []
    try:
        for s, (((a, b), mesh, remat, lean), prog) in enumerate(zip(chosen, progs)):
            cost = planner.cost(prog, mesh, manual, lean)
            # The planner never returns a stage its whole-stage estimate says does not fit.
            held = held_micro_batches(method.schedule, len(chosen), s, m)
            cost, est = _fit_stage(planner, prog, cost, mesh, manual, lean, held, remat,
                                   budget, s)
            cost, est = _amortized_fit(planner, s, prog, cost, est, mesh, manual, lean, held,
                                       remat, budget, m, (a, b))
            stages.append(_stage_record(cost, est, (a, b), remat))
            costs.append(cost)
            estimates.append(est)
    finally:
        planner.fit_problem = None      # (a whole stage's problem: not held past the fits)
    return stages, costs, progs, estimates


def _stage_record(cost: StageCost, est: MemoryEstimate, layers: tuple[int, int],
                  remat: bool) -> StagePlan:
    return dataclasses.replace(
        cost.result.stage, forward_s=cost.forward_s, backward_s=cost.backward_s,
        layers=layers, remat=remat,
        total_s=cost.forward_s * (2 if remat else 1) + cost.backward_s,
        peak_memory_bytes=est.total, memory=est)


def _amortized_fit(planner: PipelinePlanner, s: int, prog: StageProgram, cost: StageCost,
                   est: MemoryEstimate, mesh: LogicalMesh, manual: Manual | None, lean: bool,
                   held: int, remat: bool, budget: float, m: int,
                   layers: tuple[int, int]) -> tuple[StageCost, MemoryEstimate]:
    """The stage planned again with its gradient all-reduces over its accumulation axes
    weighed as once per step (1/m each: `AmortizedReductions`), where the stage
    accumulates: kept if the stage, its gradients synced as `stage_sync` settles, is then
    faster per step, else `cost`.

    The intra-op problem charges a reduction in every micro-batch's backward, as a stage
    that cannot accumulate runs it; one that accumulates reduces once per step, and on a
    data-parallel axis across slow links the per-micro-batch charge makes the problem
    choose layouts that repeat work to avoid reductions that do not run (GPT-530B on
    2 x 8 A100s per stage: 0.187 s of compute per micro-batch against 0.150 s)."""
    if m == 1 or planner.split_batch:
        return cost, est
    fb = prog.fb.graph
    axes = batch_axes(prog, cost.result.stage, planner.fwd_bdims)
    if not axes:
        return cost, est

    def per_step(c: StageCost, e: MemoryEstimate) -> float | None:
        planned = PlannedStage(s, prog, mesh, c.result, _stage_record(c, e, layers, remat))
        sync = stage_sync(planner.parts, planned, planner.cluster, planner.fwd_bdims,
                          planner.input_names(prog))
        if sync.stage.accumulate_axes != axes:
            return None
        return m * sync.stage.total_s + sync.reduce_s

    key = planner.job_key(prog, mesh, manual, lean) + (axes, m, held, remat, budget)
    if key not in planner.amortized:
        planner.amortized[key] = None
        before = per_step(cost, est)
        if before is None:      # the stage does not accumulate: it reduces every time
            return cost, est
        nodes = frozenset(n for t in prog.fb_param_grads for n in gradient_nodes(fb, t))
        built = planner.build(prog, mesh, manual, lean,
                              amortized=AmortizedReductions(nodes, axes, 1.0 / m))

        def estimate(res: StageResult) -> MemoryEstimate:
            return stage_estimate(planner, prog, planner.cost_of(prog, mesh, res), mesh,
                                  held, remat)
        try:
            # (Within the budget, or where the stage was over it, no further over.)
            res, new_est = solve_within_memory(built, max(budget, est.total), estimate)
        except PlanningError:
            return cost, est
        planner.ilps += 1
        planner.build_s += built.build_s
        planner.solve_s += res.solve_s
        raw = planner.cost_of(prog, mesh, res)
        after = per_step(planner._renamed(_moved(raw, mesh.device_offset), prog), new_est)
        if after is not None and after < before * (1 - 1e-9):
            planner.amortized[key] = (raw, new_est)
    if planner.amortized[key] is None:
        return cost, est
    raw, new_est = planner.amortized[key]
    return planner._renamed(_moved(raw, mesh.device_offset), prog), new_est


def forward_names(parts: StepParts, outer_names: Mapping[int, str]) -> dict[int, str]:
    """Forward-graph input names from the step's (the loss function's operands are step
    arguments)."""
    node = parts.outer.graph.nodes[parts.grad_node]
    names = {}
    for t_fwd, t_outer in zip(parts.forward.graph.inputs, node.inputs):
        if t_outer is not None:
            names[t_fwd] = outer_names.get(t_outer, parts.outer.graph.tensors[t_outer].name)
    return names


def _even_split(L: int, pp: int) -> tuple[tuple[int, int], ...]:
    """pp contiguous layer ranges whose sizes differ by at most one (Megatron's uniform
    split); the extra layers go to the first stages."""
    base, extra = divmod(L, pp)
    out, a = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append((a, a + size - 1))
        a += size
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class WholeStage:
    """A stage's candidate for `_polish`: a logical mesh, fastest or memory-lean, with or
    without remat; its layers' summed time, and what they need by the stage search's
    memory model where that is over the search's budget (None: within it)."""
    layer_sum_s: float
    mesh: LogicalMesh
    lean: bool
    remat: bool
    layers_need_bytes: float | None

    @property
    def label(self) -> str:
        return f"mesh {self.mesh.shape}{' lean' if self.lean else ''}" \
            f"{' remat' if self.remat else ''}"


def _polish(planner: PipelinePlanner, method: Auto, cluster: Cluster, bounds, chosen, m: int,
            dp_budget: float, alternatives: list[Alternative] | None = None):
    """The DP costs a stage as the sum of its layers; each chosen stage is now planned whole
    on the logical meshes of its submesh (fastest and memory-lean, with its remat choice)
    and keeps the fastest that fits, so the final mesh choice is made on whole stages.
    Each whole-stage plan weighed is appended to `alternatives` (kind "mesh"), for
    `alpa-lite explain`.

    Meshes are tried in the order of their layer sums. A whole stage costs at least the sum
    of its layers planned alone (it adds the resharding between layers), so once a whole
    plan that fits is in hand, a mesh whose layer sum is no faster is not planned. The sums
    are the stage search's, at its budget `dp_budget`.

    A mesh, plan kind and remat whose layers already need more than `dp_budget` by the
    stage search's memory model (the one it chose from) is planned whole only where none
    of the others fits whole (polish then hands `_fit_stages` the fastest over-budget plan
    to tighten, and that may be one of these); otherwise it is not planned, and listed
    where its layer sum is faster than the plan kept. In `exhaustive` mode every one is
    planned. On GPT-39B's 8 x 8 V100s these were half of the whole-stage plans polish
    made: a stage's fastest layer plans, which keep their weights whole over a
    data-parallel axis, need about 35 GiB by the layer sums where 14.9 fit, and their
    whole stages about 31."""
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    S = len(chosen)
    out = []
    residuals: dict = {}        # reuse key -> the bytes of the layer's residuals

    def held(s: int) -> int:    # micro-batches stage s holds, as the stage search counts
        return min(S - s, m) if method.schedule == "1f1b" else m

    def candidates(s: int, remat: bool) -> list[WholeStage]:
        (a, b), mesh, dp_remat, dp_lean = chosen[s]
        in_flight = held(s)
        sub = SubmeshShape(max(1, mesh.num_devices // cluster.devices_per_node),
                           min(mesh.num_devices, cluster.devices_per_node))
        found = []
        for shape in _logical_shapes(sub):
            at_zero = LogicalMesh(shape, ("x", "y"))
            sums = np.zeros(2)
            need = np.zeros(2)
            for layer in range(a, b + 1):
                prog = planner.program(*bounds[layer])
                key = planner.reuse_key(prog)
                if key not in residuals:
                    residuals[key] = _residual_bytes(prog)
                for i, c in enumerate(_layer_options(planner, prog, at_zero, dp_budget)):
                    sums[i] += c.search_time_s(m, remat)
                    held_always, per_micro_batch = _memory_terms(
                        c.param_bytes, c.act_bytes, c.input_bytes,
                        residuals[key] / sub.num_devices, remat)
                    need[i] += held_always + in_flight * per_micro_batch
            cand = LogicalMesh(shape, ("x", "y"), device_offset=mesh.device_offset)
            for i, lean in enumerate((False, True)):
                searchable = need[i] <= dp_budget or planner.exhaustive or \
                    (shape, lean, remat) == (mesh.shape, dp_lean, dp_remat)
                found.append(WholeStage(float(sums[i]), cand, lean, remat,
                                        None if searchable else float(need[i])))
        return found

    def both(s: int) -> list[WholeStage]:
        # The DP's remat choice came from its layer sums; the whole stage may need remat
        # to fit where the sums did not say so, so a stage without it weighs it too.
        remat = chosen[s][2]
        found = candidates(s, remat) + ([] if remat else candidates(s, True))
        return sorted(found, key=lambda f: (f.layer_sum_s, f.lean, f.remat, f.mesh.shape))

    def walk(s: int, prog: StageProgram, cands: list[WholeStage]):
        """One stage's walk over its candidates; yields each whole-stage job it is about
        to read, returns (best, what it weighed). The candidates the stage search could
        not take come last, and only where none of the others fits whole."""
        in_flight = held(s)
        a, b = chosen[s][0]
        best = None
        weighed = []
        searchable = [c for c in cands if c.layers_need_bytes is None]
        over_budget = [c for c in cands if c.layers_need_bytes is not None]
        for group in (searchable, over_budget):
            if group is over_budget and best is not None and not best[0][0]:
                # Listed where their layers alone would have been fast enough to plan.
                weighed.extend(Alternative(
                    "mesh", s, f"{c.label}: its layers need {format_bytes(c.layers_need_bytes)}"
                    " per device, not planned whole", c.layer_sum_s, c.layers_need_bytes, False)
                    for c in group if c.layer_sum_s < best[0][1])
                break
            for c in group:
                if best is not None and not best[0][0] and c.layer_sum_s >= best[0][1]:
                    break
                yield (prog, c.mesh, None, c.lean)
                try:
                    cost = planner.cost(prog, c.mesh, None, c.lean)
                except PlanningError:
                    weighed.append(Alternative("mesh", s, f"{c.label}: no plan", 0.0, 0.0,
                                               False))
                    continue
                memory = stage_estimate(planner, prog, cost, c.mesh, in_flight, c.remat).total
                t = cost.search_time_s(m, c.remat)
                key = (memory > budget, t)
                weighed.append(Alternative("mesh", s, c.label, t, memory, memory <= budget))
                if best is None or key < best[0]:
                    best = (key, ((a, b), c.mesh, c.remat, c.lean), len(weighed) - 1)
        return best, weighed

    # The stages walk together, each on its own candidates, on every core (`run_walks`).
    progs = [planner.layers_program(bounds, a, b) for (a, b), *_ in chosen]
    cands = [both(s) for s in range(S)]
    ended = planner.run_walks(
        [walk(s, prog, cs) for s, (prog, cs) in enumerate(zip(progs, cands))],
        [(prog, c.mesh, None, c.lean) for prog, cs in zip(progs, cands) for c in cs])
    for s, ((a, b), mesh, remat, lean) in enumerate(chosen):
        best, weighed = ended[s]
        if alternatives is not None:
            pick = best[2] if best is not None else -1
            alternatives.extend(dataclasses.replace(w, chosen=True) if i == pick else w
                                for i, w in enumerate(weighed))
        out.append(best[1] if best is not None else ((a, b), mesh, remat, lean))
    return out


def _layer_options(planner: PipelinePlanner, prog: StageProgram, mesh: LogicalMesh,
                   budget: float):
    """A layer's fastest and memory-lean plans on `mesh` for a stage search at `budget`
    (the same plan where the fastest already splits every parameter as finely as the mesh
    allows, or where lean plans cannot help at that budget: `lean_pruned_at`). For their
    costs only: memoised per layer structure, so the sharding tables name the first such
    layer's tensors."""
    pruned = planner.lean_pruned_at(mesh, budget)
    key = (planner.reuse_key(prog), mesh.shape, mesh.axis_names, pruned)
    # Every layer asks for its fastest plan; an identical layer's solve answers it.
    planner.asked.add((id(prog), mesh.shape, mesh.axis_names, None, False))
    if key not in planner.options:
        at = planner.layer_mesh(prog, mesh)
        fast = planner.cost(prog, at, None)
        lean = fast
        if not pruned and not _params_finest(prog, fast, at):
            try:
                lean = planner.cost(prog, at, None, lean=True)
            except PlanningError:
                pass
        planner.options[key] = (fast, lean)
    return planner.options[key]


def _residual_bytes(prog: StageProgram) -> float:
    """The whole bytes of a range's residuals, what its backward reads of its forward (per
    micro-batch, unsharded): the stage search's workspace for a recomputing stage."""
    g = prog.fb.graph
    return float(sum(g.tensors[t].nbytes for t in prog.residuals))


def _memory_terms(param, act, inp, rebuilt, remat: bool):
    """The stage search's memory model of a range (numbers or arrays of them, per device):
    what it holds whatever the micro-batches in flight, and what it holds per micro-batch
    in flight. A recomputing stage keeps only its inputs per micro-batch, but its backward
    rebuilds every residual of one micro-batch at once (the whole-stage estimate counts
    them as workspace): a constant term, at least their bytes split over every device of
    the submesh (whatever the whole stage's shardings, so the DP still never refuses a
    stage that fits)."""
    return (param + rebuilt, inp) if remat else (param, act)


def _refuse_below_floor(planner: PipelinePlanner, progs, m: int, budget: float,
                        method: Auto) -> None:
    """Raises PlanningError, before any intra-op problem is built, where no pipeline fits
    `budget` even with every layer's parameters, activations and residuals split over all
    the devices of its stage: the stage DP run on those floors. Each floor is at most the
    memory of every option `_search` gives the DP (the same terms, each split no finer than
    the submesh allows), so a pipeline the floors cannot fit has no plan that fits."""
    cluster = planner.cluster
    N, M = cluster.num_nodes, cluster.devices_per_node
    rows = []
    for prog in progs:
        g = prog.fb.graph
        rows.append([sum(g.tensors[t].nbytes for t in prog.fb_params) * (2.0 + planner.opt_ratio),
                     sum(g.tensors[t].nbytes for t in prog.fb_acts), _residual_bytes(prog)])
    prefix = np.vstack([np.zeros(3), np.cumsum(np.array(rows, dtype=float), axis=0)])
    gpipe = method.schedule == "gpipe"
    starts, ends = range_pairs(len(progs))

    def columns(sub: SubmeshShape) -> OptionColumns:
        par, inp, res = ((prefix[ends + 1] - prefix[starts]) / sub.num_devices).T
        # Only whether some pipeline fits is asked: any positive latency will do.
        latency = (ends - starts + 1) / sub.num_devices
        if gpipe:
            zero = np.zeros_like(par)
            return OptionColumns(np.stack([latency, latency], 1),
                                 np.stack([par + (inp + res) * m, par + inp * m + res], 1),
                                 np.stack([zero, zero], 1), ("", ""))
        return OptionColumns(np.stack([latency, latency], 1), np.stack([par, par + res], 1),
                             np.stack([inp + res, inp], 1), ("", ""))

    try:
        solve_stage_dp(len(progs), N, M, m, StageOptionGrid(len(progs), columns), budget,
                       max_stages=method.max_stages)
    except NoFeasiblePipelineError as e:
        raise PlanningError(
            f"no pipeline plan fits in {budget / 2**30:.1f} GiB per device, even with every "
            f"parameter, activation and residual split over all the devices of its stage "
            f"(no intra-op problem was solved): {e}") from None


def _search(planner: PipelinePlanner, method: Auto, cluster: Cluster, bounds, m: int,
            alternatives: list[Alternative] | None = None, budget: float | None = None):
    """Alpa's inter-op search: per-layer intra-op costs, summed per range, into the DP.
    What the DP weighed against its plan goes to `alternatives` (`_dp_alternatives`)."""
    N, M = cluster.num_nodes, cluster.devices_per_node
    shapes = submesh_shapes(N, M)
    L = len(bounds)
    budget = budget or method.memory_budget_bytes or cluster.device.memory_bytes
    # Per layer, per (submesh, logical shape): the layer's cost. Logical meshes are laid at
    # the start of a node-aligned block; the submesh's place does not change its costs.
    # Two options per layer and logical mesh: the fastest sharding, and the fastest with
    # every parameter split as finely as the mesh allows (the per-layer solves have no
    # memory budget, so without it a model whose fastest layers replicate their weights
    # over a data-parallel axis would have nothing that fits). The lean one is solved only
    # where the fastest does not already split every parameter that finely.
    progs = [planner.program(a, b) for a, b in bounds]
    meshes = [LogicalMesh(shape, ("x", "y")) for sub in shapes for shape in _logical_shapes(sub)]
    if not planner.exhaustive:
        _refuse_below_floor(planner, progs, m, budget, method)
    in_flight = None if planner.exhaustive else \
        m if method.schedule == "gpipe" else min(m, L)
    planner.prefetch_layers(progs, meshes, in_flight, budget)
    # Identical layers have identical options: each distinct layer's row is made once per
    # mesh and the layers index them (GPT-1T: 128 blocks, 387 submeshes, 15 searches).
    first: dict = {}        # reuse key -> (its index among the distinct layers, its first)
    which = np.array([first.setdefault(planner.reuse_key(prog), (len(first), prog))[0]
                      for prog in progs])
    distinct = [prog for _, prog in first.values()]
    residuals = np.array([_residual_bytes(prog) for prog in distinct])
    prefix: dict[tuple[int, tuple[int, int], str], np.ndarray] = {}
    for si, sub in enumerate(shapes):
        for shape in _logical_shapes(sub):
            mesh = LogicalMesh(shape, ("x", "y"))
            options = [_layer_options(planner, prog, mesh, budget) for prog in distinct]
            # (Every layer asks: the statistics count its answer as reused.)
            planner.asked.update((id(prog), shape, mesh.axis_names, None, False)
                                 for prog in progs)
            for i, kind in enumerate(("fast", "lean")):
                table = np.array([[o[i].forward_s, o[i].search_backward_s(m), o[i].param_bytes,
                                   o[i].act_bytes, o[i].input_bytes] for o in options])
                rows = np.column_stack([table, residuals / sub.num_devices])[which]
                prefix[(si, shape, kind)] = np.vstack([np.zeros(6), np.cumsum(rows, axis=0)])
    index = {sub: i for i, sub in enumerate(shapes)}
    gpipe = method.schedule == "gpipe"
    starts, ends = range_pairs(L)

    def columns(sub: SubmeshShape) -> OptionColumns:
        """Every range's options on `sub`: per logical mesh, fastest and memory-lean, each
        without and with remat (the DP's table takes them as arrays: `StageOptionGrid`)."""
        si = index[sub]
        cols = []
        for shape in _logical_shapes(sub):
            for kind in ("fast", "lean"):
                p = prefix[(si, shape, kind)]
                f, bw, par, act, inp, rebuilt = (p[ends + 1] - p[starts]).T
                tag = "" if kind == "fast" else " lean"
                for remat, time, label in ((False, f + bw, f"{shape}{tag}"),
                                           (True, 2 * f + bw, f"{shape}{tag} remat")):
                    held_always, per_micro_batch = _memory_terms(par, act, inp, rebuilt,
                                                                 remat)
                    if gpipe:   # every stage holds all m micro-batches, not 1F1B's count
                        # (summed in the order the columns always were: the same floats)
                        held_always = par + per_micro_batch * m + (rebuilt if remat else 0.0)
                        per_micro_batch = np.zeros_like(per_micro_batch)
                    cols.append((time, held_always, per_micro_batch, label))
        return OptionColumns(*(np.stack([c[a] for c in cols], 1) for a in range(3)),
                             tuple(c[3] for c in cols))

    options = StageOptionGrid(L, columns)

    report(planner.progress, DP, 0, 1)
    try:
        plan, stats = solve_stage_dp(L, N, M, m, options, budget, max_stages=method.max_stages)
    except NoFeasiblePipelineError as e:
        raise PlanningError(f"no pipeline plan fits in {budget / 2**30:.1f} GiB per device: "
                            f"{e}") from None
    report(planner.progress, DP, 1, 1)
    if alternatives is not None:
        alternatives.extend(_dp_alternatives(plan, shapes, options, budget, m, L,
                                             method.max_stages))
    sizes = [st.submesh.num_devices for st in plan.stages]
    offsets = _place(cluster, sizes)
    chosen = []
    for st, off in zip(plan.stages, offsets):
        label = st.option.label
        shape = tuple(int(x) for x in label.split(")")[0].strip("(").split(","))
        chosen.append(((st.start, st.end), LogicalMesh(shape, ("x", "y"), device_offset=off),
                       label.endswith("remat"), " lean" in label))
    return chosen, stats


def _dp_alternatives(plan, shapes, options, budget: float, m: int, L: int,
                     max_stages: int | None) -> list[Alternative]:
    """What the stage DP's plan beat, costed with the DP's own stage options (a few
    hundred bytes in the plan, so `alpa-lite explain` needs no new search):

    - "option": per chosen stage, the other options of its layers on its submesh (other
      logical meshes, memory-lean or not, remat or not), the fastest first;
    - "cut": the pipeline with one stage boundary moved one layer either way;
    - "stages": S equal stages on equal submeshes with the layers split evenly (the
      Megatron-style uniform pipeline), for every S the devices allow, and the DP's own
      plan ("chosen").
    Pipelines are costed as the DP costs them: each stage takes its fastest option that
    fits its micro-batches in flight (S - s under 1F1B), latency = sum + (m - 1) x max.
    """
    S = plan.num_stages
    out = [Alternative("stages", -1, f"chosen: {S} stage(s)", plan.latency_s, 0.0, True,
                       chosen=True)]

    def fastest(start, end, sub, in_flight):
        fits = [o for o in options(start, end, sub)
                if o.param_bytes + o.act_bytes * in_flight <= budget]
        return min(fits, key=lambda o: o.latency_s) if fits else None

    def latency(stages):   # [(start, end, submesh)] -> the DP's latency, None if one cannot fit
        n = len(stages)
        picked = [fastest(a, b, sub, n - i) for i, (a, b, sub) in enumerate(stages)]
        if any(o is None for o in picked):
            return None
        t = [o.latency_s for o in picked]
        return sum(t) + (m - 1) * max(t)

    for s, st in enumerate(plan.stages):
        opts = sorted(options(st.start, st.end, st.submesh), key=lambda o: o.latency_s)
        shown = [o for o in opts if o != st.option][:5]
        for o in sorted([st.option] + shown, key=lambda o: o.latency_s):
            memory = o.param_bytes + o.act_bytes * (S - s)
            out.append(Alternative("option", s, f"mesh {o.label} on submesh {st.submesh}",
                                   o.latency_s,
                                   memory, memory <= budget, chosen=o == st.option))
    ranges = [(st.start, st.end, st.submesh) for st in plan.stages]
    for s in range(S - 1):
        (a, b, sa), (_, d, sb) = ranges[s], ranges[s + 1]
        for shift in (-1, 1):
            if not a <= b + shift < d:
                continue
            moved = list(ranges)
            moved[s], moved[s + 1] = (a, b + shift, sa), (b + shift + 1, d, sb)
            t = latency(moved)
            out.append(Alternative("cut", s, f"stage {s} ends at layer {b + shift} "
                                   f"(chosen: {b})", t if t is not None else 0.0, 0.0,
                                   t is not None))
    devices = shapes[-1].num_devices   # the last submesh shape is the whole cluster
    for n in range(1, min(L, devices, max_stages or L) + 1):
        subs = [sh for sh in shapes if sh.num_devices * n == devices]
        if not subs:
            continue
        cuts = [p * L // n for p in range(n + 1)]
        t = latency([(cuts[p], cuts[p + 1] - 1, subs[0]) for p in range(n)])
        out.append(Alternative("stages", -1, f"{n} equal stage(s) of {subs[0]}",
                               t if t is not None else 0.0, 0.0, t is not None))
    return out
