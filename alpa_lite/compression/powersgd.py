"""PowerSGD (Vogels et al. 2019): rank-r gradient compression by one step of power iteration.

Each leaf is viewed as a matrix M (all dims but the last x the last, `matrix_shape`). With Q (cols x r) identical on all
workers (warm-started from the previous step), each worker computes

    P = psum(M Q)            (rows x r)
    P = orthonormal(P)       QR; the same on every worker since P is
    Q_w = M^T P              (cols x r), this worker's part of Q
    Q = psum(Q_w)
    sum over workers ~= P Q^T

Unlike top-k, every worker's factors have the same shape and meaning, so they are summed
by all-reduce and the bytes stay flat in n: 2 (n-1)/n * (rows + cols) * r * 4 (the factors are
float32: orthogonalisation is not a bf16 computation). If the sum of the workers' matrices has
rank <= r, P spans its columns and the result is exact.

Error feedback: worker w's contribution to the sum is P Q_w^T, so its residual
M_w - P Q_w^T (added to next step's gradient) keeps sum(sent) + sum(residuals) == sum(M).

Leaves that would not shrink, 1-D leaves and matrices with r (rows + cols) >= rows * cols
(in particular r >= min(rows, cols)), are all-reduced dense and carry no state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from alpa_lite.compression.base import Compressor, accumulator_dtype, check_axis
from alpa_lite.compression.collectives import ring_all_reduce_bytes


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(product of all but the last dim, last dim): the matrix a leaf is viewed as. JAX
    layouts put output features last (a dense kernel (in, out), a convolution kernel
    HWIO), so this is the kernel's (fan-in, fan-out) matrix, as the paper reshapes it."""
    if len(shape) < 2:
        return (math.prod(shape), 1)
    return (math.prod(shape[:-1]), shape[-1])


def low_rank_sum(m: jax.Array, q: jax.Array,
                 axis_name: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One PowerSGD round on this worker's float32 matrix `m` with the shared start `q`.

    Returns (approximate sum over workers, this worker's contribution P Q_w^T, the summed Q
    to warm-start the next step).
    """
    p = jax.lax.psum(m @ q, axis_name)                    # (rows, r)
    p, _ = jnp.linalg.qr(p)                               # orthonormal columns; 0 stays finite
    q_local = m.T @ p                                     # (cols, r)
    q = jax.lax.psum(q_local, axis_name)
    return p @ q.T, p @ q_local.T, q


@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback and warm start.

    Args:
      rank: r >= 1, the rank of the approximation (Vogels et al. use 1 to 4).
      error_feedback: carry M - (this worker's contribution) into the next step.
      warm_start: start each step's power iteration from the previous step's Q; otherwise
        from a fresh random Q. The first Q is Gaussian from `shared_key`.
    """

    rank: int = 4
    error_feedback: bool = True
    warm_start: bool = True

    name: ClassVar[str] = "powersgd"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 4.0

    def latency_hops(self, num_workers):
        return 4 * (num_workers - 1)

    def flops(self, shape):
        """M Q, M^T P and P Q^T: 6 rows cols r (the leaves it compresses)."""
        if not self.compresses(tuple(shape)):
            return 0.0
        rows, cols = matrix_shape(tuple(shape))
        return 6.0 * rows * cols * self.rank

    def __post_init__(self):
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"PowerSGD: rank must be an int >= 1, got {self.rank!r}")

    def compresses(self, shape: tuple[int, ...]) -> bool:
        """Whether a leaf of this shape goes through the low-rank path (else: dense psum)."""
        rows, cols = matrix_shape(shape)
        return len(shape) >= 2 and self.rank * (rows + cols) < rows * cols

    def init_state(self, shape, dtype):
        if not self.compresses(shape):
            return ()
        rows, cols = matrix_shape(shape)
        state = {}
        if self.error_feedback:
            state["error"] = jnp.zeros((rows, cols), accumulator_dtype(dtype))
        if self.warm_start:
            # Zeros mean "not started": reduce draws the first Q from shared_key.
            state["q"] = jnp.zeros((cols, self.rank), jnp.float32)
        return state

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        if not self.compresses(grad.shape):
            return jax.lax.psum(grad, axis_name), state
        rows, cols = matrix_shape(grad.shape)
        m = grad.reshape(rows, cols).astype(accumulator_dtype(grad.dtype))
        if self.error_feedback:
            m = m + state["error"]
        q = jax.random.normal(shared_key, (cols, self.rank), jnp.float32)
        if self.warm_start:
            # A zero Q (first step, or all gradients were zero) would give P = 0: redraw it.
            q = jnp.where(jnp.any(state["q"] != 0), state["q"], q)
        summed, contribution, q = low_rank_sum(m, q, axis_name)
        new_state = {}
        if self.error_feedback:
            new_state["error"] = m - contribution
        if self.warm_start:
            new_state["q"] = q
        return summed.reshape(grad.shape).astype(grad.dtype), new_state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        """Without `shape` the leaf is taken to be a square matrix."""
        if shape is None:
            side = math.isqrt(numel)
            shape = (side, numel // side) if side else (numel,)
        if not self.compresses(shape):
            return ring_all_reduce_bytes(numel * itemsize, num_workers)
        rows, cols = matrix_shape(shape)
        return ring_all_reduce_bytes((rows + cols) * self.rank * 4, num_workers)

    def describe(self):
        return (f"PowerSGD rank {self.rank} (error feedback {self.error_feedback}, warm start "
                f"{self.warm_start}): float32 factors P and Q, two ring all-reduces")
