"""Device specifications: what one accelerator can compute and hold.

A :class:`DeviceSpec` is a frozen record of one device's dense peak FLOP rates per dtype,
its memory size and memory bandwidth, and the fraction of peak that matmuls and
elementwise ops reach in practice. The compute model (``compute.py``) turns these into
roofline times; the cluster model (``cluster.py``) puts devices into nodes and links.
Two optional refinements come from calibration (``calibration.py`` fits them,
``alpa_lite/calibrate.py`` measures them): a matmul efficiency that depends on the matmul's
size (``matmul_efficiency_curve``) and a fixed time per matmul kernel (``op_overhead_s``).
Both are left out of :meth:`DeviceSpec.to_dict` while they hold their defaults, so the
JSON (and the cluster fingerprints) of specs without them are what they were before.

Every constant below names its source: a datasheet, ``/work/shared/HARDWARE.md`` (figures
measured on the lent H100), or ``[Nominal]`` where the number is a stand-in chosen for tests.
Units are in the names: ``_per_s`` is per second, ``_bytes`` is bytes.
"""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DeviceSpec", "DEVICES"]

# The dtype whose peak is used when a dtype has no entry of its own (ints, float64 on a
# device that lists none, ...).
_FALLBACK_DTYPE = "float32"


# --------------------------------------------------------------------------------------
# Validation helpers, shared with cluster.py and collectives.py (same package).
# --------------------------------------------------------------------------------------


def _require_number(owner: str, field: str, value: Any) -> float:
    """Returns ``value`` as a float, or raises ValueError if it is not a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{owner}: {field} must be a real number, got {value!r} "
            f"(type {type(value).__name__}); pass a float such as 1e9."
        )
    return float(value)


def require_positive(owner: str, field: str, value: Any) -> float:
    """Returns ``value`` as a float if it is finite and > 0, else raises ValueError."""
    x = _require_number(owner, field, value)
    if not math.isfinite(x) or x <= 0.0:
        raise ValueError(
            f"{owner}: {field} must be finite and > 0, got {value!r}; "
            f"give the value in the unit its name states (e.g. bytes per second)."
        )
    return x


def require_non_negative(owner: str, field: str, value: Any) -> float:
    """Returns ``value`` as a float if it is finite and >= 0, else raises ValueError."""
    # A plain float or int first: the cost models check every operator's and collective's
    # work here (hundreds of thousands of calls in one plan), and `numbers.Real`'s
    # isinstance is an ABC check in Python, several times the cost of the rest.
    if type(value) is float or type(value) is int:
        if 0.0 <= value < math.inf:
            return float(value)
    x = _require_number(owner, field, value)
    if not math.isfinite(x) or x < 0.0:
        raise ValueError(
            f"{owner}: {field} must be finite and >= 0, got {value!r}; "
            f"use 0.0 for 'none' and give the value in the unit its name states."
        )
    return x


def _require_fraction(owner: str, field: str, value: Any) -> float:
    """Returns ``value`` as a float if it lies in (0, 1], else raises ValueError."""
    x = _require_number(owner, field, value)
    if not math.isfinite(x) or not 0.0 < x <= 1.0:
        raise ValueError(
            f"{owner}: {field} must be a fraction of peak in (0, 1], got {value!r}; "
            f"e.g. 0.75 for a matmul that reaches 75% of the datasheet peak."
        )
    return x


def require_int(owner: str, field: str, value: Any, minimum: int) -> int:
    """Returns ``value`` as an int if it is an integer >= ``minimum``, else raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{owner}: {field} must be an integer >= {minimum}, got {value!r} "
            f"(type {type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"{owner}: {field} must be >= {minimum}, got {value!r}.")
    return int(value)


def require_name(owner: str, field: str, value: Any) -> str:
    """Returns ``value`` if it is a non-empty string, else raises ValueError."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner}: {field} must be a non-empty string, got {value!r}.")
    return value


def check_keys(
    owner: str, d: Any, expected: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    """Raises ValueError unless ``d`` is a dict with every key of ``expected``, and no keys
    but those and ``optional`` ones."""
    if not isinstance(d, dict):
        raise ValueError(f"{owner}: expected a JSON object (dict), got {type(d).__name__}.")
    missing = sorted(set(expected) - set(d))
    extra = sorted(set(d) - set(expected) - set(optional))
    if missing or extra:
        raise ValueError(
            f"{owner}: missing keys {missing}, unknown keys {extra}; "
            f"expected {sorted(expected)}"
            + (f" and optionally {sorted(optional)}" if optional else "")
            + " (write it with to_dict()/to_json())."
        )


def _require_efficiency_curve(
    owner: str, field: str, value: Any
) -> tuple[tuple[float, float], ...]:
    """Returns ``value`` as ``((flops, fraction), ...)`` sorted by FLOPs, or raises ValueError.

    Each point needs FLOPs finite and > 0 (given once) and a fraction of peak in (0, 1].
    Lists (as JSON gives them) are accepted; the result is a tuple of float pairs.
    """
    example = "e.g. ((1e9, 0.05), (1e11, 0.6), (1e12, 0.8))"
    try:
        points = [tuple(p) for p in value]
    except TypeError:
        points = None
    if (
        points is None
        or isinstance(value, (str, bytes, dict))
        or any(len(p) != 2 for p in points)
    ):
        raise ValueError(
            f"{owner}: {field} must be a sequence of (flops, fraction_of_peak) pairs, got "
            f"{value!r}; {example}, or () for the constant matmul_efficiency."
        )
    out = []
    for i, (flops, fraction) in enumerate(points):
        out.append(
            (
                require_positive(owner, f"{field}[{i}] flops", flops),
                _require_fraction(owner, f"{field}[{i}] fraction", fraction),
            )
        )
    out.sort()
    for (f0, _), (f1, _) in zip(out, out[1:]):
        if f0 == f1:
            raise ValueError(
                f"{owner}: {field} lists {f0:g} FLOPs twice; give one efficiency per size "
                f"(average repeated measurements first)."
            )
    return tuple(out)


def _dtype_name(dtype: Any) -> str:
    """Canonical dtype name: 'bfloat16' for 'bfloat16', jnp.bfloat16 or np.dtype('bfloat16')."""
    if isinstance(dtype, str):
        return dtype.strip().lower()
    try:
        return np.dtype(dtype).name
    except TypeError as e:
        raise ValueError(
            f"dtype {dtype!r} is neither a dtype name nor a numpy/jax dtype; "
            f"pass a name such as 'bfloat16' or 'float32'."
        ) from e


# --------------------------------------------------------------------------------------
# DeviceSpec
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense peak FLOP rates, memory size and bandwidth, efficiencies.

    Attributes:
      name: Human-readable model name, e.g. ``"H100-SXM5-80GB"``.
      peak_flops_per_s: ``((dtype_name, dense_peak_flop_per_s), ...)``. Stored sorted by
        dtype name so that equal specs compare and serialise identically whatever order
        they were given in.
      memory_bytes: Device memory (HBM) in bytes.
      memory_bandwidth_bytes_per_s: Device memory bandwidth in bytes per second.
      matmul_efficiency: Fraction of peak a large matmul reaches ([Empirical]; on the lent
        H100 large bf16 matmuls reached 71-82% of 989 TFLOP/s, HARDWARE.md, so 0.75).
        Small or heavily sharded matmuls fall far below this; ``matmul_efficiency_curve``
        models that. Used only when the curve is empty.
      elementwise_efficiency: Fraction of the FLOP peak that non-matmul ops reach
        ([Nominal] 0.8, chosen to match the ~0.8 of HBM bandwidth that bf16 gelu reached
        on the H100, 2.6-2.8 of 3.35 TB/s, HARDWARE.md). Memory-bound ops are priced at
        the full datasheet bandwidth by ``compute.py``.
      matmul_efficiency_curve: ``((flops, fraction_of_peak), ...)``: the efficiency of one
        matmul/convolution as a function of its FLOPs on one device, interpolated linearly
        in ``log(flops)`` between points and clamped to the first/last point outside them
        (:meth:`matmul_efficiency_at`). Empty (the default) means the constant
        ``matmul_efficiency`` for every size. Fitted by ``calibration.py`` from measured
        matmuls; stored sorted by FLOPs.
      op_overhead_s: Fixed seconds added to every matmul/convolution on top of its
        roofline time: the per-kernel cost (launch, thunk dispatch) that no FLOP rate
        captures. 0.0 by default; measured by calibration.
    """

    name: str
    peak_flops_per_s: tuple[tuple[str, float], ...]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float = 0.75
    elementwise_efficiency: float = 0.8
    matmul_efficiency_curve: tuple[tuple[float, float], ...] = ()
    op_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        owner = f"DeviceSpec {self.name!r}"
        require_name("DeviceSpec", "name", self.name)
        peaks = self.peak_flops_per_s
        if isinstance(peaks, dict):
            peaks = tuple(peaks.items())
        try:
            pairs = [tuple(p) for p in peaks]
        except TypeError:
            pairs = None
        if not pairs or any(len(p) != 2 for p in pairs):
            raise ValueError(
                f"{owner}: peak_flops_per_s must be a non-empty sequence of "
                f"(dtype_name, flop_per_s) pairs, got {self.peak_flops_per_s!r}; "
                f"e.g. (('bfloat16', 989e12), ('float32', 67e12))."
            )
        canonical: dict[str, float] = {}
        for dtype, flops in pairs:
            key = _dtype_name(dtype)
            if key in canonical:
                raise ValueError(
                    f"{owner}: peak_flops_per_s lists dtype {key!r} twice; give each dtype once."
                )
            canonical[key] = require_positive(owner, f"peak_flops_per_s[{key!r}]", flops)
        object.__setattr__(self, "peak_flops_per_s", tuple(sorted(canonical.items())))
        object.__setattr__(
            self, "memory_bytes", require_positive(owner, "memory_bytes", self.memory_bytes)
        )
        object.__setattr__(
            self,
            "memory_bandwidth_bytes_per_s",
            require_positive(
                owner, "memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s
            ),
        )
        object.__setattr__(
            self,
            "matmul_efficiency",
            _require_fraction(owner, "matmul_efficiency", self.matmul_efficiency),
        )
        object.__setattr__(
            self,
            "elementwise_efficiency",
            _require_fraction(owner, "elementwise_efficiency", self.elementwise_efficiency),
        )
        object.__setattr__(
            self,
            "matmul_efficiency_curve",
            _require_efficiency_curve(
                owner, "matmul_efficiency_curve", self.matmul_efficiency_curve
            ),
        )
        object.__setattr__(
            self, "op_overhead_s", require_non_negative(owner, "op_overhead_s", self.op_overhead_s)
        )
        # The curve's log FLOPs, once: the planner prices matmuls thousands of times.
        object.__setattr__(
            self, "_log_flops", tuple(math.log(f) for f, _ in self.matmul_efficiency_curve)
        )

    def matmul_efficiency_at(self, flops: float) -> float:
        """Fraction of peak that one matmul of ``flops`` FLOPs (on one device) reaches.

        With an empty ``matmul_efficiency_curve`` this is ``matmul_efficiency``. Otherwise,
        between curve points ``(f0, e0)`` and ``(f1, e1)`` with ``f0 <= flops <= f1``:

            ``e0 + (e1 - e0) * (log(flops) - log(f0)) / (log(f1) - log(f0))``

        and ``e0`` of the first point below it, ``e1`` of the last above it (clamped).
        Efficiency grows roughly with the log of the size on GPUs (HARDWARE.md's sweep: 1-6%
        of peak at 1e9 FLOPs, ~80% from 1e11), hence interpolation in ``log(flops)``.

        Raises:
          ValueError: for negative or non-finite ``flops``.
        """
        f = require_non_negative(f"DeviceSpec {self.name!r}", "flops", flops)
        curve = self.matmul_efficiency_curve
        if not curve:
            return self.matmul_efficiency
        if f <= curve[0][0]:
            return curve[0][1]
        if f >= curve[-1][0]:
            return curve[-1][1]
        x = math.log(f)
        i = bisect.bisect_right(self._log_flops, x)       # x0 <= x < x1
        x0, x1 = self._log_flops[i - 1], self._log_flops[i]
        y0, y1 = curve[i - 1][1], curve[i][1]
        return (y1 - y0) / (x1 - x0) * (x - x0) + y0

    def peak_flops(self, dtype: Any) -> float:
        """Dense peak FLOP/s for ``dtype``.

        Args:
          dtype: A dtype name (``"bfloat16"``, ``"float32"``, ``"int32"``) or a numpy/jax
            dtype object.

        Returns:
          The listed peak for that dtype; for a dtype with no entry (ints, ...) the
          ``float32`` peak.

        Raises:
          ValueError: if the dtype has no entry and neither has ``float32``.
        """
        key = _dtype_name(dtype)
        table = dict(self.peak_flops_per_s)
        if key in table:
            return table[key]
        if _FALLBACK_DTYPE in table:
            return table[_FALLBACK_DTYPE]
        raise ValueError(
            f"DeviceSpec {self.name!r} lists no peak for dtype {key!r} and no "
            f"{_FALLBACK_DTYPE!r} fallback (it lists {sorted(table)}); add a "
            f"('{_FALLBACK_DTYPE}', flop_per_s) entry to peak_flops_per_s."
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``DeviceSpec.from_dict(spec.to_dict()) == spec``.

        ``matmul_efficiency_curve`` and ``op_overhead_s`` are written only when they differ
        from their defaults, so specs without them serialise (and fingerprint) exactly as
        before these fields existed.
        """
        d = {
            "name": self.name,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "matmul_efficiency": self.matmul_efficiency,
            "elementwise_efficiency": self.elementwise_efficiency,
        }
        if self.matmul_efficiency_curve:
            d["matmul_efficiency_curve"] = [list(p) for p in self.matmul_efficiency_curve]
        if self.op_overhead_s != 0.0:
            d["op_overhead_s"] = self.op_overhead_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        """Builds a DeviceSpec from :meth:`to_dict` output.

        The keys of :data:`_DEVICE_OPTIONAL_KEYS` may be absent (they take their defaults).

        Raises:
          ValueError: on missing or unknown keys (named in the message) or bad values.
        """
        check_keys("DeviceSpec.from_dict", d, _DEVICE_KEYS, _DEVICE_OPTIONAL_KEYS)
        peaks = d["peak_flops_per_s"]
        if not isinstance(peaks, dict):
            raise ValueError(
                f"DeviceSpec.from_dict: peak_flops_per_s must be an object mapping dtype "
                f"name to FLOP/s, got {peaks!r}; e.g. {{\"bfloat16\": 9.89e14}}."
            )
        return cls(
            name=d["name"],
            peak_flops_per_s=tuple(peaks.items()),
            memory_bytes=d["memory_bytes"],
            memory_bandwidth_bytes_per_s=d["memory_bandwidth_bytes_per_s"],
            matmul_efficiency=d["matmul_efficiency"],
            elementwise_efficiency=d["elementwise_efficiency"],
            matmul_efficiency_curve=d.get("matmul_efficiency_curve", ()),
            op_overhead_s=d.get("op_overhead_s", 0.0),
        )


_DEVICE_KEYS = (
    "name",
    "peak_flops_per_s",
    "memory_bytes",
    "memory_bandwidth_bytes_per_s",
    "matmul_efficiency",
    "elementwise_efficiency",
)
# Written by to_dict() only when they differ from their defaults (module docstring).
_DEVICE_OPTIONAL_KEYS = ("matmul_efficiency_curve", "op_overhead_s")


# --------------------------------------------------------------------------------------
# The devices we know. Peaks are dense (no 2:4 sparsity).
# --------------------------------------------------------------------------------------

# NVIDIA H100 SXM5 80GB datasheet (and HARDWARE.md): bf16/fp16 dense tensor 989 TFLOP/s,
# fp32 (non-tensor) 67 TFLOP/s, fp64 34 TFLOP/s, HBM3 80 GB at 3.35 TB/s.
# (JAX on GPU may run f32 matmuls as TF32, 494 TFLOP/s dense; we price float32 at the
# IEEE fp32 rate, the conservative choice.)
_H100_BF16_FLOPS_PER_S = 989e12
_H100_FP32_FLOPS_PER_S = 67e12
_H100_FP64_FLOPS_PER_S = 34e12
_H100_MEMORY_BYTES = 80e9

# NVIDIA H200 (SXM) datasheet: the H100's Hopper compute (bf16/fp16 dense tensor 989 TFLOP/s,
# listed as 1,979 with sparsity; fp32 67 TFLOP/s; fp64 34 TFLOP/s) with HBM3e 141 GB at
# 4.8 TB/s. JAX reports it as device_kind "NVIDIA H200".
_H200_MEMORY_BYTES = 141e9
_H200_MEMORY_BANDWIDTH_BYTES_PER_S = 4.8e12

# NVIDIA A100 SXM4 80GB datasheet (and HARDWARE.md): bf16/fp16 dense tensor 312 TFLOP/s,
# fp32 19.5 TFLOP/s, fp64 9.7 TFLOP/s, HBM2e 80 GB at 2.0 TB/s (2,039 GB/s).
_A100_BF16_FLOPS_PER_S = 312e12
_A100_FP32_FLOPS_PER_S = 19.5e12
_A100_FP64_FLOPS_PER_S = 9.7e12
_A100_MEMORY_BYTES = 80e9

# NVIDIA V100 SXM2 16GB datasheet (and HARDWARE.md): fp16 tensor 125 TFLOP/s, fp32
# 15.7 TFLOP/s, fp64 7.8 TFLOP/s, HBM2 16 GB at 900 GB/s.
# bfloat16: Volta has no bf16 tensor cores (bf16 arrived with Ampere), so XLA computes
# bf16 matmuls without them; we price bf16 at the fp32 peak, 15.7 TFLOP/s.
_V100_FP16_FLOPS_PER_S = 125e12
_V100_FP32_FLOPS_PER_S = 15.7e12
_V100_BF16_FLOPS_PER_S = _V100_FP32_FLOPS_PER_S
_V100_FP64_FLOPS_PER_S = 7.8e12
_V100_MEMORY_BYTES = 16e9

# --- Measured parts (micro-benchmarks, never end-to-end training times) -----------------
# Sources are rows of bench/data/device_microbenchmarks.json (their quotes and URLs) and
# bench/data/h100_jax_sweep.json (measured on the lent H100).
#
# Memory bandwidth that element-wise kernels reach (the roofline's memory term):
# H100: 3.21 TB/s, fitted by bench/calibrate_h100.py to the sweep's bf16 gelu and softmax
#   (bench/results/calibrated_1xH100_fit.json; BabelStream on Azure ND H100 v5: 2.90-2.97).
# A100: 1.70 TB/s, BabelStream Add/Triad on Azure ND A100 v4 (Copy/Mul 1.61).
# V100: 740 GB/s, CUDA bandwidthTest device-to-device on a V100-SXM2-16GB (one run).
_H100_MEMORY_BANDWIDTH_BYTES_PER_S = 3.21e12
_A100_MEMORY_BANDWIDTH_BYTES_PER_S = 1.70e12
_V100_MEMORY_BANDWIDTH_BYTES_PER_S = 0.740e12
# Matmul efficiency by size (FLOPs of one matmul on one device, fraction of the peak):
# H100: the bf16 JAX sweep with each call's dispatch taken off (bench/calibrate_h100.py;
#   bench/results/calibrated_1xH100.json) from 6.9e10 FLOPs up, capped at the best a shape
#   scan reaches, 792.1 of 989 TFLOP/s = 0.80 (stas00/ml-engineering "Maximum Achievable
#   Matmul FLOPS" table): above it the sweep's points are dispatch-subtraction noise. Below
#   6.9e10 FLOPs the sweep's rows are mostly per-call overhead (each timed one jitted
#   call), so the small sizes take the A100's in-loop fall-off at equal time at peak (as
#   for the V100 below), scaled to the H100's large-matmul efficiency.
# A100: cuBLASLt fp16 square GEMMs 1024^3 .. 16384^3 and 1024x2145x1024, 6144x12288x12288 on
#   Azure ND A100 v4 (119.4, 132.8, 221.8, 228.0, 250.8, 253.7, 256.5 TFLOP/s of 312). The
#   thin 802816x192x768 GEMM of the same table reaches only 0.51 at 2.4e11 FLOPs: efficiency
#   depends on shape as well as size, which a curve over FLOPs does not see.
# V100: one figure, fp16 matmul 95 of 125 TFLOP/s (mli/transformers-benchmarks), so 0.76
#   for large matmuls; the fall-off for small ones is the A100's, taken at equal time at
#   peak (a matmul of f FLOPs on the V100 behaves like one of f * 312/125 on the A100:
#   both are bound by launch latency and SM fill below ~50 us).
_H100_MAX_MATMUL_EFFICIENCY = 792.1 / 989.0
_H100_SWEEP_CURVE = tuple(
    (flops, min(eff, _H100_MAX_MATMUL_EFFICIENCY)) for flops, eff in (
        (6.872e10, 0.941), (2.749e11, 0.859), (5.498e11, 0.824), (1.237e12, 0.819),
        (4.948e12, 0.729), (1.869e13, 0.713)))
_A100_MATMUL_CURVE = tuple(
    (2.0 * m * k * n, tflops * 1e12 / _A100_BF16_FLOPS_PER_S) for m, k, n, tflops in (
        (1024, 1024, 1024, 119.4), (1024, 1024, 2145, 132.8), (2048, 2048, 2048, 221.8),
        (4096, 4096, 4096, 228.0), (6144, 12288, 12288, 250.8), (8192, 8192, 8192, 253.7),
        (16384, 16384, 16384, 256.5)))


def _at_equal_time(curve, from_peak: float, to_peak: float, to_large: float):
    """`curve` (FLOPs, efficiency) of one device moved to another: the same time at peak
    (FLOPs scaled by the peaks' ratio), efficiencies scaled so the largest is `to_large`."""
    return tuple((flops * to_peak / from_peak, eff * to_large / curve[-1][1])
                 for flops, eff in curve)


_V100_MATMUL_CURVE = _at_equal_time(_A100_MATMUL_CURVE, _A100_BF16_FLOPS_PER_S,
                                    _V100_FP16_FLOPS_PER_S, 95e12 / _V100_FP16_FLOPS_PER_S)
_H100_MATMUL_CURVE = tuple(
    p for p in _at_equal_time(_A100_MATMUL_CURVE, _A100_BF16_FLOPS_PER_S,
                              _H100_BF16_FLOPS_PER_S, _H100_MAX_MATMUL_EFFICIENCY)
    if p[0] < _H100_SWEEP_CURVE[0][0]) + _H100_SWEEP_CURVE
# Fixed cost of each kernel inside a compiled program: 3.0 us, a raw cuLaunchKernel of an
# empty kernel (meta-pytorch/tritonbench PR #1017, measured on a GB200: 3.0-3.3 us; no
# figure for the H100/A100/V100 themselves was found). Not JAX's per-call dispatch (32 us
# on the lent H100): a train step is one call.
_GPU_KERNEL_LAUNCH_S = 3.0e-6

# [Nominal] A virtual CPU device (one of --xla_force_host_platform_device_count=N) for tests
# and CPU planning: 50 GFLOP/s fp32, 16 GiB, 10 GB/s. Not measured; replace by calibration.
_CPU_FP32_FLOPS_PER_S = 50e9
_CPU_MEMORY_BYTES = 16 * 2**30
_CPU_MEMORY_BANDWIDTH_BYTES_PER_S = 10e9


DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec(
        name="H100-SXM5-80GB",
        peak_flops_per_s=(
            ("bfloat16", _H100_BF16_FLOPS_PER_S),
            ("float16", _H100_BF16_FLOPS_PER_S),
            ("float32", _H100_FP32_FLOPS_PER_S),
            ("float64", _H100_FP64_FLOPS_PER_S),
        ),
        memory_bytes=_H100_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=_H100_MEMORY_BANDWIDTH_BYTES_PER_S,
        matmul_efficiency=_H100_MATMUL_CURVE[-1][1],
        matmul_efficiency_curve=_H100_MATMUL_CURVE,
        op_overhead_s=_GPU_KERNEL_LAUNCH_S,
    ),
    "H200": DeviceSpec(
        name="H200-SXM-141GB",
        peak_flops_per_s=(
            ("bfloat16", _H100_BF16_FLOPS_PER_S),
            ("float16", _H100_BF16_FLOPS_PER_S),
            ("float32", _H100_FP32_FLOPS_PER_S),
            ("float64", _H100_FP64_FLOPS_PER_S),
        ),
        memory_bytes=_H200_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=_H200_MEMORY_BANDWIDTH_BYTES_PER_S,
        # The H100's Hopper compute: its measured matmul curve and launch cost.
        matmul_efficiency=_H100_MATMUL_CURVE[-1][1],
        matmul_efficiency_curve=_H100_MATMUL_CURVE,
        op_overhead_s=_GPU_KERNEL_LAUNCH_S,
    ),
    "A100": DeviceSpec(
        name="A100-SXM4-80GB",
        peak_flops_per_s=(
            ("bfloat16", _A100_BF16_FLOPS_PER_S),
            ("float16", _A100_BF16_FLOPS_PER_S),
            ("float32", _A100_FP32_FLOPS_PER_S),
            ("float64", _A100_FP64_FLOPS_PER_S),
        ),
        memory_bytes=_A100_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=_A100_MEMORY_BANDWIDTH_BYTES_PER_S,
        matmul_efficiency=_A100_MATMUL_CURVE[-1][1],
        matmul_efficiency_curve=_A100_MATMUL_CURVE,
        op_overhead_s=_GPU_KERNEL_LAUNCH_S,
    ),
    "V100": DeviceSpec(
        name="V100-SXM2-16GB",
        peak_flops_per_s=(
            ("bfloat16", _V100_BF16_FLOPS_PER_S),
            ("float16", _V100_FP16_FLOPS_PER_S),
            ("float32", _V100_FP32_FLOPS_PER_S),
            ("float64", _V100_FP64_FLOPS_PER_S),
        ),
        memory_bytes=_V100_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=_V100_MEMORY_BANDWIDTH_BYTES_PER_S,
        matmul_efficiency=_V100_MATMUL_CURVE[-1][1],
        matmul_efficiency_curve=_V100_MATMUL_CURVE,
        op_overhead_s=_GPU_KERNEL_LAUNCH_S,
    ),
    "CPU": DeviceSpec(
        name="CPU-virtual-nominal",
        peak_flops_per_s=(("float32", _CPU_FP32_FLOPS_PER_S),),
        memory_bytes=_CPU_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=_CPU_MEMORY_BANDWIDTH_BYTES_PER_S,
    ),
}
"""Known device specs by short name: ``"H200"``, ``"H100"``, ``"A100"``, ``"V100"``, ``"CPU"``.
``cluster.py`` maps the ``device_kind`` JAX reports to these names (``device_key``)."""
