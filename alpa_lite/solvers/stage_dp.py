"""Inter-operator stage DP: cut the layers into pipeline stages, one submesh each (Alpa §5).

A model is ``L`` layers 0..L−1 in order; the cluster is ``N`` nodes of ``M`` devices. A plan
cuts the layers into ``S`` contiguous stages and gives stage s a submesh ``m_s`` (and one of
the caller's intra-op options for that layer range on that submesh). The submeshes' device
counts sum to exactly N·M. This module knows nothing of JAX: costs come from the caller's
``stage_options(start, end, submesh)``, or from a `StageOptionGrid` that gives every
range's options on a submesh as arrays (the same DP, without a call and a record per
option: at a thousand GPUs there are millions).

The problem
-----------
::

    submeshes   (1,1), (1,2), (1,4), …, (1,M)  (powers of two below M, then M)
                (k, M) for k = 2..N                                   → ``submesh_shapes``
    latency     T = Σ_s t_s + (B − 1)·max_s t_s          t_s: one micro-batch, fwd + bwd
    memory      stage s (0-based, of S) under 1F1B keeps S − s micro-batches in flight:
                param_bytes + act_bytes·(S − s) ≤ device memory
    devices     Σ_s |m_s| = N·M,  1 ≤ S ≤ max_stages

The recurrence (for one bound ``t_max`` on the stage latency)
-------------------------------------------------------------
::

    F(s, k, d) = min over k ≤ i < L, submesh m with |m| ≤ d, option o of (k..i, m) with
                     o.latency ≤ t_max and param(o) + act(o)·s ≤ memory
                 of  o.latency + F(s − 1, i + 1, d − |m|)
    F(0, L, 0) = 0,  F(0, k, d) = ∞ otherwise
    G(t_max)   = min_s F(s, 0, N·M)                       (least Σ_s t_s with max_s t_s ≤ t_max)
    T*         = min over t_max of G(t_max) + (B − 1)·t_max

``s`` counts the stages from layer k to the end, so the stage starting at k is followed by
s − 1 stages and holds s micro-batches in flight. Every stage's best option is the fastest
one that fits (T grows with every t_s), and the optimum's max stage latency is one of the
options' latencies, so t_max only needs the sorted distinct option latencies.
For the reconstructed plan the reported latency is the true T, with its actual max stage
latency (at most t_max).

How it is computed (every step keeps the optimum: results equal brute force's)
-----------------------------------------------------------------------------
1. Every ``(start, end, submesh)`` is queried once (``StageDPStats.cost_queries``). Each
   query's options are reduced to a *front*: sorted by latency, an option is kept only if
   it fits more micro-batches in flight than every faster one, so with s in flight the
   stage uses the first front entry that fits s. A front entry is a *move*: layers k..j−1
   on submesh m, valid for s in [slo, shi].                        → ``_build_stage_table``
2. Bounds for one t_max (only stages no slower than it). With t the fastest option of a
   range (it fits one micro-batch in flight; every stage fits at least that) and
   w_λ(k, j) = min_m t(k..j−1, m) + λ·|m|, two chains
       P_λ(j) = min_k P_λ(k) + w_λ(k, j),  P_λ(0) = 0      (layers 0..j−1)
       Q_λ(k) = min_j w_λ(k, j) + Q_λ(j),  Q_λ(L) = 0      (layers k..L−1)
   give Lagrangian lower bounds (Σ t = Σ (t + λ|m|) − λ·Σ|m| for any λ):
       LB(k, e)    = max_λ P_λ(k) − λ·e    ≤ least Σ t of layers 0..k−1 on e devices
       bound(move) = max_λ t + λ|m| + P_λ(k) + Q_λ(j) − λ·N·M ≤ Σ t of plans using it
       plan        = max_λ Q_λ(0) − λ·N·M  ≤ G(t_max)
   over a small grid of λ (0, one negative, a geometric range scaled by Q_0(0)/N·M). The
   limits λ → ±∞, the least and the most devices a covering can use, are applied exactly:
   a state or move that cannot end at exactly N·M devices gets ∞. Per range, the moves
   sorted by latency carry running minima, so a t_max costs one lookup per range plus the
   two chains.                                                     → ``_RangeMinima``, ``_Bounds``
3. The DP for one t_max and a threshold thr: F is evaluated level by level, s = 1, 2, …,
   as sparse arrays of states (k, d) reached from the end, each state pushed to every move
   that ends just before it. Only moves with bound ≤ thr take part, and a state is dropped
       if F(s, k, d) + LB(k, N·M − d) > thr,
   or if the same (k, d) was reached with fewer stages at no more cost (fewer stages in
   flight only help the stages before it). It returns G(t_max) if G(t_max) ≤ thr, else
   nothing.                                                        → ``_solve_for_t_max``
4. The t_max search. G is non-increasing, so over an interval [a, b] of candidate
   latencies G(t) + (B − 1)·t ≥ G(b⁺) + (B − 1)·a, with G(b⁺) known from the candidate
   above b. Alpa's early stop ("skip t_max once (B − 1)·t_max ≥ best") is this bound with
   G ≥ 0. The first DP runs at the largest latency (thr raised from ``plan`` in steps
   until a plan appears); S equal stages on equal submeshes (every S with an N·M/S-device
   submesh) give further starting incumbents. Candidates whose ``plan`` bound is ∞ (no
   covering can use exactly N·M devices) are cut off by bisection, as ``plan`` only grows
   as t_max falls. Then intervals are taken best bound first and split at their middle
   candidate c, whose DP gets thr = best − (B − 1)·a: if it
   finds nothing, all of [a, c] is pruned; otherwise G(c) is exact, the plan's actual max
   latency t' ≤ c settles [t', c] (G is constant there), and [a, t') and (c, b] remain.
   The search ends when the best interval bound reaches the best T.   → ``_search_t_max``

Ties are broken deterministically: within one t_max, fewer stages, then the earliest end
of the first stage (and so on for the next ones), then submesh order, then option order;
across t_max the first plan found is kept unless a later one is faster by more than 1e-12
(relative), or as fast with fewer stages, then earlier cuts, then submesh order.

Cost (numpy only; a 2-core machine shared with other work): 96 layers on 128 × 8 devices
(131 submesh shapes, 609,936 cost queries, 1.2M options, ~17k candidate t_max) takes
1.1–1.6 s for B = 1…128 on a GPT-like cost model, tight or loose memory, of which ~0.3 s
is the caller's ``stage_options`` and ~0.7 s building the tables. An instance where many
pipelines come within 1 % of the best (a strong cross-node penalty, B = 64 or 128) needs
21–35 DP runs and 2.6–3.1 s.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "NoFeasiblePipelineError",
    "PipelinePlan",
    "StageAssignment",
    "StageCostFn",
    "StageDPStats",
    "StageOption",
    "SubmeshShape",
    "brute_force_stage_plan",
    "solve_stage_dp",
    "submesh_shapes",
]

BRUTE_FORCE_MAX_PLANS = 2_000_000
"""``brute_force_stage_plan`` refuses instances with more (layer cuts × submesh sequences)."""

_TIE_REL = 1e-12  # relative difference below which two plan latencies count as equal
_PRUNE_SLACK = 1e-9  # relative slack on thr, so rounding in the bounds never drops an optimum
_DEEPENING = (1 / 32, 1 / 4, 2.0, math.inf)  # first DP: thr = LB·(1 + ε) for these ε in turn
_CHUNK = 1 << 21  # candidate (state, stage) pairs expanded per numpy batch
_LAMBDA_EXPONENTS = np.array([-3.0, -1.0, 1.0, 3.0, 5.0, 7.0])  # λ grid: λ_ref·2^x, 0, −λ_ref
_BOUND_CACHE_RATIO = 1.05  # the DP reuses the bound tables of a t_max at most 5 % larger


# --------------------------------------------------------------------------------------------
# Public records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmeshShape:
    """A rectangle of the cluster: ``num_nodes`` nodes × ``devices_per_node`` devices."""

    num_nodes: int
    devices_per_node: int

    def __post_init__(self):
        _check_positive_int(self.num_nodes, "SubmeshShape.num_nodes")
        _check_positive_int(self.devices_per_node, "SubmeshShape.devices_per_node")
        object.__setattr__(self, "num_nodes", int(self.num_nodes))
        object.__setattr__(self, "devices_per_node", int(self.devices_per_node))

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def __str__(self) -> str:
        return f"({self.num_nodes}, {self.devices_per_node})"


@dataclass(frozen=True)
class StageOption:
    """One way to run a layer range on one submesh: the caller's intra-op plan for it.

    Attributes:
        latency_s: forward + backward of one micro-batch, seconds.
        param_bytes: per device: parameters, gradients and optimizer state.
        act_bytes: per device: activations kept for each micro-batch in flight.
        label: free text for explanations, e.g. the logical mesh "(2, 4)" and remat on/off.
    """

    latency_s: float
    param_bytes: float
    act_bytes: float
    label: str = ""

    def __post_init__(self):
        for field, unit in (("latency_s", "seconds"), ("param_bytes", "bytes"),
                            ("act_bytes", "bytes")):
            value = getattr(self, field)
            if type(value) is float and 0.0 <= value < math.inf:
                continue      # the common case, checked fast: the DP makes millions
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"StageOption.{field} must be a number ({unit}), got {value!r}")
            value = float(value)
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"StageOption.{field} must be finite and >= 0 ({unit}), got {value}: "
                    "leave an impossible option out instead of giving it an infinite cost"
                )
            object.__setattr__(self, field, value)
        if type(self.label) is not str:
            object.__setattr__(self, "label", str(self.label))

    def memory_bytes(self, micro_batches_in_flight: int) -> float:
        """Per-device memory with this many micro-batches' activations kept."""
        return self.param_bytes + self.act_bytes * micro_batches_in_flight


StageCostFn = Callable[[int, int, SubmeshShape], Sequence[StageOption]]
"""``stage_options(start, end, submesh)``: the options for layers start..end (inclusive) on
``submesh``; an empty sequence means the range cannot run there."""


@dataclass(frozen=True, eq=False)
class OptionColumns:
    """Every layer range's options on one submesh, as arrays (`StageOptionGrid`).

    Row r is the range ``range_pairs(num_layers)[r]`` (start ≤ end, start-major: (0, 0),
    (0, 1), …, (1, 1), …); column c is one kind of option (a logical mesh, with remat or
    not, …), named ``labels[c]``. A NaN latency: that kind has no option for that range.
    Each row's options keep the column order, as a callable's list keeps its order.
    """

    latency_s: np.ndarray  # (ranges, columns), seconds
    param_bytes: np.ndarray  # (ranges, columns)
    act_bytes: np.ndarray  # (ranges, columns)
    labels: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class StageOptionGrid:
    """``stage_options`` given a submesh at a time: ``columns(submesh)`` returns the
    `OptionColumns` of every layer range on it.

    The callable form is asked once per (start, end, submesh) and answers with StageOption
    records, and at a thousand GPUs that is most of the DP's time: 128 nodes of 8 have 131
    submeshes, so 98 layers make 635k queries and 10M options. On the 2-core box, 40 layers
    with 16 options per query on those submeshes took 8.9 s (7.3 s of it the calls and the
    records) and 0.56 s as a grid, the same plan. The grid's arrays go into the table as
    they are, and records are made only for the options a plan or a message names. A grid
    is also callable as ``(start, end, submesh)`` (brute force, explanations), with the
    same options in the same order.
    """

    num_layers: int
    columns: Callable[[SubmeshShape], OptionColumns]
    _seen: dict = field(default_factory=dict, init=False, repr=False)  # checked, by submesh

    def columns_of(self, submesh: SubmeshShape) -> OptionColumns:
        """``columns(submesh)``, checked once (shapes, and finite non-negative values)."""
        if submesh not in self._seen:
            self._seen[submesh] = _checked_columns(self.columns(submesh), self.num_layers,
                                                   submesh)
        return self._seen[submesh]

    def __call__(self, start: int, end: int, submesh: SubmeshShape) -> list[StageOption]:
        cols = self.columns_of(submesh)
        r = _pair_index(start, end, self.num_layers)
        return [StageOption(float(cols.latency_s[r, c]), float(cols.param_bytes[r, c]),
                            float(cols.act_bytes[r, c]), cols.labels[c])
                for c in range(len(cols.labels)) if not math.isnan(cols.latency_s[r, c])]


def range_pairs(num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every layer range start ≤ end, start-major: `OptionColumns` rows,
    and the order of the DP's queries (each range, then each submesh)."""
    k, i = np.triu_indices(num_layers)
    return k.astype(np.int64), i.astype(np.int64)


def _pair_index(start: int, end: int, num_layers: int) -> int:
    return start * num_layers - start * (start - 1) // 2 + (end - start)


def _checked_columns(cols, num_layers: int, submesh: SubmeshShape) -> OptionColumns:
    if not isinstance(cols, OptionColumns):
        raise ValueError(f"StageOptionGrid.columns({submesh}) returned "
                         f"{type(cols).__name__}, not OptionColumns")
    ranges = num_layers * (num_layers + 1) // 2
    arrays = [np.asarray(a, dtype=float) for a in (cols.latency_s, cols.param_bytes,
                                                   cols.act_bytes)]
    want = (ranges, len(cols.labels))
    for name, a in zip(("latency_s", "param_bytes", "act_bytes"), arrays):
        if a.shape != want:
            raise ValueError(
                f"StageOptionGrid.columns({submesh}).{name} has shape {a.shape}, not {want} "
                f"(one row per layer range of {num_layers} layers, one column per label)")
    present = ~np.isnan(arrays[0])
    for name, a in zip(("latency_s", "param_bytes", "act_bytes"), arrays):
        bad = present & ~(np.isfinite(a) & (a >= 0))
        if bad.any():
            r, c = (int(x[0]) for x in np.nonzero(bad))
            starts, ends = range_pairs(num_layers)
            raise ValueError(
                f"StageOptionGrid.columns({submesh}).{name} for layers {starts[r]}..{ends[r]} "
                f"({cols.labels[c]!r}) is {a[r, c]}: it must be finite and >= 0 (leave an "
                "impossible option out with a NaN latency)")
    return OptionColumns(*arrays, tuple(str(x) for x in cols.labels))


@dataclass(frozen=True)
class StageAssignment:
    """Layers ``start..end`` (inclusive) on ``submesh``, run as ``option``."""

    start: int
    end: int
    submesh: SubmeshShape
    option: StageOption

    def __post_init__(self):
        if not 0 <= self.start <= self.end:
            raise ValueError(
                f"a stage needs 0 <= start <= end (layer indices, end inclusive), got "
                f"start={self.start}, end={self.end}"
            )

    @property
    def num_layers(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True)
class PipelinePlan:
    """Contiguous stages covering layers 0..L−1, their submeshes and options.

    Attributes:
        stages: in pipeline order; stage 0 starts at layer 0.
        num_micro_batches: B.
        latency_s: T = Σ_s t_s + (B − 1)·max_s t_s.
    """

    stages: tuple[StageAssignment, ...]
    num_micro_batches: int
    latency_s: float

    def __post_init__(self):
        stages = tuple(self.stages)
        if not stages:
            raise ValueError("a PipelinePlan needs at least one stage")
        expected = 0
        for s, stage in enumerate(stages):
            if stage.start != expected:
                raise ValueError(
                    f"stages must be contiguous from layer 0: stage {s} starts at layer "
                    f"{stage.start}, expected {expected}"
                )
            expected = stage.end + 1
        object.__setattr__(self, "stages", stages)

    @property
    def max_stage_latency_s(self) -> float:
        return max(stage.option.latency_s for stage in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def describe(self) -> str:
        """One line per stage: layers, submesh, option, latency and memory in flight."""
        n = len(self.stages)
        lines = [
            f"{n} stage(s), {self.num_micro_batches} micro-batches: T = "
            f"{self.latency_s:.6g} s (max stage {self.max_stage_latency_s:.6g} s)"
        ]
        for s, st in enumerate(self.stages):
            label = f" {st.option.label}" if st.option.label else ""
            lines.append(
                f"  stage {s}: layers {st.start}..{st.end} on {st.submesh}{label}: "
                f"{st.option.latency_s:.6g} s, {_format_bytes(st.option.memory_bytes(n - s))} "
                f"per device with {n - s} in flight"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class StageDPStats:
    """What the search did.

    Attributes:
        t_max_tried: distinct t_max values for which the DP ran.
        t_max_total: distinct latencies of the usable options (the candidate t_max values).
        cost_queries: calls to ``stage_options`` (once per (start, end, submesh)).
        solve_time_s: wall time of the whole call, cost queries included.
    """

    t_max_tried: int
    t_max_total: int
    cost_queries: int
    solve_time_s: float


class NoFeasiblePipelineError(ValueError):
    """No plan covers every layer within the device memory using exactly N·M devices."""


# --------------------------------------------------------------------------------------------
# Submesh shapes
# --------------------------------------------------------------------------------------------


def submesh_shapes(num_nodes: int, devices_per_node: int) -> tuple[SubmeshShape, ...]:
    """The allowed submeshes: (1, 1), (1, 2), (1, 4), … below M, (1, M), then (k, M), k ≥ 2.

    Example:
        >>> [str(s) for s in submesh_shapes(2, 8)]
        ['(1, 1)', '(1, 2)', '(1, 4)', '(1, 8)', '(2, 8)']
    """
    _check_positive_int(num_nodes, "num_nodes")
    _check_positive_int(devices_per_node, "devices_per_node")
    shapes = []
    width = 1
    while width < devices_per_node:
        shapes.append(SubmeshShape(1, width))
        width *= 2
    shapes.append(SubmeshShape(1, int(devices_per_node)))
    shapes.extend(SubmeshShape(k, int(devices_per_node)) for k in range(2, int(num_nodes) + 1))
    return tuple(shapes)


# --------------------------------------------------------------------------------------------
# Solve
# --------------------------------------------------------------------------------------------


def solve_stage_dp(
    num_layers: int,
    num_nodes: int,
    devices_per_node: int,
    num_micro_batches: int,
    stage_options: "StageCostFn | StageOptionGrid",
    device_memory_bytes: float,
    max_stages: int | None = None,
) -> tuple[PipelinePlan, StageDPStats]:
    """The plan with the least step latency T (module docstring: recurrence and search).

    Args:
        num_layers: L, layers 0..L−1 in order.
        num_nodes: N.
        devices_per_node: M.
        num_micro_batches: B ≥ 1.
        stage_options: ``(start, end, submesh) -> options``, called once per triple; or a
            `StageOptionGrid`, read once per submesh.
        device_memory_bytes: memory of one device (``math.inf`` for no limit).
        max_stages: at most this many stages (default: no limit beyond L and N·M).

    Returns:
        ``(plan, stats)``.

    Raises:
        ValueError: an argument is out of range, or ``stage_options`` returned a non-option.
        NoFeasiblePipelineError: no plan fits, with the reason and what to change.

    Example:
        >>> opts = lambda start, end, m: [StageOption((end - start + 1) / m.num_devices, 0, 0)]
        >>> plan, stats = solve_stage_dp(4, 1, 2, 4, opts, 1e9)
        >>> [(st.start, st.end, str(st.submesh)) for st in plan.stages], plan.latency_s
        ([(0, 3, '(1, 2)')], 8.0)
    """
    started = time.perf_counter()
    cap = _validate(num_layers, num_nodes, devices_per_node, num_micro_batches, stage_options,
                    device_memory_bytes, max_stages)
    num_layers, num_nodes, devices_per_node, num_micro_batches = map(
        int, (num_layers, num_nodes, devices_per_node, num_micro_batches))
    device_memory_bytes = float(device_memory_bytes)
    table = _build_stage_table(num_layers, num_nodes, devices_per_node, stage_options,
                               device_memory_bytes, cap)
    if table.move_lat.size == 0:
        raise _infeasible(table)
    plan, tried = _search_t_max(table, num_micro_batches)
    if plan is None:
        raise _infeasible(table)
    stats = StageDPStats(
        t_max_tried=tried,
        t_max_total=int(table.taus.size),
        cost_queries=table.cost_queries,
        solve_time_s=time.perf_counter() - started,
    )
    return plan, stats


def brute_force_stage_plan(
    num_layers: int,
    num_nodes: int,
    devices_per_node: int,
    num_micro_batches: int,
    stage_options: StageCostFn,
    device_memory_bytes: float,
    max_stages: int | None = None,
) -> PipelinePlan:
    """Try every plan; the reference for tests and tiny instances.

    Enumerates every number of stages S, every way to cut the layers into S contiguous
    stages and every sequence of S submesh shapes whose device counts sum to N·M. Each stage
    takes its fastest option that fits its S − s micro-batches in flight (T only grows with
    each t_s, so no other option can do better). Ties go to fewer stages, then earlier cuts,
    then submesh order.

    Raises:
        ValueError: bad arguments, or more than ``BRUTE_FORCE_MAX_PLANS`` plans to try.
        NoFeasiblePipelineError: no plan fits.
    """
    cap = _validate(num_layers, num_nodes, devices_per_node, num_micro_batches, stage_options,
                    device_memory_bytes, max_stages)
    num_layers, num_nodes, devices_per_node, num_micro_batches = map(
        int, (num_layers, num_nodes, devices_per_node, num_micro_batches))
    device_memory_bytes = float(device_memory_bytes)
    shapes = submesh_shapes(num_nodes, devices_per_node)
    total = num_nodes * devices_per_node
    sequences = {s: [] for s in range(1, cap + 1)}
    for s in range(1, cap + 1):
        count = math.comb(num_layers - 1, s - 1) * _count_sequences(shapes, total, s)
        if count > BRUTE_FORCE_MAX_PLANS:
            raise ValueError(
                f"brute_force_stage_plan would try more than {BRUTE_FORCE_MAX_PLANS} plans "
                f"({num_layers} layers, {total} devices, {s} stages alone give {count}): use "
                "solve_stage_dp, or pass a smaller max_stages"
            )
        sequences[s] = list(_shape_sequences(shapes, total, s))
    cache: dict[tuple[int, int, int], tuple[StageOption, ...]] = {}

    def fastest(start, end, m, in_flight):
        key = (start, end, m)
        if key not in cache:
            cache[key] = _checked_options(stage_options(start, end, shapes[m]), start, end,
                                          shapes[m])
        best = None
        for option in cache[key]:
            fits = option.param_bytes + option.act_bytes * in_flight <= device_memory_bytes
            if fits and (best is None or option.latency_s < best.latency_s):
                best = option
        return best

    best_key, best_plan = None, None
    for s in range(1, cap + 1):
        for cuts in itertools.combinations(range(1, num_layers), s - 1):
            bounds = (0,) + cuts + (num_layers,)
            for seq in sequences[s]:
                chosen = []
                for p in range(s):
                    option = fastest(bounds[p], bounds[p + 1] - 1, seq[p], s - p)
                    if option is None:
                        break
                    chosen.append(option)
                else:
                    latencies = [o.latency_s for o in chosen]
                    t = sum(latencies) + (num_micro_batches - 1) * max(latencies)
                    key = (t, s, cuts, seq)
                    if best_key is None or _better(key, best_key):
                        best_key = key
                        best_plan = tuple(
                            StageAssignment(bounds[p], bounds[p + 1] - 1, shapes[seq[p]],
                                            chosen[p]) for p in range(s))
    if best_plan is None:
        table = _build_stage_table(num_layers, num_nodes, devices_per_node, stage_options,
                                   device_memory_bytes, cap)
        raise _infeasible(table)
    return PipelinePlan(best_plan, num_micro_batches, best_key[0])


# --------------------------------------------------------------------------------------------
# Step 1: query every (start, end, submesh) once; option fronts; the stage "moves"
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _StageTable:
    """Everything the DP needs, as flat numpy arrays.

    A *move* is one front entry: layers k..j−1 on submesh m with option ``move_opt``, the
    fastest fitting option for any s in [move_slo, move_shi] micro-batches in flight. Moves
    are sorted by (j, k, m, latency), the tie-break order.
    """

    num_layers: int
    num_devices: int
    stage_cap: int
    shapes: tuple[SubmeshShape, ...]
    sizes: np.ndarray  # (num_shapes,) devices per shape
    options: _Options  # every option returned, flat, in query order
    query_offsets: np.ndarray  # options of query q are options[offsets[q]:offsets[q + 1]]
    move_k: np.ndarray
    move_j: np.ndarray
    move_m: np.ndarray
    move_opt: np.ndarray
    move_lat: np.ndarray
    move_slo: np.ndarray
    move_shi: np.ndarray
    taus: np.ndarray  # sorted distinct move latencies: the candidate t_max
    cost_queries: int
    memory_bytes: float


class _Options(Sequence):
    """The table's options, flat in query order: their numbers as arrays, and a record
    for any one of them (the callable's own, or made from a grid's arrays on demand)."""

    def __init__(self, latency_s, param_bytes, act_bytes, record):
        self.latency_s, self.param_bytes, self.act_bytes = latency_s, param_bytes, act_bytes
        self._record = record

    def __len__(self) -> int:
        return int(self.latency_s.size)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self._record(i) for i in range(*j.indices(len(self)))]
        return self._record(int(j))


def _queried_options(num_layers, shapes, stage_options) -> tuple[Sequence[int], _Options]:
    """Every (start, end, submesh) query's options (queries in (k, i, m) order): the
    number per query and the options, flat."""
    if isinstance(stage_options, StageOptionGrid):
        return _grid_options(num_layers, shapes, stage_options)
    results = [stage_options(k, i, shape) for k in range(num_layers)
               for i in range(k, num_layers) for shape in shapes]
    if not set(map(type, results)) <= {list, tuple}:
        for q, got in enumerate(results):
            if type(got) is not list and type(got) is not tuple:
                k, i, m = _query_triple(q, num_layers, len(shapes))
                results[q] = _as_option_tuple(got, k, i, shapes[m])
    counts = list(map(len, results))  # options per query
    options = list(itertools.chain.from_iterable(results))
    if any(not issubclass(t, StageOption) for t in set(map(type, options))):
        bad = next(n for n, o in enumerate(options) if not isinstance(o, StageOption))
        q = int(np.searchsorted(np.cumsum(counts), bad, side="right"))
        k, i, m = _query_triple(q, num_layers, len(shapes))
        _checked_options(options[bad:bad + 1], k, i, shapes[m])  # raises, naming the query
    n = len(options)
    return counts, _Options(np.fromiter((o.latency_s for o in options), float, n),
                            np.fromiter((o.param_bytes for o in options), float, n),
                            np.fromiter((o.act_bytes for o in options), float, n),
                            options.__getitem__)


def _grid_options(num_layers, shapes, grid: StageOptionGrid) -> tuple[np.ndarray, _Options]:
    """`_queried_options` from a grid's arrays: each submesh's present entries (a number
    latency) placed in query order ((range, submesh), then column order), straight into
    the flat arrays. (A padded (range, submesh, column) cube was GPT-1T's largest array:
    2,080 ranges x 387 submeshes x the widest submesh's columns, three times.)"""
    if grid.num_layers != num_layers:
        raise ValueError(f"the StageOptionGrid is for {grid.num_layers} layers, the DP for "
                         f"{num_layers}")
    cols = [grid.columns_of(shape) for shape in shapes]
    ranges = num_layers * (num_layers + 1) // 2
    present = [~np.isnan(c.latency_s) for c in cols]
    per_query = np.stack([p.sum(axis=1) for p in present], axis=1) if cols else \
        np.zeros((ranges, 0), dtype=np.int64)                        # (ranges, submeshes)
    counts = per_query.reshape(-1).astype(np.int64)
    first = (np.cumsum(counts) - counts).reshape(per_query.shape)    # each query's start
    n = int(counts.sum())
    lat, param, act = np.empty(n), np.empty(n), np.empty(n)
    shape_of, column = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for m, (c, p) in enumerate(zip(cols, present)):
        rows, cs = np.nonzero(p)                 # by range, then column
        at = first[rows, m] + (np.cumsum(p, axis=1) - 1)[rows, cs]
        lat[at], param[at], act[at] = c.latency_s[rows, cs], c.param_bytes[rows, cs], \
            c.act_bytes[rows, cs]
        shape_of[at], column[at] = m, cs
    labels = [c.labels for c in cols]

    def record(j: int) -> StageOption:
        return StageOption(float(lat[j]), float(param[j]), float(act[j]),
                           labels[shape_of[j]][column[j]])

    return counts, _Options(lat, param, act, record)


def _build_stage_table(num_layers, num_nodes, devices_per_node, stage_options, memory, cap):
    shapes = submesh_shapes(num_nodes, devices_per_node)
    sizes = np.array([s.num_devices for s in shapes], dtype=np.int64)
    counts, options = _queried_options(num_layers, shapes, stage_options)
    queries = len(counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    lat, param, act = options.latency_s, options.param_bytes, options.act_bytes
    smax = _max_in_flight(param, act, memory, cap)
    kept, query, pos, slo = _fronts(lat, smax, np.asarray(counts, dtype=np.int64), offsets)
    move_k, move_i, move_m = _query_keys(query, num_layers, len(shapes))
    move_j = move_i + 1
    # Moves by (j, k, m, latency): the order the DP takes them in, and its tie-break.
    width = int(pos.max(initial=0)) + 1
    sort = np.argsort(((move_j * num_layers + move_k) * len(shapes) + move_m) * width + pos,
                      kind="stable")
    return _StageTable(
        num_layers=num_layers,
        num_devices=num_nodes * devices_per_node,
        stage_cap=cap,
        shapes=shapes,
        sizes=sizes,
        options=options,
        query_offsets=offsets,
        move_k=move_k[sort],
        move_j=move_j[sort],
        move_m=move_m[sort],
        move_opt=kept[sort],
        move_lat=lat[kept][sort],
        move_slo=slo[sort],
        move_shi=smax[kept][sort],
        taus=np.unique(lat[kept]),
        cost_queries=queries,
        memory_bytes=float(memory),
    )


def _fronts(lat, smax, counts, offsets):
    """Each query's front: its options by latency (then more micro-batches in flight, then
    option order), keeping an option only if it fits more micro-batches in flight than
    every faster one (and at least one). Returns, per option kept, its index, its query,
    its place in its query's order and the least micro-batches in flight it is the
    fastest for (one more than the most any faster option fits).

    The queries are sorted a row at a time, all queries with the same number of options
    as one 2-D block: a query has a few dozen options and the table millions (GPT-175B on
    1024 A100s: 2.5M options in 160k queries), where one sort of them all was most of the
    table's time."""
    kept, query, pos, slo = [], [], [], []
    for c in np.unique(counts):
        if c == 0:
            continue
        qs = np.flatnonzero(counts == c)
        idx = offsets[qs][:, None] + np.arange(c)
        # Two stable sorts: by most in flight, then by latency (ties keep that order).
        idx = np.take_along_axis(idx, np.argsort(-smax[idx], axis=1, kind="stable"), 1)
        idx = np.take_along_axis(idx, np.argsort(lat[idx], axis=1, kind="stable"), 1)
        s = smax[idx]
        before = np.maximum.accumulate(np.concatenate(
            [np.zeros((len(qs), 1), dtype=s.dtype), s[:, :-1]], axis=1), axis=1)
        keep = (s >= 1) & (s > before)
        rows, cols = np.nonzero(keep)
        kept.append(idx[rows, cols])
        query.append(qs[rows])
        pos.append(cols)
        slo.append(before[rows, cols] + 1)
    if not kept:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    return tuple(np.concatenate(a).astype(np.int64) for a in (kept, query, pos, slo))


def _query_keys(query: np.ndarray, num_layers: int, num_shapes: int):
    """Each query's layer range start and end (inclusive) and submesh index (queries are in
    (range, submesh) order, ranges as `range_pairs`)."""
    pair_k, pair_i = range_pairs(num_layers)
    pair, shape = np.divmod(query, num_shapes)
    return pair_k[pair], pair_i[pair], shape


def _option_keys(table: "_StageTable") -> np.ndarray:
    """(num_options, 3): each option's layer range start, end and submesh index."""
    counts = np.diff(table.query_offsets)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return np.stack(_query_keys(owner, table.num_layers, len(table.shapes)), axis=1)


class _RangeMinima:
    """For the bounds: per range (k, j), its moves that fit one micro-batch in flight, sorted
    by latency, with running minima of |m|, −|m| and t + λ|m| along that order. For a t_max
    the moves no slower than it are a prefix of each range, so the minima over them are one
    lookup per range (``weights``)."""

    def __init__(self, table: "_StageTable"):
        one = np.flatnonzero(table.move_slo == 1)
        k, j, lat = table.move_k[one], table.move_j[one], table.move_lat[one]
        order = np.lexsort((lat, k, j))  # by range, then latency
        k, j, lat = k[order], j[order], lat[order]
        size = table.sizes[table.move_m[one][order]].astype(float)
        L, D = table.num_layers, table.num_devices
        new_range = np.concatenate([[True], (k[1:] != k[:-1]) | (j[1:] != j[:-1])]) \
            if k.size else np.zeros(0, dtype=bool)
        self.starts = np.flatnonzero(new_range)
        self.range_k, self.range_j = k[self.starts], j[self.starts]
        self.lat = lat
        self.num_layers = L
        lengths = np.diff(np.append(self.starts, k.size))
        base = self._running_min(np.stack([size, -size, lat], axis=1), lengths)
        # λ grid, scaled by the least Σ t ignoring devices (λ = 0) at the largest t_max.
        q0 = self.chains(self._pick(base[:, 2:], lengths))[1][0, 0]
        ref = q0 / D if math.isfinite(q0) and q0 > 0 else 1.0
        self.lam = np.concatenate([[0.0, -ref], ref * 2.0 ** _LAMBDA_EXPONENTS])
        self.minima = np.concatenate(
            [base[:, :2], self._running_min(lat[:, None] + size[:, None] * self.lam, lengths)],
            axis=1)  # (moves, 2 + λ): min |m|, min −|m|, min t + λ|m|

    def _running_min(self, values, lengths):
        out = values.copy()
        for p in range(1, int(lengths.max(initial=0))):
            at = self.starts[lengths > p] + p
            out[at] = np.minimum(out[at], out[at - 1])
        return out

    def _pick(self, minima, counts):
        """(ranges, c): the running minimum after `counts` moves of each range (∞ for 0)."""
        picked = minima[self.starts + np.maximum(counts, 1) - 1]
        picked[counts == 0] = np.inf
        return picked

    def weights(self, tau):
        fast = np.add.reduceat(self.lat <= tau, self.starts) if self.starts.size else \
            np.zeros(0, dtype=np.int64)
        return self._pick(self.minima, fast)

    def chains(self, w_ranges):
        """P(j) = min_k P(k) + w(k, j), P(0) = 0; Q(k) = min_j w(k, j) + Q(j), Q(L) = 0."""
        L = self.num_layers
        w = np.full((L + 1, L + 1, w_ranges.shape[1]), np.inf)  # (k, j, c)
        w[self.range_k, self.range_j] = w_ranges
        p = np.full((L + 1, w_ranges.shape[1]), np.inf)
        q = np.full_like(p, np.inf)
        p[0] = 0.0
        q[L] = 0.0
        for jj in range(1, L + 1):
            p[jj] = np.min(p[:jj] + w[:jj, jj], axis=0)
        for kk in range(L - 1, -1, -1):
            q[kk] = np.min(w[kk, kk + 1:] + q[kk + 1:], axis=0)
        return p, q


def _query_index(k, i, m, num_layers, num_shapes) -> int:
    """Index of query (k, i, m) in (k, i, m) loop order."""
    return _pair_index(k, i, num_layers) * num_shapes + m


def _query_triple(q, num_layers, num_shapes):
    pair, m = divmod(q, num_shapes)
    pair_k, pair_i = range_pairs(num_layers)
    return int(pair_k[pair]), int(pair_i[pair]), m


def _max_in_flight(param, act, memory, cap):
    """Largest s ≤ cap with param + act·s ≤ memory (exactly as written), 0 if none."""
    if math.isinf(memory):
        return np.where(param <= memory, cap, 0).astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        room = (memory - param) / act
    s = np.where(act > 0, np.floor(np.clip(room, -1, cap)), cap)
    s = np.where(param > memory, 0, s).astype(np.int64)
    # Repair the floating-point rounding of the division, on the few entries it is off.
    off = np.flatnonzero(((s >= 1) & (param + act * s > memory)) |
                         ((s < cap) & (param <= memory) & (param + act * (s + 1) <= memory)))
    if off.size:
        p, a, t = param[off], act[off], s[off]
        for _ in range(3):
            t = np.where((t >= 1) & (p + a * t > memory), t - 1, t)
            t = np.where((t < cap) & (p <= memory) & (p + a * (t + 1) <= memory), t + 1, t)
        s[off] = t
    return s


# --------------------------------------------------------------------------------------------
# Steps 2 and 3: the bounds and the DP for one t_max
# --------------------------------------------------------------------------------------------


class _Bounds:
    """The lower bounds of module docstring step 2, valid for every t_max ≤ ``tau``.

    ``plan`` (≤ G(tau)) is computed at once; the tables the DP needs only by ``complete()``:
        prefix: (L+1, D+1): LB(k, e) (row 0 is 0: the DP checks "no layers ⇔ no devices").
        prefix_upto: min over e' ≤ e of LB(k, e'), for a group of states at once.
        move_bound: per move, ≤ Σ t of any plan using it; ∞ for moves slower than tau.
    """

    def __init__(self, table: _StageTable, minima: _RangeMinima, tau: float):
        self.table, self.tau = table, tau
        self.prefix = self.prefix_upto = self.move_bound = None
        D = table.num_devices
        w = minima.weights(tau)
        if not np.isfinite(w[:, 0]).any():
            self.plan = math.inf
            self._p = None
            return
        p, q = minima.chains(w)
        self._lam = minima.lam
        self._dev_p, self._dev_q = p[:, :2], q[:, :2]
        self._p, self._q = p[:, 2:], q[:, 2:]
        if self._dev_q[0, 0] > D or -self._dev_q[0, 1] < D:
            self.plan = math.inf
        else:
            self.plan = max(float(np.max(self._q[0] - self._lam * D)), 0.0)

    def complete(self) -> "_Bounds":
        if self.prefix is not None:
            return self
        table = self.table
        L, D = table.num_layers, table.num_devices
        if self._p is None:
            self.prefix = self.prefix_upto = np.full((L + 1, D + 1), np.inf)
            self.move_bound = np.full(table.move_k.size, np.inf)
            return self
        p, q, lam, dev_p, dev_q = self._p, self._q, self._lam, self._dev_p, self._dev_q
        e = np.arange(D + 1, dtype=float)
        with np.errstate(invalid="ignore"):
            prefix = np.max(p[:, None, :] - lam[None, None, :] * e[None, :, None], axis=2)
        prefix = np.maximum(prefix, 0.0)
        prefix[(e[None, :] < dev_p[:, :1]) | (e[None, :] > -dev_p[:, 1:])] = np.inf
        prefix[0, :] = 0.0
        self.prefix = prefix
        self.prefix_upto = np.minimum.accumulate(prefix, axis=1)

        # Every move no slower than tau: latency + h(k, j, m), h tabulated over (k < j, m).
        pk, pj = np.triu_indices(L + 1, 1)
        pair_of = np.zeros((L + 1, L + 1), dtype=np.int64)
        pair_of[pk, pj] = np.arange(pk.size)
        extra = table.sizes.astype(float) - D  # (submesh,)
        pq = p[pk] + q[pj]  # (pairs, λ)
        h = np.full((pk.size, extra.size), -np.inf)
        for x, lam_x in enumerate(lam):
            np.maximum(h, pq[:, x, None] + lam_x * extra, out=h)
        least = (dev_p[pk, 0] + dev_q[pj, 0])[:, None] + extra + D
        most = (-dev_p[pk, 1] - dev_q[pj, 1])[:, None] + extra + D
        h[(least > D) | (most < D)] = np.inf
        fast = table.move_lat <= self.tau
        self.move_bound = np.where(
            fast, table.move_lat + h[pair_of[table.move_k, table.move_j], table.move_m], np.inf)
        return self


@dataclass(frozen=True, eq=False)
class _DPResult:
    sum_s: float  # Σ t_s as the DP added it
    moves: tuple[int, ...]  # indices into the table's move arrays, first stage first


def _solve_for_t_max(table: _StageTable, tau: float, thr: float, bounds: _Bounds):
    """Least Σ t_s over plans with every t_s ≤ tau, if some plan has Σ t_s ≤ thr; else None.

    Evaluates F(s, ·, ·) for s = 1, 2, … as sparse arrays of states (module docstring,
    step 3). Each state keeps its predecessor state and its stage (a move) to rebuild the plan.
    """
    L, D, cap = table.num_layers, table.num_devices, table.stage_cap
    slack = _PRUNE_SLACK * abs(thr) if math.isfinite(thr) else 0.0
    limit = thr + slack
    lb = bounds.prefix
    lb_upto = bounds.prefix_upto

    # Moves that can be part of a plan with Σ t ≤ thr, in table order (the tie-break order).
    idx = np.flatnonzero(bounds.move_bound <= limit)
    idx = idx[table.move_lat[idx] <= tau]
    mk, mj, ml = table.move_k[idx], table.move_j[idx], table.move_lat[idx]
    slo, shi, msize = table.move_slo[idx], table.move_shi[idx], table.sizes[table.move_m[idx]]
    moves = _Moves(mk, msize, ml, lb, D)

    num_keys = (L + 1) * (D + 1)  # state (k, d) has key k·(D+1) + d
    best_cost = np.full(num_keys, np.inf)  # least F over the levels so far, per (k, d)
    front_k = np.array([L])
    front_d = np.array([0])
    front_v = np.array([0.0])
    levels = []  # per level s: (predecessor in the previous front, move index, front map)
    found = None  # (sum, level, state index)
    for s in range(1, cap + 1):
        # Group the previous level's states by their layer j (= the next stage's end + 1).
        starts = np.flatnonzero(np.concatenate([[True], front_k[1:] != front_k[:-1]]))
        counts = np.diff(np.append(starts, front_k.size))
        group_of_j = np.full(L + 1, -1)
        group_of_j[front_k[starts]] = np.arange(starts.size)
        d_min = front_d[starts]
        d_max = front_d[starts + counts - 1]
        v_min = np.minimum.reduceat(front_v, starts)

        use = (slo <= s) & (shi >= s)
        g = group_of_j[mj]
        use &= g >= 0
        cand = np.flatnonzero(use)
        g = g[cand]
        room = D - d_min[g] - msize[cand]  # most devices any state in group g leaves
        k0 = mk[cand] == 0
        fine = np.where(k0, (room >= 0) & (D - msize[cand] <= d_max[g]), room >= 1)
        if s == cap:
            fine &= k0
        # LB(k, e) is not monotone in e: take its least value over e ≤ room.
        fine &= v_min[g] + ml[cand] + lb_upto[mk[cand], np.clip(room, 0, D)] <= limit
        cand, g = cand[fine], g[fine]
        if cand.size == 0:
            break

        pieces = []
        per_move = counts[g]
        cuts = np.searchsorted(np.cumsum(per_move), np.arange(0, per_move.sum(), _CHUNK),
                               side="right")
        cuts = np.append(cuts, cand.size)
        for a, b in zip(cuts[:-1], cuts[1:]):
            if a < b:
                pieces.append(_expand(cand[a:b], g[a:b], per_move[a:b],
                                      _Front(starts, front_d, front_v), moves, limit,
                                      s == cap))
        keys = np.concatenate([p.keys for p in pieces])
        vals = np.concatenate([p.vals for p in pieces])
        prev = np.concatenate([p.prev for p in pieces])
        move = np.concatenate([p.move for p in pieces])
        if keys.size == 0:
            break
        # One state per (k, d): least cost, then earliest move (cut, submesh, option).
        least = np.full(num_keys, np.inf)
        np.minimum.at(least, keys, vals)
        win = vals == least[keys]
        earliest = np.full(num_keys, np.iinfo(np.int64).max)
        np.minimum.at(earliest, keys[win], move[win])
        win &= move == earliest[keys]  # (key, move) names one candidate
        slot = np.full(num_keys, -1)
        slot[keys[win]] = np.flatnonzero(win)
        win = slot[slot >= 0]  # the winners, by key
        keys, vals, prev, move = keys[win], vals[win], prev[win], move[win]
        better = vals < best_cost[keys]  # else fewer stages reached (k, d) as cheaply
        keys, vals, prev, move = keys[better], vals[better], prev[better], move[better]
        best_cost[keys] = vals
        k_new, d_new = np.divmod(keys, D + 1)
        done = np.flatnonzero(k_new == 0)  # sorted by key: at most one, (0, D)
        if done.size and (found is None or vals[done[0]] < found[0]):
            found = (float(vals[done[0]]), s, int(done[0]))
            limit = min(limit, found[0])  # later levels must beat it strictly
        alive = np.flatnonzero(k_new > 0)
        # prev indexes the previous level's front; alive maps this level's front to its states
        levels.append((prev, move, alive))
        front_k, front_d, front_v = k_new[alive], d_new[alive], vals[alive]
        if front_k.size == 0:
            break
    if found is None:
        return None
    total, s, state = found
    chain = []
    for level in range(s, 0, -1):
        prev, move, _ = levels[level - 1]
        chain.append(int(idx[move[state]]))
        if level > 1:
            state = int(levels[level - 2][2][prev[state]])
    return _DPResult(sum_s=total, moves=tuple(chain))


@dataclasses.dataclass(frozen=True, eq=False)
class _Front:
    """The DP's states at one level, grouped by layers left: group i is states
    starts[i] ..., each with devices used `d` and cost `v`."""
    starts: np.ndarray
    d: np.ndarray
    v: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class _Moves:
    """The moves of one t_max's DP: per move the layers left after it (`k`), its devices
    (`size`) and latency (`lat`); `lb[k, e]` bounds what k layers on e devices still cost;
    `D` devices in all."""
    k: np.ndarray
    size: np.ndarray
    lat: np.ndarray
    lb: np.ndarray
    D: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Expansion:
    """New states: key = k·(D+1) + d, value, predecessor index in the front, move index."""
    keys: np.ndarray
    vals: np.ndarray
    prev: np.ndarray
    move: np.ndarray


def _expand(cand, g, per_move, front: _Front, moves: _Moves, limit, last) -> _Expansion:
    """Pair each candidate move with every state of its group; keep those within the bound."""
    D = moves.D
    rep = np.repeat(np.arange(cand.size), per_move)
    offset = np.arange(rep.size) - np.repeat(np.cumsum(per_move) - per_move, per_move)
    src = front.starts[g][rep] + offset
    move = cand[rep]
    k = moves.k[move]
    d = front.d[src] + moves.size[move]
    v = front.v[src] + moves.lat[move]
    ok = np.where(k == 0, d == D, (d <= D - 1) & ~np.bool_(last))
    rem = np.clip(D - d, 0, D)
    ok &= v + moves.lb[k, rem] <= limit
    return _Expansion(k[ok] * (D + 1) + d[ok], v[ok], src[ok], move[ok])


# --------------------------------------------------------------------------------------------
# Step 4: the t_max search
# --------------------------------------------------------------------------------------------


def _search_t_max(table: _StageTable, num_micro_batches: int):
    """Best-first bisection over the candidate t_max (module docstring, step 4).

    Returns (best plan or None, number of distinct t_max whose DP ran).
    """
    taus = table.taus
    slope = num_micro_batches - 1
    minima = _RangeMinima(table)
    tried: set[int] = set()
    bound_cache: dict[int, _Bounds] = {}

    def run(index, thr):
        limit = thr + _PRUNE_SLACK * abs(thr)
        if any(c >= index and b.plan > limit for c, b in bound_cache.items()):
            return None  # a bound for a larger t_max already rules it out
        if index not in bound_cache:
            bound_cache[index] = _Bounds(table, minima, float(taus[index]))
        if bound_cache[index].plan > limit:
            return None
        # The DP needs the full tables: reuse those of a t_max at most 5 % larger.
        near = [c for c, b in bound_cache.items() if c >= index and b.prefix is not None
                and taus[c] <= taus[index] * _BOUND_CACHE_RATIO]
        bounds = bound_cache[min(near)] if near else bound_cache[index].complete()
        tried.add(index)
        return _solve_for_t_max(table, float(taus[index]), thr, bounds)

    top = taus.size - 1
    bound_cache[top] = _Bounds(table, minima, float(taus[top]))
    lb_top = bound_cache[top].plan
    result = None
    if math.isfinite(lb_top):
        for eps in _DEEPENING:
            result = run(top, lb_top * (1 + eps) if math.isfinite(eps) else math.inf)
            if result is not None:
                break
    if result is None:
        return None, len(tried)
    best_plan, best_key = _make_plan(table, result, num_micro_batches)
    top_max = best_plan.max_stage_latency_s
    for plan, key in _balanced_plans(table, num_micro_batches):
        if _better(key, best_key):
            best_plan, best_key = plan, key
    heap = []

    def push(lo, hi, g_above):
        if lo <= hi:
            heapq.heappush(heap, (g_above + slope * float(taus[lo]), lo, hi, g_above))

    # No plan exists below the first t_max whose device-count bound is finite (monotone).
    lo, hi = 0, top
    if result.sum_s + slope * float(taus[0]) >= best_key[0] * (1 - _TIE_REL):
        lo = hi  # nothing below the first plan can win (B = 1, say): skip the search
    while lo < hi:
        mid = (lo + hi) // 2
        if mid not in bound_cache:
            bound_cache[mid] = _Bounds(table, minima, float(taus[mid]))
        lo, hi = (mid + 1, hi) if math.isinf(bound_cache[mid].plan) else (lo, mid)
    push(lo, _tau_index(taus, top_max) - 1, result.sum_s)
    while heap:
        bound, lo, hi, g_above = heapq.heappop(heap)
        if bound >= best_key[0] * (1 - _TIE_REL):
            break  # every interval left is at least as slow as the best plan
        mid = (lo + hi) // 2
        result = run(mid, best_key[0] - slope * float(taus[lo]))
        if result is None:  # G(t) > thr for all t ≤ taus[mid]: [lo, mid] cannot win
            push(mid + 1, hi, g_above)
            continue
        plan, key = _make_plan(table, result, num_micro_batches)
        if _better(key, best_key):
            best_plan, best_key = plan, key
        push(mid + 1, hi, g_above)
        push(lo, _tau_index(taus, plan.max_stage_latency_s) - 1, result.sum_s)
    return best_plan, len(tried)


def _balanced_plans(table: _StageTable, num_micro_batches: int):
    """Starting incumbents: S stages of about L/S layers on equal submeshes of N·M/S devices.

    Only a good first "best" for the search to prune with; the search stays exact.
    """
    L, D = table.num_layers, table.num_devices
    n_shapes = len(table.shapes)
    for num_stages in range(1, table.stage_cap + 1):
        for m, size in enumerate(table.sizes):
            if size * num_stages != D:
                continue
            cuts = [p * L // num_stages for p in range(num_stages + 1)]
            stages = []
            for p in range(num_stages):
                q = _query_index(cuts[p], cuts[p + 1] - 1, m, L, n_shapes)
                in_flight = num_stages - p
                fitting = [o for o in table.options[table.query_offsets[q]:
                                                    table.query_offsets[q + 1]]
                           if o.memory_bytes(in_flight) <= table.memory_bytes]
                if not fitting:
                    break
                best = min(fitting, key=lambda o: o.latency_s)  # first of equal latencies
                stages.append(StageAssignment(cuts[p], cuts[p + 1] - 1, table.shapes[m], best))
            else:
                latencies = [st.option.latency_s for st in stages]
                t = sum(latencies) + (num_micro_batches - 1) * max(latencies)
                yield (PipelinePlan(tuple(stages), num_micro_batches, t),
                       (t, num_stages, tuple(cuts[1:-1]), (m,) * num_stages))


def _tau_index(taus, latency):
    return int(np.searchsorted(taus, latency))


def _make_plan(table: _StageTable, result: _DPResult, num_micro_batches: int):
    stages = []
    for move in result.moves:
        k, j, m = int(table.move_k[move]), int(table.move_j[move]), int(table.move_m[move])
        option = table.options[int(table.move_opt[move])]
        stages.append(StageAssignment(k, j - 1, table.shapes[m], option))
    latencies = [st.option.latency_s for st in stages]
    t = sum(latencies) + (num_micro_batches - 1) * max(latencies)
    plan = PipelinePlan(tuple(stages), num_micro_batches, t)
    cuts = tuple(st.start for st in stages[1:])
    shape_index = tuple(int(table.move_m[move]) for move in result.moves)
    return plan, (t, len(stages), cuts, shape_index)


def _better(key, best_key) -> bool:
    """Faster by more than _TIE_REL, or as fast and earlier in (stages, cuts, submeshes)."""
    t, best_t = key[0], best_key[0]
    tol = _TIE_REL * max(abs(t), abs(best_t))
    if t < best_t - tol:
        return True
    if t > best_t + tol:
        return False
    return key[1:] < best_key[1:]


# --------------------------------------------------------------------------------------------
# Errors and small helpers
# --------------------------------------------------------------------------------------------


def _infeasible(table: _StageTable) -> NoFeasiblePipelineError:
    """Say why no plan exists and what to change."""
    L, D = table.num_layers, table.num_devices
    mem = table.memory_bytes
    remedy = ("Use more micro-batches (smaller micro-batches keep fewer activations), turn on "
              "rematerialisation in the stage options, or use more devices or devices with more "
              "memory.")
    if not table.options:
        return NoFeasiblePipelineError(
            f"stage_options returned no option for any layer range on any submesh of "
            f"{D} devices ({table.cost_queries} queries): it must return at least one "
            "StageOption for the ranges and submeshes that can run"
        )
    keys = _option_keys(table)
    covering = _covered_layers(L, keys[:, 0], keys[:, 1] + 1)
    if not covering.all():
        missing = np.flatnonzero(~covering)
        return NoFeasiblePipelineError(
            f"no stage option covers layer(s) {_format_layers(missing)}: stage_options "
            "returned nothing for every layer range and submesh containing them; give each "
            "layer at least one option on some submesh"
        )
    need = table.options.param_bytes + table.options.act_bytes
    fitting = _covered_layers(L, table.move_k, table.move_j)
    if not fitting.all():
        missing = np.flatnonzero(~fitting)
        layer = int(missing[0])
        on_layer = (keys[:, 0] <= layer) & (keys[:, 1] >= layer)
        return NoFeasiblePipelineError(
            f"no stage holding layer(s) {_format_layers(missing)} fits in {_format_bytes(mem)} "
            f"per device: the smallest per-device need seen for layer {layer} is "
            f"{_format_bytes(float(need[on_layer].min()))} (params + activations of one "
            f"micro-batch in flight). {remedy}"
        )
    minima = _RangeMinima(table)
    _, q = minima.chains(minima.weights(math.inf)[:, :2])
    least, most = q[0, 0], -q[0, 1]  # devices the stages that fit can use, in total
    if most < D:
        return NoFeasiblePipelineError(
            f"the stages that fit in {_format_bytes(mem)} per device can use at most "
            f"{most:.0f} devices in total, but a plan must use exactly {D} devices: give "
            "options on larger submeshes in stage_options, or plan for fewer devices"
        )
    if least > D:
        return NoFeasiblePipelineError(
            f"the stages that fit in {_format_bytes(mem)} per device need at least "
            f"{least:.0f} devices in total, but a plan must use exactly {D} devices (smallest "
            f"per-device need seen {_format_bytes(float(need.min()))}). {remedy}"
        )
    return NoFeasiblePipelineError(
        f"every layer fits on some submesh, but no plan of at most {table.stage_cap} stage(s) "
        f"covers layers 0..{L - 1} with submeshes summing to exactly {D} devices while each "
        f"stage fits its micro-batches in flight ({_format_bytes(mem)} per device; smallest "
        f"per-device need seen {_format_bytes(float(need.min()))}). A stage s of S holds S − s "
        f"micro-batches, so early stages need the most memory. {remedy}"
    )


def _covered_layers(num_layers, starts, stops) -> np.ndarray:
    """Which layers lie in at least one range [start, stop)."""
    marks = np.zeros(num_layers + 1, dtype=np.int64)
    np.add.at(marks, starts, 1)
    np.add.at(marks, stops, -1)
    return np.cumsum(marks[:-1]) > 0


def _validate(num_layers, num_nodes, devices_per_node, num_micro_batches, stage_options,
              device_memory_bytes, max_stages) -> int:
    """Check the arguments; return the stage cap min(L, N·M, max_stages)."""
    _check_positive_int(num_layers, "num_layers")
    _check_positive_int(num_nodes, "num_nodes")
    _check_positive_int(devices_per_node, "devices_per_node")
    _check_positive_int(num_micro_batches, "num_micro_batches")
    if not callable(stage_options):
        raise ValueError(
            f"stage_options must be a callable (start, end, submesh) -> options or a "
            f"StageOptionGrid, got {type(stage_options).__name__}"
        )
    memory = device_memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, numbers.Real) or math.isnan(memory) \
            or memory <= 0:
        raise ValueError(
            f"device_memory_bytes must be a number > 0 (math.inf for no limit), got {memory!r}"
        )
    cap = min(int(num_layers), int(num_nodes) * int(devices_per_node))
    if max_stages is not None:
        _check_positive_int(max_stages, "max_stages", "or None for no limit")
        cap = min(cap, int(max_stages))
    return cap


def _check_positive_int(value, name, extra=""):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' ' + extra if extra else ''}, got "
                         f"{value!r}")


def _as_option_tuple(got, start, end, shape) -> tuple:
    try:
        return tuple(got)
    except TypeError:
        raise ValueError(
            f"stage_options({start}, {end}, {shape}) returned {type(got).__name__}, not a "
            "sequence of StageOption (return [] when the range cannot run there)"
        ) from None


def _checked_options(got, start, end, shape) -> tuple[StageOption, ...]:
    got = _as_option_tuple(got, start, end, shape)
    for option in got:
        if not isinstance(option, StageOption):
            raise ValueError(
                f"stage_options({start}, {end}, {shape}) returned a {type(option).__name__} "
                "among its options; return StageOption records"
            )
    return got


def _count_sequences(shapes, total, length) -> int:
    """Sequences of `length` shapes whose sizes sum to `total`."""
    ways = np.zeros(total + 1, dtype=object)
    ways[0] = 1
    for _ in range(length):
        nxt = np.zeros(total + 1, dtype=object)
        for shape in shapes:
            n = shape.num_devices
            nxt[n:] += ways[: total + 1 - n]
        ways = nxt
    return int(ways[total])


def _shape_sequences(shapes, total, length):
    """Every sequence of `length` shape indices whose sizes sum to `total`, in order."""
    if length == 0:
        if total == 0:
            yield ()
        return
    for m, shape in enumerate(shapes):
        if shape.num_devices <= total - (length - 1):
            for rest in _shape_sequences(shapes, total - shape.num_devices, length - 1):
                yield (m,) + rest


def _format_layers(layers) -> str:
    layers = [int(x) for x in layers]
    if len(layers) > 6:
        return ", ".join(map(str, layers[:6])) + f", … ({len(layers)} layers)"
    return ", ".join(map(str, layers))


def _format_bytes(n: float) -> str:
    if math.isinf(n):
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.4g} {unit}" if unit != "B" else f"{n:.4g} B"
        n /= 1024
    return f"{n} B"  # unreachable
