"""Which dimension of each tensor carries the batch, followed from the batch inputs through
every operator's dimension labels."""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import OpGraph, Role
from alpa_lite.ir.op_rules import node_labels


class Combine(enum.Enum):
    """How the values one output takes on the micro-batches of a step make its value for the
    whole batch (`ir.microbatch` proves which one is exact; the plan keeps the choice as
    `plan.plan.Combine`, the same values)."""
    SAME = "same"          # every micro-batch computes the same value (a new key, a count)
    MEAN = "mean"          # a mean over examples: the mean of the micro-batch values
    SUM = "sum"            # a sum over examples: their sum
    CONCAT = "concat"      # one entry per example: concatenated along the batch dimension
    LAST = "last"          # a running value (BatchNorm's averages): each micro-batch reads
                           # the previous one's, the step returns the last micro-batch's


@dataclasses.dataclass(frozen=True)
class AuxRule:
    """How one aux output of the loss combines over micro-batches: `axis` is the batch
    dimension for CONCAT; `updates` (LAST) the loss operand (array leaf position) it is
    the new value of."""
    combine: Combine
    axis: int = 0
    updates: int | None = None


def batch_size(leaves: Mapping[str, tuple[int, ...]]) -> int | None:
    """The batch size the batch leaves (name -> shape) agree on: their common leading
    dimension. None without leaves.

    Raises:
      PlanningError: a leaf is a scalar, or the leaves' leading dimensions differ (a mask
        or a table passed with the batch), naming them.
    """
    if not leaves:
        return None
    for name, shape in leaves.items():
        if not shape:
            raise PlanningError(
                f"batch leaf {name} is a scalar; every leaf of the batch argument needs the "
                "batch as its leading dimension (pass other values in another argument, "
                "outside batch_argnums)")
    sizes: dict[int, list[str]] = {}
    for name, shape in leaves.items():
        sizes.setdefault(shape[0], []).append(name)
    if len(sizes) > 1:
        groups = [f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} with {k}"
                  for k, names in sorted(sizes.items(), key=lambda kv: -len(kv[1]))]
        raise PlanningError(
            f"the batch leaves disagree on the batch size (leading dimension): "
            f"{'; '.join(groups)}. Every leaf of the batch argument needs the batch as its "
            "leading dimension: pass a mask, a table or a key in another argument, outside "
            "batch_argnums")
    return next(iter(sizes))


def batch_dims(graph: OpGraph, seeds: Mapping[int, int | None] | None = None) -> dict[int, int]:
    """For each tensor that carries the batch, which dimension it is (the leading dimension
    of the batch inputs, or `seeds[t]` where given, followed through every operator's
    dimension labels)."""
    seeds = seeds or {}
    found: dict[int, int] = {}
    for t in graph.tensors_with_role(Role.BATCH):
        d = seeds.get(t.id, 0)
        if t.shape and d is not None:
            found[t.id] = d
    for node, labels in zip(graph.nodes, node_labels(graph)):
        if labels is None:
            continue
        label = next((labels.operands[p][found[t]] for p, t in enumerate(node.inputs)
                      if t in found and labels.operands[p] is not None), None)
        if label is None:
            continue
        for t, lab in zip(node.outputs, labels.outputs):
            if label in lab:
                found[t] = lab.index(label)
    return found
