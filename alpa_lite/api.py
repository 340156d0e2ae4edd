"""`@parallelize`: the user's entry point.

    @al.parallelize(method=al.Auto())
    def train_step(params, opt_state, batch): ...

    train_step(params, opt_state, batch)        # plans (once per signature), compiles, runs
    train_step.plan(*abstract_args, cluster=al.Cluster.preset("8xH100"))   # plans only

Planning and compilation are cached per argument signature and cluster.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from alpa_lite import compression as C
from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.errors import PlanMismatchError, PlanningError
from alpa_lite.ir.batch import batch_size
from alpa_lite.ir.graph import Role, dtype_name
from alpa_lite.ir.step_parts import SplitTraces, StepParts, split_step
from alpa_lite.ir.tracing import TracedStep, trace
from alpa_lite.plan import Choice, Plan
from alpa_lite.plan.methods import Auto, DataParallel, Manual, Method, method_to_json
from alpa_lite.planning.auto_search import SearchSpace, search_auto
from alpa_lite.planning.cache import cache_key, load_plan, save_plan
from alpa_lite.planning.collector import fewer_collections
from alpa_lite.planning.compression import make_compressed_plan, refuse_double_momentum
from alpa_lite.planning.hybrid_search import best_hybrid, hybrid_layouts
from alpa_lite.planning.pipeline import PlannerPool, make_pipeline_plan, manual_memory_floor
from alpa_lite.planning.spmd import make_plan, replace_stats
from alpa_lite.progress import TRACE, Progress, report
from alpa_lite.runtime.compressed import CompressedExecutable
from alpa_lite.runtime.distributed import share_from_first
from alpa_lite.runtime.executable import Executable, StepProgram, compile_plan
from alpa_lite.static_leaves import StaticStep, split_static


def _on_resolved(method: Callable) -> Callable:
    """`method` run by the step that plans and runs its arguments
    (`ParallelizedStep._resolved`: this one, or that of their array leaves alone)."""
    @functools.wraps(method)
    def resolved(self, *args, **kwargs):
        step, args = self._resolved(args)
        return method(step, *args, **kwargs)
    return resolved


class ParallelizedStep:
    """A train step with a parallelization method attached (see `parallelize`)."""

    def __init__(self, fn: Callable, method: Method, cluster: Cluster | None,
                 batch_argnums: Sequence[int] | None, fixed_plan: Plan | None = None,
                 compression=None, on_nonfinite: str = "raise", compression_seed: int = 0):
        if not isinstance(method, (Auto, Manual, DataParallel)):
            raise TypeError(f"method must be al.Auto(), al.Manual(dp, tp) or "
                            f"al.DataParallel(), got {method!r}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        self.compression = _compression_setting(compression)
        self.on_nonfinite = on_nonfinite
        self.compression_seed = int(compression_seed)
        self._last_compressed: CompressedExecutable | None = None
        self.fn = fn
        self.method = method
        self.cluster = cluster
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.fixed_plan = fixed_plan
        self._traces: dict[Any, TracedStep] = {}
        self._parts: dict[Any, StepParts] = {}
        self._split_traces: dict[Any, SplitTraces] = {}
        self._plans: dict[Any, Plan] = {}
        self._executables: dict[Any, Executable] = {}
        # Per set of non-array argument leaves (`alpa_lite.static_leaves`): the step of
        # the array leaves alone, planned and run in their place.
        self._static_steps: dict[Any, ParallelizedStep] = {}
        # Name and docstring only: the function's own attributes would overwrite ours.
        functools.update_wrapper(self, fn, updated=())

    def _resolved(self, args: tuple) -> tuple["ParallelizedStep", tuple]:
        """The step that plans and runs `args` (Python numbers made arrays): this one, or,
        where some argument leaves are not arrays, the step of the array leaves alone
        (`static_leaves.StaticStep`), with those leaves None in the arguments it gets."""
        # (Every call passes through here: the arguments are flattened once.)
        args, flat = _numbers_as_arrays(args)
        stripped, static = split_static(args, "argument", flat)
        if static is None:
            return self, args
        key = (static.treedef, static.positions, static.values)
        if key not in self._static_steps:
            self._static_steps[key] = ParallelizedStep(
                StaticStep(self.fn, static), self.method, self.cluster, self.batch_argnums,
                self.fixed_plan, self.compression, self.on_nonfinite, self.compression_seed)
        return self._static_steps[key], stripped

    def resolve_batch_argnums(self, nargs: int) -> tuple[int, ...]:
        if nargs == 0:
            raise TypeError("a parallelized step needs positional arguments (params, ..., batch)")
        nums = self.batch_argnums if self.batch_argnums is not None else (nargs - 1,)
        out = []
        for i in nums:
            j = i + nargs if i < 0 else i
            if not 0 <= j < nargs:
                raise ValueError(f"batch_argnums={self.batch_argnums} names argument {i}, but "
                                 f"the step was called with {nargs} positional arguments")
            out.append(j)
        return tuple(out)

    def _signature(self, args) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        sig = []
        for x in leaves:
            shape = getattr(x, "shape", None)
            dtype = getattr(x, "dtype", None)
            # `dtype_name` is memoised per dtype: str() of each of thousands of leaves is not.
            sig.append((tuple(shape) if shape is not None else type(x).__name__,
                        dtype_name(dtype) if dtype is not None else None))
        return treedef, tuple(sig)

    @_on_resolved
    def trace(self, *args) -> TracedStep:
        """Traces the step for these arguments (arrays or ShapeDtypeStructs)."""
        key = self._signature(args)
        if key not in self._traces:
            self._traces[key] = trace(self.fn, args, self.resolve_batch_argnums(len(args)))
        return self._traces[key]

    def _micro_batches(self) -> int | None:
        """The micro-batch count when the step is pipelined, else None."""
        if self.fixed_plan is not None:
            p = self.fixed_plan.pipeline
            return None if p is None else p.num_micro_batches
        m = self.method
        if isinstance(m, Manual) and (m.pipelined or self._compresses_hybrid()):
            return m.num_micro_batches
        if isinstance(m, Auto) and m.num_micro_batches is not None:
            return m.num_micro_batches
        return None

    def _compresses_hybrid(self) -> bool:
        """Compression on the data-parallel axis of a plan with tensor or pipeline
        parallelism: planned and run as a pipeline (of one stage where pp = 1) whose
        stages exchange their accumulated gradients compressed (`StagePlan.exchange`)."""
        m = self.method
        return self.compression is not None and isinstance(m, Manual) and \
            (m.tp > 1 or m.pipelined)

    @_on_resolved
    def parts(self, *args, num_micro_batches: int | None = None) -> StepParts:
        """The step split for pipelining (loss function per micro-batch, apply part), into
        `num_micro_batches` (default: the method's or the fixed plan's)."""
        m = num_micro_batches or self._micro_batches()
        key = (self._signature(args), m)
        if key not in self._parts:
            # The counts of one signature share the traces that do not depend on the count.
            traces = self._split_traces.setdefault(key[0], SplitTraces())
            self._parts[key] = split_step(self.fn, args, self.resolve_batch_argnums(len(args)),
                                          m, traces)
        return self._parts[key]

    @_on_resolved
    def plan(self, *args, cluster: Cluster | None = None,
             progress: Progress | None = None) -> Plan:
        """Plans the step for these arguments on `cluster` (default: the step's cluster,
        else the local devices). Arguments may be `jax.ShapeDtypeStruct`s. `progress`, if
        given, hears of each planning phase (`alpa_lite.progress`)."""
        with fewer_collections():
            return self._plan_for(args, cluster, progress)

    def _plan_for(self, args, cluster: Cluster | None, progress: Progress | None) -> Plan:
        cluster = cluster or self.cluster or Cluster.local()
        t0 = time.perf_counter()
        report(progress, TRACE, 0, 1)
        # A pipelined step is traced with its gradient call captured; the rest whole.
        pipelined = self._micro_batches() is not None
        parts = self.parts(*args) if pipelined else None
        traced = parts.outer if parts is not None else self.trace(*args)
        trace_s = time.perf_counter() - t0
        report(progress, TRACE, 1, 1)
        if self.fixed_plan is not None:
            self.fixed_plan.check_matches(cluster.fingerprint(), traced.fingerprint,
                                          traced.input_avals)
            return self.fixed_plan
        key = (self._signature(args), cluster.fingerprint())
        if key not in self._plans:
            # With several processes, process 0 plans and the others run its plan: a
            # solver's time limit must not let the processes disagree.
            # A pipelined step's outer trace holds its gradient call as one node: the
            # loss inside it is told apart by the forward's own fingerprint.
            inner = parts.forward.fingerprint if parts is not None else None
            disk = cache_key("plan", traced.fingerprint, inner, traced.input_avals,
                             cluster.fingerprint(), method_to_json(self.method),
                             repr(self.compression), self.resolve_batch_argnums(len(args)))
            plan = share_from_first(
                lambda: self._cached_plan(disk, args, traced, cluster, pipelined, progress),
                errors=(PlanningError,), encode=Plan.to_json, decode=Plan.from_json)
            self._plans[key] = replace_stats(plan, trace_s=trace_s)
        return self._plans[key]

    def _cached_plan(self, disk: str, args, traced: TracedStep, cluster: Cluster,
                     pipelined: bool, progress: Progress | None) -> Plan:
        """The plan from the disk cache (`planning.cache`), else made and stored there."""
        plan = load_plan(disk)
        if plan is not None:
            return replace_stats(plan, plan_cache_hit=True)
        plan = self._make_plan(args, traced, cluster, pipelined, progress)
        save_plan(disk, plan)
        return plan

    def _make_plan(self, args, traced: TracedStep, cluster: Cluster, pipelined: bool,
                   progress: Progress | None) -> Plan:
        names = outer_names_of(traced)
        if self.compression is not None:
            # DGC's momentum correction needs a plain-SGD optimizer, in every kind of plan;
            # the whole step's trace tells parameters from optimizer state (the outer trace
            # of a pipelined step holds the parameters as plain inputs).
            whole = self.trace(*args)
            refuse_double_momentum(self.compression, whole.graph.tensors_with_role(
                Role.OPT_STATE), [t.shape for t in whole.graph.tensors_with_role(Role.PARAM)],
                outer_names_of(whole))
        if self.compression is not None and self._compresses_hybrid():
            return make_pipeline_plan(self.parts(*args), self.method, cluster,
                                      traced.fingerprint, traced.input_avals, names,
                                      progress=progress, compression=self.compression)
        if self.compression is not None:
            if pipelined:
                # Auto(num_micro_batches=...): refuse rather than run the pipeline
                # uncompressed.
                raise PlanningError(
                    f"compression={self.compression!r} with the pipelined method "
                    f"{self.method!r}: compressed pipelines are planned from a layout, "
                    "al.Manual(dp=..., tp=..., pp=..., num_micro_batches=...) with dp > 1, "
                    "or chosen by al.Auto() without num_micro_batches; drop the "
                    "num_micro_batches or the compression")
            # Workers are to the batch what micro-batches are: the same check proves
            # the loss combines exactly (a mean or a sum over examples).
            try:
                workers = split_step(self.fn, args, self.resolve_batch_argnums(len(args)),
                                     cluster.num_devices)
            except PlanningError as e:
                raise PlanningError(
                    f"gradient compression runs the loss on each of the "
                    f"{cluster.num_devices} workers' share of the batch, as if they were "
                    f"micro-batches, and this step cannot be split so: {e}") from None
            if any(workers.batch_draws):
                raise PlanningError(
                    "gradient compression runs the step on each worker's share of the batch, "
                    "and the loss draws random numbers along the batch (e.g. a dropout "
                    "mask): each worker would draw its own, not jax.jit's; plan without "
                    "compression, or draw per example (jax.random.fold_in(key, index))")
            weigh_hybrids = isinstance(self.method, Auto) and \
                isinstance(self.compression, C.AutoCompression)
            if traced.sharding_constraints:
                # The per-worker engine runs the step itself inside shard_map, where the
                # user's pins name a mesh no worker has (JAX refuses them there); the
                # hybrid layouts run the traced step, which reads them as the identity.
                refusal = (
                    "gradient compression with data parallelism runs the step itself on "
                    "each worker, and the step pins values with with_sharding_constraint, "
                    "whose shardings name a mesh no worker has: remove the pins (the plan "
                    "chooses every sharding), compress a hybrid layout (al.Manual(dp=..., "
                    "tp=...) or with pp, which runs the traced step and reads the pins as "
                    "the identity), or plan without compression")
                if weigh_hybrids:
                    return self._weigh_hybrids(args, traced, cluster, None, refusal)
                raise PlanningError(refusal)
            pure_dp = make_compressed_plan(traced, self.method, cluster, self.compression,
                                           workers.loss_scale, names)
            if weigh_hybrids:
                return self._weigh_hybrids(args, traced, cluster, pure_dp)
            return pure_dp
        if not isinstance(self.method, Auto):
            if pipelined:
                return make_pipeline_plan(self.parts(*args), self.method, cluster,
                                          traced.fingerprint, traced.input_avals, names,
                                          progress=progress)
            return make_plan(traced, self.method, cluster, tensor_names=names, progress=progress)

        pool = PlannerPool()    # candidates of one micro-batch count share their work

        def pipeline_plan(method: Auto | Manual) -> Plan:
            """A pipeline of `method.num_micro_batches` micro-batches; a Manual layout is
            weighed by the search, which judges its memory (no warning)."""
            parts = self.parts(*args, num_micro_batches=method.num_micro_batches)
            outer = parts.outer
            with warnings.catch_warnings():
                if isinstance(method, Manual):
                    warnings.simplefilter("ignore")
                return make_pipeline_plan(parts, method, cluster, outer.fingerprint,
                                          outer.input_avals, outer_names_of(outer),
                                          progress=progress, pool=pool)

        budget = self.method.memory_budget_bytes or cluster.device.memory_bytes
        space = SearchSpace(
            plan_single=lambda: make_plan(traced, self.method, cluster, tensor_names=names,
                                          progress=progress),
            plan_pipelined=lambda m: pipeline_plan(
                dataclasses.replace(self.method, num_micro_batches=m)),
            plan_textbook=pipeline_plan,
            textbook_floor=self._layout_floor(args, cluster, pool, budget),
            num_devices=cluster.num_devices, devices_per_node=cluster.devices_per_node,
            budget_bytes=budget, forget=self._forgetter(args, pool))
        return search_auto(self.method, _batch_size(traced), space, progress)

    def _forgetter(self, args, pool: PlannerPool):
        """Drops the split of the step into m micro-batches and its planners (a later call
        splits it again)."""
        def forget(m: int) -> None:
            parts = self._parts.pop((self._signature(args), m), None)
            if parts is not None:
                pool.forget(parts)
        return forget

    def _layout_floor(self, args, cluster: Cluster, pool: PlannerPool, budget: float):
        """The least peak memory per device of any plan of a Manual layout of this step
        (`planning.pipeline.manual_memory_floor`), for searches to skip what cannot fit
        `budget` (a floor over it may be that of the layout's first stage found over)."""
        def floor(layout: Manual) -> float:
            parts = self.parts(*args, num_micro_batches=layout.num_micro_batches)
            return manual_memory_floor(parts, layout, cluster, outer_names_of(parts.outer),
                                       pool, stop_above=budget)
        return floor

    def _weigh_hybrids(self, args, traced: TracedStep, cluster: Cluster,
                       pure_dp: Plan | None, refusal: str = "") -> Plan:
        """Auto with AutoCompression: the pure data-parallel plan (compressed or not, or
        the best uncompressed layout it already weighed) against the hybrid layouts with
        compressed data parallelism (`planning.hybrid_search`); the fastest that fits,
        with the choice and its runner-up in `Plan.choices`. `pure_dp` None: the step
        cannot run as one (`refusal` says why), and only the hybrids are weighed."""
        budget = self.method.memory_budget_bytes or cluster.device.memory_bytes
        pool = PlannerPool()

        def plan_layout(layout: Manual) -> Plan:
            parts = self.parts(*args, num_micro_batches=layout.num_micro_batches)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return make_pipeline_plan(parts, layout, cluster, parts.outer.fingerprint,
                                          parts.outer.input_avals, outer_names_of(parts.outer),
                                          compression=self.compression, pool=pool)

        batch = _batch_size(traced)
        layouts = [] if batch is None else hybrid_layouts(
            cluster.num_devices, cluster.devices_per_node, batch)
        best, outcomes = best_hybrid(layouts, plan_layout, budget, batch or 0,
                                     self._layout_floor(args, cluster, pool, budget))
        hybrids = [(_layout_label(o.plan), o.step_time_s, o.note == "") for o in outcomes
                   if o.plan is not None]
        if pure_dp is None:
            if best is None:
                first = next((o.note for o in outcomes if o.note), "no layout fits the batch")
                raise PlanningError(f"{refusal}; no hybrid layout could be planned either "
                                    f"(first: {first})")
            weighed = hybrids
        else:
            base_fits = pure_dp.peak_memory_bytes <= budget
            label = ("data parallel, " + pure_dp.compression.description
                     if pure_dp.compression is not None else "uncompressed " + (
                         "pipeline" if pure_dp.pipeline is not None else "single stage"))
            weighed = [(label, pure_dp.step_time_s, base_fits)] + hybrids
        if best is not None and (pure_dp is None or not base_fits
                                 or best.step_time_s < pure_dp.step_time_s):
            # The plan runs the layout; the method stays what the user asked for.
            chosen, chosen_label = dataclasses.replace(best, method=self.method), \
                _layout_label(best)
        else:
            chosen, chosen_label = pure_dp, label
        others = sorted((w for w in weighed if w[0] != chosen_label),
                        key=lambda w: (not w[2], w[1]))
        runner = others[0] if others else ("", None, True)
        note = f"{len(layouts)} hybrid layouts weighed with compressed data parallelism"
        refused = [o for o in outcomes if o.step_time_s is None]
        if refused:
            note += f"; {len(refused)} could not be planned (first: {refused[0].note})"
        if pure_dp is None:
            note += f"; pure data parallelism refused: {refusal}"
        choice = Choice("layout", chosen_label, chosen.step_time_s, runner[0], runner[1],
                        runner[2], by_user=False, note=note)
        return dataclasses.replace(chosen, choices=chosen.choices + (choice,))

    def compile(self, *args) -> Executable:
        """Plans (once per signature) and compiles the step for these arguments on the
        local devices: the executable a call runs; `.collectives(*args)` lists what it
        executes, read from the compiled programs."""
        step, args = self._resolved(args)
        return step._compiled(args)

    def _compiled(self, args: tuple) -> Executable:
        # `compile` for arguments already made arrays (a call converts them once).
        cluster = self.cluster or Cluster.local()
        # The local devices may be described as another grouping into nodes (e.g. to run
        # a two-node plan on one machine's devices), or by calibrated figures; a device
        # without a datasheet row runs with the description the user gave.
        local = Cluster.local(allow_unknown=self.cluster is not None)
        same_devices = cluster.can_run_on(local)
        if not same_devices:
            raise PlanMismatchError(
                f"this step is set to cluster {cluster.name!r}, which is not the local "
                f"devices ({local.name}); plan for it with .plan(..., cluster=...) and run on "
                "the local devices")
        key = self._signature(args)
        if key not in self._executables:
            plan = self.plan(*args, cluster=cluster)
            program = self.program(plan, *args)
            with _plans_own_meshes():
                self._executables[key] = compile_plan(plan, program, jax.devices())
        return self._executables[key]

    def program(self, plan: Plan, *args) -> StepProgram:
        """What the runtime needs of this step to run `plan` on these arguments."""
        step, args = self._resolved(args)
        if step is not self:
            return step.program(plan, *args)
        nums = self.resolve_batch_argnums(len(args))
        common = dict(fn=self.fn, batch_argnums=nums, on_nonfinite=self.on_nonfinite,
                      compression_seed=self.compression_seed)
        if plan.pipeline is not None:
            return StepProgram(parts=self.parts(
                *args, num_micro_batches=plan.pipeline.num_micro_batches), **common)
        return StepProgram(traced=self.trace(*args), **common)

    def input_shardings(self, *args):
        """The `jax.sharding.Sharding` the plan wants for each argument leaf, as a pytree
        shaped like `args` (arrays or `jax.ShapeDtypeStruct`s), e.g. to load a checkpoint
        straight onto the devices that need it. Plans and builds the executable as the
        first call would, but compiles and runs nothing."""
        step, args = self._resolved(args)
        shardings = step._compiled(args).input_shardings(*args)
        if step is self:
            return shardings
        # Shaped like the arguments as given: None at their non-array leaves.
        return step.fn.static.as_none().restore(jax.tree_util.tree_leaves(shardings))

    def with_method(self, method: Method) -> "ParallelizedStep":
        """The same step with another method, sharing this step's traces (tracing a large
        model takes seconds; `alpa_lite.tools.compare` plans one step many ways)."""
        other = ParallelizedStep(self.fn, method, self.cluster, self.batch_argnums,
                                 compression=self.compression, on_nonfinite=self.on_nonfinite,
                                 compression_seed=self.compression_seed)
        # The caches are keyed by argument signature (and micro-batch count), not by
        # method, so the dicts themselves are shared.
        other._traces = self._traces
        other._parts = self._parts
        other._split_traces = self._split_traces
        return other

    def with_plan(self, plan: Plan) -> "ParallelizedStep":
        """A step that runs `plan` (e.g. one loaded from JSON) instead of planning; it is
        checked against the cluster, program and argument shapes on the first call."""
        return ParallelizedStep(self.fn, self.method, self.cluster, self.batch_argnums, plan,
                                self.compression, self.on_nonfinite, self.compression_seed)

    def __call__(self, *args):
        step, args = self._resolved(args)
        if step is not self:
            out = step.fn.restore(step._run(args))
            self._last_compressed = step._last_compressed or self._last_compressed
            return out
        return self._run(args)

    def _run(self, args: tuple):
        # `__call__` for arguments already resolved (flattened once per call).
        exe = self._compiled(args)
        if isinstance(exe, CompressedExecutable):
            self._last_compressed = exe
        with _plans_own_meshes():
            return exe(*args)

    @property
    def built_plans(self) -> tuple[Plan, ...]:
        """The plans of the executables built so far, one per argument signature."""
        return tuple(exe.plan for exe in self._executables.values()) + tuple(
            p for step in self._static_steps.values() for p in step.built_plans)

    # ---- compressor state (residuals, warm starts, delayed queues) ----------------------

    @property
    def active_compressed(self) -> CompressedExecutable | None:
        """The compressed executable whose state `compression_state` shows: the last
        one called, or the one a checkpoint was restored into; None before either."""
        return self._last_compressed

    @active_compressed.setter
    def active_compressed(self, exe: CompressedExecutable) -> None:
        own = list(self._executables.values()) + [
            e for step in self._static_steps.values() for e in step._executables.values()]
        if not any(exe is e for e in own):
            raise ValueError("active_compressed must be one of this step's own executables "
                             "(step.compile(*args))")
        self._last_compressed = exe

    def _compressed(self) -> CompressedExecutable:
        if self._last_compressed is None:
            raise ValueError("no compressed step has run yet: the compression state exists "
                             "after the first call of a step with compression=...")
        return self._last_compressed

    @property
    def compression_state(self):
        """The per-worker compressor state of the last compressed call: a pytree of arrays
        stacked over workers (one row per device), for checkpoints."""
        return self._compressed().state()

    def set_compression_state(self, state) -> None:
        """Restores a state `compression_state` returned (same plan and shapes)."""
        self._compressed().set_state(state)

    def reset_compression_state(self, seed: int | None = None) -> None:
        """Zeroes every residual and queue and restarts warm-ups (step count 0); `seed`
        re-seeds the compressors' random choices (also before the first call)."""
        if seed is not None:
            self.compression_seed = int(seed)
        for exe in self._executables.values():
            if isinstance(exe, CompressedExecutable):
                exe.reset_state(seed)
        for step in self._static_steps.values():
            step.reset_compression_state(seed)


def _plans_own_meshes():
    """A context without the user's mesh (`jax.set_mesh`, which code written for pjit calls
    its step under): the plan's programs carry their own meshes, a pipeline stage's a part
    of the devices, and jit refuses arguments off the context mesh. The step is still
    traced under the user's mesh, where its bare PartitionSpecs need it."""
    return jax.set_mesh(None)


def _numbers_as_arrays(args: tuple) -> tuple[tuple, tuple[list, Any]]:
    """`args` with each Python number leaf (flax's `TrainState.create` starts `step` at the
    int 0) made the array `jax.jit` would make of it (weakly typed, e.g. int32): the
    runtimes take arrays, and the next step's array of the same value then has the same
    signature, so the step is not planned and compiled twice; and its (leaves, treedef).
    `args` itself, unrebuilt, where there is none (every call of a step passes through
    here)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    numbers = (bool, int, float, complex)
    if not any(isinstance(x, numbers) for x in leaves):
        return args, (leaves, treedef)
    leaves = [jnp.asarray(x) if isinstance(x, numbers) else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves), (leaves, treedef)


def parallelize(fn: Callable | None = None, *, method: Method | None = None,
                cluster: Cluster | None = None, batch_argnums: Sequence[int] | None = None,
                compression=None, on_nonfinite: str = "raise", compression_seed: int = 0):
    """Parallelizes a train step.

    Args:
      fn: the train step `(params, opt_state, batch) -> (params, opt_state, loss)` or any
        step whose gradients come from `al.value_and_grad` / `al.grad`.
      method: `al.Auto()` (default), `al.Manual(dp, tp)` or `al.DataParallel()`.
      cluster: the cluster to plan for; default the local devices.
      batch_argnums: positional arguments holding the batch (default: the last one).
      compression: how data-parallel gradients travel: a compressor from
        `alpa_lite.compression` (e.g. `PowerSGD(rank=4)`), `DelayedAveraging(delay=D)`,
        `LocalSGD(every=H)` (parameters averaged every H steps),
        `AutoCompression(allow=...)` or "auto" (the planner chooses among the allowed
        methods and none; plain "auto" allows no lossy method). None: the plan's own
        collectives, uncompressed.
      on_nonfinite: with compression, a NaN or Inf gradient raises
        `NonFiniteGradientError` ("raise") or skips the update with a warning ("skip");
        either way the parameters and the compressor state stay as they were.
      compression_seed: seeds the compressors' random choices (random-k positions,
        stochastic rounding, PowerSGD's first Q, DGC's threshold sample).

    Returns:
      A `ParallelizedStep`; usable as a decorator with or without arguments.
    """
    method = Auto() if method is None else method

    def wrap(f):
        return ParallelizedStep(f, method, cluster, batch_argnums, compression=compression,
                                on_nonfinite=on_nonfinite, compression_seed=compression_seed)
    return wrap if fn is None else wrap(fn)


def _layout_label(plan: Plan) -> str:
    """A hybrid plan's layout (its method is the Manual layout it was planned as)."""
    layout = plan.method
    exchanges = {C.from_config(s.exchange.method).name for s in plan.stages if s.exchange}
    return (f"dp={layout.dp} x tp={layout.tp} x pp={layout.pp}, "
            f"{layout.num_micro_batches} micro-batch(es), dp "
            + (f"compressed ({', '.join(sorted(exchanges))})" if exchanges else "all-reduce"))


def outer_names_of(traced: TracedStep) -> dict[int, str]:
    """The step's names for its inputs and outputs (tensor id -> name)."""
    return {t.id: t.name for t in traced.graph.tensors if t.role is not Role.ACTIVATION}


def _batch_size(traced: TracedStep) -> int | None:
    """The step's batch size, None where it has no batch (or its leaves disagree: the
    pipeline planner names them when it is asked to split the batch)."""
    try:
        return batch_size({t.name: t.shape
                           for t in traced.graph.tensors_with_role(Role.BATCH)})
    except PlanningError:
        return None


def _compression_setting(compression):
    if compression is None:
        return None
    if isinstance(compression, str):
        if compression != "auto":
            raise ValueError(f"compression={compression!r}: the only name accepted is "
                             "'auto'; pass a compressor such as "
                             "alpa_lite.compression.PowerSGD(rank=4)")
        return C.AutoCompression()
    if isinstance(compression, (C.Compressor, C.DelayedAveraging, C.LocalSGD,
                                C.AutoCompression)):
        return compression
    raise TypeError(f"compression must be a compressor from alpa_lite.compression, "
                    f"DelayedAveraging, LocalSGD, AutoCompression or 'auto', got "
                    f"{compression!r}")
