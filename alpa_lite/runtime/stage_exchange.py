"""A stage's compressed gradient exchange (`StagePlan.exchange`): hybrid plans' compressed
data parallelism, run once per step after the stage's last backward.

The stage's backward runs per device over its accumulation axes (`runtime.pipeline`), so
each device holds its own partial gradients, stacked over those axes ([replicas, ...],
every other dimension sharded as the plan shards the gradient). The exchange is one
program over the stage's mesh with every axis manual (`jax.shard_map`): each device takes
its block of each gradient (its tensor-parallel shard) and

* for a gradient the plan compresses, runs the compressor's `reduce` over the
  accumulation axes, with its own state for that block (error-feedback residuals,
  PowerSGD's warm start: sharded like the gradient, one block per device);
* for the others, a full-precision `psum` over the same axes.

The result is each gradient summed over the replicas, in the plan's sharding: what the
uncompressed path's sum over the stacked axis gives, up to the compressor's loss.

Random keys: the key shared by the replicas that exchange one block differs per block
(folded with the block's position on the other axes) and per step; the per-worker key
differs per device. Compressors whose payload changes over training (DGC's warm-up) get
one compiled program per phase.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpa_lite import compression as C
from alpa_lite.ir.graph import as_dtype
from alpa_lite.plan import StageExchange
from alpa_lite.plan.sharding import LogicalMesh, TensorSpec
from alpa_lite.runtime.spmd import partition_spec


class CompressedReduce:
    """Runs one stage's `StageExchange`; keeps the compressor's state between steps."""

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], exchange: StageExchange,
                 grad_specs: Sequence[TensorSpec], grad_shapes: Sequence[tuple[int, ...]],
                 grad_dtypes: Sequence[str], seed: int = 0):
        if len(exchange.compressed) != len(grad_specs):
            raise ValueError(f"the plan's exchange covers {len(exchange.compressed)} "
                             f"gradients but the stage makes {len(grad_specs)}; plan again")
        self.mesh = mesh
        self.axes = tuple(axes)
        self.method = C.from_config(exchange.method)
        self.compressed = tuple(exchange.compressed)
        self.num_workers = math.prod(mesh.shape[a] for a in self.axes)
        if self.num_workers != exchange.num_workers:
            raise ValueError(f"the plan exchanges over {exchange.num_workers} replicas but "
                             f"the stage's axes {self.axes} hold {self.num_workers}")
        self.others = tuple(a for a in mesh.axis_names if a not in self.axes)
        self.specs = [partition_spec(s) for s in grad_specs]
        self.stacked = [P(self.axes, *s) for s in self.specs]
        logical = LogicalMesh(tuple(mesh.shape.values()), tuple(mesh.axis_names))
        self.local_shapes = [spec.local_shape(shape, logical)
                             for shape, spec in zip(grad_shapes, grad_specs)]
        self.dtypes = [as_dtype(d) for d in grad_dtypes]
        self.per_device = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        self.out_shardings = [NamedSharding(mesh, s) for s in self.specs]
        self.base_key = jax.random.key(seed)
        self.state = self.initial_state()
        self._programs: dict[Any, Any] = {}

    def initial_state(self) -> list:
        """Zero state for every compressed gradient: one block's state per device, stacked
        over the devices (row-major over the mesh)."""
        n = math.prod(self.mesh.shape.values())
        states = []
        for shape, dtype, c in zip(self.local_shapes, self.dtypes, self.compressed):
            if not c:
                continue
            one = jax.eval_shape(lambda s=shape, d=dtype: self.method.init_state(s, d))
            states.append(jax.tree.map(
                lambda x: jax.device_put(np.zeros((n,) + tuple(x.shape), x.dtype),
                                         self.per_device), one))
        return states

    def _program(self, phase):
        axes, others, method, n = self.axes, self.others, self.method, self.num_workers
        every = tuple(self.mesh.axis_names)

        def body(grads, states, key):
            device = jax.lax.axis_index(every)
            block = jax.lax.axis_index(others) if others else 0
            outs, new, j = [], [], 0
            for i, (g, c) in enumerate(zip(grads, self.compressed)):
                local = g[0]
                if not c:
                    outs.append(jax.lax.psum(local, axes))
                    continue
                leaf_key = jax.random.fold_in(key, i)
                state = jax.tree.map(lambda x: x[0], states[j])
                total, state = method.reduce(
                    local, state, axis_name=axes, num_workers=n, phase=phase,
                    shared_key=jax.random.fold_in(leaf_key, block),
                    worker_key=jax.random.fold_in(jax.random.fold_in(leaf_key, 1 << 20),
                                                  device))
                outs.append(total.astype(local.dtype))
                new.append(jax.tree.map(lambda x: x[None], state))
                j += 1
            return outs, new

        state_specs = [jax.tree.map(lambda _: P(every), s) for s in self.state]
        state_shardings = [jax.tree.map(lambda _: self.per_device, s) for s in self.state]
        mapped = jax.shard_map(body, mesh=self.mesh,
                               in_specs=(self.stacked, state_specs, P()),
                               out_specs=(self.specs, state_specs), check_vma=False)
        return jax.jit(mapped, out_shardings=(self.out_shardings, state_shardings),
                       donate_argnums=(0, 1))

    def program(self, step: int):
        """The compiled exchange for `step`'s phase."""
        phase = self.method.phase(step)
        if phase not in self._programs:
            self._programs[phase] = self._program(phase)
        return self._programs[phase]

    def __call__(self, stacked_grads: list, step: int) -> list:
        """The gradients summed over the replicas (the plan's sharding); advances state."""
        key = jax.random.fold_in(self.base_key, step)
        out, self.state = self.program(step)(list(stacked_grads), self.state, key)
        return out

    def compiled_text(self, stacked_avals: list, step: int = 0) -> str:
        """The partitioned HLO of the exchange for `step`'s phase (abstract gradients)."""
        key = jax.random.fold_in(self.base_key, step)
        return self.program(step).lower(stacked_avals, self.state, key).compile().as_text()
