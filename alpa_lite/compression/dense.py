"""Uncompressed exchange: the exact psum baseline, and the gradient cast to 16 bits."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from alpa_lite.compression.base import Compressor, accumulator_dtype, check_axis
from alpa_lite.compression.collectives import (
    ColumnChunks,
    all_gather_exact,
    all_to_all_exact,
    ring_all_reduce_bytes,
    two_phase_bytes,
)


@dataclasses.dataclass(frozen=True)
class Dense(Compressor):
    """The plain all-reduce: `psum` of the gradient in its own dtype. Exact, no state."""

    name: ClassVar[str] = "dense"
    lossy: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 0.0

    def init_state(self, shape, dtype):
        return ()

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        return jax.lax.psum(grad, axis_name), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        return ring_all_reduce_bytes(numel * itemsize, num_workers)

    def describe(self):
        return "dense: ring all-reduce of the gradient as is (exact)"


_SMALL_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Cast(Compressor):
    """The gradient exchanged in a 16-bit float type, summed in float32.

    A plain `psum` of a bf16 array compiles to a float32 all-reduce on XLA CPU, saving nothing.
    So the ring all-reduce is written out: each worker cuts its 16-bit gradient into n chunks
    and all-to-alls them, sums the chunk it owns in float32, rounds the sum to 16 bits and
    all-gathers it. Bytes are those of a 16-bit ring all-reduce, 2 (n-1)/n * 2 * numel, and
    every worker ends with the same 16-bit-rounded sum. No error feedback (rounding error is
    small and unbiased in expectation over steps), so no state.

    Args:
      dtype: "bf16" (float32's range, 8-bit mantissa) or "fp16" (10-bit mantissa, but values
        above 65504 overflow to inf: prefer bf16 unless the gradients are scaled).
    """

    dtype: str = "bf16"

    name: ClassVar[str] = "cast"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 2.0

    def __post_init__(self):
        if self.dtype not in _SMALL_DTYPES:
            raise ValueError(f"Cast: dtype must be one of {sorted(_SMALL_DTYPES)}, "
                             f"got {self.dtype!r}")

    def init_state(self, shape, dtype):
        return ()

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        small = _SMALL_DTYPES[self.dtype]
        layout = ColumnChunks((grad.size,), num_workers)
        chunks = layout.to_chunks(grad.astype(small))                 # (n, 1, rows)
        received = all_to_all_exact(chunks, axis_name)                # (senders, 1, rows)
        owned = received.astype(accumulator_dtype(grad.dtype)).sum(0).astype(small)
        gathered = all_gather_exact(owned, axis_name)                 # (n, 1, rows)
        return layout.from_chunks(gathered).reshape(grad.shape).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        chunk_numel = math.ceil(numel / num_workers)
        return two_phase_bytes(chunk_numel * 2, num_workers)

    def describe(self):
        return (f"cast to {self.dtype}: 2-byte gradient, all-to-all + float32 chunk sum + "
                "all-gather (a hand-written ring all-reduce)")
