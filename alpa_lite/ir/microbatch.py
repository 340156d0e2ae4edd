"""The micro-batching guard: may the loss be split into micro-batches without changing the math?

A pipelined train step runs the loss once per micro-batch (the batch cut along dim 0 into m
equal parts) and combines the losses and gradients as `scale * sum(micro-batch values)`.
That reproduces the full-batch loss and gradients exactly only if the loss is, as a function
of the parameters, a fixed multiple of a sum of per-example terms (a mean or a sum over
examples), plus at most a batch-independent term that a mean counts once. `check_microbatching`
proves this from two traces of the same loss function, at the micro-batch size and at the
full batch size, and returns the scale (1/m for a mean, 1.0 for a sum); anything it cannot
prove is a `PlanningError` naming the operator, never a silent change to the user's math.

The rule, tensor by tensor (walking both graphs in lockstep; they must be the same program):

* per-example tensors carry the batch in one dimension (`ir.batch.batch_dims`). Operators
  must keep examples apart: the batch label goes from operand to result and is never
  `fixed` (no cumsum, sort, slice or window across examples), and its size must scale by m.
* the only way to leave the batch is a sum over it (`reduce_sum`, or a `dot_general`
  contracting it); max, argmax, sort, ... over the batch would see part of the batch only.
* everything computed from such a sum (the "tail") must stay linear in it on the way to the
  loss: no batch statistics fed back into per-example values (batch norm), no division by
  or nonlinearity of a whole-batch value (a masked mean sum(l*mask)/sum(mask)).
* the batch size may enter only as a literal multiplier (the 1/B of a mean). Each
  batch-derived tensor carries r = (its value in the micro trace) / (its value in the full
  trace), relative to the same examples: literal factors that differ between the traces
  change r. Terms added together must have the same r; a batch-independent term (a weight
  penalty) may be added only where r == m, i.e. to a mean, where averaging the m
  micro-batch losses counts it once. The loss's r is m for a mean (scale 1/m) or 1 for a
  sum (scale 1).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from alpa_lite.errors import PlanningError
from alpa_lite.ir.batch import AuxRule, Combine, batch_dims
from alpa_lite.ir.graph import Node, Role, as_dtype
from alpa_lite.ir.op_rules import ELEMENTWISE, dim_labels
from alpa_lite.ir.tracing import TracedStep, sub_jaxprs

# What a tensor is to the batch (see the module docstring).
IND = "independent"      # same value in both traces (params, constants, their functions)
SIZED = "size"           # not computed from the batch, but from the batch *size* (arange(B))
UNIF = "uniform"         # a batch-shaped constant, the same along the batch (ones_like(x))
PER = "per-example"      # carries the batch in one dimension, each slice one example's value
TAIL = "tail"            # computed from a sum over the batch
STAT = "statistic"       # with statistics per micro-batch: a nonlinear function of a TAIL

_ADD = frozenset({"add", "add_any", "sub"})
# Linear in operand 0 when the other operands are batch-independent (or indices).
_LINEAR = frozenset({"neg", "copy", "copy_p", "convert_element_type", "reshape", "squeeze",
                     "broadcast_in_dim", "transpose", "expand_dims", "reduce_sum", "slice",
                     "rev", "stop_gradient", "reduce_window_sum", "cumsum", "gather",
                     "dynamic_slice", "pad", "real", "imag"})
_TAIL_LINEAR = frozenset({"neg", "copy", "copy_p", "convert_element_type", "reshape",
                          "squeeze", "broadcast_in_dim", "transpose", "expand_dims",
                          "reduce_sum", "slice", "stop_gradient"})
_RTOL = 1e-9

_FIX_STAT = ("use num_micro_batches=1, pass micro_batch_statistics=True to al.value_and_grad "
             "to compute it per micro-batch as gradient accumulation does, or compute the "
             "statistic per example / per "
             "fixed-size group (e.g. ghost batch norm with a fixed group size)")


# Loops, branches and custom-derivative calls kept whole by tracing: their rule comes from
# their bodies.
CONTROL_FLOW = frozenset({"scan", "while", "cond", "custom_jvp_call", "custom_vjp_call",
                          "custom_vjp_call_jaxpr"})


def _body_literals(params) -> list:
    """The literal constants of a loop's or branch's bodies, in order, and the shapes of
    the random numbers they draw (a draw that grows with the batch differs per
    micro-batch)."""
    found = []
    for jaxpr in sub_jaxprs(params):
        for e in jaxpr.eqns:
            found += [repr(a.val) for a in e.invars if isinstance(a, jex.Literal)]
            if e.primitive.name in _RANDOM_DRAWS:
                found.append(repr([v.aval.shape for v in e.outvars]))
            found += _body_literals(e.params)
    return found


def _op(node: Node) -> str:
    return f"operator {node.name}" + (f" (in {node.scope})" if node.scope else "")


def _same_value(a, b) -> bool:
    """Whether two constants (a literal or a captured array in the two traces) are the same
    value, a NaN the same as a NaN: a literal NaN (jnp.var's value for an empty sample)
    is one constant at every batch size, not a value that changes with it."""
    a, b = np.asarray(a), np.asarray(b)
    nan = np.issubdtype(a.dtype, np.inexact) and np.issubdtype(b.dtype, np.inexact)
    return np.array_equal(a, b, equal_nan=nan)


def _eps(value: np.ndarray) -> float:
    return float(np.finfo(value.dtype).eps) if np.issubdtype(value.dtype, np.inexact) else 0.0


def check_microbatching(micro: TracedStep, full: TracedStep, num_micro_batches: int) -> float:
    """The loss's scale alone (see `micro_batch_rules`; aux outputs are not examined)."""
    m = _checked_count(num_micro_batches)
    _check_structure(micro, full, m)
    return 1.0 if m == 1 else _Checker(micro, full, m).run(full.graph.outputs[:1])


def _checked_count(m) -> int:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"num_micro_batches must be a positive int, got {m!r}")
    return m


def micro_batch_rules(micro: TracedStep, full: TracedStep, num_micro_batches: int,
                      running: Mapping[int, int] | None = None,
                      statistics_per_micro_batch: bool = False
                      ) -> tuple[float, tuple[AuxRule, ...]]:
    """The scale that makes `scale * sum(micro-batch losses and gradients)` equal the
    full-batch loss and gradients: 1/m for a mean over examples, 1.0 for a sum.

    Returns `(scale, aux)`: with `aux`, per further output of the loss function (the aux
    leaves of `value_and_grad(..., has_aux=True)`), how its micro-batch values combine into
    the full batch's and along which dimension (for `Combine.CONCAT`): the same value on
    every micro-batch, a mean or a sum over examples, or one entry per example.

    With `statistics_per_micro_batch` (the user asked for gradient accumulation's meaning,
    `al.value_and_grad(..., micro_batch_statistics=True)`), a value computed over the batch
    may feed per-example values (BatchNorm's mean and variance): each micro-batch uses its
    own, and the proof covers the rest of the loss. `running` maps aux outputs (positions
    among the aux leaves) to the loss operand each is the new value of (BatchNorm's running
    averages): they combine as `Combine.LAST`, threaded through the micro-batches.

    Args:
      micro: the loss function traced (`tracing.trace_flat`) at the micro-batch size; its
        first output is the scalar loss, any others aux values.
      full: the same loss function traced at the full batch size (m times the leading
        dimension of every batch input).
      num_micro_batches: m.

    Raises:
      PlanningError: where summing micro-batch results would not reproduce the full-batch
        loss exactly, naming the operator and what to do.
    """
    m = _checked_count(num_micro_batches)
    _check_structure(micro, full, m)
    running = dict(running or {})
    n_aux = len(full.graph.outputs) - 1
    if m == 1:   # one micro-batch is the whole batch: nothing changes
        return 1.0, tuple(AuxRule(Combine.LAST, updates=running[k]) if k in running
                          else AuxRule(Combine.SAME) for k in range(n_aux))
    checker = _Checker(micro, full, m, statistics_per_micro_batch)
    scale = checker.run(full.graph.outputs)
    return scale, tuple(AuxRule(Combine.LAST, updates=running[k]) if k in running
                        else checker.aux_rule(t, k + 1)
                        for k, t in enumerate(full.graph.outputs[1:]))


def _check_structure(micro: TracedStep, full: TracedStep, m: int) -> None:
    gm, gf = micro.graph, full.graph
    if not gm.outputs or not gf.outputs:
        raise PlanningError("the loss function returns nothing; it must return the scalar loss")
    if len(gm.inputs) != len(gf.inputs):
        raise PlanningError(f"the micro-batch trace has {len(gm.inputs)} inputs but the "
                            f"full-batch trace {len(gf.inputs)}; trace the same loss function")
    for tm, tf in zip((gm.tensors[i] for i in gm.inputs), (gf.tensors[i] for i in gf.inputs)):
        if tm.role is not tf.role:
            raise PlanningError(f"input {tf.name} is {tm.role.value} in the micro-batch trace "
                                f"but {tf.role.value} in the full-batch trace")
        if tf.role is Role.BATCH:
            if not tf.shape:
                raise PlanningError(f"batch leaf {tf.name} is a scalar; a batch leaf needs a "
                                    "leading batch dimension to split into micro-batches")
            if (tf.shape[0], tf.shape[1:]) != (m * tm.shape[0], tm.shape[1:]):
                raise PlanningError(
                    f"batch leaf {tf.name} has shape {tm.shape} per micro-batch but {tf.shape} "
                    f"for the full batch; expected {m} x the leading dimension")
        elif tm.shape != tf.shape:
            raise PlanningError(f"input {tf.name} (not a batch leaf) has shape {tm.shape} in "
                                f"the micro-batch trace but {tf.shape} in the full-batch trace")
    # Same operators, wired the same way, every value of the same rank: then tensor and node
    # ids name the same thing in both traces.
    def differs(nm: Node, nf: Node) -> bool:
        return ((nm.primitive, nm.inputs, nm.outputs) != (nf.primitive, nf.inputs, nf.outputs)
                or any(t >= len(gm.tensors) or len(gm.tensors[t].shape) != len(gf.tensors[t].shape)
                       for t in nf.outputs))

    first = next((nf for nm, nf in zip(gm.nodes, gf.nodes) if differs(nm, nf)), None)
    if first is None and (len(gm.nodes), len(gm.tensors), gm.outputs) == \
            (len(gf.nodes), len(gf.tensors), gf.outputs):
        return
    where = (f"first at {_op(first)}" if first is not None else
             f"{len(gm.nodes)} operators at the micro-batch size, {len(gf.nodes)} at the full size")
    tiny = any(gm.tensors[t].role is Role.BATCH and gm.tensors[t].shape[:1] == (1,)
               for t in gm.inputs)
    raise PlanningError(
        "the loss function's operators depend on the batch size: its trace at the micro-batch "
        f"size differs from the full-batch one ({where}). Micro-batching needs the same program "
        "at every batch size: avoid Python branches on the batch size in the loss"
        + (", use micro-batches of more than one example (JAX treats size-1 dimensions "
           "specially)" if tiny else "") + ", or use num_micro_batches=1")


# Primitives that draw random numbers of a requested shape.
_RANDOM_DRAWS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


class _Checker:
    """Classifies every tensor the loss depends on (IND/SIZED/UNIF/PER/TAIL) in one
    topological pass; PER and TAIL tensors carry their ratio r (see the module docstring)."""

    def __init__(self, micro: TracedStep, full: TracedStep, m: int,
                 statistics_per_micro_batch: bool = False):
        self.micro, self.full, self.m = micro, full, m
        self.local_statistics = statistics_per_micro_batch
        self.gm, self.gf = micro.graph, full.graph
        self.kind: dict[int, str] = {}
        self.ratio: dict[int, float] = {}
        self.dim = dict(batch_dims(self.gf))   # batch dim of PER (and UNIF) tensors
        self.zero: set[int] = set()            # IND tensors known to be all zeros
        self.origin: dict[int, Node] = {}      # SIZED tensor -> where the batch size came in
        for t in self.gf.inputs:
            if self.gf.tensors[t].role is Role.BATCH:
                self.kind[t], self.ratio[t] = PER, 1.0
            else:
                self.kind[t] = IND
        for t, vf in full.consts.items():
            vm = micro.consts.get(t)
            same = vm is not None and np.shape(vm) == np.shape(vf) and _same_value(vm, vf)
            self.kind[t] = IND if same else SIZED
        # A literal that differs between the traces (the 1/B of a mean) is rounded to its
        # dtype, so a ratio built from such literals is exact only up to their rounding
        # (x * (1/21) against x * (1/7) in float32 is 3 * (1 + 4e-8)).
        self.tol = _RTOL + sum(_eps(a) + _eps(b) for a, b in (
            (np.asarray(v), np.asarray(full.literals[k])) for k, v in micro.literals.items())
            if not _same_value(a, b))

    # -- helpers ----------------------------------------------------------------------------

    def close(self, a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=self.tol)

    def literal(self, node: Node, pos: int):
        return (np.asarray(self.micro.literals[(node.id, pos)]),
                np.asarray(self.full.literals[(node.id, pos)]))

    def literal_differs(self, node: Node) -> bool:
        return any(not _same_value(*self.literal(node, p))
                   for p, t in enumerate(node.inputs) if t is None)

    def is_zero(self, node: Node, pos: int) -> bool:
        t = node.inputs[pos]
        if t is None:
            a, b = self.literal(node, pos)
            return bool(np.all(a == 0) and np.all(b == 0))
        return t in self.zero

    def scaled_dim(self, t: int) -> int | None:
        """The one dimension whose size is m times larger in the full trace, if that is the
        only difference between the two shapes."""
        sm, sf = self.gm.tensors[t].shape, self.gf.tensors[t].shape
        diff = [d for d, (a, b) in enumerate(zip(sm, sf)) if a != b]
        if len(sm) == len(sf) and len(diff) == 1 and sf[diff[0]] == self.m * sm[diff[0]]:
            return diff[0]
        return None

    def factor(self, node: Node, pos: int) -> float:
        """How operand `pos` of a mul/div/dot_general scales r: its own r, the ratio of a
        literal that differs between the traces, or 1 for a batch-independent value."""
        t = node.inputs[pos]
        if t is not None:
            return self.ratio.get(t, 1.0)
        a, b = self.literal(node, pos)
        if _same_value(a, b):
            return 1.0
        a, b = float(a), float(b)
        if a == 0 or b == 0:
            raise PlanningError(f"{_op(node)} multiplies by {a} at the micro-batch size but by "
                                f"{b} at the full batch size; use num_micro_batches=1")
        return a / b

    def product_ratio(self, node: Node, statistics_constant: bool = False) -> float:
        """r of a product (or quotient); with `statistics_constant`, operands computed over
        the micro-batch count as constants (statistics per micro-batch)."""
        r = 1.0
        for pos, t in enumerate(node.inputs):
            if statistics_constant and t is not None and self.kind[t] in (TAIL, STAT):
                continue
            f = self.factor(node, pos)
            r = r / f if node.primitive == "div" and pos == 1 else r * f
        return r

    # -- the pass ---------------------------------------------------------------------------

    def run(self, outputs) -> float:
        """Classifies what `outputs` (the loss first) depend on; returns the loss's scale."""
        loss = self.gf.outputs[0]
        needed = set(outputs)
        nodes = []
        for node in reversed(self.gf.nodes):      # only what the loss depends on
            if any(t in needed for t in node.outputs):
                nodes.append(node)
                needed.update(t for t in node.inputs if t is not None)
        for node in reversed(nodes):
            kinds = {self.kind[t] for t in node.inputs if t is not None}
            if PER in kinds:
                self.per_node(node, kinds)
            elif TAIL in kinds or STAT in kinds:
                self.tail_node(node, kinds)
            else:
                self.const_node(node, kinds)
        return self.finish(loss)

    def finish(self, loss: int) -> float:
        kind = self.kind[loss]
        if kind == STAT:
            raise PlanningError(
                "the loss is a nonlinear function of statistics computed over the micro-batch "
                "(not a mean or sum of per-example terms), so micro-batch losses do not add "
                "up to it; use num_micro_batches=1")
        if self.gf.tensors[loss].shape != ():
            raise PlanningError(f"the loss has shape {self.gf.tensors[loss].shape}; it must be "
                                "a scalar to be split into micro-batches")
        if kind != TAIL:
            raise PlanningError(
                "the loss does not depend on the batch (no sum over examples reaches it), so "
                "micro-batching would count it num_micro_batches times; use "
                "num_micro_batches=1")
        r = self.ratio[loss]
        if self.close(r, self.m):
            return 1.0 / self.m
        if self.close(r, 1.0):
            return 1.0
        raise PlanningError(
            f"the loss is neither a mean nor a sum over examples: it is {r:g} times larger per "
            f"micro-batch than over the same examples in the full batch (a mean gives "
            f"{self.m}, a sum 1); make it a plain mean or sum over examples, or use "
            "num_micro_batches=1")

    def aux_rule(self, t: int, position: int) -> AuxRule:
        """How aux output `t` combines over micro-batches, and along which dimension."""
        kind, name = self.kind[t], f"aux output {position} of the loss function"
        if kind == IND:
            return AuxRule(Combine.SAME)
        if kind == TAIL:
            r = self.ratio[t]
            if self.close(r, self.m):
                return AuxRule(Combine.MEAN)
            if self.close(r, 1.0):
                return AuxRule(Combine.SUM)
            raise PlanningError(
                f"{name} is computed over the batch but is neither a mean nor a sum over "
                f"examples ({r:g} times larger per micro-batch than over the same examples in "
                "the full batch), so no combination of its micro-batch values equals it; "
                "return a plain mean or sum over examples, or use num_micro_batches=1")
        if kind == STAT:
            raise PlanningError(
                f"{name} is a statistic of each micro-batch (computed per micro-batch, as "
                "asked): the step has no single value for it. Return it as the new value of "
                "a loss argument of the same structure (BatchNorm's running averages), which "
                "each micro-batch then updates in turn, or use num_micro_batches=1")
        if kind == PER and self.close(self.ratio[t], 1.0) and self.scaled_dim(t) == self.dim[t]:
            return AuxRule(Combine.CONCAT, axis=self.dim[t])
        raise PlanningError(
            f"{name} depends on the batch size itself (its values change with how many "
            "examples a micro-batch holds), so its micro-batch values cannot be combined "
            "into the full batch's; compute it outside the loss function, or use "
            "num_micro_batches=1")

    def const_node(self, node: Node, kinds: set[str]) -> None:
        """No batch data in: the result is IND, unless the batch size leaks in."""
        shapes_same = all(self.gm.tensors[t].shape == self.gf.tensors[t].shape
                          for t in node.outputs)
        nm = self.gm.nodes[node.id]
        sized = (kinds & {SIZED, UNIF} or self.literal_differs(node) or not shapes_same
                 or repr(dict(nm.params)) != repr(dict(node.params)))
        if not sized:
            for t in node.outputs:
                self.kind[t] = IND
            if node.primitive in ("broadcast_in_dim", "convert_element_type", "copy", "copy_p",
                                  "reshape") and self.is_zero(node, 0):
                self.zero.update(node.outputs)
            return
        # A batch-shaped constant that is the same for every example (zeros_like(x), a
        # broadcast mask, an iota along another dimension) may meet per-example values.
        for t in node.outputs:
            d = self.scaled_dim(t)
            uniform = d is not None and not self.literal_differs(node) and (
                (node.primitive == "broadcast_in_dim" and kinds <= {IND})
                or (node.primitive == "iota" and node.params.get("dimension") != d)
                or (node.primitive in ELEMENTWISE and kinds <= {IND, UNIF}
                    and all(self.dim.get(i) == d for i in node.inputs
                            if i is not None and self.kind[i] is UNIF))
                or (kinds == {IND, UNIF} or kinds == {UNIF}) and self.keeps_uniform(node, t, d))
            self.kind[t] = UNIF if uniform else SIZED
            self.origin[t] = next((self.origin[i] for i in node.inputs
                                   if i is not None and i in self.origin), node)
            if uniform:
                self.dim[t] = d
                if node.primitive == "broadcast_in_dim" and self.is_zero(node, 0):
                    self.zero.add(t)

    def keeps_uniform(self, node: Node, t: int, d: int) -> bool:
        """Whether result `t` of a node reading uniform values (the same for every example)
        is uniform along its dimension `d`: the uniform operands' batch dimensions are one
        label, neither fixed nor reduced, that lands on `d` (position ids broadcast to the
        batch and looked up in a table stay the same for every example)."""
        labels = dim_labels(node.primitive, node.params,
                            [None if i is None else self.gf.tensors[i].shape
                             for i in node.inputs],
                            [self.gf.tensors[o].shape for o in node.outputs])
        if labels is None:
            return False
        found = set()
        for pos, i in enumerate(node.inputs):
            if i is None or self.kind[i] is not UNIF:
                continue
            if labels.operands[pos] is None:
                return False
            found.add(labels.operands[pos][self.dim[i]])
        if len(found) != 1:
            return False
        label = found.pop()
        out = labels.outputs[node.outputs.index(t)]
        return label not in labels.fixed and label in out and out.index(label) == d

    def per_node(self, node: Node, kinds: set[str]) -> None:
        """Some operand carries the batch: examples must stay apart, or be summed over."""
        op, prim = _op(node), node.primitive
        if kinds & {TAIL, STAT} and not self.local_statistics:
            raise PlanningError(
                f"{op} combines per-example values with a value computed over the "
                "whole batch (batch statistics, e.g. batch norm's mean and variance): each "
                "micro-batch would use its own statistics and the result would change; "
                + _FIX_STAT)
        if SIZED in kinds:
            raise PlanningError(self.sized_message(node))
        labels = dim_labels(prim, node.params,
                            [None if t is None else self.gf.tensors[t].shape for t in node.inputs],
                            [self.gf.tensors[t].shape for t in node.outputs])
        if labels is None:
            raise PlanningError(
                f"alpa_lite cannot tell how {op} treats the batch dimension, so it "
                "cannot prove that micro-batching leaves the loss unchanged; use "
                "num_micro_batches=1, or write this part without it")
        batch_labels = set()
        for pos, t in enumerate(node.inputs):
            if t is None or self.kind[t] not in (PER, UNIF):
                continue
            lab = labels.operands[pos]
            if lab is None:
                raise PlanningError(
                    f"alpa_lite cannot follow the batch dimension through operand {pos} of {op}; "
                    "use num_micro_batches=1")
            batch_labels.add(lab[self.dim[t]])
        if len(batch_labels) != 1:
            raise PlanningError(
                f"{op} pairs examples with other examples (two operands' batch "
                "dimensions meet different dimensions, e.g. an outer product over the batch); "
                "micro-batching would drop the pairs across micro-batches; use "
                "num_micro_batches=1")
        label = batch_labels.pop()
        if label in labels.fixed:
            raise PlanningError(
                f"{op} works along the batch dimension (a cumulative op, sort, slice, "
                "argmax, concatenation, padding or window across examples): with micro-batches "
                "it would see only part of the batch and compute something else; use "
                "num_micro_batches=1, or apply it along another dimension / per fixed-size "
                "group")
        outs = [k for k, lab in enumerate(labels.outputs) if label in lab]
        if not outs:
            self.batch_reduction(node)
            return
        if prim in CONTROL_FLOW:
            # A loop or branch whose body keeps examples apart (its rule leaves the batch
            # label free): a result without the batch took nothing from the examples (that
            # would have reduced, and so fixed, the label), unless the body's constants
            # differ with the batch size.
            if _body_literals(self.gm.nodes[node.id].params) != _body_literals(node.params):
                raise PlanningError(self.sized_message(node))
            for k, t in enumerate(node.outputs):
                if k not in outs and self.gm.tensors[t].shape == self.gf.tensors[t].shape:
                    self.kind[t] = IND
        if any(k not in outs and self.kind.get(t) is not IND
               for k, t in enumerate(node.outputs)):
            raise PlanningError(f"alpa_lite cannot follow the batch dimension through {op}; "
                                "use num_micro_batches=1")
        r = 1.0 if prim in CONTROL_FLOW and all(self.close(self.ratio[t], 1.0) for t in
                                                node.inputs if t is not None and
                                                self.kind[t] is PER) else self.per_ratio(node)
        for k, t in enumerate(node.outputs):
            if k not in outs:
                continue
            d = labels.outputs[k].index(label)
            if self.dim.get(t) != d or self.scaled_dim(t) != d:
                raise PlanningError(
                    f"{op} turns the batch dimension into a dimension whose size does "
                    f"not grow with the batch (shape {self.gm.tensors[t].shape} per micro-batch, "
                    f"{self.gf.tensors[t].shape} for the full batch, e.g. a split into a fixed "
                    "number of groups): its groups would hold different examples at the two "
                    "batch sizes; use groups of a fixed size, or num_micro_batches=1")
            self.kind[t], self.ratio[t] = PER, r

    def batch_reduction(self, node: Node) -> None:
        """The batch label is in no result: only a sum over examples splits exactly."""
        if node.primitive not in ("reduce_sum", "dot_general"):
            if not (node.primitive.startswith("reduce_") or node.primitive in ("argmax", "argmin")):
                raise PlanningError(
                    f"{_op(node)} merges the batch dimension into another "
                    "one (e.g. a reshape of (T, B) to (T * B)), so alpa_lite cannot follow the "
                    "examples through it; keep the batch dimension leading, or use "
                    "num_micro_batches=1")
            raise PlanningError(
                f"{_op(node)} computes {node.primitive} over the batch dimension: with "
                "micro-batches it would see only part of the batch, and combining the "
                "micro-batch results by a sum would change what it computes. Only sums and "
                "means over examples can be split; use num_micro_batches=1, or "
                "compute it per example / per fixed-size group")
        r = self.product_ratio(node)
        for t in node.outputs:
            if self.gm.tensors[t].shape != self.gf.tensors[t].shape:
                raise PlanningError(f"alpa_lite cannot follow the batch dimension through "
                                    f"{_op(node)}; use num_micro_batches=1")
            self.kind[t], self.ratio[t] = TAIL, r

    def per_ratio(self, node: Node) -> float:
        """r of a per-example result. Products and quotients of per-example values multiply
        their r (exact for each example); anything else needs r == 1, or is linear."""
        prim, op = node.primitive, _op(node)
        if prim in ("mul", "div", "dot_general"):
            return self.product_ratio(node, statistics_constant=self.local_statistics)
        if self.literal_differs(node):
            raise PlanningError(self.sized_message(node))
        dep = [(p, t) for p, t in enumerate(node.inputs)
               if t is not None and self.kind[t] is PER]
        rs = [self.ratio[t] for _, t in dep]
        if all(self.close(r, 1.0) for r in rs):
            return 1.0
        if prim == "integer_pow":
            return rs[0] ** node.params["y"]
        if prim == "square":
            return rs[0] ** 2
        if prim in _ADD:
            others = [p for p, t in enumerate(node.inputs) if t is None or self.kind[t] is not PER]
            if all(self.close(r, rs[0]) for r in rs) and all(self.is_zero(node, p) for p in others):
                return rs[0]
            raise PlanningError(
                f"{op} adds per-example values that depend on the batch size in "
                "different ways (e.g. one divided by the batch size and one not, or a constant "
                "added to x / batch_size); divide by the batch size after the sum over "
                "examples (a plain mean), or use num_micro_batches=1")
        float_out = all(jnp.issubdtype(as_dtype(self.gf.tensors[t].dtype), jnp.inexact)
                        for t in node.outputs)
        if prim in _LINEAR and float_out and dep[0][0] == 0 and all(
                self.close(self.ratio[t], 1.0) for p, t in dep[1:]) and (
                prim != "pad" or self.is_zero(node, 1)):
            return rs[0]
        raise PlanningError(
            f"{op} is applied to a per-example value that was scaled by a constant "
            "that depends on the batch size (e.g. x / batch_size before a nonlinearity), so "
            "it computes something else per micro-batch; divide by the batch size after the "
            "sum over examples (a plain mean), or use num_micro_batches=1")

    def tail_node(self, node: Node, kinds: set[str]) -> None:
        """Computed from a sum over the batch: must stay linear in it up to the loss. With
        statistics per micro-batch, anything else is a statistic of the micro-batch (STAT),
        which per-example values may use but the loss may not be."""
        if self.local_statistics and SIZED not in kinds:
            try:
                if STAT in kinds:
                    raise PlanningError("a statistic of the micro-batch")
                self.linear_tail(node, kinds)
            except PlanningError:
                for t in node.outputs:
                    self.kind[t] = STAT
            return
        self.linear_tail(node, kinds)

    def linear_tail(self, node: Node, kinds: set[str]) -> None:
        """The strict rule of `tail_node`."""
        op, prim = _op(node), node.primitive
        if UNIF in kinds:
            raise PlanningError(
                f"{op} combines a value computed over the whole batch with a "
                "batch-shaped tensor (batch statistics); " + _FIX_STAT)
        if SIZED in kinds:
            raise PlanningError(self.sized_message(node))
        tails = [p for p, t in enumerate(node.inputs) if t is not None and self.kind[t] is TAIL]
        rs = [self.ratio[node.inputs[p]] for p in tails]
        others = [p for p in range(len(node.inputs)) if p not in tails]
        nonlinear = PlanningError(
            f"a value computed over the whole batch (a sum or mean over examples) feeds {op}, "
            "which is not linear in it (e.g. a masked mean sum(l * mask) / "
            "sum(mask), a division by a batch statistic, or a nonlinearity of a mean): the "
            "sum of the micro-batch results would differ from the full-batch result. Make the "
            "loss a plain mean or sum over examples (divide by a fixed count), compute the "
            "statistic per example / per fixed-size group, or use num_micro_batches=1")
        if prim in ("mul", "dot_general") and len(tails) == 1:
            r = self.product_ratio(node)
        elif prim == "div" and tails == [0]:
            r = self.product_ratio(node)
        elif prim in _ADD:
            if not all(self.close(r, rs[0]) for r in rs):
                raise PlanningError(
                    f"{op} adds terms that scale differently with the batch size "
                    "(e.g. a mean over examples and a sum over examples): no single scale of "
                    "the micro-batch results reproduces both; make every term a mean (or every "
                    "term a sum) over examples, or use num_micro_batches=1")
            if self.literal_differs(node):
                raise PlanningError(self.sized_message(node))
            r = rs[0]
            if not all(self.is_zero(node, p) for p in others) and not self.close(r, self.m):
                raise PlanningError(
                    f"{op} adds a batch-independent term (e.g. a weight penalty) to "
                    "a sum over examples: summing the micro-batch losses would count that "
                    f"term {self.m} times. Use a mean over examples for the data term (then "
                    "the term is counted once), or use num_micro_batches=1")
        elif prim in _TAIL_LINEAR and tails == [0] and not self.literal_differs(node) and all(
                jnp.issubdtype(as_dtype(self.gf.tensors[t].dtype), jnp.inexact)
                for t in node.outputs):
            r = rs[0]
        else:
            raise nonlinear
        for t in node.outputs:
            if self.gm.tensors[t].shape != self.gf.tensors[t].shape:
                raise PlanningError(
                    f"{op} spreads a value computed over the whole batch along the "
                    "batch (batch statistics); " + _FIX_STAT)
            self.kind[t], self.ratio[t] = TAIL, r

    def sized_message(self, node: Node) -> str:
        src = next((self.origin[t] for t in node.inputs
                    if t is not None and self.kind[t] is SIZED and t in self.origin), None)
        came = f", computed from {_op(src)}" if src is not None and src is not node else ""
        if src is not None and src.primitive in _RANDOM_DRAWS:
            # Random numbers of the batch's shape (a dropout mask) are drawn once for the
            # whole batch; a micro-batch drawing its own from the same key gets others.
            return (f"{_op(node)} uses random numbers drawn for the whole batch at once "
                    f"({_op(src)}, e.g. a dropout mask): a micro-batch drawing its own "
                    "would get different ones, so a micro-batched plan cannot reproduce the "
                    "step. Use a plan without micro-batches (al.DataParallel(), al.Auto(), "
                    "al.Manual with num_micro_batches=1: they draw exactly as jax.jit does), "
                    "or draw per example (jax.random.fold_in(key, example_index))")
        return (f"{_op(node)} uses a value that depends on the batch size"
                f"{came} (e.g. jnp.arange(batch_size), or x.shape[0] used other than as the "
                "divisor of a mean): a micro-batch would see a different value; compute it "
                "from a fixed size instead, or use num_micro_batches=1")
