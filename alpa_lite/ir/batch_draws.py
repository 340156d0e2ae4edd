"""Random draws along the batch, drawn per micro-batch exactly as for the whole batch.

A dropout mask `jax.random.bernoulli(key, p, (B, ...))` is one draw over the whole batch:
with JAX's partitionable threefry (`jax_threefry_partitionable`, the default) element i of a
draw of `shape` is threefry(key, i), i its row-major position in `shape`. A micro-batch of
rows [r, r + b) traced at its own size would draw `shape` (b, ...) and get elements 0.. of
the draw, the first micro-batch's numbers, again. `batch_bits_p` draws what the whole
batch's draw holds at those rows: element (j, ...) of the micro-batch's draw is
threefry(key, (r + j) * inner + position within the row), with r read from `rows`, the
micro-batch's row indices into the batch (a batch input the pipeline slices like the
others). The micro-batch proof (`ir.microbatch`) sees a per-example value; the sharding rule
splits it like any element-wise result.

Tracing swaps a `random_bits` equation for `batch_bits_p` when the micro-batch and
full-batch traces show its leading dimension grows with the batch (`step_parts`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir

batch_bits_p = Primitive("alpa_batch_bits")

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}
_MASK16 = np.uint32(0xFFFF)


def _mul_64(a, b: int):
    """a * b as (high, low) uint32 words, for uint32 `a` and Python int b < 2**32."""
    a_lo, a_hi = a & _MASK16, a >> 16
    b_lo, b_hi = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> 16) + (p1 & _MASK16) + (p2 & _MASK16)
    low = (p0 & _MASK16) | ((mid & _MASK16) << 16)
    high = p3 + (p1 >> 16) + (p2 >> 16) + (mid >> 16)
    return high, low


def _batch_bits(key, rows, *, bit_width: int, shape: tuple[int, ...]):
    size, inner = math.prod(shape), math.prod(shape[1:])
    if size >= 2 ** 32:
        raise NotImplementedError(
            f"a random draw of {size} elements per micro-batch (shape {shape}): alpa_lite "
            "draws at most 2**32 per micro-batch along the batch; use more micro-batches")
    k1, k2 = jax.random.key_data(key)
    start_hi, start_lo = _mul_64(rows[0].astype(jnp.uint32), inner)
    local = jax.lax.iota(jnp.uint32, size).reshape(shape)
    low = local + start_lo
    high = start_hi + (low < local).astype(jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.broadcast_to(high, shape), low)
    # As jax's partitionable threefry combines the two words.
    if bit_width == 64:
        return (bits1.astype(jnp.uint64) << 32) | bits2.astype(jnp.uint64)
    if bit_width == 32:
        return bits1 ^ bits2
    return (bits1 ^ bits2).astype(_UINT[bit_width])


def _abstract(key, rows, *, bit_width, shape):
    return jax.core.ShapedArray(shape, np.dtype(_UINT[bit_width]))


batch_bits_p.def_impl(lambda key, rows, **kw: jax.jit(
    _batch_bits, static_argnames=("bit_width", "shape"))(key, rows, **kw))
batch_bits_p.def_abstract_eval(_abstract)
mlir.register_lowering(batch_bits_p, mlir.lower_fun(_batch_bits, multiple_results=False))


def check_drawable(key_dtype) -> None:
    """Raises unless keys of `key_dtype` are threefry keys drawn partitionably (what
    `batch_bits_p` reproduces)."""
    impl = getattr(key_dtype, "_impl", None)
    if impl is None or getattr(impl, "name", "") != "threefry2x32" \
            or not jax.config.jax_threefry_partitionable:
        raise NotImplementedError(
            "a micro-batched plan reproduces random draws along the batch (dropout) only "
            "for threefry keys with jax_threefry_partitionable on (JAX's defaults); this "
            f"step draws with {key_dtype}. Use a plan without micro-batches")
