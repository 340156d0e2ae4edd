"""The loss traced at one example, numbered as the trace at a larger batch.

JAX skips work that is the identity at the shapes it is given, and the shapes of one
example make more of it the identity: `jnp.broadcast_to(positions[None], (B, T))` binds no
`broadcast_in_dim` when B is 1, `jnp.take_along_axis` indexes one example without
expanding its indices, the gradient of `x + bias[None]` needs no sum over the batch, and
the transpose of a broadcast sums over the operand's size-1 dimensions too and puts them
back. A trace at one example is therefore another program than the trace at two or more,
though it computes the same function. Hugging Face's Flax models, Equinox and Flax
transformers, and our own GPT all trace so (forward, and the more so their `jax.vjp`).

A data-parallel replica of a pipeline stage whose share of a micro-batch is one example
still runs the micro-batch's stage plan, whose stage cuts, shardings and residuals name
the micro-batch trace's node and tensor ids. `align_one_example` makes the one-example
trace carry those ids. It walks the micro-batch trace's operators in order against the
one-example trace's and, for each, takes the first that applies:

- a reduction whose one-example counterpart sums over more, size-1, dimensions and puts
  them back: the micro-batch's reduction, bound at one example (`_unit_reduction`);
- a sum over dimensions of size 1 at one example, put back as size 1 (a broadcast's
  transpose), which the one-example trace skips: both bound at one example, the identity
  (`_skipped_unbroadcast`);
- the next one-example operator, of the same primitive, on operands that correspond: it,
  with its own parameters (`_pairing`);
- a `broadcast_in_dim` or `reshape` the one-example trace skipped (`_skipped_identity`):
  bound at one example as the identity.

Anything else is refused. Every operator of the result is either the one-example trace's
own or an identity at one example, so the result computes what the one-example trace
computes, operator for operator. A value may still have another rank than in the
micro-batch trace (size-1 dimensions dropped or added): `planning.gradient_sync` lets such
a value only enter a replica's backward, reshaped (`StagePlan.accumulate_reshapes`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import Node, OpGraph
from alpa_lite.ir.tracing import TracedStep, graph_fingerprint

# Shape operators JAX's NumPy layer leaves out when the result would have the operand's
# shape; each is the identity when bound at that shape.
_SKIPPED_WHEN_IDENTITY = {"broadcast_in_dim": "shape", "reshape": "new_sizes"}


def align_one_example(local: TracedStep, micro: TracedStep) -> TracedStep:
    """`local` (the loss traced at one example per batch leaf) with `micro`'s node and
    tensor ids (the same loss traced at more examples, same inputs in the same order); see
    the module docstring. Neither trace may have had its batch-free work sunk
    (`tracing.sink_batch_free_work` reorders by the graph, so sink the result).

    Raises:
      PlanningError: the traces differ other than by skipped identities, naming the first
        operator where they part.
    """
    gl, gm = local.graph, micro.graph
    if len(gl.inputs) != len(gm.inputs) or len(gl.outputs) != len(gm.outputs):
        raise PlanningError("the loss traced at one example has other inputs or outputs "
                            "than at the micro-batch size")
    to_local: dict[int, int] = dict(zip(gm.inputs, gl.inputs))
    own_shape: dict[int, tuple[int, ...]] = {}     # results with no local counterpart
    nodes: list[Node] = []
    primitives: list = []
    literals: dict = {}

    def rebound(mn: Node, shape=None, flops=0.0, nbytes=0.0) -> None:
        """`mn` itself, bound at the one-example shapes (`shape`: its target shape)."""
        params = dict(mn.params)
        if shape is not None:
            params[_SKIPPED_WHEN_IDENTITY[mn.primitive]] = shape
        nodes.append(Node(mn.id, mn.primitive, mn.inputs, mn.outputs,
                          MappingProxyType(params), flops, nbytes, mn.scope))
        primitives.append(micro.primitives[mn.id])

    i = k = 0
    while i < len(gm.nodes):
        mn = gm.nodes[i]
        ln = gl.nodes[k] if k < len(gl.nodes) else None
        after = gl.nodes[k + 1] if k + 1 < len(gl.nodes) else None
        out = _unit_reduction(mn, ln, after, to_local, gm, gl) if ln is not None else None
        if out is not None:
            rebound(mn, flops=ln.flops, nbytes=ln.bytes_accessed)
            to_local[mn.outputs[0]] = out
            i, k = i + 1, k + 2
            continue
        # (Before pairing: at one example the sum's operand is what the local trace
        # reads next, and its reduce_sum may be the next node's transpose.)
        nxt = gm.nodes[i + 1] if i + 1 < len(gm.nodes) else None
        summed = _skipped_unbroadcast(mn, nxt, to_local, gm, gl)
        if summed is not None:
            rebound(mn)
            own_shape[mn.outputs[0]] = summed
            rebound(nxt, gl.tensors[to_local[mn.inputs[0]]].shape)
            to_local[nxt.outputs[0]] = to_local[mn.inputs[0]]
            i += 2
            continue
        bound = _pairing(mn, ln, to_local, micro, local) if ln is not None else None
        if bound is not None:
            to_local.update(bound)
            to_local.update(zip(mn.outputs, ln.outputs))
            nodes.append(Node(mn.id, ln.primitive, mn.inputs, mn.outputs, ln.params, ln.flops,
                              ln.bytes_accessed, mn.scope))
            primitives.append(local.primitives[ln.id])
            literals.update({(mn.id, pos): local.literals[(ln.id, pos)]
                             for pos, t in enumerate(ln.inputs) if t is None})
            i, k = i + 1, k + 1
            continue
        shape = _skipped_identity(mn, to_local, gm, gl)
        if shape is not None:
            rebound(mn, shape)
            to_local[mn.outputs[0]] = to_local[mn.inputs[0]]
            i += 1
            continue
        at = f"{mn.name}, paired with {ln.name}" if ln is not None else mn.name
        raise PlanningError(
            "the loss traced at one example is not the micro-batch trace with JAX's "
            f"skipped identities put back (they part at {at})")
    if k != len(gl.nodes):
        raise PlanningError(f"the loss traced at one example has {len(gl.nodes) - k} "
                            "operators more than at the micro-batch size")
    if [to_local.get(t) for t in gm.outputs] != list(gl.outputs):
        raise PlanningError("the loss traced at one example returns other values than at "
                            "the micro-batch size")
    tensors = tuple(t.replace(shape=gl.tensors[to_local[t.id]].shape) if t.id in to_local
                    else t.replace(shape=own_shape[t.id]) if t.id in own_shape
                    else t for t in gm.tensors)
    consts = {t: local.consts[to_local[t]] if t in to_local else v
              for t, v in micro.consts.items()}
    graph = OpGraph(tensors, tuple(nodes), gm.inputs, gm.outputs, gm.output_ties)
    return dataclasses.replace(
        local, graph=graph, primitives=tuple(primitives),
        literals=MappingProxyType(literals), consts=MappingProxyType(consts),
        boundaries=micro.boundaries, fingerprint=graph_fingerprint(graph))


def _pairing(mn: Node, ln: Node, to_local: dict[int, int], micro: TracedStep,
             local: TracedStep) -> dict[int, int] | None:
    """Whether micro node `mn` is local node `ln` (same primitive and arity, operands that
    correspond); if so, the constants the pairing newly maps (micro id -> local id)."""
    if (mn.primitive, len(mn.inputs), len(mn.outputs)) != \
            (ln.primitive, len(ln.inputs), len(ln.outputs)):
        return None
    bound: dict[int, int] = {}
    for tm, tl in zip(mn.inputs, ln.inputs):
        if tm is None or tl is None:
            if tm is not tl:
                return None
        elif tm in to_local or tm in bound:
            if to_local.get(tm, bound.get(tm)) != tl:
                return None
        elif tm in micro.consts and tl in local.consts:
            bound[tm] = tl       # a captured constant, met at its first reader
        else:
            return None
    for tm, tl in zip(mn.outputs, ln.outputs):
        if micro.graph.tensors[tm].dtype != local.graph.tensors[tl].dtype:
            return None
    return bound


def _skipped_identity(mn: Node, to_local: dict[int, int], gm: OpGraph, gl: OpGraph
                      ) -> tuple[int, ...] | None:
    """The one-example shape at which micro node `mn` is an identity JAX skipped, or None
    where it is not one: a shape operator on one corresponding operand of the result's
    rank and dtype, each dimension the result's or a divisor of it (the batch's); or a
    reshape that only adds or drops size-1 dimensions, which the local trace's reader
    does without (`jnp.take_along_axis` indexes one example without expanding its
    indices)."""
    if mn.primitive not in _SKIPPED_WHEN_IDENTITY or len(mn.inputs) != 1 \
            or mn.inputs[0] not in to_local:
        return None
    operand = gl.tensors[to_local[mn.inputs[0]]]
    result = gm.tensors[mn.outputs[0]]
    if operand.dtype != result.dtype:
        return None
    if mn.primitive == "reshape" and mn.params.get("dimensions") is None and \
            without_ones(gm.tensors[mn.inputs[0]].shape) == without_ones(result.shape):
        return tuple(operand.shape)
    if len(operand.shape) != len(result.shape):
        return None
    if any(a == 0 or b % a for a, b in zip(operand.shape, result.shape)):
        return None
    return tuple(operand.shape)


def _unit_reduction(mn: Node, ln: Node, after: Node | None, to_local: dict[int, int],
                    gm: OpGraph, gl: OpGraph) -> int | None:
    """Where micro node `mn` reduces over `axes` and the local trace reduces the same
    operand over those axes and some of size 1 (`ln`), then puts the size-1 dimensions
    back (`after`, a `broadcast_in_dim` or `reshape` that keeps every element): the local
    id of `mn`'s result (`after`'s), which is `mn` bound at the local shapes. JAX's
    transpose of a broadcast sums so over the operand's size-1 dimensions."""
    if after is None or not mn.primitive.startswith("reduce_") or \
            mn.primitive != ln.primitive or len(mn.inputs) != 1 or len(ln.inputs) != 1 or \
            to_local.get(mn.inputs[0]) != ln.inputs[0] or "axes" not in mn.params:
        return None
    operand = gl.tensors[ln.inputs[0]].shape
    ours, theirs = set(mn.params["axes"]), set(ln.params.get("axes", ()))
    if not ours < theirs or any(operand[a] != 1 for a in theirs - ours):
        return None
    if after.primitive not in _SKIPPED_WHEN_IDENTITY or after.inputs != ln.outputs:
        return None
    want = tuple(d for a, d in enumerate(operand) if a not in ours)
    result = gl.tensors[after.outputs[0]]
    if result.shape != want or result.dtype != gm.tensors[mn.outputs[0]].dtype or \
            len(result.shape) != len(gm.tensors[mn.outputs[0]].shape):
        return None
    # (The summed-over dimensions are of size 1: `ln`'s result holds `mn`'s elements, in
    # order, and `after` keeps each, only adding size-1 dimensions.)
    return after.outputs[0]


def _skipped_unbroadcast(mn: Node, nxt: Node | None, to_local: dict[int, int],
                         gm: OpGraph, gl: OpGraph) -> tuple[int, ...] | None:
    """Where micro nodes `mn`, `nxt` sum a value over dimensions that have size 1 at one
    example and put them back as size 1 (a broadcast's transpose: the gradient of
    `x + bias[None]` summed to the bias's shape), which the local trace skips as the
    identity: the shape of `mn`'s result at one example, else None."""
    if nxt is None or mn.primitive != "reduce_sum" or len(mn.inputs) != 1 or \
            mn.inputs[0] not in to_local or nxt.primitive not in _SKIPPED_WHEN_IDENTITY or \
            nxt.inputs != mn.outputs:
        return None
    operand = gl.tensors[to_local[mn.inputs[0]]]
    axes = set(mn.params.get("axes", ()))
    if not axes or any(operand.shape[a] != 1 for a in axes):
        return None
    result = gm.tensors[nxt.outputs[0]]
    if result.dtype != operand.dtype or len(result.shape) != len(operand.shape) or \
            any(a == 0 or b % a for a, b in zip(operand.shape, result.shape)):
        return None
    return tuple(d for a, d in enumerate(operand.shape) if a not in axes)


def without_ones(shape) -> tuple[int, ...]:
    """`shape` without its size-1 dimensions: shapes equal so hold the same elements in
    the same order (row-major), whatever size-1 dimensions each adds."""
    return tuple(d for d in shape if d != 1)
