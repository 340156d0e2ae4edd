"""Groups: light operators follow a neighbour and share its ILP variable.

Only heavy units (matmuls, convolutions, gathers, scatters, parameters, inputs read more than
once) own an ILP variable. A light unit follows one neighbour: an element-wise op, reduction,
reshape or broadcast follows its largest operand (real data before a broadcast); a unit with
no tensor operand to follow (iota, a literal broadcast, an input read once) follows its only
consumer. For each strategy of its group, a follower copies its neighbour's spec where it can
and otherwise takes its cheapest strategy, and any reshard this forces is charged to the
group. `repeated_group_classes` then finds the groups that play the same part in repeated
layers, so they can share one choice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from alpa_lite.ir.graph import OpGraph, Role
from alpa_lite.plan.sharding import TensorSpec
from alpa_lite.planning.strategies import BROADCASTS, HEAVY, Strategy, Units, reshard_cost


@dataclasses.dataclass
class Group:
    leader: int
    members: list[int]
    # choice[member][s] = the member's strategy index under group strategy s
    choice: dict[int, list[int]]
    cost: np.ndarray      # per group strategy, seconds


def follow_targets(graph: OpGraph, units: Units) -> dict[int, tuple[str, int, int]]:
    """For each light unit, whom it follows: ("fwd", producer unit, operand pos) or
    ("bwd", consumer unit, operand pos of the consumer that reads it)."""
    follow: dict[int, tuple[str, int, int]] = {}
    off = units.offset
    source_like: set[int] = set()
    # Inputs read by exactly one node (not parameters) follow that node.
    for tid, u in units.unit_of_source.items():
        t = graph.tensors[tid]
        cons = graph.consumers(tid)
        if t.role in (Role.BATCH, Role.OPT_STATE) and len(cons) == 1 \
                and len(units.strategies[u]) > 1:
            source_like.add(u)
    for node in graph.nodes:
        u = off + node.id
        if node.primitive in HEAVY or len(units.strategies[u]) == 1:
            continue
        best = None
        for pos, tid in enumerate(node.inputs):
            if tid is None or units.strategies[u][0].in_specs[pos] is None:
                continue
            pu = units.producer_unit(tid)
            if pu in source_like:
                continue
            # Follow real data over a broadcast of something smaller: an element-wise op
            # of an activation and a broadcast scalar should take the activation's spec.
            prod = graph.producer(tid)
            broadcast = prod is not None and graph.nodes[prod].primitive in BROADCASTS
            key = (not broadcast, graph.tensors[tid].size)
            if best is None or key > best[0]:
                best = (key, pu, pos)
        if best is not None:
            follow[u] = ("fwd", best[1], best[2])
        else:
            source_like.add(u)
    # Source-like units follow their only consumer, if they have exactly one.
    for u in sorted(source_like, reverse=True):
        outs = [units.source_tensors[u]] if u < off else list(graph.nodes[u - off].outputs)
        readers = [(c, pos) for tid in outs for c in graph.consumers(tid)
                   for pos, x in enumerate(graph.nodes[c].inputs) if x == tid]
        readers = list(dict.fromkeys(readers))
        if len(readers) == 1 and len(outs) == 1:
            follow[u] = ("bwd", off + readers[0][0], readers[0][1])
    return follow


def build_groups(graph: OpGraph, units: Units, follow, cache) -> tuple[list[Group], dict[int, int]]:
    off = units.offset
    group_of: dict[int, int] = {}
    groups: list[Group] = []
    n_units = len(units.strategies)
    for u in range(n_units):
        if u not in follow:
            group_of[u] = len(groups)
            n = len(units.strategies[u])
            groups.append(Group(u, [u], {u: list(range(n))},
                                 np.array([s.cost_s for s in units.strategies[u]])))

    # attach's result by everything it depends on: repeated layers attach the same
    # follower to the same target under the same group choices, once per layer.
    attached: dict[tuple, tuple[list[int], np.ndarray]] = {}

    def attach(u: int, target: int, pick, link: tuple) -> None:
        g = groups[group_of[target]]
        target_choice = np.asarray(g.choice[target], dtype=np.int64)
        key = (link, id(units.strategies[u]), id(units.strategies[target]),
               target_choice.tobytes())
        if key not in attached:
            # The follower's choice depends only on the target's strategy: pick once per
            # strategy the group uses, then spread over the group's strategies.
            n = len(units.strategies[target])
            idx_of = np.zeros(n, dtype=np.int64)
            cost_of = np.zeros(n)
            for ts in np.unique(target_choice).tolist():
                idx, extra = pick(ts)
                idx_of[ts] = idx
                cost_of[ts] = units.strategies[u][idx].cost_s + extra
            attached[key] = (idx_of[target_choice].tolist(), cost_of[target_choice])
        choice, cost = attached[key]
        g.cost += cost
        g.members.append(u)
        g.choice[u] = list(choice)
        group_of[u] = group_of[target]

    def resolved(target: int) -> bool:
        return target in group_of

    shared_memo: dict[tuple, tuple[int, float]] = {}

    # Forward followers in program order, then backward followers from the end; a chain
    # whose target is not resolved yet is retried, and anything left becomes a leader.
    pending = sorted(follow)
    for _ in range(4):
        progress, rest = False, []
        fwd = [u for u in pending if follow[u][0] == "fwd"]
        bwd = sorted((u for u in pending if follow[u][0] == "bwd"), reverse=True)
        for u in fwd + bwd:
            kind, target, pos = follow[u]
            if not resolved(target):
                rest.append(u)
                continue
            if kind == "fwd":   # u reads `target`'s result through its operand `pos`
                tid = graph.nodes[u - off].inputs[pos]
                k = units.out_index(target, tid)
                mine = lambda st, pos=pos: st.in_specs[pos]
                theirs = lambda ts, target=target, k=k: units.strategies[target][ts].out_specs[k]
            else:               # `target` reads u's result through its operand `pos`
                tid = graph.nodes[target - off].inputs[pos]
                k = units.out_index(u, tid)
                mine = lambda st, k=k: st.out_specs[k]
                theirs = lambda ts, target=target, pos=pos: units.strategies[target][ts].in_specs[pos]
            t = graph.tensors[tid]

            def pick(ts, u=u, t=t, kind=kind, mine=mine, theirs=theirs, slot=(pos, k),
                     memo={}):
                if ts not in memo:
                    spec = theirs(ts)
                    key = (kind, id(units.strategies[u]), slot, spec, t.shape, t.dtype)
                    if key not in shared_memo:
                        if kind == "fwd":
                            cost = lambda st: reshard_cost(units, t, spec, mine(st), cache)
                        else:
                            cost = lambda st: reshard_cost(units, t, mine(st), spec, cache)
                        shared_memo[key] = _follow_choice(units.strategies[u], mine, spec, cost)
                    memo[ts] = shared_memo[key]
                return memo[ts]
            attach(u, target, pick, (kind, pos, k, t.shape, t.dtype))
            progress = True
        pending = rest
        if not pending or not progress:
            break
    for u in pending:
        group_of[u] = len(groups)
        n = len(units.strategies[u])
        groups.append(Group(u, [u], {u: list(range(n))},
                             np.array([s.cost_s for s in units.strategies[u]])))
        follow.pop(u)
    return groups, group_of


def _follow_choice(strategies: Sequence[Strategy], spec_of: Callable[[Strategy], TensorSpec],
                   target: TensorSpec | None, reshard: Callable[[Strategy], float]
                   ) -> tuple[int, float]:
    """A follower's strategy given its neighbour's spec on the link between them.

    It takes the neighbour's spec as it is when it can (the least extra splitting among
    those, then the cheapest); only when no strategy matches does it take the one with the
    least own cost + reshard cost. Copying the spec, rather than picking the locally
    cheapest, keeps a group's strategies the leader's: a follower that split further just
    because slicing is free would push reshards onto edges it cannot see.
    """
    # Compared on dims (tuples compare in C; this runs for every follower and strategy).
    if target is None:
        exact = [i for i, st in enumerate(strategies) if spec_of(st) is None]
    else:
        exact = [i for i, st in enumerate(strategies)
                 if (spec := spec_of(st)) is not None and spec.dims == target.dims]
    if exact:
        best = min(exact, key=lambda i: (strategies[i].work_shards,
                                         round(strategies[i].cost_s, 15), i))
        return best, 0.0
    best, best_key, best_extra = 0, None, 0.0
    for i, st in enumerate(strategies):
        extra = reshard(st)
        key = (round(st.cost_s + extra, 15), st.work_shards, i)
        if best_key is None or key < best_key:
            best, best_key, best_extra = i, key, extra
    return best, best_extra


class StrategyNumbers:
    """Numbers strategy lists by content (`group_signature`), each list read once."""

    def __init__(self):
        self.by_id: dict[int, int] = {}
        self.by_content: dict[tuple, int] = {}

    def __call__(self, strategies: Sequence[Strategy]) -> int:
        key = id(strategies)      # the lists live in `Units` for the whole call
        if key not in self.by_id:
            content = tuple((st.in_specs, st.out_specs, st.collectives, st.work_shards,
                             st.compute_s) for st in strategies)
            self.by_id[key] = self.by_content.setdefault(content, len(self.by_content))
        return self.by_id[key]


def group_signature(graph: OpGraph, units: Units, g: Group,
                    numbers: StrategyNumbers | None = None) -> tuple:
    """What a group is, for `repeated_group_classes`: its members' strategies, by content,
    and the strategy each takes under each group strategy.

    By content, not by the strategy lists' identity: `Units` shares one list between
    operators of one structural key only, and the key holds an operator's static
    parameters, so operators that shard alike can have lists of their own. A repeated
    layer's slice of a stacked per-layer array (Hugging Face BERT's `head_mask[i]`) has
    the layer's index among its parameters; judged by identity, that one slice made every
    group within a few hops of it unlike its neighbour layer's, and BERT-base on a 2x4
    mesh kept 474 of 591 groups apart instead of 187."""
    numbers = StrategyNumbers() if numbers is None else numbers
    sig = []
    for u in g.members:
        if u < units.offset:
            t = graph.tensors[units.source_tensors[u]]
            sig.append((t.shape, t.dtype, t.role.value, numbers(units.strategies[u])))
        else:
            sig.append(numbers(units.strategies[u]))
    return (tuple(sig), tuple(g.choice[u] for u in g.members))


def repeated_group_classes(graph: OpGraph, units: Units, groups: list[Group],
                            edges: dict[tuple[int, int], np.ndarray], rounds: int = 4
                            ) -> list[int]:
    """Classes of groups that play the same part in repeated layers.

    A model's repeated blocks (transformer layers, residual blocks) yield groups with the
    same operators, strategies and costs. Refining "same members" by the classes of each
    group's neighbours for a few rounds (colour refinement, as in the Weisfeiler-Lehman
    test) separates the first and last blocks, which touch the embedding or the loss, from
    the interior ones. Groups of one class then share one ILP choice: every interior layer
    gets the same sharding, as in every hand-written plan, and the ILP shrinks by the layer
    count. Groups whose costs differ never share a class.
    """
    colour: list = []
    numbers = StrategyNumbers()
    for g in groups:
        colour.append(hash((group_signature(graph, units, g, numbers), g.cost.tobytes(),
                            g.memory.tobytes())))
    nbrs: list[list[tuple]] = [[] for _ in groups]
    for (a, b), m in edges.items():
        h = hash(m.tobytes())
        nbrs[a].append(("out", b, h))
        nbrs[b].append(("in", a, h))
    for _ in range(rounds):
        colour = [hash((colour[i], tuple(sorted((d, colour[j], h) for d, j, h in nbrs[i]))))
                  for i in range(len(groups))]
    first: dict = {}
    classes = []
    for i, c in enumerate(colour):
        classes.append(first.setdefault(c, len(first)))
    return classes


