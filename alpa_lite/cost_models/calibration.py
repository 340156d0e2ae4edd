"""Calibration fits: turn micro-benchmark timings into cost-model parameters (numpy only).

These are pure functions of measured numbers; ``alpa_lite/calibrate.py`` does the measuring
(with JAX) and ``bench/calibrate_h100.py`` feeds them published H100 timings. Each fit is
the inverse of the formula the cost model prices with, so a fitted parameter reproduces the
measurement it came from when it goes back through the model:

* Matmul efficiency curve (``compute.py``): one matmul of ``f`` FLOPs on one device takes
  ``t = op_overhead_s + f / (peak * eff(f))``, so a sample gives
  ``eff = f / (peak * (t - op_overhead_s))``. Samples are grouped into bins of
  ``1 / points_per_decade`` decades of FLOPs; each bin becomes one curve point
  ``(median f, median eff)``: medians, because timings on shared machines have outliers
  (the H100 sweep has a 512x8192x8192 matmul at 114 TFLOP/s between neighbours at 700).
  :meth:`DeviceSpec.matmul_efficiency_at` interpolates the points in ``log f``.
* Link alpha and beta (``collectives.py``): every flat collective time is linear in the
  link's latency ``alpha`` and inverse bandwidth ``1/B``, ``t = a * alpha + b * (1/B)``,
  e.g. ring all-reduce ``a = 2(n-1)``, ``b = 2(n-1)/n * M``. The coefficients are read off
  ``collectives.collective_time`` itself (evaluated on unit links), so the fit uses exactly
  the formulas the planner prices with, and ``alpha, B`` follow by least squares.
  :func:`fit_link_collectives` fits each collective timed on a link on its own: the
  all-reduce fit becomes the link's figures, the others its ``MeasuredCollective`` records.
* Memory bandwidth (``compute.py``'s memory term): an element-wise pass over ``M`` bytes
  (read plus written) takes ``t = c + M / B_mem``; ``B_mem`` and ``c`` by least squares.

Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_per_s`` per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from alpa_lite.cost_models.cluster import LinkSpec, MeasuredCollective
from alpa_lite.cost_models.collectives import AxisTopology, CollectiveKind, collective_time
from alpa_lite.cost_models.devices import (
    require_int,
    require_name,
    require_non_negative,
    require_positive,
)

__all__ = [
    "CollectiveSample",
    "LinkFit",
    "matmul_efficiencies",
    "best_flop_rate",
    "fit_matmul_efficiency_curve",
    "collective_coefficients",
    "fit_link",
    "fit_link_collectives",
    "fit_memory_bandwidth",
]

# A sample's overhead-free time must be at least this fraction of its measured time for
# the sample to say anything about efficiency: when the fixed overhead is more than half
# of the time, the difference is mostly measurement noise (CPU timings here vary by tens
# of percent, DESIGN.md), and the efficiency it implies is meaningless.
_MIN_WORK_FRACTION = 0.5

# An efficiency this close above 1 is rounding, not a measurement: `best_flop_rate`
# divides in another order than `matmul_efficiencies`, so the sample that set the peak can
# come out at 1 + a few ulps. Such a point is clipped to 1; anything larger is refused.
_ROUNDING = 1e-9


def _as_positive_array(owner: str, name: str, values: Sequence[float]) -> np.ndarray:
    """``values`` as a 1-D float array of finite positive numbers, or ValueError."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(
            f"{owner}: {name} must be a sequence of numbers, got {values!r}."
        ) from None
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            f"{owner}: {name} must be a non-empty 1-D sequence of numbers, got shape "
            f"{arr.shape}; pass one number per measured sample."
        )
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"{owner}: {name}[{i}] = {float(arr[i])!r} must be finite and > 0; drop failed or "
            f"empty measurements before fitting."
        )
    return arr


def _paired(owner: str, a_name: str, a, b_name: str, b) -> tuple[np.ndarray, np.ndarray]:
    x = _as_positive_array(owner, a_name, a)
    y = _as_positive_array(owner, b_name, b)
    if x.shape != y.shape:
        raise ValueError(
            f"{owner}: {a_name} has {x.size} samples but {b_name} has {y.size}; give one "
            f"{b_name} per {a_name}."
        )
    return x, y


# --------------------------------------------------------------------------------------
# Matmul efficiency
# --------------------------------------------------------------------------------------


def matmul_efficiencies(
    flops: Sequence[float],
    seconds: Sequence[float],
    peak_flops_per_s: float,
    overhead_s: float = 0.0,
) -> np.ndarray:
    """Fraction of peak each sample reached: ``eff = f / (peak * (t - overhead_s))``.

    Args:
      flops: FLOPs of one matmul on one device, per sample.
      seconds: Its measured time, per sample (same order).
      peak_flops_per_s: The peak the efficiencies are relative to.
      overhead_s: Fixed time per matmul to take off first (``DeviceSpec.op_overhead_s``).

    Returns:
      Efficiencies, one per sample; ``nan`` where ``t - overhead_s`` is less than half of
      ``t`` (the overhead dominates, module constant ``_MIN_WORK_FRACTION``).

    Raises:
      ValueError: for empty, unequal-length, non-positive or non-finite inputs.

    Example:
      >>> matmul_efficiencies([2e12], [2.0], 1e12).tolist()   # 1 TFLOP/s of 1 TFLOP/s
      [1.0]
    """
    owner = "matmul_efficiencies"
    f, t = _paired(owner, "flops", flops, "seconds", seconds)
    peak = require_positive(owner, "peak_flops_per_s", peak_flops_per_s)
    o = require_non_negative(owner, "overhead_s", overhead_s)
    work_s = t - o
    with np.errstate(divide="ignore", invalid="ignore"):
        eff = f / (peak * work_s)
    return np.where(work_s >= _MIN_WORK_FRACTION * t, eff, np.nan)


def best_flop_rate(
    flops: Sequence[float], seconds: Sequence[float], overhead_s: float = 0.0
) -> float:
    """The highest FLOP rate of the samples, ``max f / (t - overhead_s)``, in FLOP/s.

    Calibration on CPUs uses it as the peak (a CPU has no datasheet tensor peak that XLA
    reaches; the curve is then relative to the best rate seen). Samples dominated by the
    overhead are ignored as in :func:`matmul_efficiencies`.

    Raises:
      ValueError: for bad inputs, or when every sample is dominated by the overhead.
    """
    eff = matmul_efficiencies(flops, seconds, 1.0, overhead_s)
    if np.all(np.isnan(eff)):
        raise ValueError(
            f"best_flop_rate: every sample's time is mostly the overhead_s = {overhead_s!r} s; "
            f"measure larger matmuls."
        )
    return float(np.nanmax(eff))


def fit_matmul_efficiency_curve(
    flops: Sequence[float],
    seconds: Sequence[float],
    peak_flops_per_s: float,
    *,
    overhead_s: float = 0.0,
    points_per_decade: int = 2,
) -> tuple[tuple[float, float], ...]:
    """Fits ``DeviceSpec.matmul_efficiency_curve`` to matmul timings.

    ``eff_i = f_i / (peak * (t_i - overhead_s))`` per sample; samples whose
    ``log10 f`` falls in the same bin ``floor(log10 f * points_per_decade)`` are merged
    into the point ``(median f, median eff)`` (module docstring for why medians).

    Args:
      flops: FLOPs of one matmul on one device, per sample.
      seconds: Measured time of that matmul, per sample.
      peak_flops_per_s: The peak of the ``DeviceSpec`` the curve is for (the dtype
        measured): the datasheet peak of a known GPU, or :func:`best_flop_rate` on a CPU.
      overhead_s: The spec's ``op_overhead_s``, which the cost model adds on top.
      points_per_decade: Curve points per factor of 10 in FLOPs (at most).

    Returns:
      ``((flops, efficiency), ...)`` sorted by FLOPs, ready for ``DeviceSpec``.

    Raises:
      ValueError: for bad inputs; when no sample is left after dropping those dominated by
        the overhead; when a bin's median efficiency exceeds 1 (the peak is below what was
        measured: pass the right peak, or the best measured rate).

    Example:
      >>> fit_matmul_efficiency_curve([1e9, 1.2e9, 1e12], [0.01, 0.012, 1.25], 1e12)
      ((1100000000.0, 0.1), (1000000000000.0, 0.8))
    """
    owner = "fit_matmul_efficiency_curve"
    ppd = require_int(owner, "points_per_decade", points_per_decade, 1)
    f, _ = _paired(owner, "flops", flops, "seconds", seconds)
    eff = matmul_efficiencies(flops, seconds, peak_flops_per_s, overhead_s)
    keep = ~np.isnan(eff)
    if not keep.any():
        raise ValueError(
            f"{owner}: overhead_s = {overhead_s!r} s is more than half of every sample's "
            f"time, so no sample measures the matmul itself; measure larger matmuls."
        )
    f, eff = f[keep], eff[keep]
    bins = np.floor(np.log10(f) * ppd).astype(int)
    curve = []
    for b in np.unique(bins):
        sel = bins == b
        point_flops = float(np.median(f[sel]))
        point_eff = float(np.median(eff[sel]))
        if point_eff > 1.0 + _ROUNDING:
            raise ValueError(
                f"{owner}: matmuls of ~{point_flops:.3g} FLOPs ran at {point_eff:.3f} x the "
                f"peak {peak_flops_per_s:.4g} FLOP/s; the peak must be at least the measured "
                f"rate: pass the device's datasheet peak for this dtype, or best_flop_rate()."
            )
        curve.append((point_flops, min(point_eff, 1.0)))
    return tuple(curve)


# --------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------


def _flat(n: int, link: LinkSpec) -> AxisTopology:
    """A group of ``n`` devices on one link. A group spanning nodes with one device per
    node (how calibration times the inter-node link) is priced by the same flat formulas
    on the inter-node link (``collectives.py``, "local_size == 1")."""
    return AxisTopology(n, n, link, None)


@dataclass(frozen=True)
class CollectiveSample:
    """One timed collective over a group of devices on one kind of link.

    Attributes:
      kind: The collective (``CollectiveKind``); all-reduce is priced as a ring.
      group_size: Devices in the group (``n``), >= 2.
      nbytes: Bytes as ``collectives.py`` counts them (all-reduce: the per-device buffer;
        all-gather: the gathered result; reduce-scatter: the full input).
      seconds: Measured time of one collective.
    """

    kind: CollectiveKind
    group_size: int
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        owner = "CollectiveSample"
        if not isinstance(self.kind, CollectiveKind):
            raise ValueError(
                f"{owner}: kind must be a CollectiveKind, got {self.kind!r}; e.g. "
                f"CollectiveKind.ALL_REDUCE."
            )
        object.__setattr__(
            self, "group_size", require_int(owner, "group_size", self.group_size, 2)
        )
        object.__setattr__(self, "nbytes", require_positive(owner, "nbytes", self.nbytes))
        object.__setattr__(self, "seconds", require_positive(owner, "seconds", self.seconds))


def collective_coefficients(
    kind: CollectiveKind, group_size: int, nbytes: float
) -> tuple[float, float]:
    """``(a, b)`` with ``collective_time = a * alpha + b / B`` on one flat group.

    Read off ``collectives.collective_time`` itself: ``a`` is its time on a link with
    ``alpha = 1 s`` and an (in effect) infinite bandwidth, ``b`` its time on a link with
    ``alpha = 0`` and ``B = 1 byte/s``. Every flat formula of ``collectives.py`` is linear
    in ``alpha`` and ``1/B``, so these two evaluations give it exactly; e.g. ring all-reduce
    ``a = 2(n-1)``, ``b = 2(n-1)/n * M``.

    Example:
      >>> collective_coefficients(CollectiveKind.ALL_REDUCE, 4, 1000.0)
      (6.0, 1500.0)
    """
    n = require_int("collective_coefficients", "group_size", group_size, 2)
    # 1e300 bytes/s: M / B is below 1e-280 s for any real message, so `a` is exact to
    # float precision.
    latency_only = LinkSpec("unit-latency", 1e300, 1.0)
    bandwidth_only = LinkSpec("unit-bandwidth", 1.0, 0.0)
    a = collective_time(kind, nbytes, _flat(n, latency_only))
    b = collective_time(kind, nbytes, _flat(n, bandwidth_only))
    return float(a), float(b)


@dataclass(frozen=True)
class LinkFit:
    """A fitted link and how well it reproduces its samples.

    Attributes:
      link: The fitted ``LinkSpec`` (``latency_s`` = alpha, ``bandwidth_bytes_per_s`` = B).
      predicted_s: ``collective_time`` of each sample on ``link``, in sample order.
      relative_errors: ``predicted / measured - 1`` per sample.
    """

    link: LinkSpec
    predicted_s: tuple[float, ...]
    relative_errors: tuple[float, ...]


def fit_link(samples: Sequence[CollectiveSample], name: str) -> LinkFit:
    """Fits a link's alpha (latency per step) and beta (bandwidth) to collective timings.

    Each sample gives one equation ``t_i = a_i * alpha + b_i * x`` with ``x = 1/B`` and
    ``(a_i, b_i)`` from :func:`collective_coefficients`. The fit minimises the sum of
    squared *relative* errors ``sum_i ((a_i alpha + b_i x) / t_i - 1)^2`` (each row divided
    by ``t_i``), so microsecond small-message timings weigh as much as second-long large
    ones; an unweighted fit would let the largest message decide alpha. Constraints
    ``alpha >= 0`` and ``x > 0``: when the unconstrained optimum has ``alpha < 0`` the fit is
    redone with ``alpha = 0``.

    Args:
      samples: At least two samples with two different message sizes.
      name: The ``LinkSpec`` name.

    Returns:
      A :class:`LinkFit`.

    Raises:
      ValueError: with fewer than two distinct message sizes, or when the timings do not
        grow with the message size (no positive bandwidth fits).

    Example (ring all-reduce on 4 devices, alpha = 10 us, B = 1 GB/s, exact data):
      >>> s = [CollectiveSample(CollectiveKind.ALL_REDUCE, 4, m, 6e-5 + 1.5 * m / 1e9)
      ...      for m in (1e3, 1e6, 1e8)]
      >>> fit = fit_link(s, "l")
      >>> round(fit.link.latency_s * 1e6, 6), round(fit.link.bandwidth_bytes_per_s / 1e9, 6)
      (10.0, 1.0)
    """
    owner = "fit_link"
    require_name(owner, "name", name)
    samples = list(samples)
    if not all(isinstance(s, CollectiveSample) for s in samples):
        raise ValueError(f"{owner}: samples must be CollectiveSample records, got {samples!r}.")
    if len({(s.kind, s.group_size, s.nbytes) for s in samples}) < 2:
        raise ValueError(
            f"{owner}: {len(samples)} sample(s) with fewer than two distinct message sizes "
            f"cannot separate latency from bandwidth; time at least two sizes (e.g. 1 KB "
            f"and 64 MB)."
        )
    coef = np.array([collective_coefficients(s.kind, s.group_size, s.nbytes) for s in samples])
    t = np.array([s.seconds for s in samples])
    rows = coef / t[:, None]  # relative-error weighting (docstring)
    ones = np.ones_like(t)
    (alpha, x), *_ = np.linalg.lstsq(rows, ones, rcond=None)
    if alpha < 0:
        alpha = 0.0
        x = float(rows[:, 1] @ ones / (rows[:, 1] @ rows[:, 1]))
    if not x > 0:
        raise ValueError(
            f"{owner}: the timings do not grow with the message size (fitted 1/B = {x:.3g}), "
            f"so no positive bandwidth fits; time larger messages, or repeat noisy ones."
        )
    link = LinkSpec(name, 1.0 / float(x), float(alpha))
    predicted = tuple(
        float(collective_time(s.kind, s.nbytes, _flat(s.group_size, link))) for s in samples
    )
    errors = tuple(p / s.seconds - 1.0 for p, s in zip(predicted, samples))
    return LinkFit(link, predicted, errors)


def fit_link_collectives(
    samples: Sequence[CollectiveSample], name: str
) -> tuple[LinkSpec, tuple[tuple[CollectiveKind, LinkFit], ...]]:
    """Fits every collective timed on one link on its own (:func:`fit_link` per kind).

    The all-reduce fit gives the link's ``latency_s`` and ``bandwidth_bytes_per_s`` (the
    figures a preset link has, and what a collective without timings is priced with); each
    other collective's fit becomes a ``MeasuredCollective`` of the link.

    Returns:
      ``(link, ((kind, fit), ...))``, the fits in ``CollectiveKind`` order.

    Raises:
      ValueError: without all-reduce samples, or when a collective's fit fails
        (:func:`fit_link`; the message names the collective).

    Example (all-gather twice as slow per byte as the all-reduce's link):
      >>> ar = [CollectiveSample(CollectiveKind.ALL_REDUCE, 4, m, 6e-5 + 1.5 * m / 1e9)
      ...       for m in (1e3, 1e6)]
      >>> ag = [CollectiveSample(CollectiveKind.ALL_GATHER, 4, m, 3e-5 + 0.75 * m / 5e8)
      ...       for m in (1e3, 1e6)]
      >>> link, fits = fit_link_collectives(ar + ag, "l")
      >>> round(link.bandwidth_bytes_per_s / 1e9, 6), len(fits)
      (1.0, 2)
      >>> round(link.for_collective("all-gather").bandwidth_bytes_per_s / 1e9, 6)
      0.5
    """
    owner = "fit_link_collectives"
    samples = list(samples)
    if not all(isinstance(s, CollectiveSample) for s in samples):
        raise ValueError(f"{owner}: samples must be CollectiveSample records, got {samples!r}.")
    fits = []
    for kind in CollectiveKind:
        mine = [s for s in samples if s.kind is kind]
        if not mine:
            continue
        try:
            fits.append((kind, fit_link(mine, f"{name}:{kind.value}")))
        except ValueError as e:
            raise ValueError(f"{owner}: {kind.value}: {e}") from None
    by_kind = dict(fits)
    if CollectiveKind.ALL_REDUCE not in by_kind:
        raise ValueError(
            f"{owner}: no all-reduce samples; the all-reduce fit is the link's own figures, "
            f"so time all-reduces too."
        )
    base = by_kind[CollectiveKind.ALL_REDUCE].link
    measured = tuple(
        MeasuredCollective(kind.value, fit.link.bandwidth_bytes_per_s, fit.link.latency_s)
        for kind, fit in fits if kind is not CollectiveKind.ALL_REDUCE
    )
    link = LinkSpec(name, base.bandwidth_bytes_per_s, base.latency_s, measured)
    return link, tuple(fits)


# --------------------------------------------------------------------------------------
# Memory bandwidth
# --------------------------------------------------------------------------------------


def fit_memory_bandwidth(
    nbytes: Sequence[float], seconds: Sequence[float]
) -> tuple[float, float]:
    """Fits ``t = c + M / B_mem`` to element-wise passes over ``M`` bytes (read + written).

    Least squares on relative errors, as :func:`fit_link`: minimises
    ``sum_i ((c + M_i / B_mem) / t_i - 1)^2``, so small passes (the sizes of a small model's
    activations, often cache-resident and faster per byte) weigh as much as large ones.
    ``c`` is a fixed cost per pass (launch); with a single size, or a negative intercept,
    ``c = 0`` and ``1/B_mem = sum(M_i/t_i) / sum((M_i/t_i)^2)``.

    Returns:
      ``(bandwidth_bytes_per_s, intercept_s)``.

    Raises:
      ValueError: for bad inputs, or timings that do not grow with the size.

    Example:
      >>> bw, c = fit_memory_bandwidth([1e8, 2e8, 4e8], [0.011, 0.021, 0.041])
      >>> round(bw / 1e9, 6), round(c * 1e3, 6)    # 10 GB/s, 1 ms per pass
      (10.0, 1.0)
    """
    owner = "fit_memory_bandwidth"
    m, t = _paired(owner, "nbytes", nbytes, "seconds", seconds)
    ones = np.ones_like(t)
    slope = intercept = None
    if np.unique(m).size >= 2:
        rows = np.stack([m / t, 1.0 / t], axis=1)  # relative-error weighting (docstring)
        (slope, intercept), *_ = np.linalg.lstsq(rows, ones, rcond=None)
    if slope is None or intercept < 0:
        r = m / t
        slope, intercept = float(r @ ones / (r @ r)), 0.0
    if not slope > 0:
        raise ValueError(
            f"{owner}: the timings do not grow with the size (fitted 1/B = {slope:.3g}); "
            f"time larger arrays."
        )
    return 1.0 / float(slope), float(intercept)
