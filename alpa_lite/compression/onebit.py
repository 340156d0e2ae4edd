"""Sign-based compression: 1-bit SGD with error feedback, and signSGD with majority vote.

Both send one bit per entry, packed 8 to a uint8 byte, through the two-phase exchange of
`collectives` (all-to-all of per-owner chunks, a local combine of the owned chunk, all-gather of
the combined chunk), so each worker sends 2 (n-1) * chunk bytes, about 2 (n-1)/n of a
bit-packed copy of the leaf: flat in n.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from alpa_lite.compression.base import Compressor, accumulator_dtype, check_axis, safe_divide
from alpa_lite.compression.collectives import (
    ColumnChunks,
    all_gather_exact,
    all_to_all_exact,
    pack_bits,
    ring_all_reduce_bytes,
    two_phase_bytes,
    unpack_bits,
)


def _encode_columns(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """1-bit code of each column (last axis): sign bits and the two reconstruction values.

    Positive entries are rebuilt as the mean of the column's positive entries, the others as
    the mean of its non-positive ones, so the code preserves every column's sum. Invalid
    (padding) entries take no part. Returns (packed bits, scales (..., 2) float32).
    """
    positive = (x > 0) & valid
    negative = (x <= 0) & valid
    mean_positive = safe_divide(jnp.where(positive, x, 0).sum(-1), positive.sum(-1))
    mean_negative = safe_divide(jnp.where(negative, x, 0).sum(-1), negative.sum(-1))
    return pack_bits(positive), jnp.stack([mean_positive, mean_negative], axis=-1)


def _decode_columns(bits: jax.Array, scales: jax.Array, valid: jax.Array) -> jax.Array:
    """Inverse of `_encode_columns` up to quantization; padding decodes to 0."""
    positive = unpack_bits(bits, valid.shape[-1])
    return jnp.where(valid, jnp.where(positive, scales[..., :1], scales[..., 1:]), 0)


@dataclasses.dataclass(frozen=True)
class OneBit(Compressor):
    """1-bit SGD (Seide et al. 2014) with column-wise scales and quantization error feedback.

    The leaf is a matrix (first dim x rest; a vector is cut into n equal columns). Each column
    is sent as its sign bits plus two float32 values, the means of its positive and of its
    non-positive entries. In two phases, each with its own error feedback:

      1. acc = grad + residual; encode acc; residual = acc - decode(code). Chunk i (a group of
         columns) goes to worker i by all-to-all.
      2. Worker i decodes and sums the n codes of its chunk, adds its second residual
         (kept because this sum is quantized again), encodes it, keeps the new quantization
         error, and all-gathers the code. Everyone decodes the same full leaf.

    So sum(grads) + sum(old residuals) == result + sum(new residuals), elementwise. Both
    residuals are stored in the leaf's shape (the second is nonzero only in this worker's
    chunk), so the state's shape does not depend on n.

    Args:
      error_feedback: carry both quantization errors into the next step.
    """

    error_feedback: bool = True

    name: ClassVar[str] = "onebit"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 6.0

    def init_state(self, shape, dtype):
        if not self.error_feedback:
            return ()
        zeros = jnp.zeros(shape, accumulator_dtype(dtype))
        return {"residual": zeros, "chunk_residual": zeros}

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        layout = ColumnChunks(grad.shape, num_workers)
        valid = jnp.asarray(layout.valid)                             # (n, cols/n, rows)
        me = jax.lax.axis_index(axis_name)
        acc = layout.to_chunks(grad.astype(jnp.float32))
        if self.error_feedback:
            acc = acc + layout.to_chunks(state["residual"])
        bits, scales = _encode_columns(acc, valid)

        # Phase 1: owner i receives every worker's code for chunk i and sums the decoded values.
        owned_valid = valid[me]
        owned = _decode_columns(all_to_all_exact(bits, axis_name),
                                all_to_all_exact(scales, axis_name), owned_valid).sum(0)
        if self.error_feedback:
            owned = owned + layout.to_chunks(state["chunk_residual"])[me]
        owned_bits, owned_scales = _encode_columns(owned, owned_valid)

        # Phase 2: every worker gathers all owners' codes.
        total = _decode_columns(all_gather_exact(owned_bits, axis_name),
                                all_gather_exact(owned_scales, axis_name), valid)
        if self.error_feedback:
            chunk_error = owned - _decode_columns(owned_bits, owned_scales, owned_valid)
            state = {
                "residual": layout.from_chunks(acc - _decode_columns(bits, scales, valid)),
                "chunk_residual": layout.from_chunks(jnp.zeros_like(acc).at[me].set(chunk_error)),
            }
        return layout.from_chunks(total).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        """Without `shape` the leaf is taken to be a vector (n columns)."""
        layout = ColumnChunks(shape if shape is not None else (numel,), num_workers)
        column_bytes = math.ceil(layout.rows / 8) + 2 * 4          # sign bits + 2 float32
        return two_phase_bytes(layout.cols_per_chunk * column_bytes, num_workers)

    def describe(self):
        return ("1-bit SGD, column-wise scales" + (" with error feedback" if self.error_feedback
                                                    else "")
                + ": packed sign bits + 2 float32 per column, all-to-all + all-gather")


@dataclasses.dataclass(frozen=True)
class SignSGD(Compressor):
    """signSGD with majority vote (Bernstein et al. 2018, 2019), no state.

    Every worker sends the signs of its gradient (entries >= 0 count as +1); the owner of each
    chunk counts the votes and sends back the winning sign (a tie goes to the owner's own
    sign, since one bit cannot carry a zero). The result is

        sum_w(||g_w||_1 / numel) * sign(sum_w sign(g_w)),

    so the caller's mean over workers is the majority sign times the workers' average entry
    magnitude: updates keep the gradient's scale and plain SGD learning rates stay meaningful.
    The scale costs one float32 all-reduce.
    """

    name: ClassVar[str] = "signsgd"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 4.0

    def init_state(self, shape, dtype):
        return ()

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        layout = ColumnChunks((grad.size,), num_workers)              # (n, 1, rows)
        x = layout.to_chunks(grad.astype(jnp.float32))
        received = unpack_bits(all_to_all_exact(pack_bits(x >= 0), axis_name), layout.rows)
        votes = jnp.where(received, 1, -1).sum(0)                     # (1, rows), int32
        own = x[jax.lax.axis_index(axis_name)] >= 0
        majority = jnp.where(votes != 0, votes > 0, own)
        signs = unpack_bits(all_gather_exact(pack_bits(majority), axis_name), layout.rows)
        scale = jax.lax.psum(jnp.abs(grad.astype(jnp.float32)).mean(), axis_name)
        result = layout.from_chunks(jnp.where(signs, scale, -scale))
        return result.reshape(grad.shape).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        chunk_bytes = math.ceil(ColumnChunks((numel,), num_workers).rows / 8)
        return two_phase_bytes(chunk_bytes, num_workers) + ring_all_reduce_bytes(4, num_workers)

    def describe(self):
        return ("signSGD majority vote: packed sign bits, all-to-all + vote + all-gather, "
                "scaled by the mean |g|")
