"""The pipeline runtime: executes a pipelined `Plan` on disjoint submeshes (MPMD).

Per stage, two programs are jitted on the stage's `Mesh` with the shardings the plan chose
(the same replay as the single-stage runtime, on the stage's forward+backward graph): the
forward of one micro-batch (returning the stage outputs and the residuals its backward
needs, or only the outputs when the stage recomputes) and the backward (parameter gradients,
added into per-stage accumulators, and the gradients of the stage inputs, sent back).
Activations and their gradients move between submeshes to the receiving stage's
shardings (`distributed.place`: `jax.device_put`, also across processes). The tasks are
issued from Python in the plan's schedule order (GPipe or 1F1B); JAX dispatches
asynchronously, so stages on different devices run side by side.

After the last backward, the apply-gradient part of the step (the optimizer update) runs
where the parameters live: each operator of it goes to the stage owning what it reads, and
values one stage computes for another (e.g. a global gradient norm) are moved between
them. The runtime knows nothing of how the plan was found.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa_lite.cost_models.pipeline_schedule import schedule_from_name, stage_order
from alpa_lite.errors import PlanMismatchError
from alpa_lite.ir.graph import Role, as_dtype
from alpa_lite.ir.replay import replay
from alpa_lite.ir.step_parts import (
    StageProgram,
    StepParts,
    local_stage_program,
    param_homes,
    stage_program,
)
from alpa_lite.plan import Plan, StagePlan
from alpa_lite.plan.plan import AuxCombination, Combine
from alpa_lite.plan.sharding import TensorSpec
from alpa_lite.runtime.distributed import on_every_process, place
from alpa_lite.runtime.hlo import CompiledCollective, compiled_collectives
from alpa_lite.runtime.spmd import named_sharding, partition_spec, shardings_like, stage_mesh
from alpa_lite.runtime.stage_exchange import CompressedReduce


class _Stage:
    """One stage's compiled forward, backward and gradient accumulation.

    With `accumulate_axes` in the stage's plan, the backward runs per device over those
    axes (`jax.shard_map`, the other axes left to the partitioner): it replays the stage
    program traced at 1/replicas of the micro-batch, so each device's parameter gradients
    are its own partial sums, returned stacked over the axes ([replicas, ...]), summed over
    micro-batches where they are, and reduced once by `reduce` after the last backward.
    """

    def __init__(self, parts: StepParts, prog: StageProgram, stage: StagePlan,
                 devices: Sequence[Any], seed: int = 0):
        self.prog = prog
        self.plan = stage
        self.mesh = stage_mesh(stage, devices)
        fb = prog.fb.graph
        spec: dict[int, TensorSpec] = dict(stage.tensor_specs)
        spec.update(zip(fb.inputs, stage.input_specs))
        self.spec = spec
        ns = self.sharding
        self._tensor = {t: ns(s) for t, s in stage.tensor_specs if s.rank}
        self._operand = {(n, p): ns(s) for n, p, s in stage.operand_specs if s.rank}
        out_spec = dict(zip(fb.outputs, stage.output_specs))
        P, A = len(prog.params), len(prog.acts)
        self.param_in = [ns(spec[t]) for t in prog.fb_params]
        self.act_in = [ns(spec[t]) for t in prog.fb_acts]
        self.ct_in = [ns(spec[t]) for t in prog.fb_cts]
        self.out = [ns(out_spec[t]) for t in prog.fb_outputs]
        self.grad_out = [ns(out_spec[t]) for t in prog.fb_param_grads]
        self.act_grad_out = [ns(out_spec[t]) for t in prog.fb_act_grads]
        self.res = [ns(spec[t]) for t in prog.residuals]
        inputs = fb.inputs
        remat = stage.remat

        def forward(params, acts):
            env = dict(zip(inputs[:P], params))
            env.update(zip(inputs[P:P + A], acts))
            replay(prog.fb, prog.fwd_nodes, env, self._tensor, self._operand)
            outs = [env[t] for t in prog.fb_outputs]
            return outs, ([] if remat else [env[t] for t in prog.residuals])

        def backward_of(run: StageProgram, tensor, operand):
            def backward(params, acts, residuals, cts):
                env = dict(zip(inputs[:P], params))
                env.update(zip(inputs[P:P + A], acts))
                env.update(zip(run.fb_cts, cts))
                if remat:
                    replay(run.fb, run.remat_nodes, env, tensor, operand)
                else:
                    env.update(zip(run.residuals, residuals))
                    replay(run.fb, run.bwd_nodes, env, tensor, operand)
                return ([env[t] for t in run.fb_param_grads],
                        [env[t] for t in run.fb_act_grads])
            return backward

        self.forward = jax.jit(forward, in_shardings=(self.param_in, self.act_in),
                               out_shardings=(self.out, [] if remat else self.res))
        in_shardings = (self.param_in, self.act_in, [] if remat else self.res, self.ct_in)
        self.axes = tuple(stage.accumulate_axes)
        if not self.axes:
            self.backward = jax.jit(backward_of(prog, self._tensor, self._operand),
                                    in_shardings=in_shardings,
                                    out_shardings=(self.grad_out, self.act_grad_out))
            self.reduce = None
        else:
            replicas = self.replicas = math.prod(self.mesh.shape[a] for a in self.axes)
            local = local_stage_program(parts, prog, replicas)[0]
            lfb = local.fb.graph
            auto = lambda s: _auto_spec(s, self.axes)         # noqa: E731

            reshaped = dict(stage.accumulate_reshapes)

            def manual(t: int) -> PartitionSpec:
                # A replica's share: its slice of the one dimension that shrinks per
                # replica (the plan checked it is split over the axes there, or whole),
                # or of the batch dimension the plan names for a value the replica's
                # program holds with other size-1 dimensions.
                full, part = fb.tensors[t].shape, lfb.tensors[t].shape
                if t in reshaped:
                    return PartitionSpec(*[self.axes if i == reshaped[t] else None
                                           for i in range(len(full))])
                return PartitionSpec(*[self.axes if a != b else None
                                       for a, b in zip(full, part)])

            def fitted(ts, xs):
                return [x.reshape(lfb.tensors[t].shape) if t in reshaped else x
                        for t, x in zip(ts, xs)]

            # (At one example per replica a value may have another rank in the replica's
            # program, `ir.one_example`: its sharding constraint is the partitioner's then.)
            def kept(t: int, s) -> bool:
                return bool(s.rank) and s.rank == len(lfb.tensors[t].shape)
            body = backward_of(
                local, {t: auto(s) for t, s in stage.tensor_specs if kept(t, s)},
                {(n, p): auto(s) for n, p, s in stage.operand_specs
                 if kept(lfb.nodes[n].inputs[p], s)})

            # An activation without the batch in it (e.g. a layer's auxiliary loss term)
            # gets a partial cotangent from each replica: they are summed here, as the
            # plan charges (`planning.gradient_sync`).
            whole = [not any(a != b for a, b in zip(fb.tensors[t].shape, lfb.tensors[t].shape))
                     for t in prog.fb_act_grads]

            def stacked(params, acts, residuals, cts):
                g_params, g_acts = body(
                    fitted(prog.fb_params, params), fitted(prog.fb_acts, acts),
                    fitted([] if remat else prog.residuals, residuals),
                    fitted(prog.fb_cts, cts))
                g_acts = [_psum(g, self.axes) if w else g for g, w in zip(g_acts, whole)]
                return [g[None] for g in g_params], g_acts

            stack = PartitionSpec(self.axes)
            in_specs = ([manual(t) for t in prog.fb_params],
                        [manual(t) for t in prog.fb_acts],
                        [] if remat else [manual(t) for t in prog.residuals],
                        [manual(t) for t in prog.fb_cts])
            out_specs = ([stack for _ in prog.fb_param_grads],
                         [manual(t) for t in prog.fb_act_grads])
            self.grad_stacked = [
                NamedSharding(self.mesh, PartitionSpec(self.axes, *partition_spec(out_spec[t])))
                for t in prog.fb_param_grads]
            self.backward = jax.jit(
                jax.shard_map(stacked, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                              axis_names=set(self.axes), check_vma=False),
                in_shardings=in_shardings, out_shardings=(self.grad_stacked, self.act_grad_out))
            # The once-per-step reduction: the partitioner turns the sum over the stacked
            # axis into one all-reduce over `axes` (the stage's gradients combined).
            self.reduce = jax.jit(lambda gs: [g.sum(0) for g in gs],
                                  out_shardings=self.grad_out, donate_argnums=0)
        self.accumulate = jax.jit(lambda acc, g: [a + b for a, b in zip(acc, g)],
                                  donate_argnums=0)
        # A compressed exchange replaces the reduction (`runtime.stage_exchange`).
        self.exchange = None
        if stage.exchange is not None:
            if not self.axes:
                raise ValueError("the plan compresses a stage whose backward does not run "
                                 "per replica (no accumulate_axes); plan again")
            self.exchange = CompressedReduce(
                self.mesh, self.axes, stage.exchange,
                [out_spec[t] for t in prog.fb_param_grads],
                [tuple(fb.tensors[t].shape) for t in prog.fb_param_grads],
                [fb.tensors[t].dtype for t in prog.fb_param_grads], seed)

    def loss_cotangent(self, loss_scale: float, dtype) -> np.ndarray:
        """The cotangent of the loss this stage's backward starts from: the step's scale,
        times each replica's share when the backward runs per replica."""
        return np.asarray(loss_scale * self.plan.local_loss_scale, dtype)

    def sharding(self, spec: TensorSpec) -> NamedSharding:
        return named_sharding(self.mesh, spec)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


class PipelineExecutable:
    """A pipelined plan made runnable: call with the step's positional arguments."""

    def __init__(self, parts: StepParts, plan: Plan, devices: Sequence[Any],
                 compression_seed: int = 0):
        spec = plan.pipeline
        if spec is None:
            raise ValueError("PipelineExecutable needs a pipelined plan (plan.pipeline)")
        if spec.forward_fingerprint != parts.forward.fingerprint:
            raise PlanMismatchError("this plan was made for a different loss function "
                                    "(forward fingerprints differ); plan again")
        if spec.num_micro_batches != parts.num_micro_batches:
            raise PlanMismatchError("the plan's micro-batch count differs from the trace's")
        self.parts = parts
        self.plan = plan
        fwd = parts.forward.graph
        n = len(fwd.nodes)
        starts = list(spec.layer_starts) + [n]
        self.stages = []
        for st in plan.stages:
            a, b = st.layers
            prog = stage_program(parts.forward, starts[a], starts[b + 1], starts[a + 1:b + 1])
            self.stages.append(_Stage(parts, prog, st, devices,
                                      seed=compression_seed * 1009 + len(self.stages)))
        self.step = 0   # steps run: the compressed exchanges' phase and keys follow it
        self._layout()
        # Fixed per plan: the order tasks are issued in, and where each gradient is summed.
        self.tasks = self._tasks(schedule_from_name(spec.schedule), len(self.stages),
                                 spec.num_micro_batches)
        # Gradients are summed where their parameter lives.
        outer_of = {t_f: t_o for t_o, t_f in self.fwd_of_outer.items()}
        self.grad_sharding = {t: self.input_sharding[outer_of[t]] for t in self.param_home}

    # ---- where everything lives ---------------------------------------------------------

    def _layout(self) -> None:
        parts, fwd = self.parts, self.parts.forward.graph
        # Forward tensor -> the stage that makes it; and who reads what.
        self.maker: dict[int, int] = {}
        for s, st in enumerate(self.stages):
            for t in st.prog.outputs:
                self.maker[t] = s
        self.readers: dict[int, list[int]] = {}
        for s, st in enumerate(self.stages):
            for t in st.prog.acts:
                self.readers.setdefault(t, []).append(s)
        # Parameters: the home is the first stage that reads one (where the plan keeps
        # it); later readers get copies.
        self.param_home = param_homes([st.prog for st in self.stages])
        loss = fwd.outputs[0]
        self.loss_stage = self.maker[loss]
        if self.plan.pipeline.batch_draws != sum(parts.batch_draws):
            raise PlanMismatchError(
                f"the plan draws {self.plan.pipeline.batch_draws} random number array(s) "
                f"along the batch per micro-batch but the loss function draws "
                f"{sum(parts.batch_draws)}; plan again")
        if len(self.plan.pipeline.aux) != len(fwd.outputs) - 1:
            raise PlanMismatchError(
                f"the plan combines {len(self.plan.pipeline.aux)} aux output(s) but the loss "
                f"function returns {len(fwd.outputs) - 1}; plan again")
        # The apply part runs where the plan says (planning.update_placement).
        outer = parts.outer.graph
        grad_node = outer.nodes[parts.grad_node]
        self.fwd_of_outer = {t_o: t_f for t_f, t_o in zip(fwd.inputs, grad_node.inputs)
                             if t_o is not None}
        spec = self.plan.pipeline
        if len(spec.update_stages) != len(parts.apply_nodes) or \
                len(spec.inputs) != len(outer.inputs):
            raise PlanMismatchError("the plan places another step's optimizer update "
                                    "(operator or input counts differ); plan again")
        node_home = dict(zip(parts.apply_nodes, spec.update_stages))
        self.input_stage = {t: p.stage for t, p in zip(outer.inputs, spec.inputs)}
        # Levels: a node one hop from a value made on another stage runs a level later.
        level: dict[int, int] = {}
        for nid in parts.apply_nodes:
            node = outer.nodes[nid]
            lv = 0
            for t in node.inputs:
                p = outer.producer(t) if t is not None else None
                if p is None or p == parts.grad_node:
                    continue
                lv = max(lv, level[p] + (node_home[p] != node_home[nid]))
            level[nid] = lv
        # Operators the gradient call's operands need (a key folded with the step, the
        # batch normalised) run before the pipeline, the rest after it.
        before = parts.before_nodes()
        segments: dict[tuple[bool, int, int], list[int]] = {}
        for nid in parts.apply_nodes:
            segments.setdefault((nid not in before, level[nid], node_home[nid]),
                                []).append(nid)
        self.segments = []
        needed_later = set(outer.outputs)
        for (after, lv, s), nodes in sorted(segments.items()):
            made = {t for nid in nodes for t in outer.nodes[nid].outputs}
            ins = []
            for nid in nodes:
                for t in outer.nodes[nid].inputs:
                    if t is not None and t not in made and t not in ins \
                            and outer.tensors[t].role is not Role.CONST:
                        ins.append(t)
            self.segments.append((s, nodes, ins, made))
        self.num_before = sum(1 for key in segments if not key[0])
        needed_later.update(t for t in grad_node.inputs if t is not None)
        for s, nodes, ins, made in self.segments:
            needed_later.update(ins)
        # Shardings of step inputs at home.
        self.input_sharding = {t: self.stages[p.stage].sharding(p.spec)
                               for t, p in zip(outer.inputs, spec.inputs)}
        self.segment_fns = []
        for s, nodes, ins, made in self.segments:
            outs = [t for t in sorted(made) if t in needed_later]
            fn, away = self._segment_fn(s, nodes, ins, outs)
            self.segment_fns.append((s, nodes, ins, outs, fn, away))
        self.batch_inputs = {t for t, b in zip(fwd.inputs, parts.batch_inputs) if b}

    def input_shardings(self, *args):
        """The sharding each argument leaf should have, as a pytree shaped like `args`
        (arrays or ShapeDtypeStructs); compiles nothing.

        Where the plan keeps each (`PipelineSpec.inputs`): parameters, optimizer state and
        other step inputs at their home stage, where a training loop gets them back from
        the previous step; batch leaves on the first stage that reads them, split as it
        reads each micro-batch (micro-batches are slices of the leading dimension, so the
        whole batch divides the same way).
        """
        return shardings_like(args, [self.input_sharding[t]
                                     for t in self.parts.outer.graph.inputs])

    def collectives(self, *args) -> tuple[CompiledCollective, ...]:
        """What one step runs, from the compiled stage programs: each stage's forward and
        backward once per micro-batch, its gradient reduction once (the optimizer update's
        segments are not listed)."""
        m = self.parts.num_micro_batches
        out: list[CompiledCollective] = []
        for s, st in enumerate(self.stages):
            prog, fb = st.prog, st.prog.fb.graph

            def avals(ids, shardings):
                return [jax.ShapeDtypeStruct(fb.tensors[t].shape, as_dtype(fb.tensors[t].dtype),
                                             sharding=sh) for t, sh in zip(ids, shardings)]
            params = avals(prog.fb_params, st.param_in)
            acts = avals(prog.fb_acts, st.act_in)
            res = [] if st.plan.remat else avals(prog.residuals, st.res)
            cts = avals(prog.fb_cts, st.ct_in)
            out += compiled_collectives(st.forward.lower(params, acts).compile().as_text(),
                                        f"stage {s} forward", m)
            out += compiled_collectives(
                st.backward.lower(params, acts, res, cts).compile().as_text(),
                f"stage {s} backward", m)
            if st.reduce is not None:
                stacked = [jax.ShapeDtypeStruct((st.replicas,) + tuple(fb.tensors[t].shape),
                                                as_dtype(fb.tensors[t].dtype), sharding=sh)
                           for t, sh in zip(prog.fb_param_grads, st.grad_stacked)]
                text = (st.exchange.compiled_text(stacked, self.step)
                        if st.exchange is not None else
                        st.reduce.lower(stacked).compile().as_text())
                out += compiled_collectives(text, f"stage {s} gradient reduction")
        return tuple(out)

    def _segment_fn(self, s, nodes, ins, outs):
        """The jitted operators of one segment on stage `s`, and the new values among its
        results whose home is another stage's devices: {tensor: sharding at home}.

        A new value of a step input (a parameter, optimizer state) is made at its input's
        home sharding, where the next step reads it. One operator can make new values for
        several stages (an optimizer update under one `lax.cond`, as optax.MultiSteps and
        apply_if_finite write it): a program runs on one stage's devices only, so those
        values are made there and moved home after it (`_run_segments`)."""
        outer = self.parts.outer
        mesh_devices = set(self.stages[s].mesh.devices.flat)
        tied_out = {}
        for o, tie in zip(outer.graph.outputs, outer.graph.output_ties):
            if tie is not None:
                tied_out[o] = tie

        def run(*vals):
            env = dict(zip(ins, vals))
            replay(outer, nodes, env)
            return [env[t] for t in outs]

        shardings, away = [], {}
        for t in outs:
            home = (self.input_sharding[outer.graph.inputs[tied_out[t]]]
                    if t in tied_out else None)
            if home is not None and set(home.device_set) != mesh_devices:
                away[t], home = home, None
            shardings.append(home)
        return jax.jit(run, out_shardings=shardings), away

    # ---- one step -----------------------------------------------------------------------

    def __call__(self, *args):
        parts = self.parts
        outer = parts.outer.graph
        fwd = parts.forward.graph
        flat = jax.tree_util.tree_leaves(args)
        if len(flat) != len(outer.inputs):
            raise PlanMismatchError(f"the step was planned for {len(outer.inputs)} argument "
                                    f"leaves, got {len(flat)}")
        value_of = dict(zip(outer.inputs, flat))
        for t, v in parts.outer.consts.items():
            value_of[t] = v
        env: dict[int, Any] = dict(value_of)
        self._run_segments(self.segment_fns[:self.num_before], env)
        node = outer.nodes[parts.grad_node]
        fwd_value = {t_f: (env[t_o] if t_o is not None else None)
                     for t_f, t_o in zip(fwd.inputs, node.inputs)}
        m = parts.num_micro_batches
        S = len(self.stages)
        if any(parts.batch_draws):
            # Each micro-batch draws at its rows of the batch (`ir.batch_draws`).
            rows = fwd.inputs[-1]
            fwd_value[rows] = np.arange(m * fwd.tensors[rows].shape[0], dtype=np.uint32)

        # Parameters on every stage that reads them.
        params = []
        for st in self.stages:
            params.append(place([fwd_value[t] for t in st.prog.params], st.param_in))

        # Running values (BatchNorm's averages with statistics per micro-batch): micro-batch
        # i reads what micro-batch i - 1 made of them.
        threaded = {fwd.inputs[rule.updates]: fwd.outputs[k]
                    for k, rule in enumerate(self.plan.pipeline.aux, start=1)
                    if rule.combine is Combine.LAST}

        def micro(t: int, i: int):
            if t in threaded and i > 0:
                made = aux_values[threaded[t]]
                if len(made) < i:
                    raise PlanMismatchError(
                        f"micro-batch {i} reads the running value {fwd.tensors[t].name} "
                        f"before micro-batch {i - 1} has made it (a later stage makes it); "
                        "use num_micro_batches=1")
                return made[i - 1]
            x = fwd_value[t]
            if t in self.batch_inputs:
                b = x.shape[0] // m
                return x[i * b:(i + 1) * b]
            return x

        # Aux outputs of the loss function, per micro-batch, combined as the plan says.
        aux_values: dict[int, list] = {t: [] for t in fwd.outputs[1:]}
        acts_out: dict[tuple[int, int], Any] = {}     # (forward tensor, micro-batch) -> value
        left = {(t, i): len(r) for t, r in self.readers.items() for i in range(m)}
        saved: dict[tuple[int, int], tuple] = {}      # (stage, micro-batch) -> (acts, residuals)
        cts: dict[tuple[int, int], list] = {}         # (forward tensor, micro-batch) -> parts
        grads: list[Any] = [None] * S
        losses = []
        for kind, s, i in self.tasks:
            st = self.stages[s]
            prog = st.prog
            if kind == "F":
                acts = [micro(t, i) if t not in self.maker else acts_out[(t, i)]
                        for t in prog.acts]
                acts = place(acts, st.act_in)
                for t in prog.acts:
                    # Sent to every reader: the producer's copy can go.
                    if t in self.maker:
                        left[(t, i)] -= 1
                        if not left[(t, i)]:
                            del acts_out[(t, i)]
                outs, res = st.forward(params[s], acts)
                for t, v in zip(prog.outputs, outs):
                    acts_out[(t, i)] = v
                    if t == fwd.outputs[0]:
                        losses.append(v)
                    elif t in aux_values:
                        aux_values[t].append(v)
                saved[(s, i)] = (acts, res)
            else:
                acts, res = saved.pop((s, i))
                ct_vals = []
                for t, d in zip(prog.outputs, prog.diff_outputs):
                    if not d:
                        continue
                    if t == fwd.outputs[0]:
                        ct_vals.append(st.loss_cotangent(parts.loss_scale, fwd.tensors[t].dtype))
                    elif (t, i) not in cts:
                        # An aux output no later operator reads: it takes no gradient.
                        ct_vals.append(np.zeros(fwd.tensors[t].shape,
                                                as_dtype(fwd.tensors[t].dtype)))
                    else:
                        pieces = cts.pop((t, i))
                        total = pieces[0]
                        for p in pieces[1:]:
                            total = total + place(p, total.sharding)
                        ct_vals.append(total)
                ct_vals = place(ct_vals, st.ct_in)
                g_params, g_acts = st.backward(params[s], acts, res, ct_vals)
                grads[s] = g_params if grads[s] is None else st.accumulate(grads[s], g_params)
                d_acts = [t for t, d in zip(prog.acts, prog.diff_acts) if d]
                for t, g in zip(d_acts, g_acts):
                    if t in self.maker:
                        cts.setdefault((t, i), []).append(
                            place(g, self.stages[self.maker[t]].sharding(
                                self._output_spec(t))))

        # Stages that accumulate per device reduce once, now.
        for s, st in enumerate(self.stages):
            if st.exchange is not None:
                grads[s] = st.exchange(grads[s], self.step)
            elif st.reduce is not None:
                grads[s] = st.reduce(grads[s])
        self.step += 1
        # Gradients of parameters read by several stages meet at the parameter's home (the
        # first stage that reads it, so it is met first).
        grad_of: dict[int, Any] = {}
        for s, st in enumerate(self.stages):
            for t, g in zip(st.prog.params, grads[s]):
                g = place(g, self.grad_sharding[t])
                grad_of[t] = g if t not in grad_of else grad_of[t] + g
        loss = losses[0]
        for x in losses[1:]:
            loss = loss + x
        loss = loss * np.asarray(parts.loss_scale, loss.dtype)

        # The apply part.
        outer_of_fwd = {t_f: t_o for t_o, t_f in self.fwd_of_outer.items()}
        for k, t in enumerate(parts.grad_outputs()):
            t_f = fwd.inputs[parts.call.grad_leaves[k]]
            if t_f not in grad_of:
                # The loss never reads this parameter: its gradient is zero.
                tt = fwd.tensors[t_f]
                grad_of[t_f] = place(np.zeros(tt.shape, as_dtype(tt.dtype)),
                                     self.input_sharding[outer_of_fwd[t_f]])
            env[t] = grad_of[t_f]
        env[parts.value_output()] = loss
        value_outs = outer.nodes[parts.grad_node].outputs
        for k, (t, rule) in enumerate(zip(fwd.outputs[1:], self.plan.pipeline.aux), start=1):
            env[value_outs[k]] = combine(rule, aux_values[t])
        self._run_segments(self.segment_fns[self.num_before:], env)
        results = [env[t] for t in outer.outputs]
        if jax.process_count() > 1:
            # The loss (and any other result that is not new state) lives on the last
            # stage's devices; every process of a multi-process run gets a copy. New
            # parameters and optimizer state stay at their stage, where the next step reads
            # them.
            results = [v if tie is not None else on_every_process(v)
                       for v, tie in zip(results, outer.output_ties)]
        return jax.tree_util.tree_unflatten(parts.outer.out_tree, results)

    def _run_segments(self, segment_fns, env: dict) -> None:
        """Runs step operators outside the gradient call, each on its stage."""
        outer = self.parts.outer.graph
        for s, nodes, ins, outs, fn, away in segment_fns:
            st = self.stages[s]
            vals = []
            for t in ins:
                v = env[t]
                if outer.producer(t) is None and self.input_stage.get(t) == s:
                    v = place(v, self.input_sharding[t])
                elif _elsewhere(v, st.mesh):
                    v = place(v, st.replicated())
                vals.append(v)
            for t, v in zip(outs, fn(*vals)):
                env[t] = place(v, away[t]) if t in away else v

    def _output_spec(self, t: int) -> TensorSpec:
        st = self.stages[self.maker[t]]
        return st.spec[st.prog.fb_outputs[st.prog.outputs.index(t)]]

    def _tasks(self, schedule, S: int, m: int) -> list[tuple[str, int, int]]:
        """Every (kind, stage, micro-batch) in an order that respects the schedule on each
        stage and the data dependencies between stages."""
        orders = [[("F" if k.value == "forward" else "B", i)
                   for k, i in stage_order(schedule, s, S, m)] for s in range(S)]
        done: set[tuple[str, int, int]] = set()
        pos = [0] * S
        producers = [{self.maker[t] for t in st.prog.acts if t in self.maker}
                     for st in self.stages]
        consumers = [set() for _ in range(S)]
        for s, ps in enumerate(producers):
            for p in ps:
                consumers[p].add(s)
        out = []
        while len(out) < 2 * S * m:
            progressed = False
            for s in range(S):
                while pos[s] < len(orders[s]):
                    kind, i = orders[s][pos[s]]
                    deps = [("F", p, i) for p in producers[s]] if kind == "F" else \
                        [("F", s, i)] + [("B", c, i) for c in consumers[s]]
                    if not all(d in done for d in deps):
                        break
                    done.add((kind, s, i))
                    out.append((kind, s, i))
                    pos[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline schedule deadlocked (a bug in alpa_lite)")
        return out


def _auto_spec(spec: TensorSpec, axes: tuple[str, ...]) -> PartitionSpec:
    """The part of `spec` over the other axes, as a sharding constraint inside the body."""
    return partition_spec(TensorSpec(tuple(tuple(a for a in d if a not in axes)
                                           for d in spec.dims)))


def _psum(x, axes):
    """A sum over mesh axes, in float32 for narrower floats: more exact, and XLA:CPU aborts
    on a bfloat16 all-reduce inside a partly manual shard_map (AllReducePromotion)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def combine(rule: AuxCombination, values: list):
    """An aux output's value for the step from its micro-batch values (in order)."""
    if rule.combine in (Combine.SAME, Combine.LAST) or len(values) == 1:
        return values[-1]
    if rule.combine is Combine.CONCAT:
        values = [place(v, values[0].sharding) for v in values]
        return jnp.concatenate(values, axis=rule.axis)
    total = values[0]
    for v in values[1:]:
        total = total + place(v, total.sharding)
    return total / len(values) if rule.combine is Combine.MEAN else total


def _elsewhere(v, mesh: Mesh) -> bool:
    """True when `v` is a jax.Array not on exactly the devices of `mesh`."""
    if not isinstance(v, jax.Array):
        return True
    return set(v.sharding.device_set) != set(mesh.devices.flat)
