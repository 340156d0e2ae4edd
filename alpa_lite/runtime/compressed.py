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

A full-precision exchange (`Dense()`) with buckets in the plan (`Plan.sync_buckets`,
`BucketIssue.RUNTIME`) is issued bucket by bucket, in the plan's order: each bucket's
gradients are flattened into one buffer (per dtype) and summed by one all-reduce over
every worker (both mesh axes: on several nodes the collective library's own all-reduce,
as the cost model prices it), as DDP's buckets are. An all-reduce depends on its
bucket's gradients and (through an `optimization_barrier`, which holds no compute back)
on the previous bucket's all-reduce, so the collectives run as one stream in the planned
order and XLA schedules each as soon as both exist, between the backward's remaining
operators; XLA's own all-reduce combiner is turned off for the program
(`runtime.xla_options`), or it would merge the buckets again (on CPU into one). A `psum`
of several arrays would not do: JAX lowers it to one all-reduce per array.

Synchronous methods leave every worker with the same parameters, returned replicated.
Delayed averaging (Zhu et al. 2021) gives each worker its own parameters: the executable
keeps them (stacked over workers, one per device) and returns worker 0's (with one
process, an array on worker 0's device: nothing is copied between devices to return it);
when the caller passes back what it was given, the workers go on from their own copies,
otherwise every worker restarts from what was passed.

The exchange of step i under delayed averaging carries step i-1's gradient (from the
state), so it does not wait for step i's backward pass and XLA may overlap it with it; the
average is applied D steps after its gradient was computed. Overlap across more than one
step needs an asynchronous runtime this one is not: the cost model's delayed estimate
assumes it (see `cost_models.gradient_sync`).

Local SGD (`compression.LocalSGD`) keeps per-worker parameters and optimizer states the
same way, and compiles one program per kind of step (`phase_of`):

- "warmup" (post-local SGD's first steps): the gradients all-reduced exactly, as `Dense()`;
- "local": each worker applies its optimizer to its own gradient; the program has no
  collective at all (the NaN check's flags and the results that are not carried to the next
  step come back one row per worker, and the host reads worker 0's / sums the flags);
- "average": a local step, then the parameters (the inputs `al.value_and_grad` takes the
  gradient of, where a result replaces them) are averaged over the workers, exactly or as
  compressed deltas from the last average (kept in the state as "anchor"); the optimizer
  state stays per worker.

Per-worker state (residuals, warm starts, the delayed queues, local SGD's last average)
lives here, stacked over workers and sharded one per device: `state()`, `set_state()`,
`reset_state()`.
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
from alpa_lite.errors import NonFiniteGradientError, PlanMismatchError
from alpa_lite.ir.graph import Role
from alpa_lite.ir.markers import GradientHook, gradient_hook
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.plan import BucketIssue, Plan
from alpa_lite.runtime.distributed import place
from alpa_lite.runtime.hlo import CompiledCollective, compiled_collectives
from alpa_lite.runtime.spmd import shardings_like
from alpa_lite.runtime.xla_options import bucket_options

WORKERS = ("node", "local")
# Folded into the step's shared key for local SGD's parameter exchange, so its random
# choices (random-k positions, PowerSGD's first Q) do not repeat the gradient exchange's.
_AVERAGE_KEY = 0x10CA15D


@jax.jit
def _drop_worker_axis(rows):
    """(1, ...) arrays on one device -> (...) arrays there, in one dispatch."""
    return [r[0] for r in rows]


class _Exchange(GradientHook):
    """The hook for one traced call of the step (module docstring, steps 1–4)."""

    def __init__(self, owner: "CompressedExecutable", state, phase, shared_key):
        self.owner = owner
        self.state = state
        self.phase = phase
        # Local SGD's local and averaging steps exchange no gradient.
        self.local = owner.mode(phase) in ("local", "average")
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
        if self.local:
            return self.local_gradient(value, leaves, treedef)
        self.bad = jax.lax.psum(jnp.stack([(~jnp.isfinite(g)).any().astype(jnp.int32)
                                           for g in leaves]), WORKERS)
        worker = jax.lax.axis_index("node") * o.local + jax.lax.axis_index("local")
        node_key = jax.random.fold_in(self.shared_key, jax.lax.axis_index("node"))
        worker_key = jax.random.fold_in(self.shared_key, o.num_nodes + worker)
        state = jax.tree.map(lambda x: x[0], self.state)
        exchanged, states = [], []
        if o.bucket_leaves is not None:
            sums = o.bucketed_sums(leaves)
            loss = jax.lax.psum(value, WORKERS) * o.loss_scale
            out = [(t * o.loss_scale).astype(g.dtype) for t, g in zip(sums, leaves)]
            self.new_state = jax.tree.map(lambda x: x[None], state)   # Dense: no state
            return loss, jax.tree.unflatten(treedef, out)
        for i, g in enumerate(leaves):
            keys = (jax.random.fold_in(self.shared_key, i), jax.random.fold_in(worker_key, i),
                    jax.random.fold_in(node_key, i))
            # Delayed averaging sends the previous step's gradient (module docstring).
            outgoing = state["sent"][i][0] if o.delay else g
            total, st = o.exchange_leaf(outgoing, state["exchange"][i], self.phase, *keys)
            exchanged.append(total * o.loss_scale)
            states.append(st)
        new = dict(state, exchange=states)      # local SGD's anchor and residuals pass
        if o.delay:
            out, new["sent"], new["averages"] = o.delayed_update(leaves, exchanged, state)
        else:
            out = [t.astype(g.dtype) for t, g in zip(exchanged, leaves)]
        self.new_state = jax.tree.map(lambda x: x[None], new)
        loss = jax.lax.psum(value, WORKERS) * o.loss_scale
        return loss, jax.tree.unflatten(treedef, out)

    def local_gradient(self, value, leaves, treedef):
        """Local SGD: this worker's own gradient, scaled so that the workers' mean is the
        synchronous gradient (n x loss_scale x its own); no collective. The NaN flags stay
        per worker (the host counts them). The loss is the global one on an averaging step
        (a scalar beside the parameters' exchange), this worker's own on a local step."""
        o = self.owner
        self.bad = jnp.stack([(~jnp.isfinite(g)).any().astype(jnp.int32) for g in leaves])
        self.new_state = self.state
        scale = o.num_workers * o.loss_scale
        out = [g if scale == 1 else (g * scale).astype(g.dtype) for g in leaves]
        if o.mode(self.phase) == "average":
            loss = jax.lax.psum(value, WORKERS) * o.loss_scale
        else:
            loss = value if scale == 1 else value * scale
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
        self.local_sgd = method if isinstance(method, C.LocalSGD) else None
        if isinstance(method, C.DelayedAveraging):
            self.delay, self.method = method.delay, method.compressor
        elif self.local_sgd is not None:
            # The gradient exchange runs only in post-local SGD's warm-up: exact.
            self.delay, self.method = 0, C.Dense()
        else:
            self.delay, self.method = 0, method
        # Local SGD: how the parameters (deltas, when lossy) are averaged.
        self.averager = method.compressor if self.local_sgd is not None else None
        self.buckets = plan.sync_buckets_of(0)
        self.keeps_anchor = self.averager is not None and self.averager.lossy
        n = len(plan.stages[0].devices)
        self.num_nodes = spec.num_workers if spec.axis == "node" else 1
        self.local = n // self.num_nodes
        picked = [devices[i] for i in plan.stages[0].devices]
        self.mesh = Mesh(np.array(picked, dtype=object).reshape(self.num_nodes, self.local),
                         WORKERS)
        self.num_workers = self.num_nodes * self.local
        self.worker_sharding = NamedSharding(self.mesh, P(WORKERS))   # one row per worker
        # The plan's buckets, as positions in the gradient's leaves (`bucket_leaves`), and
        # the leaves that are literals (the same on every worker: summed without a
        # collective); None: each leaf goes through the method on its own.
        self.bucket_leaves, self.constant_leaves = self._bucket_leaves(traced)
        self.compiler_options = bucket_options(self.buckets, picked[0].platform)
        self.batch_argnums = tuple(batch_argnums)
        self.loss_scale = spec.loss_scale
        self.on_nonfinite = on_nonfinite
        self.base_key = jax.random.key(seed)
        self.step = 0
        self.grad_names: list[str] = []
        self._state = None
        self._one_state = None      # one worker's state shapes (this executable's signature)
        self._compiled: dict[Any, Any] = {}
        # Delayed averaging, local SGD: input leaf -> per-worker copies / what we returned.
        self._replicas: dict[int, jax.Array] = {}
        self._returned: dict[int, Any] = {}
        ties = traced.graph.output_ties
        self.ties = {o: i for o, i in enumerate(ties) if i is not None}
        # Delayed averaging and local SGD keep a copy per worker of every input a result
        # replaces (parameters, optimizer state).
        self.per_worker = (frozenset(self.ties.values()) if self.delay or self.local_sgd
                           else frozenset())
        # Local SGD averages the parameters: inputs differentiated by al.value_and_grad
        # that a result replaces, in input order (k-th: state["anchor"][k]).
        graph = traced.graph
        params = {j for j, tid in enumerate(graph.inputs) if graph.tensors[tid].role is
                  Role.PARAM}
        self.averaged = (tuple(sorted(j for j in self.ties.values() if j in params))
                         if self.local_sgd is not None else ())
        self.averaged_outputs = {o: self.averaged.index(j) for o, j in self.ties.items()
                                 if j in self.averaged}
        if self.local_sgd is not None and not self.averaged:
            raise ValueError(
                "local SGD averages the parameters the step returns, but no result of this "
                "step replaces an input it differentiates with al.value_and_grad; return "
                "the updated parameters (same structure, shapes and dtypes as the input)")

    # ---- buckets (full-precision exchange) ---------------------------------------------

    def _bucket_leaves(self, traced: TracedStep):
        """(buckets as lists of gradient leaf positions, literal leaf positions) for the
        plan's `SyncBuckets`, or (None, ()) where the plan has none."""
        b = self.buckets
        if b is None:
            return None, ()
        if b.issue is not BucketIssue.RUNTIME or self.method != C.Dense() or self.delay or \
                self.local_sgd is not None:
            raise PlanMismatchError(
                f"the plan buckets the gradient exchange ({b.issue.value}), which this "
                "engine issues itself only for a synchronous full-precision exchange "
                f"(Dense()); the plan exchanges with {self.spec.description!r}: plan again")
        if len(traced.grad_leaves) != 1:
            raise PlanMismatchError(f"the plan buckets the gradient of one al.value_and_grad "
                                    f"call; this step makes {len(traced.grad_leaves)}")
        leaves = traced.grad_leaves[0]
        names = [None if t is None else traced.graph.tensors[t].name for t in leaves]
        where = {n: k for k, bucket in enumerate(b.buckets) for n in bucket.grads}
        missing = sorted({n for n in names if n is not None and n not in where})
        if missing:
            raise PlanMismatchError(f"gradients {missing[:5]} are in none of the plan's "
                                    "buckets: the plan was made for another program; plan "
                                    "again")
        order = {n: i for bucket in b.buckets for i, n in enumerate(bucket.grads)}
        buckets: list[list[int]] = [[] for _ in b.buckets]
        for j in sorted((j for j, n in enumerate(names) if n is not None),
                        key=lambda j: order[names[j]]):
            buckets[where[names[j]]].append(j)
        return [x for x in buckets if x], tuple(j for j, n in enumerate(names) if n is None)

    def bucketed_sums(self, leaves: Sequence[Any]) -> list[Any]:
        """Each gradient leaf summed over the workers, one all-reduce per bucket and dtype
        in the plan's order (module docstring); a literal leaf is n times itself."""
        out: list[Any] = [None] * len(leaves)
        previous = None
        for bucket in self.bucket_leaves:
            by_dtype: dict[Any, list[int]] = {}
            for j in bucket:
                by_dtype.setdefault(jnp.result_type(leaves[j]), []).append(j)
            for group in by_dtype.values():
                buffer = leaves[group[0]] if len(group) == 1 else \
                    jnp.concatenate([jnp.ravel(leaves[j]) for j in group])
                if previous is not None:
                    # One collective stream in the plan's order: this all-reduce starts
                    # after the previous one has ended (the backward does not wait).
                    buffer, _ = jax.lax.optimization_barrier((buffer, previous))
                previous = total = jax.lax.psum(buffer, WORKERS)
                if len(group) == 1:
                    out[group[0]] = total
                    continue
                start = 0
                for j in group:
                    size = int(np.prod(np.shape(leaves[j])))
                    out[j] = total[start:start + size].reshape(np.shape(leaves[j]))
                    start += size
        for j in self.constant_leaves:
            out[j] = leaves[j] * self.num_workers
        return out

    # ---- the exchange of one leaf -----------------------------------------------------

    def exchange_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a worker exchanges for a leaf: its node's shard, else the whole leaf."""
        if self.num_nodes > 1 and self.local > 1 and shape and shape[0] % self.local == 0:
            return (shape[0] // self.local,) + tuple(shape[1:])
        return tuple(shape)

    def exchange_leaf(self, g, state, phase, shared_key, worker_key, node_key, method=None):
        m = self.method if method is None else method
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

    def phase_of(self, step: int):
        """The static phase of step `step` (from 0): one program is compiled per phase. The
        compressor's own (DGC's warm-up); under local SGD ("warmup",), ("local",) or
        ("average", the parameter exchange's compressor phase)."""
        ls = self.local_sgd
        if ls is None:
            return self.method.phase(step)
        if ls.is_warmup(step):
            return ("warmup",)
        if ls.averages_at(step):
            return ("average", self.averager.phase(step))
        return ("local",)

    def mode(self, phase) -> str:
        """What a step of this phase does: "sync" (the gradients are exchanged), or local
        SGD's "local" (nothing is) and "average" (the parameters are, after the step)."""
        if self.local_sgd is None or not phase or phase[0] == "warmup":
            return "sync"
        return phase[0]

    def average_parameters(self, outs: list, state, phase, shared_key):
        """Local SGD, after the user's step inside the worker: (results, new state).

        Averaging step: each averaged parameter result w_j becomes the workers' mean, as
        `(1/n) sum_k w_k` with Dense() or `a + (1/n) C(sum_k (w_k - a))` with a lossy
        compressor C, `a` the last average, which it then replaces (compression.local_sgd).
        Warm-up step: the (identical) new parameters become the last average. Local step:
        nothing. `state` is stacked (a leading axis of 1), as the hook returns it."""
        mode = self.mode(phase)
        if mode == "local":
            return outs, state
        cur = jax.tree.map(lambda x: x[0], state)
        anchors, residuals = list(cur["anchor"]), list(cur["average"])
        if mode == "sync":          # warm-up: synchronous, every worker holds the average
            if self.keeps_anchor:
                for o, k in self.averaged_outputs.items():
                    anchors[k] = outs[o]
        else:
            n = self.num_workers
            avg_key = jax.random.fold_in(shared_key, _AVERAGE_KEY)
            worker = jax.lax.axis_index("node") * self.local + jax.lax.axis_index("local")
            node_key = jax.random.fold_in(avg_key, jax.lax.axis_index("node"))
            worker_key = jax.random.fold_in(avg_key, self.num_nodes + worker)
            for o, k in self.averaged_outputs.items():
                w = outs[o]
                keys = (jax.random.fold_in(avg_key, k), jax.random.fold_in(worker_key, k),
                        jax.random.fold_in(node_key, k))
                if self.keeps_anchor:
                    a = anchors[k].astype(jnp.float32)
                    total, residuals[k] = self.exchange_leaf(
                        w.astype(jnp.float32) - a, residuals[k], phase[1], *keys,
                        method=self.averager)
                    outs[o] = anchors[k] = (a + total / n).astype(w.dtype)
                else:
                    total, residuals[k] = self.exchange_leaf(
                        w.astype(jnp.float32), residuals[k], phase[1], *keys,
                        method=self.averager)
                    outs[o] = (total / n).astype(w.dtype)
        new = dict(cur, anchor=anchors, average=residuals)
        return outs, jax.tree.map(lambda x: x[None], new)

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
        mode = self.mode(phase)
        # A local SGD step moves nothing between workers: every result and the NaN flags
        # come back one row per worker (`__call__` reads worker 0's / sums the flags).
        out_specs = [P(WORKERS) if self.ties.get(o) in per_worker or mode == "local" else P()
                     for o in range(out_leaves)]
        bad_spec = P(WORKERS) if mode in ("local", "average") else P()

        def worker(state, shared_key, *flat):
            flat = [x[0] if j in per_worker else x for j, x in enumerate(flat)]
            hook = _Exchange(self, state, phase, shared_key)
            with gradient_hook(hook):
                outs = self.fn(*jax.tree.unflatten(treedef, flat))
            outs = jax.tree.leaves(outs)
            new_state = hook.new_state
            if self.local_sgd is not None:
                outs, new_state = self.average_parameters(list(outs), new_state, phase,
                                                          shared_key)
            outs = [x[None] if s == P(WORKERS) else x for x, s in zip(outs, out_specs)]
            bad = hook.bad[None] if bad_spec == P(WORKERS) else hook.bad
            return outs, new_state, bad

        state_spec = jax.tree.map(lambda _: P(WORKERS), self._state)
        mapped = jax.shard_map(worker, mesh=self.mesh,
                               in_specs=(state_spec, P(), *in_specs),
                               out_specs=(out_specs, state_spec, bad_spec))
        return jax.jit(mapped, compiler_options=self.compiler_options or None), in_specs, \
            out_specs

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
        if self.local_sgd is not None:
            # The last average (lossy exchange only) and the exchange's own state (residuals)
            # per averaged parameter, which is exchanged in float32.
            shapes = [(tuple(flat[j].shape), flat[j].dtype) for j in self.averaged]
            one = dict(one, anchor=[jax.ShapeDtypeStruct(shape, dtype)
                                    for shape, dtype in shapes] if self.keeps_anchor else [],
                       average=[jax.eval_shape(lambda s=shape: self.averager.init_state(
                           self.exchange_shape(s), jnp.float32)) for shape, _ in shapes])
        self._one_state = one
        return one

    def _prepare(self, args):
        """(program, its input specs, the placed argument leaves, its output specs) for
        this step."""
        flat = jax.tree.leaves(args)
        if self._state is None:
            self._init_state(args)
        phase = self.phase_of(self.step)
        if phase not in self._compiled:
            self._compiled[phase] = self._program(args, phase)
        program, in_specs, out_specs = self._compiled[phase]
        n = self.num_workers
        placed = []
        anchors = list(self._state["anchor"]) if self.keeps_anchor else []
        for j, (x, spec) in enumerate(zip(flat, in_specs)):
            if j in self._replicas and self._returned.get(j) is x:
                placed.append(self._replicas[j])
                continue
            if j in self.per_worker:
                x = jnp.broadcast_to(jnp.asarray(x)[None], (n,) + tuple(np.shape(x)))
            placed.append(place(x, NamedSharding(self.mesh, spec)))
            if j in self.averaged and self.keeps_anchor:
                # Every worker restarts from the value passed: it is the last average.
                anchors[self.averaged.index(j)] = placed[-1]
        if self.keeps_anchor:
            self._state = dict(self._state, anchor=anchors)
        return program, in_specs, placed, out_specs

    def hlo(self, *args) -> str:
        """The compiled program of the next step for these arguments, as HLO text."""
        program, _, placed, _ = self._prepare(args)
        shared_key = jax.random.fold_in(self.base_key, self.step)
        return program.lower(self._state, shared_key, *placed).compile().as_text()

    def collectives(self, *args) -> tuple[CompiledCollective, ...]:
        """What the next call runs, from its compiled program."""
        return compiled_collectives(self.hlo(*args), "step")

    def __call__(self, *args):
        flat = jax.tree.leaves(args)
        program, in_specs, placed, out_specs = self._prepare(args)
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
        if bad.ndim == 2:           # local SGD: one row of flags per worker
            bad = bad.sum(0)
        if bad.any():
            names = [self.grad_names[i] for i in np.flatnonzero(bad)]
            message = (f"non-finite gradient (NaN or Inf) in {', '.join(names[:5])}"
                       f"{' and more' if len(names) > 5 else ''} on "
                       f"{int(bad.max())} of {n} workers at step {self.step}")
            if self.on_nonfinite == "skip":
                warnings.warn(message + "; the update was skipped", stacklevel=3)
                out_flat = jax.tree.leaves(outs)
                kept = [flat[self.ties[o]] if o in self.ties else
                        x[0] if out_specs[o] == P(WORKERS) else x
                        for o, x in enumerate(out_flat)]
                return jax.tree.unflatten(self.traced.out_tree, kept)
            raise NonFiniteGradientError(message + "; nothing was updated. Pass "
                                         "on_nonfinite='skip' to skip such steps")
        self._state = new_state
        self.step += 1
        results = list(outs)
        # Per-worker copies are kept, and worker 0's returned; so are the other results
        # of local SGD's local step (one row per worker).
        rows = [o for o in range(len(results)) if out_specs[o] == P(WORKERS)]
        for o, x in zip(rows, self._worker0([results[o] for o in rows])):
            j = self.ties.get(o)
            if j in self.per_worker:
                self._replicas[j] = results[o]
                self._returned[j] = x
            results[o] = x
        return jax.tree.unflatten(self.traced.out_tree, results)

    def _worker0(self, stacked: list) -> list:
        """Worker 0's row of each array stacked over workers. With one process it is read
        from worker 0's device and stays there: nothing crosses devices (`x[0]` would
        gather it and copy it to every device, a broadcast per step). With several, `x[0]`:
        a multi-controller program must hand every process the same global arrays."""
        if not stacked:
            return []
        if jax.process_count() > 1:
            return [x[0] for x in stacked]
        first = self.mesh.devices.flat[0]          # worker 0's device holds row 0
        rows = [next(sh.data for sh in x.addressable_shards if sh.device == first)
                for x in stacked]
        return _drop_worker_axis(rows)
