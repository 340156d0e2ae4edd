"""Layer clustering: cut the forward pass into L contiguous layers (Alpa paper, §5.2).

The forward pass of a train step is a sequence of ``n`` operators in program order; op ``j``
costs ``w_j ≥ 0`` FLOPs. Tensor ``e`` is produced by op ``p_e`` and last read in the forward
pass by op ``q_e > p_e``, and has ``s_e`` bytes. This module knows nothing of JAX: the caller
(tracing) turns equations into these numbers.

The problem
-----------
Positions are *boundaries* ``b ∈ {0, …, n}``: boundary ``b`` lies between op ``b−1`` and op
``b``, so a layer is a half-open op range ``[a, b)`` with FLOPs ``P[b] − P[a]``, where
``P[b] = w_0 + … + w_(b−1)`` is the prefix sum (``P[0] = 0``, ``W = P[n]``). A clustering
into L layers is ``0 = b_0 < b_1 < … < b_(L−1) < b_L = n``. Cutting at interior boundary
``b`` (ops ``…b−1 | b…``, "after op ``c = b − 1``") costs the activations that cross it::

    X(c) = Σ_e s_e  over tensors with  0 ≤ p_e ≤ c < q_e                  → ``cut_costs``

computed with a difference array (``+s_e`` at ``p_e``, ``−s_e`` at ``q_e``, prefix sum), in
O(n + #tensors). A tensor with ``p_e = −1`` (a program input) is accepted but costs nothing
at any cut: it is delivered to whichever layer reads it wherever the cuts fall, so it cannot
tell one clustering from another. Parameters should not be passed at all.

Constraint (balance, Alpa §5.2)::

    P[b_(k+1)] − P[b_k] ≤ cap = (1 + eps) · W / L          for every layer k

checked as ``P[b] ≤ P[a] + cap + 1e-9·W`` (``FLOPS_RELATIVE_TOLERANCE``) so that a layer
that is exactly ``cap`` is not refused for a rounding error in the prefix sums.

Objective, lexicographic::

    1. M = max_k X(b_k − 1)          the fattest activation cut through (pipeline p2p volume)
    2. S = Σ_k X(b_k − 1)            total activation bytes crossing cuts
    3. F = max_k (P[b_(k+1)] − P[b_k])   the heaviest layer (balance)
    4. (b_1, …, b_(L−1))             lexicographically smallest: earliest cuts (determinism)

Why not one DP on the tuple (M, S, F)
-------------------------------------
A forward DP that keeps, per (layers used, end), the lexicographic minimum of (max, sum, …)
is *not* exact, because "take the max with the next cut" does not preserve lexicographic
order: a prefix with (max 1, sum 100) beats one with (max 2, sum 2), but after a cut of 5
they become (5, 105) and (5, 7) and the order flips. So the objective is split into parts
where each recurrence composes monotonically:

Phase 1 — smallest achievable max cut M*  → ``_smallest_max_cut``
    For a threshold T let the allowed cuts be the boundaries with X ≤ T. Exactly L layers
    exist iff (a) the greedy "jump to the farthest allowed boundary within cap" needs at most
    L layers and (b) there are at least L − 1 allowed boundaries — adding a cut to a valid
    clustering keeps it valid (its two halves have no more FLOPs than the whole), so every
    count from the greedy minimum up to 1 + #allowed is reachable. Feasibility is monotone
    in T, so M* is found by binary search over the distinct values of X; each test costs
    O(L log n). The same greedy, bisected over the cap, gives the smallest eps that works
    when no clustering exists (``ClusteringError.min_eps``).

Phase 2 — smallest sum S* using only cuts with X ≤ M*  → ``_solve_sum_then_balance``
    Suffix DP over k layers left and start boundary a; C(b) = X(b−1) if allowed, else ∞::

        H_1(a) = 0                                     if a < n and P[n] ≤ P[a] + cap, else ∞
        H_k(a) = min_{b ∈ (a, R(a)], b < n} V_k(b),    V_k(b) = C(b) + H_(k−1)(b)
        R(a)   = max { b : P[b] ≤ P[a] + cap }          (one ``searchsorted`` for all a)

    The window (a, R(a)] is where the FLOPs bound holds (two pointers: R is non-decreasing
    in a), and the window minimum is a range-minimum query on a sparse table, vectorised over
    every a at once: O(n log n) numpy work per k. S* = H_L(0).

Phase 3 — smallest heaviest layer F* among the sum-optimal clusterings  → same function
    An edge a → b is *tight* if V_k(b) = H_k(a) (it starts a sum-optimal suffix); then::

        F_1(a) = P[n] − P[a]
        F_k(a) = min over tight b ∈ (a, R(a)] of  max(P[b] − P[a], F_(k−1)(b))

    (sum then bottleneck composes monotonically: equal sums stay equal after adding C(b),
    and max(·, d) preserves order). With the tight b of one value class sorted by position,
    P[b] − P[a] rises and the running minimum m(J) of F_(k−1) over the first J of them falls,
    so min_J max(P[b_J] − P[a], m(J)) sits where the two cross: a vectorised binary search
    with range-minimum queries. F* = F_L(0).

Reconstruction — earliest cuts
    From a = 0, k = L: take the *smallest* b in the window with V_k(b) = H_k(a) and
    max(P[b] − P[a], F_(k−1)(b)) ≤ F*; then a = b, k = k − 1. Each choice keeps an optimal
    completion possible, so the result is the lexicographically smallest optimal clustering.

Total O(L · n log n) numpy work plus O(n) for the phase-1 searches; ``brute_force_clustering``
enumerates every cut set and is what the tests compare against. Ties are decided by exact
float comparison; byte and FLOP counts are whole numbers, which float64 adds exactly.

Choosing L  → ``choose_num_layers``
    Among the candidates whose clustering exists, take the largest L whose M*(L) is at most
    (1 + eps) · min_{L' ≥ 2} M*(L'). Only phase 1 runs per candidate; the full DP runs once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BRUTE_FORCE_MAX_CUT_SETS",
    "Clustering",
    "ClusteringError",
    "ClusteringProblem",
    "brute_force_clustering",
    "choose_num_layers",
    "cluster_layers",
    "cut_costs",
    "thin_layer_counts",
]

BRUTE_FORCE_MAX_CUT_SETS = 200_000
"""``brute_force_clustering`` refuses problems with more cut sets (C(n−1, L−1)) than this."""

DEFAULT_MAX_AUTO_LAYERS = 64
"""``choose_num_layers`` tries every L from 1 to min(n, this) when no candidates are given."""

FLOPS_RELATIVE_TOLERANCE = 1e-9
"""A layer may exceed the FLOPs cap by this fraction of W (rounding in the prefix sums)."""


# --------------------------------------------------------------------------------------------
# Public records
# --------------------------------------------------------------------------------------------


class ClusteringError(ValueError):
    """No clustering into ``num_layers`` layers keeps every layer within the FLOPs cap.

    Attributes:
        num_layers: the L that was asked for.
        eps: the balance slack that was asked for.
        min_eps: the smallest eps for which a clustering into ``num_layers`` layers exists;
            ``None`` when none exists for any eps (more layers than operators).
    """

    def __init__(self, message: str, num_layers: int, eps: float, min_eps: float | None):
        super().__init__(message)
        self.num_layers = num_layers
        self.eps = eps
        self.min_eps = min_eps


@dataclass(frozen=True)
class ClusteringProblem:
    """The forward pass as the clustering sees it; validated when built.

    Attributes:
        flops: FLOPs per operator, in program order (finite, ≥ 0). At least one operator.
        tensors: ``(producer, last_reader, bytes)`` per activation: the op that produces it
            (or −1 for a program input, which costs nothing at a cut), the last op that reads
            it in the forward pass (``producer < last_reader < n``), and its size in bytes
            (finite, ≥ 0). Parameters do not belong here.

    Raises:
        ValueError: naming the entry that is not a number, is negative or non-finite, or has
            an index out of range or a producer that does not come before its reader.
    """

    flops: tuple[float, ...]
    tensors: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self):
        try:
            flops = tuple(float(f) for f in self.flops)
        except (TypeError, ValueError) as err:
            raise ValueError(f"flops must be a sequence of numbers (FLOPs per op): {err}") from None
        if not flops:
            raise ValueError("flops is empty: a clustering problem needs at least one operator")
        for j, f in enumerate(flops):
            if not math.isfinite(f) or f < 0:
                raise ValueError(
                    f"flops[{j}] = {f}: FLOPs must be finite and >= 0; give an op that does no "
                    "arithmetic 0 FLOPs"
                )
        n = len(flops)
        tensors = []
        for k, entry in enumerate(self.tensors):
            tensors.append(_check_tensor(k, entry, n))
        object.__setattr__(self, "flops", flops)
        object.__setattr__(self, "tensors", tuple(tensors))

    @property
    def num_ops(self) -> int:
        return len(self.flops)

    @property
    def total_flops(self) -> float:
        return float(np.sum(self.flops))


@dataclass(frozen=True)
class Clustering:
    """L contiguous layers of operators and what cutting there costs.

    Attributes:
        boundaries: first op of each layer; ``boundaries[0] == 0``, strictly increasing,
            length L. Layer k holds ops ``boundaries[k]`` up to (not including)
            ``boundaries[k+1]`` (or n for the last layer).
        layer_flops: FLOPs per layer.
        cut_bytes: X at each of the L − 1 cuts: bytes of activations crossing the cut in
            front of ``boundaries[1:]``.
    """

    boundaries: tuple[int, ...]
    layer_flops: tuple[float, ...]
    cut_bytes: tuple[float, ...]

    def __post_init__(self):
        boundaries = tuple(int(b) for b in self.boundaries)
        if not boundaries or boundaries[0] != 0:
            raise ValueError(f"boundaries must start with 0 (the first layer starts at op 0), "
                             f"got {boundaries}")
        if any(b1 <= b0 for b0, b1 in zip(boundaries, boundaries[1:])):
            raise ValueError(f"boundaries must be strictly increasing (layers are non-empty), "
                             f"got {boundaries}")
        layer_flops = tuple(float(f) for f in self.layer_flops)
        cut_bytes = tuple(float(x) for x in self.cut_bytes)
        if len(layer_flops) != len(boundaries) or len(cut_bytes) != len(boundaries) - 1:
            raise ValueError(
                f"{len(boundaries)} layers need {len(boundaries)} layer_flops and "
                f"{len(boundaries) - 1} cut_bytes, got {len(layer_flops)} and {len(cut_bytes)}"
            )
        object.__setattr__(self, "boundaries", boundaries)
        object.__setattr__(self, "layer_flops", layer_flops)
        object.__setattr__(self, "cut_bytes", cut_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.boundaries)

    @property
    def max_cut_bytes(self) -> float:
        """The fattest cut (0 for a single layer): the objective the clustering minimises."""
        return max(self.cut_bytes, default=0.0)

    @property
    def sum_cut_bytes(self) -> float:
        """Bytes crossing all cuts together: the first tie-break."""
        return float(sum(self.cut_bytes))

    @property
    def imbalance(self) -> float:
        """Heaviest layer over the mean, max_k FLOPs_k / (W / L); 1.0 is perfect balance."""
        total = sum(self.layer_flops)
        if total == 0:
            return 1.0
        return max(self.layer_flops) / (total / self.num_layers)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def cut_costs(problem: ClusteringProblem) -> np.ndarray:
    """X(c) for c = 0 … n−2: bytes of activations crossing the cut after op c.

    X(c) = Σ s_e over tensors with 0 ≤ p_e ≤ c < q_e, by a difference array: +s_e at p_e,
    −s_e at q_e, then a prefix sum, O(n + #tensors). Program inputs (p_e = −1) are left out
    (module docstring). Tiny negative rounding residues are clipped to 0.

    Returns:
        float64 array of length n − 1 (empty for a single op).
    """
    n = problem.num_ops
    diff = np.zeros(n + 1)
    if problem.tensors:
        table = np.asarray(problem.tensors, dtype=float)  # (tensors, 3)
        producer = table[:, 0].astype(np.int64)
        reader = table[:, 1].astype(np.int64)
        size = table[:, 2]
        keep = producer >= 0
        np.add.at(diff, producer[keep], size[keep])
        np.add.at(diff, reader[keep], -size[keep])
    crossing = np.cumsum(diff[: n - 1]) if n > 1 else np.zeros(0)
    return np.maximum(crossing, 0.0)


def cluster_layers(problem: ClusteringProblem, num_layers: int, eps: float = 0.1) -> Clustering:
    """Cut the ops into ``num_layers`` contiguous layers (module docstring, phases 1–3).

    Every layer has at most (1 + eps) · W / L FLOPs; among those clusterings the result has
    the smallest max cut, then the smallest total cut, then the lightest heaviest layer, then
    the earliest cuts.

    Args:
        problem: the ops' FLOPs and the activations between them.
        num_layers: L, between 1 and the number of ops.
        eps: balance slack, ≥ 0 (Alpa uses 0.1–0.5).

    Returns:
        The optimal ``Clustering``.

    Raises:
        ClusteringError: if num_layers exceeds the number of ops, or no clustering meets the
            FLOPs cap; the message (and ``min_eps``) gives the smallest eps that works.
        ValueError: if num_layers < 1 or eps is negative or not finite.

    Example:
        >>> p = ClusteringProblem(flops=(1, 1, 1, 1), tensors=((0, 2, 8.0), (1, 3, 1.0)))
        >>> cluster_layers(p, 2, eps=0.5).boundaries  # the cut after op 2 crosses 1 byte only
        (0, 3)
    """
    num_layers, eps = _check_arguments(problem, num_layers, eps)
    n, L = problem.num_ops, num_layers
    prefix = _prefix_flops(problem)
    x = cut_costs(problem)
    if L == 1:
        return _make_clustering(prefix, x, (0,))
    limit = _flops_limit(prefix[-1], L, eps)
    cut_at = np.full(n + 1, np.inf)  # X at boundary b (the cut after op b − 1); ∞ at 0 and n
    cut_at[1:n] = x
    max_cut = _smallest_max_cut(prefix, cut_at, limit, L)
    if max_cut is None:
        raise _infeasible_error(problem, prefix, L, eps)
    allowed_cost = np.where(cut_at <= max_cut, cut_at, np.inf)
    boundaries = _solve_sum_then_balance(prefix, allowed_cost, limit, L)
    return _make_clustering(prefix, x, boundaries)


def thin_layer_counts(
    problem: ClusteringProblem, candidates: Sequence[int] | None = None, eps: float = 0.1
) -> tuple[int, ...]:
    """The layer counts ``choose_num_layers`` may pick from, largest first.

    Every feasible candidate L ≥ 2 whose smallest max cut M*(L) is within (1 + eps) of the
    thinnest over all feasible L ≥ 2 (module docstring of ``choose_num_layers``); ``(1,)``
    when no L ≥ 2 is feasible but L = 1 is a candidate.

    Raises:
        ClusteringError, ValueError: as ``choose_num_layers``.
    """
    eps = _check_eps(eps)
    n = problem.num_ops
    if candidates is None:
        candidates = range(1, min(n, DEFAULT_MAX_AUTO_LAYERS) + 1)
    chosen_from = sorted({_check_layer_count(c, "candidates entry") for c in candidates})
    if not chosen_from:
        raise ValueError("candidates is empty: give at least one number of layers, or None "
                         "to try every L from 1 to min(n, 64)")
    prefix = _prefix_flops(problem)
    cut_at = np.full(n + 1, np.inf)
    cut_at[1:n] = cut_costs(problem)
    max_cut: dict[int, float] = {}
    for L in chosen_from:
        if L > n:
            continue
        if L == 1:
            max_cut[L] = 0.0
            continue
        found = _smallest_max_cut(prefix, cut_at, _flops_limit(prefix[-1], L, eps), L)
        if found is not None:
            max_cut[L] = found
    if not max_cut:
        tried = [L for L in chosen_from if L <= n]
        if not tried:
            raise ClusteringError(
                f"every candidate number of layers {chosen_from} exceeds the {n} operators: "
                f"give candidates of at most {n}",
                num_layers=chosen_from[0], eps=eps, min_eps=None)
        raise _infeasible_error(problem, prefix, tried[0], eps)
    multi = {L: m for L, m in max_cut.items() if L >= 2}
    if not multi:
        return (1,)
    thinnest = min(multi.values())
    return tuple(sorted((L for L, m in multi.items() if m <= (1 + eps) * thinnest),
                        reverse=True))


def choose_num_layers(
    problem: ClusteringProblem, candidates: Sequence[int] | None = None, eps: float = 0.1
) -> Clustering:
    """Pick L when the user gives none, then cluster into L layers.

    Rule: let M*(L) be the smallest max cut of an L-layer clustering (phase 1 of the module
    docstring) and M_min = min over feasible candidates L ≥ 2 of M*(L). Return the clustering
    for the *largest* feasible L ≥ 2 with M*(L) ≤ (1 + eps) · M_min; L = 1 only when no
    L ≥ 2 is feasible.

    Why: layers are the units the stage DP assigns to pipeline stages, so more layers give
    it more freedom (finer balance, more stages possible) and cost nothing in the stage DP
    beyond time. But each extra layer boundary is a place where activations may be sent
    between stages, and past some L the FLOPs cap forces cuts inside a block, through a
    fat tensor such as attention scores. M*(L) jumps at exactly that L, so the rule keeps
    the finest clustering that still cuts only where the model is thin. A single layer is
    left out of M_min because it has no cut at all (M* = 0) and would make every real
    clustering look fat. eps doubles as the slack on cut bytes, so a cut a few percent
    fatter than the thinnest one (e.g. a residual plus a small mask) still counts as thin.

    Args:
        problem: the ops' FLOPs and the activations between them.
        candidates: the L to consider; default every L from 1 to min(n, 64). Candidates
            larger than the number of ops are skipped.
        eps: balance slack for the FLOPs cap, and the slack on max cut bytes above.

    Raises:
        ClusteringError: if no candidate has a clustering within the FLOPs cap.
        ValueError: if candidates is empty or holds a non-integer or an L < 1.
    """
    return cluster_layers(problem, thin_layer_counts(problem, candidates, eps)[0], eps)


def brute_force_clustering(
    problem: ClusteringProblem, num_layers: int, eps: float = 0.1
) -> Clustering:
    """Enumerate every set of L − 1 cuts; for tests and tiny problems.

    Same objective, tie-breaks and FLOPs check as ``cluster_layers``.

    Raises:
        ValueError: if there are more than ``BRUTE_FORCE_MAX_CUT_SETS`` cut sets.
        ClusteringError: as ``cluster_layers``.
    """
    num_layers, eps = _check_arguments(problem, num_layers, eps)
    n, L = problem.num_ops, num_layers
    count = math.comb(n - 1, L - 1)
    if count > BRUTE_FORCE_MAX_CUT_SETS:
        raise ValueError(
            f"brute_force_clustering would enumerate C({n - 1}, {L - 1}) = {count} cut sets, "
            f"more than {BRUTE_FORCE_MAX_CUT_SETS}: use cluster_layers for this problem"
        )
    prefix = _prefix_flops(problem)
    x = cut_costs(problem)
    limit = _flops_limit(prefix[-1], L, eps)
    best_key, best = None, None
    for cuts in itertools.combinations(range(1, n), L - 1):
        ends = (0, *cuts, n)
        if any(prefix[b] > prefix[a] + limit for a, b in zip(ends, ends[1:])):
            continue
        crossing = [float(x[b - 1]) for b in cuts]
        heaviest = max(float(prefix[b] - prefix[a]) for a, b in zip(ends, ends[1:]))
        key = (max(crossing, default=0.0), sum(crossing), heaviest, cuts)
        if best_key is None or key < best_key:
            best_key, best = key, (0, *cuts)
    if best is None:
        raise _infeasible_error(problem, prefix, L, eps)
    return _make_clustering(prefix, x, best)


# --------------------------------------------------------------------------------------------
# Phase 1: smallest max cut, by binary search over thresholds with a greedy feasibility test
# --------------------------------------------------------------------------------------------


def _fewest_layers(
    prefix: np.ndarray, limit: float, allowed: np.ndarray, at_most: int
) -> int | None:
    """Fewest layers when cuts may fall only at the sorted interior boundaries ``allowed``.

    Greedy: from a, jump to the farthest allowed b with P[b] ≤ P[a] + limit. Returns None if
    impossible or more than ``at_most`` layers are needed (so it stops after O(at_most) jumps).
    """
    n = len(prefix) - 1
    reachable = prefix[allowed]  # non-decreasing
    a, count = 0, 0
    while count < at_most:
        count += 1
        reach = prefix[a] + limit
        if prefix[n] <= reach:
            return count
        k = int(np.searchsorted(reachable, reach, side="right")) - 1
        if k < 0 or allowed[k] <= a:
            return None  # the op right after a is heavier than the cap, or no cut in reach
        a = int(allowed[k])
    return None


def _smallest_max_cut(prefix: np.ndarray, cut_at: np.ndarray, limit: float, L: int) -> float | None:
    """M*: the smallest threshold T such that L layers exist using only cuts with X ≤ T."""
    n = len(prefix) - 1
    interior = cut_at[1:n]

    def feasible(threshold: float) -> bool:
        allowed = 1 + np.flatnonzero(interior <= threshold)
        return len(allowed) >= L - 1 and _fewest_layers(prefix, limit, allowed, L) is not None

    values = np.unique(interior)
    if len(values) == 0 or not feasible(values[-1]):
        return None
    lo, hi = 0, len(values) - 1  # values[hi] is feasible; find the first feasible index
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


def _smallest_cap(prefix: np.ndarray, L: int) -> float:
    """The smallest cap B* for which L layers exist with every cut allowed (bisection)."""
    n = len(prefix) - 1
    everywhere = np.arange(1, n)
    widest_op = float(np.max(np.diff(prefix)))
    lo, hi = max(widest_op, float(prefix[-1]) / L), float(prefix[-1])
    if _fewest_layers(prefix, lo, everywhere, L) is not None:
        return lo
    for _ in range(200):  # lo infeasible, hi feasible
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if _fewest_layers(prefix, mid, everywhere, L) is not None:
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------------------------
# Phases 2 and 3: sum DP, bottleneck DP over tight edges, earliest-cut reconstruction
# --------------------------------------------------------------------------------------------


def _solve_sum_then_balance(
    prefix: np.ndarray, cost: np.ndarray, limit: float, L: int
) -> tuple[int, ...]:
    """Boundaries minimising (Σ cost, heaviest layer, earliest cuts) over L layers.

    ``cost[b]`` is the cost of cutting at boundary b, ∞ where not allowed (and at 0 and n).
    Implements H_k, F_k and the reconstruction of the module docstring.
    """
    n = len(prefix) - 1
    starts = np.arange(n + 1)
    window_end = np.searchsorted(prefix, prefix + limit, side="right") - 1  # R(a) ≥ a
    window_end = np.minimum(window_end, n - 1)  # a cut at b = n would leave an empty layer
    H = np.full((L + 1, n + 1), np.inf)  # H[k, a]: min Σ cost over cuts of ops a.. into k layers
    F = np.full((L + 1, n + 1), np.inf)  # F[k, a]: min heaviest layer among those
    last = (prefix[n] <= prefix + limit) & (starts < n)
    H[1, last] = 0.0
    F[1, last] = prefix[n] - prefix[last]
    for k in range(2, L + 1):
        values = cost + H[k - 1]  # V_k(b)
        H[k] = _window_min(values, starts + 1, window_end)
        F[k] = _tight_bottleneck(prefix, values, H[k], F[k - 1], window_end)
    if not math.isfinite(H[L, 0]):  # phase 1 said a clustering exists: this is a bug
        raise RuntimeError("layer clustering DP found no clustering although phase 1 did")
    heaviest = F[L, 0]
    boundaries, a = [0], 0
    for k in range(L, 1, -1):
        b = np.arange(a + 1, window_end[a] + 1)
        ok = (cost[b] + H[k - 1, b] == H[k, a]) & (
            np.maximum(prefix[b] - prefix[a], F[k - 1, b]) <= heaviest
        )
        a = int(b[np.argmax(ok)])
        boundaries.append(a)
    return tuple(boundaries)


def _tight_bottleneck(
    prefix: np.ndarray,
    values: np.ndarray,
    best: np.ndarray,
    tail: np.ndarray,
    window_end: np.ndarray,
) -> np.ndarray:
    """F_k(a) = min over b ∈ (a, R(a)] with values[b] == best[a] of max(P[b] − P[a], tail[b]).

    Positions b with finite values are sorted by (value, b); the tight b for one a are then a
    contiguous run [lo, hi] in that order, along which P[b] − P[a] rises and the running
    minimum of ``tail`` falls, and a vectorised binary search finds where they cross.
    """
    n = len(prefix) - 1
    out = np.full(n + 1, np.inf)
    queries = np.flatnonzero(np.isfinite(best))
    if len(queries) == 0:
        return out
    finite = np.flatnonzero(np.isfinite(values))
    position = finite[np.argsort(values[finite], kind="stable")]  # by (value, b)
    distinct, rank = np.unique(values[position], return_inverse=True)
    stride = n + 2
    key = rank.astype(np.int64) * stride + position  # strictly increasing
    query_rank = np.searchsorted(distinct, best[queries]).astype(np.int64)  # exact match
    lo = np.searchsorted(key, query_rank * stride + queries + 1, side="left")
    hi = np.searchsorted(key, query_rank * stride + window_end[queries], side="right") - 1
    sorted_prefix = prefix[position]
    table = _sparse_min_table(tail[position], int(np.max(hi - lo + 1)))
    base = prefix[queries]
    # First J in [lo, hi] with min(tail[lo..J]) ≤ P[b_J] − P[a]; hi + 1 when there is none.
    left, right = lo.copy(), hi + 1
    active = np.flatnonzero(left < right)
    while len(active):
        mid = (left[active] + right[active]) // 2
        crossed = _query_min(table, lo[active], mid) <= sorted_prefix[mid] - base[active]
        right[active[crossed]] = mid[crossed]
        left[active[~crossed]] = mid[~crossed] + 1
        active = active[left[active] < right[active]]
    result = np.full(len(queries), np.inf)
    at = left <= hi  # taking b_J itself: max is P[b_J] − P[a]
    result[at] = sorted_prefix[left[at]] - base[at]
    before = left > lo  # stopping just before: max is the running minimum of tail
    result[before] = np.minimum(result[before], _query_min(table, lo[before], left[before] - 1))
    out[queries] = result
    return out


def _window_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(values[lo[i] .. hi[i]]) for every i (inclusive), ∞ where the window is empty."""
    out = np.full(len(lo), np.inf)
    ok = np.flatnonzero(lo <= hi)
    if len(ok):
        table = _sparse_min_table(values, int(np.max(hi[ok] - lo[ok] + 1)))
        out[ok] = _query_min(table, lo[ok], hi[ok])
    return out


def _sparse_min_table(values: np.ndarray, longest: int) -> np.ndarray:
    """table[t, i] = min(values[i .. i + 2^t − 1]) (∞-padded), for 2^t ≤ longest."""
    levels = max(1, int(longest).bit_length())
    table = np.full((levels, len(values)), np.inf)
    table[0] = values
    for t in range(1, levels):
        span = 1 << (t - 1)
        table[t, : len(values) - span] = np.minimum(table[t - 1, :-span], table[t - 1, span:])
    return table


def _query_min(table: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Range minimum over [lo, hi] (inclusive, lo ≤ hi) from two overlapping power-of-2 blocks."""
    level = np.frexp((hi - lo + 1).astype(float))[1] - 1  # floor(log2(length)), exact
    return np.minimum(table[level, lo], table[level, hi - (1 << level) + 1])


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _prefix_flops(problem: ClusteringProblem) -> np.ndarray:
    prefix = np.zeros(problem.num_ops + 1)
    np.cumsum(problem.flops, out=prefix[1:])
    return prefix


def _flops_limit(total: float, num_layers: int, eps: float) -> float:
    """(1 + eps) · W / L plus the rounding allowance FLOPS_RELATIVE_TOLERANCE · W."""
    return (1.0 + eps) * total / num_layers + FLOPS_RELATIVE_TOLERANCE * total


def _make_clustering(prefix: np.ndarray, x: np.ndarray, boundaries: tuple[int, ...]) -> Clustering:
    ends = (*boundaries, len(prefix) - 1)
    return Clustering(
        boundaries=tuple(boundaries),
        layer_flops=tuple(float(prefix[b] - prefix[a]) for a, b in zip(ends, ends[1:])),
        cut_bytes=tuple(float(x[b - 1]) for b in boundaries[1:]),
    )


def _infeasible_error(
    problem: ClusteringProblem, prefix: np.ndarray, L: int, eps: float
) -> ClusteringError:
    total = float(prefix[-1])
    cap = (1 + eps) * total / L
    need = _smallest_cap(prefix, L)
    min_eps = max(0.0, need * L / total - 1.0)
    shown = math.ceil(min_eps * 1e4 - 1e-6) / 1e4  # rounded up, so the advice works
    heaviest_op = int(np.argmax(problem.flops))
    if problem.flops[heaviest_op] > cap:
        why = (
            f"op {heaviest_op} alone has {problem.flops[heaviest_op]:.6g} FLOPs, more than "
            f"the per-layer cap (1 + eps)·W/L = {cap:.6g} (eps={eps:g}, W={total:.6g}, L={L})"
        )
    else:
        why = (
            f"every clustering has a layer above the cap (1 + eps)·W/L = {cap:.6g} FLOPs "
            f"(eps={eps:g}, W={total:.6g}, L={L}); the most balanced one has a layer of "
            f"{need:.6g}"
        )
    return ClusteringError(
        f"no clustering of the {problem.num_ops} operators into {L} layers exists: {why}. "
        f"Use eps >= {shown:g} (the smallest that works for {L} layers), or another number "
        "of layers (choose_num_layers picks one)",
        num_layers=L, eps=eps, min_eps=min_eps,
    )


def _check_arguments(problem: ClusteringProblem, num_layers, eps) -> tuple[int, float]:
    if not isinstance(problem, ClusteringProblem):
        raise ValueError(f"problem must be a ClusteringProblem, got {type(problem).__name__}")
    L = _check_layer_count(num_layers, "num_layers")
    eps = _check_eps(eps)
    if L > problem.num_ops:
        raise ClusteringError(
            f"cannot cut {problem.num_ops} operators into {L} layers: every layer needs at "
            f"least one operator. Use num_layers <= {problem.num_ops}, or choose_num_layers",
            num_layers=L, eps=eps, min_eps=None,
        )
    return L, eps


def _check_layer_count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be an int number of layers, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1 (a number of layers), got {value}")
    return int(value)


def _check_eps(eps) -> float:
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a number (balance slack, e.g. 0.1), got {eps!r}") from None
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(
            f"eps must be finite and >= 0 (layers may have up to (1 + eps)·W/L FLOPs), got {eps}"
        )
    return eps


def _check_tensor(k: int, entry, n: int) -> tuple[int, int, float]:
    try:
        producer, reader, size = entry
    except (TypeError, ValueError):
        raise ValueError(
            f"tensors[{k}] = {entry!r}: expected a (producer op, last reader op, bytes) triple"
        ) from None
    for name, index in (("producer", producer), ("last reader", reader)):
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise ValueError(f"tensors[{k}] = {entry!r}: the {name} must be an int op index, "
                             f"got {index!r}")
    producer, reader = int(producer), int(reader)
    try:
        size = float(size)
    except (TypeError, ValueError):
        raise ValueError(f"tensors[{k}] = {entry!r}: bytes must be a number") from None
    if not -1 <= producer < n:
        raise ValueError(f"tensors[{k}] = {entry!r}: producer {producer} is out of range; use "
                         f"an op index in 0..{n - 1}, or -1 for a program input")
    if not 0 <= reader < n:
        raise ValueError(f"tensors[{k}] = {entry!r}: last reader {reader} is out of range for "
                         f"{n} ops; use an op index in 0..{n - 1}")
    if producer >= reader:
        raise ValueError(
            f"tensors[{k}] = {entry!r}: producer op {producer} must come before its last "
            f"reader op {reader} in program order; drop tensors no later op reads"
        )
    if not math.isfinite(size) or size < 0:
        raise ValueError(f"tensors[{k}] = {entry!r}: bytes must be finite and >= 0, got {size}")
    return producer, reader, size
