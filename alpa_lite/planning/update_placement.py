"""Where a pipelined step's optimizer update runs, and where each step input lives.

After the last backward, the rest of the step (every operator but the gradient call: the
optimizer update, a global gradient norm, a step counter) runs once. `place_update`
decides for the Plan (`PipelineSpec.update_stages`, `PipelineSpec.inputs`):

- a parameter lives on the first stage that reads it (later readers get copies), sharded
  as that stage's plan has it; its gradient is summed there;
- each update operator runs on the stage holding its largest operand (ties: the earlier
  stage), so tensors stay where they are and only small values (a norm, a step count)
  move; an operator reading only step inputs not placed yet runs with its first reader;
- a batch leaf lives with its first reader, split as that stage reads micro-batches;
- any other input (optimizer state, a step count) lives where the operator that replaces
  it runs (else with its first reader), sharded like the parameter it is updated with.
  "Updated with" follows the update's data flow, not names: the same-shaped operands and
  results of element-wise operators are joined (Adam's `b1 * mu + (1 - b1) * g` joins `mu`
  to the gradient, the gradient to its parameter), and an input joined to a parameter
  on the same stage takes that parameter's spec; anything else is whole on its stage.
"""

from __future__ import annotations

from typing import Sequence

from alpa_lite.ir.op_rules import ELEMENTWISE
from alpa_lite.ir.step_parts import StageProgram, StepParts, param_homes
from alpa_lite.plan import InputPlacement, StagePlan
from alpa_lite.plan.sharding import TensorSpec

# Operators that keep a value's shape and meaning (joined like element-wise ones).
_SAME_VALUE = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def place_update(parts: StepParts, progs: Sequence[StageProgram],
                 stages: Sequence[StagePlan]) -> tuple[tuple[int, ...],
                                                       tuple[InputPlacement, ...]]:
    """(the stage of each update operator, in `parts.apply_nodes` order; the placement of
    each step input, in the outer graph's input order). See the module docstring."""
    outer, fwd = parts.outer.graph, parts.forward.graph
    S = len(progs)
    phome = param_homes(progs)
    # A differentiated parameter the loss never reads (its gradient is zero) lives on
    # the first stage.
    for k in parts.call.grad_leaves:
        phome.setdefault(fwd.inputs[k], 0)
    maker = {t: s for s, prog in enumerate(progs) for t in prog.outputs}
    grad_node = outer.nodes[parts.grad_node]
    fwd_of = {t_o: t_f for t_f, t_o in zip(fwd.inputs, grad_node.inputs) if t_o is not None}

    home: dict[int, int] = {}
    for k, t in enumerate(parts.grad_outputs()):
        home[t] = phome[fwd.inputs[parts.call.grad_leaves[k]]]
    home[parts.value_output()] = maker[fwd.outputs[0]]
    for t_o, t_f in fwd_of.items():
        if t_f in phome:
            home[t_o] = phome[t_f]
    node_home: dict[int, int] = {}
    deferred = []
    for nid in parts.apply_nodes:
        node = outer.nodes[nid]
        placed = [(outer.tensors[t].nbytes, -home[t]) for t in node.inputs
                  if t is not None and t in home]
        if placed:
            node_home[nid] = -max(placed)[1]
            for t in node.outputs:
                home[t] = node_home[nid]
        else:
            deferred.append(nid)
    for nid in reversed(deferred):
        node = outer.nodes[nid]
        readers = [node_home[c] for t in node.outputs for c in outer.consumers(t)
                   if c in node_home]
        node_home[nid] = min(readers) if readers else S - 1
        for t in node.outputs:
            home[t] = node_home[nid]

    param_of = _params_joined(parts)
    first_reader = {}
    for s, prog in enumerate(progs):
        for t in prog.acts:
            first_reader.setdefault(t, s)
    input_pos = {t: k for k, t in reversed(list(enumerate(fwd.inputs)))}
    tied_to: dict[int, int] = {}         # input position -> the first output tied to it
    for o, tie in zip(outer.outputs, outer.output_ties):
        if tie is not None:
            tied_to.setdefault(tie, o)
    placements = []
    for pos, t in enumerate(outer.inputs):
        t_f = fwd_of.get(t)
        if t_f in phome:                       # a parameter
            s = phome[t_f]
            placements.append(InputPlacement(s, _param_spec(progs[s], stages[s], t_f,
                                                            len(fwd.tensors[t_f].shape))))
            continue
        if t_f is not None and t_f in first_reader and \
                parts.batch_inputs[input_pos[t_f]]:     # a batch leaf
            s = first_reader[t_f]
            prog = progs[s]
            spec = dict(zip(prog.fb.graph.inputs, stages[s].input_specs))
            placements.append(InputPlacement(s, spec[prog.fb_acts[prog.acts.index(t_f)]]))
            continue
        tied = tied_to.get(pos)
        if tied is not None and outer.producer(tied) in node_home:
            s = node_home[outer.producer(tied)]
        else:
            readers = [node_home[c] for c in outer.consumers(t) if c in node_home]
            s = min(readers) if readers else 0
        p = param_of.get(t)
        if p is not None and phome[p] == s and \
                tuple(fwd.tensors[p].shape) == tuple(outer.tensors[t].shape):
            spec = _param_spec(progs[s], stages[s], p, len(fwd.tensors[p].shape))
        else:
            spec = TensorSpec.replicated(len(outer.tensors[t].shape))
        placements.append(InputPlacement(s, spec))
    return tuple(node_home[n] for n in parts.apply_nodes), tuple(placements)


def _param_spec(prog: StageProgram, stage: StagePlan, t_fwd: int, rank: int) -> TensorSpec:
    if t_fwd not in prog.params:     # a parameter the loss never reads
        return TensorSpec.replicated(rank)
    spec = dict(zip(prog.fb.graph.inputs, stage.input_specs))
    return spec[prog.fb_params[prog.params.index(t_fwd)]]


def _params_joined(parts: StepParts) -> dict[int, int]:
    """Outer step input -> the forward parameter its update joins it to (module
    docstring); where several are joined, the first in gradient order."""
    outer, fwd = parts.outer.graph, parts.forward.graph
    parent: dict[int, int] = {}

    def find(t: int) -> int:
        while parent.get(t, t) != t:
            parent[t] = parent.get(parent[t], parent[t])
            t = parent[t]
        return t

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for nid in parts.apply_nodes:
        node = outer.nodes[nid]
        if node.primitive not in ELEMENTWISE and node.primitive not in _SAME_VALUE:
            continue
        for out in node.outputs:
            shape = outer.tensors[out].shape
            if not shape:
                continue
            for t in node.inputs:
                if t is not None and outer.tensors[t].shape == shape:
                    union(out, t)
    grad_node = outer.nodes[parts.grad_node]
    # A parameter's step input and its gradient belong together.
    by_root: dict[int, int] = {}
    for k, g in enumerate(parts.grad_outputs()):
        pos = parts.call.grad_leaves[k]
        t_o, t_f = grad_node.inputs[pos], fwd.inputs[pos]
        for t in (g, t_o):
            if t is not None:
                by_root.setdefault(find(t), t_f)
    return {t: by_root[find(t)] for t in outer.inputs if find(t) in by_root}
