"""Collectives that move a payload's exact bytes, their costs, and the chunk layout they share.

Wire costs (bytes one worker SENDS, for n workers; the bandwidth-optimal ring/pairwise forms):

* ring all-reduce of B bytes: reduce-scatter then all-gather, each sending (n-1)/n * B,
  so 2 (n-1)/n * B. Flat in n: `ring_all_reduce_bytes`.
* all-gather of B bytes from every worker: each worker's B must reach n-1 others,
  so (n-1) * B. Grows with n: `all_gather_bytes`.
* all-to-all of a local buffer of B bytes cut into n chunks: n-1 chunks leave, (n-1)/n * B.

The two-phase scheme (all-to-all of compressed chunks, a local sum of this worker's chunk,
all-gather of the re-compressed chunk) is a ring all-reduce done by hand: it costs
2 (n-1) * chunk bytes, flat in n, while letting the payload stay compressed and the sum happen
in float32 in between. 1-bit SGD, sign majority vote and the bf16/fp16 cast use it.

XLA on CPU widens every bfloat16 collective (all-reduce, all-gather, all-to-all,
reduce-scatter) to float32 (seen in the compiled HLO of jax 0.10.2), which would double the
bytes of a bf16 payload. `all_gather_exact` and `all_to_all_exact` therefore move bf16 data as
its uint16 bit pattern; float16, int8 and uint8 collectives are left alone by XLA.
The plain psums of Dense, RandomK and PowerSGD's dense leaves keep the gradient's dtype: their
`wire_bytes` count the bf16 bytes a GPU all-reduce moves, twice what XLA CPU actually sends.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def ring_all_reduce_bytes(nbytes: float, num_workers: int) -> float:
    """Bytes sent per worker by a ring all-reduce of `nbytes`: 2 (n-1)/n * B."""
    return 2 * (num_workers - 1) / num_workers * nbytes


def all_gather_bytes(nbytes_per_worker: float, num_workers: int) -> float:
    """Bytes sent per worker by an all-gather of `nbytes_per_worker` from each: (n-1) * B."""
    return (num_workers - 1) * nbytes_per_worker


def two_phase_bytes(chunk_nbytes: float, num_workers: int) -> float:
    """All-to-all of n chunks then all-gather of one chunk: 2 (n-1) * chunk bytes."""
    return 2 * (num_workers - 1) * chunk_nbytes


def _gathered_type(axis_name) -> str:
    # Under shard_map the gathered copy is the same on every worker; saying so ("invarying")
    # lets callers return results derived from it with out_specs=P(). vmap has no such notion
    # (the option raises there), so it keeps the default. `axis_name` may be a tuple of axes.
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return "invarying" if all(a in manual for a in names) else "varying"


def _to_wire(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _from_wire(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if dtype == jnp.bfloat16 else x


def all_gather_exact(x: jax.Array, axis_name: str) -> jax.Array:
    """`all_gather` (new leading axis of size n) that keeps bf16 payloads 2 bytes wide."""
    out = jax.lax.all_gather(_to_wire(x), axis_name, to=_gathered_type(axis_name))
    return _from_wire(out, x.dtype)


def all_to_all_exact(x: jax.Array, axis_name: str) -> jax.Array:
    """Chunk i of dim 0 goes to worker i; the result's dim 0 is indexed by sender."""
    out = jax.lax.all_to_all(_to_wire(x), axis_name, 0, 0)
    return _from_wire(out, x.dtype)


def pack_bits(bits: jax.Array) -> jax.Array:
    """Booleans along the last axis, 8 per uint8 byte (the last byte zero-padded)."""
    return jnp.packbits(bits, axis=-1)


def unpack_bits(packed: jax.Array, count: int) -> jax.Array:
    """Inverse of `pack_bits`: the first `count` booleans along the last axis."""
    return jnp.unpackbits(packed, axis=-1, count=count).astype(bool)


@dataclasses.dataclass(frozen=True)
class ColumnChunks:
    """A leaf laid out as columns, grouped into one chunk of columns per worker.

    A leaf with two or more dims is the matrix (shape[0], rest) and its columns are the
    matrix's columns; a vector or scalar is cut into `num_workers` contiguous slices, one
    column each, so that every worker owns an equal share. Columns are padded with empty
    (invalid) columns to a multiple of the worker count. The chunked array has shape
    (num_workers, cols_per_chunk, rows): chunk i, then the column, then the rows in it.
    """

    shape: tuple[int, ...]
    num_workers: int

    @property
    def rows(self) -> int:
        """Elements per column."""
        if len(self.shape) >= 2:
            return self.shape[0]
        return max(1, math.ceil(math.prod(self.shape) / self.num_workers))

    @property
    def cols(self) -> int:
        """Real (unpadded) columns."""
        if len(self.shape) >= 2:
            return math.prod(self.shape[1:])
        return self.num_workers

    @property
    def cols_per_chunk(self) -> int:
        return math.ceil(self.cols / self.num_workers)

    @property
    def valid(self) -> np.ndarray:
        """(num_workers, cols_per_chunk, rows) bool: True where a real element sits."""
        numel = math.prod(self.shape)
        padded_cols = self.num_workers * self.cols_per_chunk
        column = np.arange(padded_cols)[:, None]
        if len(self.shape) >= 2:
            mask = np.broadcast_to(column < self.cols, (padded_cols, self.rows))
        else:
            mask = column * self.rows + np.arange(self.rows)[None, :] < numel
        return mask.reshape(self.num_workers, self.cols_per_chunk, self.rows)

    def to_chunks(self, x: jax.Array) -> jax.Array:
        """Leaf -> (num_workers, cols_per_chunk, rows), padding with zeros."""
        numel = math.prod(self.shape)
        if len(self.shape) >= 2:
            columns = x.reshape(self.rows, self.cols).T
        else:
            flat = jnp.pad(x.reshape(numel), (0, self.rows * self.cols - numel))
            columns = flat.reshape(self.cols, self.rows)
        extra = self.num_workers * self.cols_per_chunk - self.cols
        columns = jnp.pad(columns, ((0, extra), (0, 0)))
        return columns.reshape(self.num_workers, self.cols_per_chunk, self.rows)

    def from_chunks(self, chunks: jax.Array) -> jax.Array:
        """(num_workers, cols_per_chunk, rows) -> leaf, dropping the padding."""
        columns = chunks.reshape(-1, self.rows)[: self.cols]
        if len(self.shape) >= 2:
            return columns.T.reshape(self.shape)
        return columns.reshape(-1)[: math.prod(self.shape)].reshape(self.shape)
