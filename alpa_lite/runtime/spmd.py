"""The runtime: executes a `StagePlan` on JAX devices.

The traced program is replayed equation by equation inside one `jax.jit` over the stage's
`Mesh`: arguments and results carry the plan's `NamedSharding`s, every operator result is
pinned with `with_sharding_constraint` to the plan's spec, and an operand the plan reshards
before an operator is pinned to the spec the operator wants. The partitioner (Shardy) then
inserts exactly the collectives those specs imply. The runtime knows nothing of how the plan
was found.

Gradient buckets: the partitioner places one reduction per gradient; the plan's bucket
size (`Plan.sync_buckets`) reaches XLA's combiner and latency-hiding scheduler as compiler
options of this stage's executable (`runtime.xla_options`: on GPUs; XLA:CPU combines every
all-reduce whatever it is told).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa_lite.errors import PlanMismatchError
from alpa_lite.ir.replay import replay
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.plan import Plan, StagePlan
from alpa_lite.plan.sharding import TensorSpec
from alpa_lite.runtime.distributed import place
from alpa_lite.runtime.hlo import CompiledCollective, compiled_collectives
from alpa_lite.runtime.xla_options import bucket_options


def partition_spec(spec: TensorSpec) -> PartitionSpec:
    return PartitionSpec(*[None if not d else d[0] if len(d) == 1 else tuple(d)
                           for d in spec.dims])


def stage_mesh(stage: StagePlan, devices: Sequence[Any]) -> Mesh:
    """The `Mesh` of a stage: its cluster device indices, laid row-major over its shape."""
    picked = [devices[i] for i in stage.devices]
    return Mesh(np.array(picked, dtype=object).reshape(stage.mesh_shape), stage.axis_names)


def named_sharding(mesh: Mesh, spec: TensorSpec) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(spec))


class StageExecutable:
    """One compiled SPMD stage: call it with the flattened argument leaves.

    `compiler_options` are XLA's, for this stage's executable alone (`runtime.xla_options`).
    """

    def __init__(self, traced: TracedStep, stage: StagePlan, devices: Sequence[Any],
                 compiler_options: dict[str, Any] | None = None):
        self.traced = traced
        self.stage = stage
        self.mesh = stage_mesh(stage, devices)
        ns = lambda spec: named_sharding(self.mesh, spec)
        self.in_shardings = tuple(ns(s) for s in stage.input_specs)
        self.out_shardings = tuple(ns(s) for s in stage.output_specs)
        self._tensor = {t: ns(s) for t, s in stage.tensor_specs if s.rank}
        self._operand = {(n, p): ns(s) for n, p, s in stage.operand_specs if s.rank}
        self.compiler_options = dict(compiler_options or {})
        self._jitted = jax.jit(self._replay, in_shardings=self.in_shardings,
                               out_shardings=self.out_shardings,
                               compiler_options=self.compiler_options or None)
        self._compiled: dict[tuple, Any] = {}

    def _replay(self, *flat_args):
        # Each operator runs under a scope named after its graph node (in the HLO metadata,
        # to trace a collective back to the plan).
        g = self.traced.graph
        env: dict[int, Any] = dict(zip(g.inputs, flat_args))
        replay(self.traced, range(len(g.nodes)), env, self._tensor, self._operand)
        return tuple(env[t] if t in env else self.traced.consts[t] for t in g.outputs)

    def put_args(self, flat_args: Sequence[Any]) -> list[Any]:
        # One batched call: arrays already placed as the plan wants are passed through.
        return place(list(flat_args), list(self.in_shardings))

    def compiled(self, flat_args: Sequence[Any]):
        """The compiled program for these argument shapes (compiled once, then reused)."""
        key = tuple((np.shape(x), str(x.dtype)) for x in flat_args)
        if key not in self._compiled:
            avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
                     for x, s in zip(flat_args, self.in_shardings)]
            self._compiled[key] = self._jitted.lower(*avals).compile()
        return self._compiled[key]

    def __call__(self, flat_args: Sequence[Any]) -> tuple[Any, ...]:
        return self.compiled(flat_args)(*self.put_args(flat_args))

    def compiled_text(self, flat_args: Sequence[Any]) -> str:
        """The partitioned HLO XLA compiled for these arguments (abstract ones work)."""
        return self.compiled(flat_args).as_text()


class SpmdExecutable:
    """A plan made runnable: call with the step's positional arguments."""

    def __init__(self, traced: TracedStep, plan: Plan, devices: Sequence[Any]):
        if len(plan.stages) != 1 or plan.pipeline is not None:
            raise ValueError(
                f"this is a pipelined plan ({len(plan.stages)} stage(s), {plan.schedule}); "
                "it runs with alpa_lite.runtime.pipeline.PipelineExecutable")
        self.traced = traced
        self.plan = plan
        platform = devices[plan.stages[0].devices[0]].platform
        self.stage = StageExecutable(traced, plan.stages[0], devices,
                                     bucket_options(plan.sync_buckets_of(0), platform))

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The XLA options the step's executable is compiled with (`runtime.xla_options`)."""
        return self.stage.compiler_options

    def __call__(self, *args):
        flat = jax.tree_util.tree_leaves(args)
        outs = self.stage(flat)
        return jax.tree_util.tree_unflatten(self.traced.out_tree, outs)

    def compiled_text(self, *args) -> str:
        return self.stage.compiled_text(jax.tree_util.tree_leaves(args))

    def collectives(self, *args) -> tuple[CompiledCollective, ...]:
        """What one call runs, from the compiled program (arguments may be abstract)."""
        return compiled_collectives(self.compiled_text(*args), "step")

    def input_shardings(self, *args):
        """The sharding the plan wants for each argument leaf (the stage's `in_shardings`),
        as a pytree shaped like `args` (arrays or ShapeDtypeStructs); compiles nothing."""
        return shardings_like(args, self.stage.in_shardings)


def shardings_like(args, flat_shardings: Sequence[Any]):
    """`flat_shardings` (one per leaf of `args`) as a pytree shaped like `args`."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    if len(leaves) != len(flat_shardings):
        raise PlanMismatchError(f"the step was planned for {len(flat_shardings)} argument "
                                f"leaves, got {len(leaves)}; pass the arguments it was "
                                "built for")
    return jax.tree_util.tree_unflatten(treedef, list(flat_shardings))
