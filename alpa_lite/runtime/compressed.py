"""The runtime of compressed data parallelism: the step per worker inside `shard_map`.

Every device is a worker. The step runs once per worker on its share of the batch, inside
`jax.shard_map` over the mesh ("node", "local") (nodes x devices per node). Its gradient
call (`al.value_and_grad`) goes through a `markers.GradientHook` that

1. differentiates with the parameters cast to per-worker ("varying") values, so the
   gradient stays local instead of being all-reduced by JAX;
2. checks every gradient leaf for NaN or Inf (the check is global: a count of workers);
3. exchanges the gradients as `plan.compression` says: across nodes, a full-precision
   reduce-scatter inside the node, the method between nodes, an all-gather inside the node;
   on one node, the method among its devices;
4. scales the sum like the loss (`loss_scale`: 1/n for a mean loss) and hands the step the
   global loss and gradient, so the optimizer update is the one the user wrote.

Synchronous methods leave every worker with the same parameters, returned replicated.
Delayed averaging (Zhu et al. 2021) gives each worker its own parameters: the executable
keeps them (stacked over workers, one per device) and returns worker 0's; when the caller
passes back what it was given, the workers go on from their own copies, otherwise every
worker restarts from what was passed.

The exchange of step i under delayed averaging carries step i-1's gradient (from the
state), so it does not wait for step i's backward pass and XLA may overlap it with it; the
average is applied D steps after its gradient was computed. Overlap across more than one
step needs an asynchronous runtime this one is not: the cost model's delayed estimate
assumes it (see `cost_models.gradient_sync`).

Per-worker state (residuals, warm starts, the delayed queues) lives here, stacked over
workers and sharded one per device: `state()`, `set_state()`, `reset_state()`.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpa_lite import compression as C
from alpa_lite.errors import NonFiniteGradientError
from alpa_lite.ir.markers import GradientHook, gradient_hook
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.plan import Plan
from alpa_lite.runtime.distributed import place
from alpa_lite.runtime.hlo import CompiledCollective, compiled_collectives
from alpa_lite.runtime.spmd import shardings_like

WORKERS = ("node", "local")


class _Exchange(GradientHook):
    """The hook for one traced call of the step (module docstring, steps 1–4)."""

    def __init__(self, owner: "CompressedExecutable", state, phase, shared_key):
        self.owner = owner
        self.state = state
        self.phase = phase
        self.shared_key = shared_key
        self.new_state = None
        self.bad = None
        self.calls = 0

    def localize(self, params):
        if self.state is None:      # the shape probe runs outside shard_map
            return params

        def cast(p):
            missing = tuple(a for a in WORKERS
                            if a not in jax.typeof(p).manual_axis_type.varying)
            return jax.lax.pcast(p, missing, to="varying") if missing else p
        return jax.tree.map(cast, params)

    def exchange(self, value, grads):
        o = self.owner
        self.calls += 1
        if self.calls > 1:
            raise NotImplementedError("gradient compression supports one al.value_and_grad "
                                      "call per step; this step makes more")
        leaves, treedef = jax.tree.flatten(grads)
        o.grad_names = [jax.tree_util.keystr(path) for path, _ in
                        jax.tree_util.tree_flatten_with_path(grads)[0]]
        if self.state is None:      # tracing only to learn the gradient's shapes
            self.new_state = o.initial_state(leaves)
            return value, grads
        self.bad = jax.lax.psum(jnp.stack([(~jnp.isfinite(g)).any().astype(jnp.int32)
                                           for g in leaves]), WORKERS)
        worker = jax.lax.axis_index("node") * o.local + jax.lax.axis_index("local")
        node_key = jax.random.fold_in(self.shared_key, jax.lax.axis_index("node"))
        worker_key = jax.random.fold_in(self.shared_key, o.num_nodes + worker)
        state = jax.tree.map(lambda x: x[0], self.state)
        exchanged, states = [], []
        for i, g in enumerate(leaves):
            keys = (jax.random.fold_in(self.shared_key, i), jax.random.fold_in(worker_key, i),
                    jax.random.fold_in(node_key, i))
            # Delayed averaging sends the previous step's gradient (module docstring).
            outgoing = state["sent"][i][0] if o.delay else g
            total, st = o.exchange_leaf(outgoing, state["exchange"][i], self.phase, *keys)
            exchanged.append(total * o.loss_scale)
            states.append(st)
        new = {"exchange": states, "sent": state["sent"], "averages": state["averages"]}
        if o.delay:
            out, new["sent"], new["averages"] = o.delayed_update(leaves, exchanged, state)
        else:
            out = [t.astype(g.dtype) for t, g in zip(exchanged, leaves)]
        self.new_state = jax.tree.map(lambda x: x[None], new)
        loss = jax.lax.psum(value, WORKERS) * o.loss_scale
        return loss, jax.tree.unflatten(treedef, out)


class CompressedExecutable:
    """Runs a plan with `plan.compression` on the local devices (module docstring)."""

    def __init__(self, fn, traced: TracedStep, plan: Plan, devices: Sequence[Any],
                 batch_argnums: Sequence[int], on_nonfinite: str = "raise", seed: int = 0):
        spec = plan.compression
        if spec is None or plan.pipeline is not None:
            raise ValueError("CompressedExecutable runs data-parallel plans with compression")
        self.fn = fn
        self.traced = traced
        self.plan = plan
        self.spec = spec
        method = C.from_config(spec.exchange)
        self.delay, self.method = ((method.delay, method.compressor)
                                   if isinstance(method, C.DelayedAveraging) else (0, method))
        n = len(plan.stages[0].devices)
        self.num_nodes = spec.num_workers if spec.axis == "node" else 1
        self.local = n // self.num_nodes
        picked = [devices[i] for i in plan.stages[0].devices]
        self.mesh = Mesh(np.array(picked, dtype=object).reshape(self.num_nodes, self.local),
                         WORKERS)
        self.num_workers = self.num_nodes * self.local
        self.worker_sharding = NamedSharding(self.mesh, P(WORKERS))   # one row per worker
        self.batch_argnums = tuple(batch_argnums)
        self.loss_scale = spec.loss_scale
        self.on_nonfinite = on_nonfinite
        self.base_key = jax.random.key(seed)
        self.step = 0
        self.grad_names: list[str] = []
        self._state = None
        self._one_state = None      # one worker's state shapes (this executable's signature)
        self._compiled: dict[Any, Any] = {}
        self._replicas: dict[int, jax.Array] = {}   # delayed: input leaf -> per-worker copies
        self._returned: dict[int, Any] = {}         # delayed: input leaf -> what we returned
        ties = traced.graph.output_ties
        self.ties = {o: i for o, i in enumerate(ties) if i is not None}
        # Delayed averaging keeps a copy per worker of every input a result replaces.
        self.per_worker = frozenset(self.ties.values()) if self.delay else frozenset()

    # ---- the exchange of one leaf -----------------------------------------------------

    def exchange_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a worker exchanges for a leaf: its node's shard, else the whole leaf."""
        if self.num_nodes > 1 and self.local > 1 and shape and shape[0] % self.local == 0:
            return (shape[0] // self.local,) + tuple(shape[1:])
        return tuple(shape)

    def exchange_leaf(self, g, state, phase, shared_key, worker_key, node_key):
        m = self.method
        if self.num_nodes == 1 or self.local == 1:
            # Flat: over both axes, one of which has size 1 (an axis all the same).
            return m.reduce(g, state, axis_name=WORKERS,
                            num_workers=self.num_workers, phase=phase,
                            shared_key=shared_key, worker_key=worker_key)
        if self.exchange_shape(g.shape) != tuple(g.shape):
            shard = jax.lax.psum_scatter(g, "local", scatter_dimension=0, tiled=True)
            total, state = m.reduce(shard, state, axis_name="node",
                                    num_workers=self.num_nodes, phase=phase,
                                    shared_key=shared_key, worker_key=worker_key)
            return jax.lax.all_gather(total, "local", axis=0, tiled=True,
                                      to="invarying"), state
        # Whole leaf: summed inside the node, then every device of the node runs the same
        # exchange with the node's key; the copies agree, one is kept.
        whole = jax.lax.psum(g, "local") if self.local > 1 else g
        total, state = m.reduce(whole, state, axis_name="node", num_workers=self.num_nodes,
                                phase=phase, shared_key=shared_key, worker_key=node_key)
        if self.local > 1:
            total = jax.lax.all_gather(total, "local", to="invarying")[0]
        return total, state

    def delayed_update(self, grads, averages, state):
        """Delayed averaging: (corrected gradients, new sent queue, new averages queue).

        `averages` holds the average of step i-1's gradients (exchanged this step); the
        update uses step i-D's: g_i - g_{i-D} + avg_{i-D}."""
        D = self.delay
        out, sent, avgs = [], [], []
        for g, avg, q, a in zip(grads, averages, state["sent"], state["averages"]):
            g32 = g.astype(jnp.float32)
            oldest_avg = avg if D == 1 else a[D - 2]
            out.append((g32 - q[D - 1] + oldest_avg).astype(g.dtype))
            sent.append(jnp.concatenate([g32[None], q[:-1]]))
            avgs.append(a if D == 1 else jnp.concatenate([avg[None], a[:-1]]))
        return out, sent, avgs

    def initial_state(self, grads) -> dict:
        """Per-worker state for these gradient leaves (one worker's view, no worker axis)."""
        D = self.delay
        return {
            "exchange": [self.method.init_state(self.exchange_shape(g.shape), g.dtype)
                         for g in grads],
            "sent": [jnp.zeros((D,) + g.shape, jnp.float32) if D else None for g in grads],
            "averages": [jnp.zeros((D - 1,) + g.shape, jnp.float32) if D > 1 else None
                         for g in grads],
        }

    # ---- state -------------------------------------------------------------------------

    def state(self):
        """The per-worker state, each array stacked over workers (None before a step)."""
        return self._state

    def set_state(self, state) -> None:
        """Restores a state `state()` returned (e.g. from a checkpoint)."""
        if self._state is None:
            raise ValueError("run one step before restoring the compression state: its "
                             "shapes come from the step's gradients")
        self._put_state(state, self._state)

    def _put_state(self, state, want) -> None:
        """Places `state`, one row per device, after checking it against `want` (arrays or
        ShapeDtypeStructs of the expected structure, shapes and dtypes)."""
        if jax.tree.structure(state) != jax.tree.structure(want):
            raise ValueError(f"compression state has structure {jax.tree.structure(state)}, "
                             f"expected {jax.tree.structure(want)}")
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                raise ValueError(f"compression state leaf {a.shape} {a.dtype} does not match "
                                 f"{b.shape} {b.dtype}")
        self._state = jax.tree.map(lambda x: place(x, self.worker_sharding), state)

    def reset_state(self, seed: int | None = None) -> None:
        """Zeroes the state (residuals, queues) and the step count, and forgets the
        per-worker copies of delayed averaging; `seed` re-seeds the random choices."""
        if seed is not None:
            self.base_key = jax.random.key(seed)
        if self._state is not None:
            self._state = jax.tree.map(jnp.zeros_like, self._state)
        self.step = 0
        self._replicas.clear()
        self._returned.clear()

    # ---- checkpoints (alpa_lite.tools.checkpoint) -------------------------------------------

    def input_shardings(self, *args):
        """Where each argument leaf goes, as a pytree shaped like `args` (arrays or
        ShapeDtypeStructs); compiles nothing. Batch leaves are split over the workers
        (dimension 0); every other leaf is replicated on the workers' mesh, including
        those delayed averaging copies per worker (the copies are made from it)."""
        _, _, batch = self._specs(args)
        return shardings_like(args, [NamedSharding(self.mesh, P(WORKERS) if j in batch else P())
                                     for j in range(len(jax.tree.leaves(args)))])

    def state_shapes(self, *args):
        """The per-worker state for these arguments as ShapeDtypeStructs stacked over workers
        and sharded one row per device (what `state()` holds after a step). Traces the step
        as its first call does; computes and compiles nothing."""
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((self.num_workers,) + tuple(s.shape), s.dtype,
                                           sharding=self.worker_sharding),
            self._probe_state(args))

    def replicas_of(self, leaves: Sequence[Any]) -> dict[int, jax.Array]:
        """Delayed averaging: {position in `leaves`: per-worker copies} for the leaves this
        executable returned last, i.e. those whose next call goes on from the workers' own
        copies instead of the value passed. Empty for synchronous methods."""
        by_id = {id(r): j for j, r in self._returned.items()}
        return {i: self._replicas[by_id[id(x)]] for i, x in enumerate(leaves) if id(x) in by_id}

    def restore_checkpoint(self, args, state, step_count: int, key,
                           replicas: dict[int, jax.Array]) -> None:
        """Puts back what a checkpoint holds, so the next call continues bit-identically.

        Args:
          args: the arguments of the next call (arrays or ShapeDtypeStructs); the leaves
            named in `replicas` must be the very arrays that call will pass.
          state: the per-worker state, shaped as `state_shapes(*args)`.
          step_count: steps taken (it picks the warm-up phase).
          key: the base PRNG key of the compressors' random choices.
          replicas: delayed averaging: {argument leaf index: per-worker copies, stacked},
            as `alpa_lite.tools.checkpoint` checks and restores them.
        """
        flat = jax.tree.leaves(args)
        self._put_state(state, self.state_shapes(*args))
        self.step = int(step_count)
        self.base_key = key
        self._replicas = {j: place(r, self.worker_sharding) for j, r in replicas.items()}
        # `_prepare` uses the copies only when the caller hands back this exact array.
        self._returned = {j: flat[j] for j in replicas}

    # ---- running -------------------------------------------------------------------------

    def _specs(self, args):
        leaves, treedef = jax.tree.flatten(args)
        counts = [len(jax.tree.leaves(a)) for a in args]
        batch = set()
        pos = 0
        for i, c in enumerate(counts):
            if i in self.batch_argnums:
                batch.update(range(pos, pos + c))
            pos += c
        specs = [P(WORKERS) if (j in batch or j in self.per_worker) else P()
                 for j in range(len(leaves))]
        return treedef, specs, batch

    def _program(self, args, phase):
        treedef, in_specs, _ = self._specs(args)
        per_worker = self.per_worker
        out_leaves = self.traced.out_tree.num_leaves
        out_specs = [P(WORKERS) if self.ties.get(o) in per_worker else P()
                     for o in range(out_leaves)]

        def worker(state, shared_key, *flat):
            flat = [x[0] if j in per_worker else x for j, x in enumerate(flat)]
            hook = _Exchange(self, state, phase, shared_key)
            with gradient_hook(hook):
                outs = self.fn(*jax.tree.unflatten(treedef, flat))
            outs = jax.tree.leaves(outs)
            outs = [x[None] if s == P(WORKERS) else x for x, s in zip(outs, out_specs)]
            return outs, hook.new_state, hook.bad

        state_spec = jax.tree.map(lambda _: P(WORKERS), self._state)
        mapped = jax.shard_map(worker, mesh=self.mesh,
                               in_specs=(state_spec, P(), *in_specs),
                               out_specs=(out_specs, state_spec, P()))
        return jax.jit(mapped), in_specs

    def _init_state(self, args):
        """Zeroes the per-worker state, shaped for these arguments' gradient leaves."""
        # Made on the devices, one row each: nothing of size n x (the gradient) on a host.
        shapes = self.state_shapes(*args)
        self._state = jax.jit(
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            out_shardings=jax.tree.map(lambda s: s.sharding, shapes))()

    def _probe_state(self, args):
        """Traces the step once without exchanging, to learn the gradient leaves (and their
        names): one worker's state, as ShapeDtypeStructs. Once: an executable serves one
        argument signature, and tracing a large model takes seconds."""
        if self._one_state is not None:
            return self._one_state
        treedef, _, batch = self._specs(args)
        n = self.num_workers
        flat = jax.tree.leaves(args)
        local = [jax.ShapeDtypeStruct((x.shape[0] // n,) + tuple(x.shape[1:]), x.dtype)
                 if j in batch else jax.ShapeDtypeStruct(x.shape, x.dtype)
                 for j, x in enumerate(flat)]
        hook = _Exchange(self, None, (), None)

        def probe(*leaves):
            with gradient_hook(hook):
                self.fn(*jax.tree.unflatten(treedef, leaves))
            return hook.new_state
        one = jax.eval_shape(probe, *local)
        if hook.calls == 0:
            raise ValueError("the step never called al.value_and_grad / al.grad: there is "
                             "no gradient to compress")
        self._one_state = one
        return one

    def _prepare(self, args):
        """(program, its input specs, the placed argument leaves) for this step."""
        flat = jax.tree.leaves(args)
        if self._state is None:
            self._init_state(args)
        phase = self.method.phase(self.step)
        if phase not in self._compiled:
            self._compiled[phase] = self._program(args, phase)
        program, in_specs = self._compiled[phase]
        n = self.num_workers
        placed = []
        for j, (x, spec) in enumerate(zip(flat, in_specs)):
            if j in self._replicas and self._returned.get(j) is x:
                placed.append(self._replicas[j])
                continue
            if j in self.per_worker:
                x = jnp.broadcast_to(jnp.asarray(x)[None], (n,) + tuple(np.shape(x)))
            placed.append(place(x, NamedSharding(self.mesh, spec)))
        return program, in_specs, placed

    def hlo(self, *args) -> str:
        """The compiled program of the next step for these arguments, as HLO text."""
        program, _, placed = self._prepare(args)
        shared_key = jax.random.fold_in(self.base_key, self.step)
        return program.lower(self._state, shared_key, *placed).compile().as_text()

    def collectives(self, *args) -> tuple[CompiledCollective, ...]:
        """What the next call runs, from its compiled program."""
        return compiled_collectives(self.hlo(*args), "step")

    def __call__(self, *args):
        flat = jax.tree.leaves(args)
        program, in_specs, placed = self._prepare(args)
        n = self.num_workers
        shared_key = jax.random.fold_in(self.base_key, self.step)
        try:
            outs, new_state, bad = program(self._state, shared_key, *placed)
        except ValueError as e:
            if "out_specs[0][" in str(e):       # a result of the user's step differs per worker
                raise ValueError(
                    "with gradient compression the step runs once per worker on its share "
                    "of the batch; every result must come from the loss al.value_and_grad "
                    "returns, the parameters or the optimizer state (a result computed from "
                    "the batch outside the gradient call cannot be combined). If every result "
                    "does, this is a bug in alpa_lite: please report it with this message. "
                    f"JAX said: {e}") from None
            raise
        bad = np.asarray(bad)
        if bad.any():
            names = [self.grad_names[i] for i in np.flatnonzero(bad)]
            message = (f"non-finite gradient (NaN or Inf) in {', '.join(names[:5])}"
                       f"{' and more' if len(names) > 5 else ''} on "
                       f"{int(bad.max())} of {n} workers at step {self.step}")
            if self.on_nonfinite == "skip":
                warnings.warn(message + "; the update was skipped", stacklevel=3)
                out_flat = jax.tree.leaves(outs)
                kept = [flat[self.ties[o]] if o in self.ties else x
                        for o, x in enumerate(out_flat)]
                return jax.tree.unflatten(self.traced.out_tree, kept)
            raise NonFiniteGradientError(message + "; nothing was updated. Pass "
                                         "on_nonfinite='skip' to skip such steps")
        self._state = new_state
        self.step += 1
        results = []
        for o, x in enumerate(outs):
            j = self.ties.get(o)
            if self.delay and j is not None:     # per-worker copies: keep, return worker 0's
                self._replicas[j] = x
                x = self._returned[j] = x[0]
            results.append(x)
        return jax.tree.unflatten(self.traced.out_tree, results)
