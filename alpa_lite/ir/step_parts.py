"""A pipelined step as programs: the loss cut into layers and stages, per stage a forward
and a backward, and the apply-gradient part placed with the parameters it updates.

`split_step` traces the step with its `al.value_and_grad` call captured (one
`alpa_grad_call` node, see `markers.capture_grad_calls`) and traces the loss function alone
at micro-batch size: that *forward graph* is what layers and stages cut. `stage_program`
turns a contiguous node range of it into a `StageProgram`: a traced forward+backward graph
(`jax.vjp` of the range, or, for a stage of several layers, its layers' programs chained),
split into the part that runs when the micro-batch goes forward and the part that runs
when its gradient comes back. The same function gives a single layer's program, which is
how the stage DP is costed.

Micro-batching changes a step's math unless every example's loss is independent of the
others (no batch statistics, no capacity over the whole batch) and the loss is a mean or a
sum over examples; `alpa_lite.ir.microbatch` checks this and says how to combine micro-batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alpa_lite.errors import PlanningError, detached, kept_answer
from alpa_lite.ir.batch import AuxRule, batch_dims, batch_size
from alpa_lite.ir.batch_draws import check_drawable
from alpa_lite.ir.graph import OpGraph, Role, as_dtype, dtype_name, is_key, per_graph
from alpa_lite.ir.microbatch import check_microbatching, micro_batch_rules
from alpa_lite.ir.one_example import align_one_example
from alpa_lite.ir.replay import replay
from alpa_lite.ir.tracing import (
    TracedStep,
    random_key_inputs,
    sink_batch_free_work,
    trace,
    trace_flat,
)

GRAD_CALL = "alpa_grad_call"


@dataclasses.dataclass(eq=False)
class SplitTraces:
    """What `split_step` traces alike for every micro-batch count of one step and argument
    signature, kept so that a search over counts traces it once: the step with its gradient
    call captured, and the loss function per batch size it is traced at (`loss_trace`).

    A batch size recurs across counts: the full batch is the micro-batch of one count, and
    a data-parallel replica's share of a micro-batch of m (`local_forward`) is the
    micro-batch of a larger count. Traced once, they are one forward graph, and so share
    their stage programs too (`stage_program` keeps those per forward graph)."""
    outer: TracedStep | None = None
    loss: dict = dataclasses.field(default_factory=dict)     # key -> the traced loss
    sunk: dict = dataclasses.field(default_factory=dict)     # key -> it, batch-free work sunk
    # A loss function that closes over the step's values is traced with the step: the step
    # (fn, args, batch_argnums), and its gradient call per batch size traced again.
    step: tuple | None = None
    calls: dict = dataclasses.field(default_factory=dict)    # batch size -> GradCall


@dataclasses.dataclass(frozen=True, eq=False)
class StepParts:
    """A step split around its gradient call.

    `outer` is the whole step with the gradient call as node `grad_node`; `forward` is the
    loss function at micro-batch size, its inputs the call's array operands in order (params
    with Role.PARAM, batch leaves with Role.BATCH) and its one output the loss.
    """
    outer: TracedStep
    grad_node: int
    call: Any                               # markers.GradCall
    forward: TracedStep
    batch_inputs: tuple[bool, ...]          # per forward input: sliced into micro-batches
    num_micro_batches: int
    loss_scale: float                       # mean over micro-batches (1/m) or sum (1.0)
    # Per aux leaf (forward outputs after the loss), how micro-batch values combine and
    # along which dimension (`Combine.CONCAT`).
    aux: tuple[AuxRule, ...] = ()
    # Per `random_bits` equation of the loss, whether it draws along the batch and so per
    # micro-batch from the rows it holds (`ir.batch_draws`); with any, `forward`'s last
    # input is the micro-batch's row indices (a batch leaf the runtime makes).
    batch_draws: tuple[bool, ...] = ()
    # The traces this split shares with the other counts of its step (`SplitTraces`).
    traces: SplitTraces = dataclasses.field(default_factory=SplitTraces, repr=False)

    @property
    def apply_nodes(self) -> tuple[int, ...]:
        """Outer nodes other than the gradient call: they run once per step."""
        return tuple(n.id for n in self.outer.graph.nodes if n.id != self.grad_node)

    def before_nodes(self) -> frozenset[int]:
        """Outer nodes the gradient call's operands are computed from: they run before it."""
        g = self.outer.graph
        need = [t for t in g.nodes[self.grad_node].inputs if t is not None]
        found: set[int] = set()
        while need:
            p = g.producer(need.pop())
            if p is not None and p not in found:
                found.add(p)
                need.extend(t for t in g.nodes[p].inputs if t is not None)
        return frozenset(found)

    def grad_outputs(self) -> tuple[int, ...]:
        """Outer tensor ids of the gradient leaves, per differentiated forward input."""
        node = self.outer.graph.nodes[self.grad_node]
        return node.outputs[self.call.num_value_leaves:]

    def value_output(self) -> int:
        return self.outer.graph.nodes[self.grad_node].outputs[0]


def loss_trace(traces: SplitTraces, call, avals, roles, names, draws=(),
               sunk: bool = False) -> TracedStep:
    """The captured loss function traced at `avals` (with `roles`, `names` and batch
    `draws`, as `trace_flat` takes them), once per `traces`; with `sunk`, through
    `sink_batch_free_work` (the form pipelines cut into layers)."""
    key = (tuple((tuple(a.shape), dtype_name(a.dtype)) for a in avals), tuple(roles),
           tuple(names), tuple(draws))
    if key not in traces.loss:
        if call.num_closed:
            call = _call_at(traces, call, avals, roles)
        traces.loss[key] = trace_flat(_flat(call), avals, roles, names, draws)
    if not sunk:
        return traces.loss[key]
    if key not in traces.sunk:
        traces.sunk[key] = sink_batch_free_work(traces.loss[key])
    return traces.sunk[key]


def _call_at(traces: SplitTraces, call, avals, roles):
    """The gradient call of a loss that closes over the step's values, as it is made where
    the batch operands have `avals`' leading size: its loss replays a trace at the shapes
    it was called with, so the step is traced again with its batch leaves at that size.

    Raises:
      PlanningError: the step traced at that size calls the loss with other shapes than
        `avals` (a value it closes over does not follow the batch).
    """
    same = [tuple(a.shape) == tuple(c.shape) for a, c in zip(avals, call.avals)]
    if all(same):
        return call
    full = {call.avals[k].shape[0] for k, r in enumerate(roles)
            if r is Role.BATCH and not same[k]}
    size = {avals[k].shape[0] for k, r in enumerate(roles) if r is Role.BATCH and not same[k]}
    closure = (f"the loss function closes over {call.num_closed} value(s) of the step; "
               "pass them to it as arguments (al.value_and_grad(loss)(params, batch))")
    if len(full) != 1 or len(size) != 1:
        raise PlanningError(f"{closure}: the loss is asked for at shapes that do not differ "
                            "by the batch size alone")
    (whole,), (b,) = full, size
    if b not in traces.calls:
        fn, args, batch_argnums = traces.step
        g = traces.outer.graph

        def resized(tid, leaf):
            t = g.tensors[tid]
            if t.role is Role.BATCH and t.shape and t.shape[0] == whole:
                return jax.ShapeDtypeStruct((b,) + tuple(t.shape[1:]), as_dtype(t.dtype))
            return leaf
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        try:
            again = trace(fn, jax.tree_util.tree_unflatten(
                tree, [resized(t, x) for t, x in zip(g.inputs, leaves)]), batch_argnums,
                capture=True)
        except Exception as e:      # the user's step may refuse the size in any way
            raise PlanningError(f"{closure}: the step traced with {b} examples in place of "
                                f"{whole} fails: {type(e).__name__}: {e}") from None
        traces.calls[b] = again.grad_calls[-1] if len(again.grad_calls) == 1 else None
    found = traces.calls[b]
    if found is None or [tuple(a.shape) for a in found.avals] != \
            [tuple(a.shape) for a in avals]:
        raise PlanningError(f"{closure}: traced with {b} examples in place of {whole}, the "
                            "step calls it with values of other shapes")
    return found


def split_step(fn, args: Sequence[Any], batch_argnums: Sequence[int],
               num_micro_batches: int, traces: SplitTraces | None = None) -> StepParts:
    """Traces `fn(*args)` for pipelining (see the module docstring). `traces`: the traces
    shared with the other counts of the same step and arguments (filled here).

    Raises:
      PlanningError: the step has no `al.value_and_grad` / `al.grad` call or more than one,
        its operands are computed inside the step, `has_aux` is used, the batch does not
        divide into micro-batches, or micro-batching would change the loss.
    """
    traces = traces if traces is not None else SplitTraces()
    if traces.outer is None:
        traces.outer = trace(fn, args, batch_argnums, capture=True)
        traces.step = (fn, args, batch_argnums)
    outer = traces.outer
    g = outer.graph
    calls = [n for n in g.nodes if n.primitive == GRAD_CALL]
    if not calls:
        raise PlanningError(
            "a pipelined plan needs the step's gradient from al.value_and_grad or al.grad "
            "(drop-in for the jax functions): none was found in the step"
            + "".join(f"; change {line}" for line in gradient_call_sites(fn)))
    if len(calls) > 1:
        raise PlanningError(
            f"the step computes {len(calls)} gradients; a pipelined plan supports one "
            "al.value_and_grad / al.grad call per step")
    node = calls[0]
    call = outer.grad_calls[node.params["index"]]
    m = num_micro_batches
    computed_batch = _computed_batch_operands(g, node)
    diff = set(call.grad_leaves)
    full_avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in call.avals]
    full_roles = [Role.PARAM if pos in diff else
                  Role.BATCH if tid is not None and (g.tensors[tid].role is Role.BATCH
                                                     or tid in computed_batch)
                  else Role.OPT_STATE for pos, tid in enumerate(node.inputs)]
    full_names = [g.tensors[tid].name if tid is not None else f"const{pos}"
                  for pos, tid in enumerate(node.inputs)]
    # Random keys handed in with the batch (their use is inside the loss function) are
    # not batch data: every micro-batch reads the whole key. Only a typed key or a uint32
    # array can be one; the loss traced at the full batch says which are read as keys.
    full, keys = None, set()
    if any(r is Role.BATCH and (is_key(dtype_name(a.dtype)) or a.dtype == np.uint32)
           for r, a in zip(full_roles, full_avals)):
        full = loss_trace(traces, call, full_avals, full_roles, full_names)
        fg = full.graph
        keys = {fg.inputs.index(t) for t in random_key_inputs(fg.nodes, fg.tensors, fg.inputs)}
    batch_size({name: tuple(a.shape) for pos, (a, r, name) in
                enumerate(zip(full_avals, full_roles, full_names))
                if r is Role.BATCH and pos not in keys})
    avals, roles, names, batch_inputs = [], [], [], []
    for pos, (aval, tid) in enumerate(zip(call.avals, node.inputs)):
        is_batch = tid is not None and full_roles[pos] is Role.BATCH and pos not in keys
        name = g.tensors[tid].name if tid is not None else f"const{pos}"
        shape = tuple(aval.shape)
        if is_batch:
            if not shape:
                raise PlanningError(f"batch leaf {name} is a scalar; micro-batching needs a "
                                    "leading batch dimension")
            if shape[0] % m:
                raise PlanningError(
                    f"batch leaf {name} has leading dimension {shape[0]}, which is not "
                    f"divisible by num_micro_batches={m}; use a batch size that is a "
                    f"multiple of {m} or another micro-batch count")
            shape = (shape[0] // m,) + shape[1:]
        avals.append(jax.ShapeDtypeStruct(shape, aval.dtype))
        roles.append(Role.PARAM if pos in diff else Role.BATCH if is_batch else Role.OPT_STATE)
        names.append(name)
        batch_inputs.append(is_batch)
    forward = loss_trace(traces, call, avals, roles, names)
    leaked = [f"{v.dtype}{list(v.shape)}" for v in forward.consts.values()
              if isinstance(v, jax.core.Tracer)]
    if leaked:
        raise PlanningError(
            f"the loss function given to al.value_and_grad closes over {len(leaked)} value(s) "
            f"computed in the step ({', '.join(leaked[:3])}): a pipelined plan runs the loss "
            "function apart from the step, so pass those values to it as arguments "
            "(al.value_and_grad(loss)(params, batch, extra) differentiates the first only)")
    out = forward.graph.tensors[forward.graph.outputs[0]]
    if out.shape != () or not _is_float(out.dtype):
        raise PlanningError(f"the loss must be a float scalar, got {out.dtype}{list(out.shape)}")
    running = {k: pos for k, pos in enumerate(call.aux_updates) if pos is not None}
    rules = dict(running=running, statistics_per_micro_batch=call.micro_batch_statistics)
    scale, aux = micro_batch_rules(forward, forward, 1, running)
    draws: tuple[bool, ...] = ()
    if m > 1:
        if full is None or keys:    # (with keys the roles differ from the probe's)
            full = loss_trace(traces, call, full_avals, roles, names)
        draws = _batch_draws(forward, full, m)
        if any(draws):
            forward = loss_trace(traces, call, avals, roles, names, draws)
            full = loss_trace(traces, call, full_avals, roles, names, draws)
            batch_inputs.append(True)
        else:
            draws = ()
        try:
            scale, aux = micro_batch_rules(forward, full, m, **rules)
        except PlanningError:
            if not _one_example(avals, batch_inputs):
                raise
            scale, aux = _proxy_rules(traces, call, avals, batch_inputs, roles, names, m,
                                      draws, rules)
    return StepParts(outer=outer, grad_node=node.id, call=call,
                     forward=loss_trace(traces, call, avals, roles, names, draws, sunk=True),
                     batch_inputs=tuple(batch_inputs), num_micro_batches=m, loss_scale=scale,
                     aux=aux, batch_draws=draws, traces=traces)


def _batch_draws(micro: TracedStep, full: TracedStep, m: int) -> tuple[bool, ...]:
    """Per random draw of the loss, whether it is drawn along the batch: its leading
    dimension m times larger in the full-batch trace, the rest alike."""
    flags = []
    for k, (sm, sf) in enumerate(zip(micro.draw_shapes, full.draw_shapes)):
        if sm == sf:
            flags.append(False)
        elif sm and sf[0] == m * sm[0] and sf[1:] == sm[1:]:
            flags.append(True)
        else:
            raise PlanningError(
                f"random draw {k} of the loss function has shape {list(sf)} for the whole "
                f"batch but {list(sm)} per micro-batch: it grows with the batch along a "
                "dimension other than the leading one, so a micro-batch cannot draw its "
                "share; draw with the batch as the leading dimension, or use "
                "num_micro_batches=1")
    if any(flags):
        g = micro.graph
        for node in g.nodes:
            if node.primitive == "random_bits":
                check_drawable(as_dtype(g.tensors[node.inputs[0]].dtype))
    return tuple(flags)


def _computed_batch_operands(g: OpGraph, node) -> set[int]:
    """Operands of the gradient call computed in the step from the batch (`x / 255`): batch
    data like the batch leaves, split into micro-batches along their leading dimension,
    which must be the batch's."""
    bdims = batch_dims(g)
    found = set()
    for pos, tid in enumerate(node.inputs):
        if tid is None or g.producer(tid) is None or tid not in _batch_derived(g, tid):
            continue
        if bdims.get(tid) != 0:
            raise PlanningError(
                f"operand {pos} of value_and_grad ({g.tensors[tid].name}, shape "
                f"{list(g.tensors[tid].shape)}) is computed in the step from the batch, but "
                "its leading dimension is not the batch's, so it cannot be split into "
                "micro-batches; compute it inside the loss function instead")
        found.add(tid)
    return found


def _batch_derived(g: OpGraph, tid: int) -> set[int]:
    """`{tid}` if `tid` is computed from a batch leaf, else empty."""
    need, seen = [tid], set()
    while need:
        t = need.pop()
        if t in seen:
            continue
        seen.add(t)
        if g.tensors[t].role is Role.BATCH:
            return {tid}
        p = g.producer(t)
        if p is not None:
            need.extend(i for i in g.nodes[p].inputs if i is not None)
    return set()


def _flat(call):
    """The captured loss function as traced: array leaves in, (loss, *aux leaves) out."""
    return lambda *xs: tuple(jax.tree_util.tree_leaves(call.loss(*xs)))


# Gradient functions a step may call instead of `al.value_and_grad` / `al.grad`.
_OTHER_GRADS = re.compile(r"\b(jax|nnx|eqx|equinox|flax\.nnx)\.(value_and_grad|grad|"
                          r"filter_value_and_grad|filter_grad)\(")


def gradient_call_sites(fn) -> list[str]:
    """Where `fn`'s source calls another library's gradient function, as
    "file:line `code`" (for the error that asks for `al.value_and_grad`)."""
    fn = inspect.unwrap(getattr(fn, "func", fn))
    try:
        lines, first = inspect.getsourcelines(fn)
        path = inspect.getsourcefile(fn)
    except (OSError, TypeError):
        return []
    return [f"{path}:{first + i} `{line.strip()}` to use al.{m.group(2).replace('filter_', '')}"
            for i, line in enumerate(lines) if (m := _OTHER_GRADS.search(line))]


def _one_example(avals, batch_inputs) -> bool:
    """Whether the micro-batches hold one example each."""
    return any(b for b in batch_inputs) and all(
        a.shape[0] == 1 for a, b in zip(avals, batch_inputs) if b)


def _proxy_rules(traces: SplitTraces, call, avals, batch_inputs, roles, names, m: int,
                 draws=(), rules=None):
    """The micro-batch proof for micro-batches of one example, made at two examples.

    JAX traces size-1 dimensions differently (it may drop or broadcast them where a larger
    size needs a reshape), so the trace at one example need not match the full batch's
    operator for operator, though it computes the same function. The proof that m
    micro-batch losses sum (scaled) to the full-batch loss is therefore made between the
    traces at 2 and 2m examples, where the program is the one the batch size does not
    change; a loss that refuses there is refused with that trace's reason.
    """
    def at(k: int):
        return _traced_at(traces, call, avals, batch_inputs, roles, names, draws, k)

    return micro_batch_rules(at(2), at(2 * m), m, **(rules or {}))


def _traced_at(traces: SplitTraces, call, avals, batch_inputs, roles, names, draws,
               k: int) -> TracedStep:
    """The loss traced with `k` examples in each batch leaf (`loss_trace`)."""
    return loss_trace(traces, call,
                      [jax.ShapeDtypeStruct((k,) + tuple(a.shape[1:]) if b else
                                            tuple(a.shape), a.dtype)
                       for a, b in zip(avals, batch_inputs)], roles, names, draws)


_LOCAL_FORWARDS: "weakref.WeakKeyDictionary[StepParts, dict]" = weakref.WeakKeyDictionary()


def local_forward(parts: StepParts, replicas: int) -> tuple[TracedStep, float]:
    """The loss function traced at 1/`replicas` of the micro-batch (what one data-parallel
    replica computes), and the scale that turns a replica's loss into its share of the
    micro-batch loss (1/replicas for a mean, 1.0 for a sum). Node and tensor ids equal the
    micro-batch trace's, so a stage plan's specs apply to it (with one example per
    replica, whose trace JAX makes another program, by `ir.one_example`).

    Raises:
      PlanningError: the micro-batch does not split so, or splitting it changes the loss.
    """
    cache = _LOCAL_FORWARDS.setdefault(parts, {})
    if replicas not in cache:
        try:
            cache[replicas] = _traced_locally(parts, replicas)
        except PlanningError as e:
            # Refusals are remembered too: every stage of every candidate plan with this
            # many replicas asks again (GPT-175B's Megatron layouts: 64-96 stages each),
            # and a refused size was traced, at a cost, before it was refused.
            cache[replicas] = detached(e)
    return kept_answer(cache[replicas])


def _traced_locally(parts: StepParts, replicas: int) -> tuple[TracedStep, float]:
    g = parts.forward.graph
    avals, roles, names = [], [], []
    # (The micro-batch rows input, last with batch draws, trace_flat adds itself.)
    operands = g.inputs[:len(g.inputs) - bool(any(parts.batch_draws))]
    for t, is_batch in zip(operands, parts.batch_inputs):
        tt = g.tensors[t]
        shape = tuple(tt.shape)
        if is_batch:
            if shape[0] % replicas:
                raise PlanningError(
                    f"batch leaf {tt.name} has {shape[0]} examples per micro-batch, "
                    f"which do not split over {replicas} replicas")
            shape = (shape[0] // replicas,) + shape[1:]
        avals.append(jax.ShapeDtypeStruct(shape, as_dtype(tt.dtype)))
        roles.append(tt.role)
        names.append(tt.name)
    draws = parts.batch_draws
    try:
        local = loss_trace(parts.traces, parts.call, avals, roles, names, draws, sunk=True)
    except Exception as e:      # the user's loss may refuse the size in any way
        raise PlanningError(f"the loss function cannot be traced at 1/{replicas} of a "
                            f"micro-batch: {type(e).__name__}: {e}") from None
    try:
        return local, check_microbatching(local, parts.forward, replicas)
    except PlanningError:
        if replicas == 1 or not _one_example(avals, parts.batch_inputs):
            raise
    # One example per replica: JAX traced it as another program (`ir.one_example`). The
    # replica runs that trace numbered as the micro-batch's, and the split is proved
    # between 2 and 2 * replicas examples, as `_proxy_rules` proves micro-batches of one.
    def at(k: int):
        return _traced_at(parts.traces, parts.call, avals, parts.batch_inputs, roles, names,
                          draws, k)
    scale = check_microbatching(at(2), at(2 * replicas), replicas)
    micro = [jax.ShapeDtypeStruct(tuple(g.tensors[t].shape), as_dtype(g.tensors[t].dtype))
             for t in operands]
    return sink_batch_free_work(align_one_example(
        loss_trace(parts.traces, parts.call, avals, roles, names, draws),
        loss_trace(parts.traces, parts.call, micro, roles, names, draws))), scale


# ---- stages ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class StageProgram:
    """Forward nodes `[start, stop)` of the forward graph as a pipeline stage.

    `fb` is the traced `jax.vjp` of the range (or its pieces' chained, `cuts`): its inputs
    are the stage's parameters, its other inputs (activations from earlier stages, batch
    leaves), and a cotangent per differentiable output; its outputs are the stage's outputs,
    the parameter gradients and the gradients of the differentiable activation inputs.
    """
    start: int
    stop: int
    fb: TracedStep
    params: tuple[int, ...]           # forward tensor ids, in fb input order
    acts: tuple[int, ...]             # forward tensor ids of the other inputs
    diff_acts: tuple[bool, ...]       # per act: a cotangent flows back to its producer
    outputs: tuple[int, ...]          # forward tensor ids the range hands on (or the loss)
    diff_outputs: tuple[bool, ...]    # per output: expects a cotangent
    fwd_nodes: tuple[int, ...]        # fb node ids run in the forward task
    bwd_nodes: tuple[int, ...]        # fb node ids run in the backward task (no remat)
    remat_nodes: tuple[int, ...]      # fb node ids run in the backward task with remat
    residuals: tuple[int, ...]        # fb tensor ids kept from forward to backward
    structure: str                    # hash: equal for ranges that compute the same way
    cuts: tuple[int, ...] = ()        # forward node positions where its layers meet

    @property
    def fb_params(self) -> tuple[int, ...]:
        return self.fb.graph.inputs[:len(self.params)]

    @property
    def fb_acts(self) -> tuple[int, ...]:
        p = len(self.params)
        return self.fb.graph.inputs[p:p + len(self.acts)]

    @property
    def fb_cts(self) -> tuple[int, ...]:
        return self.fb.graph.inputs[len(self.params) + len(self.acts):]

    @property
    def fb_outputs(self) -> tuple[int, ...]:
        return self.fb.graph.outputs[:len(self.outputs)]

    @property
    def fb_param_grads(self) -> tuple[int, ...]:
        o = len(self.outputs)
        return self.fb.graph.outputs[o:o + len(self.params)]

    @property
    def fb_act_grads(self) -> tuple[int, ...]:
        return self.fb.graph.outputs[len(self.outputs) + len(self.params):]


@per_graph
def _param_dependent(forward: OpGraph) -> frozenset[int]:
    """Tensors computed from a parameter (they need a gradient); once per forward graph,
    however many ranges of it become stages."""
    dep = {t.id for t in forward.tensors if t.role is Role.PARAM}
    for node in forward.nodes:
        if any(t in dep for t in node.inputs if t is not None):
            dep.update(node.outputs)
    return frozenset(dep)


def _is_float(dtype: str) -> bool:
    return bool(jnp.issubdtype(as_dtype(dtype), jnp.floating))   # bfloat16 included


def range_io(forward: OpGraph, start: int, stop: int) -> tuple[list[int], list[int]]:
    """Inputs (read in the range, made before it or program inputs) and outputs (made in the
    range, read after it or a program output) of forward nodes [start, stop)."""
    made = {t for n in forward.nodes[start:stop] for t in n.outputs}
    ins: dict[int, None] = {}          # (ordered, without repeats)
    for n in forward.nodes[start:stop]:
        for t in n.inputs:
            if t is not None and t not in made and t not in ins \
                    and forward.tensors[t].role is not Role.CONST:
                ins[t] = None
    last = _last_reader(forward)
    program_outputs = set(forward.outputs)
    outs = [t for n in forward.nodes[start:stop] for t in n.outputs
            if last.get(t, -1) >= stop or t in program_outputs]
    return list(ins), outs


@per_graph
def _last_reader(forward: OpGraph) -> dict[int, int]:
    """Per tensor, the position of the last forward node that reads it (once per graph: the
    planners ask `range_io` of thousands of ranges)."""
    last: dict[int, int] = {}
    for k, n in enumerate(forward.nodes):
        for t in n.inputs:
            if t is not None:
                last[t] = k
    return last


_HASHES: "weakref.WeakKeyDictionary[OpGraph, dict[tuple[int, int], str]]" = \
    weakref.WeakKeyDictionary()


def structure_hash(forward: TracedStep, start: int, stop: int) -> str:
    """Equal for two node ranges that compute the same way on same-shaped inputs (e.g. two
    transformer blocks): primitives, parameters, literals, shapes and the wiring, with tensor
    ids renumbered locally. Remembered per forward graph and range."""
    known = _HASHES.setdefault(forward.graph, {})
    if (start, stop) not in known:
        known[(start, stop)] = _structure_hash(forward, start, stop)
    return known[(start, stop)]


def _structure_hash(forward: TracedStep, start: int, stop: int) -> str:
    g = forward.graph
    pieces = _node_pieces(forward)
    h = hashlib.sha256()
    local: dict[int, int] = {}

    def ref(t):
        if t not in local:
            tt = g.tensors[t]
            local[t] = len(local)
            h.update(f"in{tt.shape}{tt.dtype}{tt.role.value}".encode())
        return local[t]

    for n in g.nodes[start:stop]:
        head, inputs, outputs = pieces[n.id]
        parts = [head]
        for t, fixed in zip(n.inputs, inputs):
            parts.append(fixed if fixed is not None else str(ref(t)))
        for t in n.outputs:
            local[t] = len(local)
        parts.extend(outputs)
        h.update("|".join(parts).encode())
    ins, outs = range_io(g, start, stop)
    h.update(f"out{[local.get(t) for t in outs]}".encode())
    return h.hexdigest()[:20]


_PIECES: "weakref.WeakKeyDictionary[OpGraph, list]" = weakref.WeakKeyDictionary()


def _node_pieces(forward: TracedStep) -> list[tuple[str, list[str | None], list[str]]]:
    """Per node, what `_structure_hash` writes of it that no range changes: the primitive
    with its parameters, each input that is a literal or a constant (None for a tensor,
    which a range numbers locally) and each output's type. Once per forward graph: the
    layer search hashes thousands of ranges, and writing the parameters out is most of a
    hash's work."""
    if forward.graph not in _PIECES:
        g = forward.graph
        pieces = []
        for n in g.nodes:
            head = "|".join([n.primitive,
                             repr(sorted((k, repr(v)) for k, v in n.params.items()))])
            inputs: list[str | None] = []
            for pos, t in enumerate(n.inputs):
                if t is None:
                    inputs.append(
                        f"lit{np.asarray(forward.literals[(n.id, pos)]).tolist()!r}")
                elif g.tensors[t].role is Role.CONST:
                    digest = hashlib.sha256(np.asarray(forward.consts[t]).tobytes())
                    inputs.append(f"const{digest.hexdigest()[:8]}")
                else:
                    inputs.append(None)
            outputs = [f"{g.tensors[t].shape}{g.tensors[t].dtype}" for t in n.outputs]
            pieces.append((head, inputs, outputs))
        _PIECES[forward.graph] = pieces
    return _PIECES[forward.graph]


_PROGRAMS: "weakref.WeakKeyDictionary[OpGraph, dict[str, StageProgram]]" = \
    weakref.WeakKeyDictionary()


def stage_program(forward: TracedStep, start: int, stop: int,
                  cuts: Sequence[int] = ()) -> StageProgram:
    """The forward and backward programs of forward nodes [start, stop) (see StageProgram).

    Ranges of one forward graph with the same `structure_hash`, whose same inputs and
    outputs carry gradients, share one traced program (repeated layers, and stages of as
    many repeated layers, are traced once, whoever asks: the planner's layer search, its
    textbook layouts, the gradient-sync check of each candidate, the runtime).

    `cuts`: node positions inside the range where it may be cut into pieces (the layer
    boundaries). The range's program is then chained from its pieces' programs, each
    differentiated once per structure (`_chained`), instead of `jax.vjp` of the whole
    range: the same values (the chain rule, as `jax.vjp` applies it), made several times
    faster, since a stage of many layers is traced as a replay of graphs already
    differentiated. Pieces are single ranges (never cut further)."""
    g = forward.graph
    ins, outs = range_io(g, start, stop)
    dep = _param_dependent(g)
    params = [t for t in ins if g.tensors[t].role is Role.PARAM]
    acts = [t for t in ins if g.tensors[t].role is not Role.PARAM]
    diff_acts = [t in dep and _is_float(g.tensors[t].dtype) for t in acts]
    diff_outs = [t in dep and _is_float(g.tensors[t].dtype) for t in outs]
    inner = tuple(sorted({c for c in cuts if start < c < stop}))
    # A chained program is another graph than the range's own vjp (the same values; its
    # backward recomputes constants its forward made, which one vjp shares): ranges share
    # a program only if cut alike, so that a stage and its per-replica program (made
    # with the stage's cuts) always match node for node.
    structure = structure_hash(forward, start, stop) + "/" + \
        "".join("1" if d else "0" for d in diff_acts + diff_outs) + \
        "".join(f"/{c - start}" for c in inner)
    known = _PROGRAMS.setdefault(g, {})
    like = known.get(structure)
    if like is not None:
        return dataclasses.replace(like, start=start, stop=stop, params=tuple(params),
                                   acts=tuple(acts), outputs=tuple(outs), cuts=inner)
    bounds = (start, *inner, stop)
    fb = _chained([stage_program(forward, a, b) for a, b in zip(bounds, bounds[1:])],
                  params, acts, diff_acts, outs, diff_outs) if inner else \
        _range_vjp(forward, range(start, stop), params, acts, diff_acts, outs, diff_outs)
    avals = [g.tensors[t] for t in params + acts] + \
        [g.tensors[t] for t, d in zip(outs, diff_outs) if d]
    roles = [Role.PARAM] * len(params) + [Role.BATCH] * (len(avals) - len(params))
    names = [g.tensors[t].name for t in params + acts] + \
        [f"d/{g.tensors[t].name}" for t, d in zip(outs, diff_outs) if d]
    fb_traced = trace_flat(fb, [jax.ShapeDtypeStruct(t.shape, as_dtype(t.dtype)) for t in avals],
                           roles, names)
    fwd, bwd, remat, residuals = _split_fb(fb_traced.graph, len(params) + len(acts), len(outs))
    known[structure] = StageProgram(
        start=start, stop=stop, fb=fb_traced, params=tuple(params), acts=tuple(acts),
        diff_acts=tuple(diff_acts), outputs=tuple(outs), diff_outputs=tuple(diff_outs),
        fwd_nodes=fwd, bwd_nodes=bwd, remat_nodes=remat, residuals=residuals,
        structure=structure, cuts=inner)
    return known[structure]


_ALIGNED: "weakref.WeakKeyDictionary[OpGraph, weakref.WeakKeyDictionary]" = \
    weakref.WeakKeyDictionary()


def local_stage_program(parts: StepParts, prog: StageProgram, replicas: int
                        ) -> tuple[StageProgram, float]:
    """Stage `prog` as one of `replicas` data-parallel replicas runs it, on its share of
    each micro-batch, with the scale of its loss (`local_forward`). Node and tensor ids are
    `prog`'s: the runtime feeds the replica the stage's own forward values by them.

    With one example per replica JAX may trace the range's `jax.vjp` as another program
    (it forwards a broadcast to the shape the value already has): the replica's program
    is then aligned to `prog`'s by `ir.one_example`, keeping `prog`'s partition of it into
    forward, backward and residuals.

    Raises:
      PlanningError: the micro-batch does not split so, splitting it changes the loss, or
        the replica's program is not the stage's at a smaller batch.
    """
    local_fwd, scale = local_forward(parts, replicas)
    local = stage_program(local_fwd, prog.start, prog.stop, prog.cuts)
    g, gl = prog.fb.graph, local.fb.graph
    # (Once per pair of programs: every candidate plan's stages ask.)
    known = _ALIGNED.setdefault(gl, weakref.WeakKeyDictionary())
    if g not in known:
        if len(g.nodes) == len(gl.nodes) and len(g.tensors) == len(gl.tensors) and all(
                (a.primitive, a.inputs, a.outputs) == (b.primitive, b.inputs, b.outputs)
                for a, b in zip(g.nodes, gl.nodes)):
            known[g] = local
        else:
            try:
                known[g] = dataclasses.replace(prog, fb=align_one_example(local.fb, prog.fb))
            except PlanningError as e:
                known[g] = detached(e)
    return kept_answer(known[g]), scale


def _range_vjp(forward: TracedStep, node_ids, params, acts, diff_acts, outs, diff_outs):
    """The fb function (`StageProgram`) of forward nodes `node_ids` as one `jax.vjp` of
    their replay."""
    P, A = len(params), len(acts)

    def fb(*leaves):
        p_vals, a_vals, cts = leaves[:P], leaves[P:P + A], leaves[P + A:]
        d_idx = [i for i in range(A) if diff_acts[i]]

        def f(ps, das):
            env = dict(zip(params, ps))
            full = list(a_vals)
            for i, x in zip(d_idx, das):
                full[i] = x
            env.update(zip(acts, full))
            replay(forward, node_ids, env)
            vals = [env[t] for t in outs]
            return ([v for v, d in zip(vals, diff_outs) if d],
                    [v for v, d in zip(vals, diff_outs) if not d])

        dvals, vjp, ndvals = jax.vjp(f, list(p_vals), [a_vals[i] for i in d_idx], has_aux=True)
        gp, ga = vjp(list(cts))
        dv, nv = iter(dvals), iter(ndvals)
        vals = [next(dv) if d else next(nv) for d in diff_outs]
        return tuple(vals) + tuple(gp) + tuple(ga)

    return fb


def _chained(pieces: Sequence[StageProgram], params, acts, diff_acts, outs, diff_outs):
    """The fb function (`StageProgram`) of consecutive ranges run as one: each piece's
    forward nodes in order, then each piece's backward nodes in reverse order, fed the
    cotangents of its outputs summed over the later pieces that read them and the range's
    own cotangents; a parameter read by several pieces gets the sum of their gradients.
    Pieces are replayed from their traced graphs, forward tensor ids wiring them."""
    P, A = len(params), len(acts)

    def fb(*leaves):
        val = dict(zip(params, leaves[:P]))          # forward tensor id -> value
        val.update(zip(acts, leaves[P:P + A]))
        envs = []
        for piece in pieces:
            env = {t_fb: val[t] for t_fb, t in zip(piece.fb.graph.inputs,
                                                   piece.params + piece.acts)}
            replay(piece.fb, piece.fwd_nodes, env)
            val.update((t, env[t_fb]) for t_fb, t in zip(piece.fb_outputs, piece.outputs))
            envs.append(env)
        # Cotangent per forward tensor, summed over its readers (and the range's own).
        ct = dict(zip([t for t, d in zip(outs, diff_outs) if d], leaves[P + A:]))
        grads: dict[int, Any] = {}
        for piece, env in zip(reversed(pieces), reversed(envs)):
            g = piece.fb.graph
            for t_fb, t in zip(piece.fb_cts, [t for t, d in zip(piece.outputs,
                                                                 piece.diff_outputs) if d]):
                tt = g.tensors[t_fb]
                env[t_fb] = ct[t] if t in ct else jnp.zeros(tt.shape, as_dtype(tt.dtype))
            replay(piece.fb, piece.bwd_nodes, env)
            for t_fb, t in zip(piece.fb_param_grads, piece.params):
                grads[t] = _summed(grads.get(t), env[t_fb])
            for t_fb, t in zip(piece.fb_act_grads, [t for t, d in zip(piece.acts,
                                                                       piece.diff_acts) if d]):
                ct[t] = _summed(ct.get(t), env[t_fb])
        return tuple(val[t] for t in outs) + tuple(grads[t] for t in params) + \
            tuple(ct[t] for t, d in zip(acts, diff_acts) if d)

    return fb


def _summed(a, b):
    """Two contributions to one gradient (None: none yet); a non-float's (`float0`) gradient
    is nothing to add."""
    if a is None:
        return b
    return a if a.dtype == jax.dtypes.float0 else a + b


def param_homes(progs: Sequence[StageProgram]) -> dict[int, int]:
    """Forward parameter tensor -> the first stage that reads it."""
    home: dict[int, int] = {}
    for s, prog in enumerate(progs):
        for t in prog.params:
            home.setdefault(t, s)
    return home


def _ancestors(g: OpGraph, targets, stop: set[int]) -> list[int]:
    need = set(t for t in targets if t not in stop)
    nodes = []
    for node in reversed(g.nodes):
        if any(t in need for t in node.outputs):
            nodes.append(node.id)
            need.update(t for t in node.inputs if t is not None and t not in stop)
    return sorted(nodes)


def _split_fb(g: OpGraph, num_primal_inputs: int, num_outputs: int):
    """Forward nodes (not reading a cotangent), backward nodes, the nodes a rematerialising
    backward runs, and the residuals (forward results the backward reads)."""
    cts = set(g.inputs[num_primal_inputs:])
    tainted = set(cts)
    bwd_all = set()
    for node in g.nodes:
        if any(t in tainted for t in node.inputs if t is not None):
            tainted.update(node.outputs)
            bwd_all.add(node.id)
    primal_in = set(g.inputs[:num_primal_inputs])
    # Values computed from constants alone (a causal mask from iota and a comparison, and
    # its broadcast to the scores' shape) are not kept from the forward: the backward
    # computes them again, which costs nothing next to holding a (batch, heads, seq, seq)
    # mask per micro-batch between the two programs.
    constant: set[int] = set()
    for node in g.nodes:
        if all(t is None or t in constant for t in node.inputs) and node.outputs:
            constant.update(node.outputs)
    residuals = []
    for node in g.nodes:
        if node.id not in bwd_all:
            continue
        for t in node.inputs:
            if t is None or t in tainted or t in primal_in or t in residuals or t in constant:
                continue
            if g.producer(t) is not None:
                residuals.append(t)
    outs = g.outputs[:num_outputs]
    grads = g.outputs[num_outputs:]
    fwd = _ancestors(g, list(outs) + residuals, primal_in)
    fwd = [n for n in fwd if n not in bwd_all]
    bwd = _ancestors(g, grads, primal_in | cts | set(residuals))
    remat = _ancestors(g, grads, primal_in | cts)
    return tuple(fwd), tuple(bwd), tuple(remat), tuple(residuals)
