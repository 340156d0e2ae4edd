"""The interface every gradient compressor implements, and the helpers they share.

A compressor replaces the data-parallel `psum` of one gradient leaf. Its `reduce` runs inside
a per-worker context with a named axis (`shard_map` over the data-parallel mesh axis, or
`jax.vmap(axis_name=...)` in tests): each worker passes its local gradient and its own state,
and gets back the SUM over workers of what they sent, already decompressed, plus its new
state. Methods that drop information keep it in the state (error feedback), so over steps
nothing is lost, only delayed.

Conventions shared by all compressors:

* State is a pytree of arrays (a dict, or `()` when there is none) whose shapes depend only on
  the leaf's shape, so it can be carried across jitted steps. Residuals are kept in float32
  even for bfloat16 gradients, since small updates would vanish in a bfloat16 accumulator.
* Arithmetic is float32; the result is cast back to the gradient's dtype.
* `wire_bytes` counts the bytes one worker sends per step for one leaf, with the formulas in
  `alpa_lite.compression.collectives`; it is the number the cost model uses.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Hashable

import jax
import jax.numpy as jnp

PyTree = Any
"""A pytree of arrays: a compressor's per-leaf state."""


class Compressor(abc.ABC):
    """A lossy (or exact) replacement for the data-parallel gradient all-reduce of one leaf.

    Subclasses are frozen dataclasses whose fields are the method's hyper-parameters; they
    validate them in `__post_init__` and raise `ValueError` naming the bad value.
    """

    name: ClassVar[str]
    """Short id used by `by_name` and in plan summaries, e.g. "dgc"."""
    lossy: ClassVar[bool]
    """False only for methods whose result is the exact sum (fp32 passthrough)."""
    synchronous: ClassVar[bool]
    """True when every worker ends with the same reduced gradient."""

    memory_passes: ClassVar[float] = 0.0
    """Float32 passes over the leaf (reads plus writes) that compressing and decompressing
    take: the cost model prices them at the device's memory bandwidth. An estimate from the
    operations `reduce` runs, not a measurement (bench/compression_cost.py measures)."""

    def latency_hops(self, num_workers: int) -> int:
        """Link latencies one exchange pays in sequence (a ring all-reduce: 2(n-1)). The
        cost model charges them once per step: XLA combines the leaves' collectives."""
        return 2 * (num_workers - 1)

    def flops(self, shape: tuple[int, ...]) -> float:
        """Arithmetic beyond the memory passes (PowerSGD's matrix products)."""
        del shape
        return 0.0

    @abc.abstractmethod
    def init_state(self, shape: tuple[int, ...], dtype) -> PyTree:
        """Per-worker state for one gradient leaf of this local shape: arrays only, zeros."""

    def phase(self, step: int) -> Hashable:
        """The static phase of a Python int `step`; one program is compiled per phase.

        Only methods whose payload size changes over training (DGC's sparsity warm-up) have
        more than one phase; the others return `()`.
        """
        del step
        return ()

    def state_bytes(self, shape: tuple[int, ...], dtype) -> int:
        """Bytes of the state `init_state` keeps for a leaf of this shape (shapes only)."""
        state = jax.eval_shape(lambda: self.init_state(tuple(shape), dtype))
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))

    @abc.abstractmethod
    def reduce(self, grad, state, *, axis_name: str, num_workers: int, phase: Hashable,
               shared_key, worker_key) -> tuple[jax.Array, PyTree]:
        """Sums the workers' compressed gradients; returns (summed grad, new state).

        Args:
          grad: this worker's local gradient leaf.
          state: this worker's state for the leaf, as `init_state` made it or `reduce` returned.
          axis_name: the named axis of the data-parallel workers.
          num_workers: the size of that axis.
          phase: `self.phase(step)` for the current step.
          shared_key: a PRNG key identical on every worker (shared random choices).
          worker_key: a PRNG key that differs per worker (stochastic rounding).

        Returns:
          The sum over workers of the decompressed contributions, in `grad`'s shape and dtype
          (the caller divides by `num_workers` for a mean), and the new state, with the same
          tree structure and shapes as `state`.
        """

    @abc.abstractmethod
    def wire_bytes(self, numel: int, itemsize: int, num_workers: int, phase: Hashable = (), *,
                   shape: tuple[int, ...] | None = None) -> float:
        """Bytes one worker sends per step for a leaf of `numel` elements of `itemsize` bytes.

        `shape` matters only to methods that view the leaf as a matrix (PowerSGD, 1-bit SGD);
        without it they assume the shape their docstring names.
        """

    @abc.abstractmethod
    def describe(self) -> str:
        """One line: the method and its payload, for plan summaries."""


# ---------------------------------------------------------------------------------------------
# Helpers shared by the compressors.


def check_axis(axis_name: str, num_workers: int) -> None:
    """Raises ValueError when `num_workers` is not the size of the named axis."""
    size = jax.lax.axis_size(axis_name)
    if size != num_workers:
        raise ValueError(f"num_workers={num_workers} but the axis {axis_name!r} has size {size}; "
                         "pass the size of the data-parallel axis")


def accumulator_dtype(dtype) -> jnp.dtype:
    """float32 for float32 and narrower gradients (the dtype of residuals and arithmetic)."""
    return jnp.promote_types(dtype, jnp.float32)


def safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, and 0 where den == 0 (a zero norm or scale must not create NaN)."""
    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1), 0)


def count_of(numel: int, fraction: float) -> int:
    """How many of `numel` elements a `fraction` keeps: at least 1, at most all."""
    return max(1, min(numel, round(numel * fraction)))


def require_synchronous(owner: str, compressor, what: str) -> None:
    """Raises ValueError unless `compressor` is a compressor whose result agrees on every
    worker; `what` says what must agree (e.g. "the averages")."""
    if not isinstance(compressor, Compressor):
        raise ValueError(f"{owner}: compressor must be an alpa_lite.compression "
                         f"compressor, got {compressor!r}")
    if not compressor.synchronous:
        raise ValueError(f"{owner}: {what} must agree on every worker; "
                         f"{compressor.name} is not synchronous")


def require_fraction(owner: str, field: str, value: float, *, closed_above: bool) -> None:
    """Raises ValueError unless 0 < value < 1 (or <= 1 when `closed_above`)."""
    upper_ok = value <= 1 if closed_above else value < 1
    if not (0 < value and upper_ok):
        interval = "(0, 1]" if closed_above else "(0, 1)"
        raise ValueError(f"{owner}: {field} must be in {interval}, got {value!r}")
