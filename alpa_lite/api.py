"""`@parallelize`: the user's entry point.

    @al.parallelize(method=al.Auto())
    def train_step(params, opt_state, batch): ...

    train_step(params, opt_state, batch)        # plans (once per signature), compiles, runs
    train_step.plan(*abstract_args, cluster=al.Cluster.preset("8xH100"))   # plans only

Planning and compilation are cached per argument signature and cluster.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.errors import PlanMismatchError
from alpa_lite.graph import Role
from alpa_lite.methods import Auto, DataParallel, Manual, Method
from alpa_lite.pipeline_planner import make_pipeline_plan
from alpa_lite.pipeline_program import StepParts, split_step
from alpa_lite.pipeline_runtime import PipelineExecutable
from alpa_lite.plan import Plan
from alpa_lite.planner import make_plan, replace_stats
from alpa_lite.runtime import Executable
from alpa_lite.tracing import TracedStep, trace


class ParallelizedStep:
    """A train step with a parallelization method attached (see `parallelize`)."""

    def __init__(self, fn: Callable, method: Method, cluster: Cluster | None,
                 batch_argnums: Sequence[int] | None, fixed_plan: Plan | None = None):
        if not isinstance(method, (Auto, Manual, DataParallel)):
            raise TypeError(f"method must be al.Auto(), al.Manual(dp, tp) or "
                            f"al.DataParallel(), got {method!r}")
        self.fn = fn
        self.method = method
        self.cluster = cluster
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.fixed_plan = fixed_plan
        self._traces: dict[Any, TracedStep] = {}
        self._parts: dict[Any, StepParts] = {}
        self._plans: dict[Any, Plan] = {}
        self._executables: dict[Any, Executable] = {}
        functools.update_wrapper(self, fn)

    def _batch_argnums(self, nargs: int) -> tuple[int, ...]:
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
            sig.append((tuple(shape) if shape is not None else type(x).__name__,
                        str(dtype) if dtype is not None else None))
        return treedef, tuple(sig)

    def trace(self, *args) -> TracedStep:
        """Traces the step for these arguments (arrays or ShapeDtypeStructs)."""
        key = self._signature(args)
        if key not in self._traces:
            self._traces[key] = trace(self.fn, args, self._batch_argnums(len(args)))
        return self._traces[key]

    def _micro_batches(self) -> int | None:
        """The micro-batch count when the step is pipelined, else None."""
        if self.fixed_plan is not None:
            p = self.fixed_plan.pipeline
            return None if p is None else p.num_micro_batches
        m = self.method
        if isinstance(m, Manual) and m.pipelined:
            return m.num_micro_batches
        if isinstance(m, Auto) and m.num_micro_batches is not None:
            return m.num_micro_batches
        return None

    def parts(self, *args) -> StepParts:
        """The step split for pipelining (loss function per micro-batch, apply part)."""
        key = (self._signature(args), self._micro_batches())
        if key not in self._parts:
            self._parts[key] = split_step(self.fn, args, self._batch_argnums(len(args)),
                                          self._micro_batches())
        return self._parts[key]

    def plan(self, *args, cluster: Cluster | None = None) -> Plan:
        """Plans the step for these arguments on `cluster` (default: the step's cluster,
        else the local devices). Arguments may be `jax.ShapeDtypeStruct`s."""
        cluster = cluster or self.cluster or Cluster.local()
        t0 = time.perf_counter()
        # A pipelined step is traced with its gradient call captured; the rest whole.
        pipelined = self._micro_batches() is not None
        traced = self.parts(*args).outer if pipelined else self.trace(*args)
        trace_s = time.perf_counter() - t0
        if self.fixed_plan is not None:
            self.fixed_plan.check_matches(cluster.fingerprint(), traced.fingerprint,
                                          traced.input_avals)
            return self.fixed_plan
        key = (self._signature(args), cluster.fingerprint())
        if key not in self._plans:
            names = {t.id: t.name for t in traced.graph.tensors if t.role is not Role.ACTIVATION}
            if pipelined:
                plan = make_pipeline_plan(self.parts(*args), self.method, cluster,
                                          traced.fingerprint, traced.input_avals, names)
            else:
                plan = make_plan(traced, self.method, cluster, tensor_names=names)
            self._plans[key] = replace_stats(plan, trace_s=trace_s)
        return self._plans[key]

    def executable(self, *args) -> Executable:
        """The compiled executable for these arguments on the local devices."""
        cluster = self.cluster or Cluster.local()
        local = Cluster.local()
        if cluster.fingerprint() != local.fingerprint():
            raise PlanMismatchError(
                f"this step is set to cluster {cluster.name!r}, which is not the local "
                f"devices ({local.name}); plan for it with .plan(..., cluster=...) and run on "
                "the local devices")
        key = self._signature(args)
        if key not in self._executables:
            plan = self.plan(*args, cluster=cluster)
            if plan.pipeline is not None:
                self._executables[key] = PipelineExecutable(self.parts(*args), plan,
                                                            jax.devices())
            else:
                self._executables[key] = Executable(self.trace(*args), plan, jax.devices())
        return self._executables[key]

    def with_plan(self, plan: Plan) -> "ParallelizedStep":
        """A step that runs `plan` (e.g. one loaded from JSON) instead of planning; it is
        checked against the cluster, program and argument shapes on the first call."""
        return ParallelizedStep(self.fn, self.method, self.cluster, self.batch_argnums, plan)

    def __call__(self, *args):
        return self.executable(*args)(*args)


def parallelize(fn: Callable | None = None, *, method: Method | None = None,
                cluster: Cluster | None = None, batch_argnums: Sequence[int] | None = None):
    """Parallelizes a train step.

    Args:
      fn: the train step `(params, opt_state, batch) -> (params, opt_state, loss)` or any
        step whose gradients come from `al.value_and_grad` / `al.grad`.
      method: `al.Auto()` (default), `al.Manual(dp, tp)` or `al.DataParallel()`.
      cluster: the cluster to plan for; default the local devices.
      batch_argnums: positional arguments holding the batch (default: the last one).

    Returns:
      A `ParallelizedStep`; usable as a decorator with or without arguments.
    """
    method = Auto() if method is None else method

    def wrap(f):
        return ParallelizedStep(f, method, cluster, batch_argnums)
    return wrap if fn is None else wrap(fn)
