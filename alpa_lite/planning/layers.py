"""Layers: where the loss function's forward graph is cut for the stage DP.

The user's `al.mark_layer_boundary` calls when there are any, else the layer clustering of
`solvers.layer_clustering`, at the layer count with the most layers per distinct layer shape.
"""

from __future__ import annotations

import weakref

from alpa_lite.errors import PlanningError
from alpa_lite.ir.graph import OpGraph, per_graph
from alpa_lite.ir.step_parts import structure_hash
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.solvers.layer_clustering import (
    ClusteringError,
    ClusteringProblem,
    cluster_layers,
    thin_layer_counts,
)


@per_graph
def clustering_problem(forward: OpGraph):
    """The forward graph as the layer clustering sees it: FLOPs per node, and per activation
    its producer, its last reader and its size."""
    last: dict[int, int] = {}
    for node in forward.nodes:
        for t in node.inputs:
            if t is not None:
                last[t] = node.id
    tensors = []
    for node in forward.nodes:
        for t in node.outputs:
            if t in last and last[t] > node.id:
                tensors.append((node.id, last[t], float(forward.tensors[t].nbytes)))
    return ClusteringProblem(flops=tuple(n.flops for n in forward.nodes), tensors=tuple(tensors))


# Per forward graph: layer starts by (num_layers, min_layers, eps), and each clustering
# `_fewest_structures` weighed with its count of layer structures by ("cut", L, eps): the
# searches ask for layers at several minimum counts (one per pipeline depth weighed), and
# their windows of counts overlap.
_LAYERS: "weakref.WeakKeyDictionary[OpGraph, dict[tuple, tuple]]" = \
    weakref.WeakKeyDictionary()


def forward_layers(forward: TracedStep, num_layers: int | None = None,
                   min_layers: int = 1, eps: float = 0.1) -> tuple[int, ...]:
    """The first forward node of each layer: the user's `al.mark_layer_boundary` calls when
    there are any, else the layer clustering (`num_layers` layers, or chosen from
    `min_layers` ... 64 when None). Remembered per forward graph: a search plans many
    candidates of one split of the step."""
    known = _LAYERS.setdefault(forward.graph, {})
    key = (num_layers, min_layers, eps)
    if key not in known:
        known[key] = _forward_layers(forward, num_layers, min_layers, eps)
    return known[key]


def _forward_layers(forward: TracedStep, num_layers: int | None, min_layers: int,
                    eps: float) -> tuple[int, ...]:
    n = len(forward.graph.nodes)
    if forward.boundaries:
        starts = (0,) + tuple(b for b in forward.boundaries if 0 < b < n)
        if num_layers is not None and len(starts) != num_layers:
            raise PlanningError(f"the loss function marks {len(starts)} layers with "
                                f"al.mark_layer_boundary, but {num_layers} were asked for")
        return starts
    problem = clustering_problem(forward.graph)
    try:
        if num_layers is not None:
            return _cluster_relaxed(problem, num_layers, eps)
        top = max(min_layers, min(n, 64))
        try:
            counts = thin_layer_counts(problem, range(min_layers, top + 1), eps)
        except ClusteringError:
            # No L >= min_layers balances within eps (one operator, e.g. a language-model
            # head, outweighs a layer's share): take min_layers, as balanced as it gets.
            return _cluster_relaxed(problem, min_layers, eps)
        return _fewest_structures(forward, problem, counts, eps)
    except ClusteringError as e:
        raise PlanningError(f"cannot cut the loss function into layers: {e}") from None


def _fewest_structures(forward: TracedStep, problem, counts, eps: float) -> tuple[int, ...]:
    """Of the layer counts that cut only where the model is thin, the clustering with the
    most layers per distinct layer shape (`structure_hash`); ties go to more layers.

    The planner solves one intra-op problem per distinct layer and logical mesh, and the
    stage DP gains freedom with every layer: cutting a 32-block transformer into 33 layers
    (3 shapes: first, block, last) serves both, where 36 uneven layers (6 shapes) would plan
    twice as slowly and 2 layers would leave the DP nothing to choose.
    """
    n = len(forward.graph.nodes)
    known = _LAYERS.setdefault(forward.graph, {})
    best, best_score = None, None
    for L in counts[:_MAX_LAYER_COUNTS_TRIED]:
        if ("cut", L, eps) not in known:
            starts = cluster_layers(problem, L, eps).boundaries
            ends = list(starts[1:]) + [n]
            known[("cut", L, eps)] = (
                starts, len({structure_hash(forward, a, b) for a, b in zip(starts, ends)}))
        starts, kinds = known[("cut", L, eps)]
        score = (L / kinds, L)
        if best is None or score > best_score:
            best, best_score = starts, score
    return best


# Layer counts `_fewest_structures` examines (hashing every layer of one clustering is a
# pass over the forward graph).
_MAX_LAYER_COUNTS_TRIED = 16


def _cluster_relaxed(problem, num_layers: int, eps: float) -> tuple[int, ...]:
    """`num_layers` layers within eps of balance if possible, else with the smallest eps
    that admits any clustering (the balance is a preference, the layer count is not)."""
    try:
        return cluster_layers(problem, num_layers, eps).boundaries
    except ClusteringError as e:
        if e.min_eps is None:
            raise
        return cluster_layers(problem, num_layers, e.min_eps * (1 + 1e-6) + 1e-9).boundaries
