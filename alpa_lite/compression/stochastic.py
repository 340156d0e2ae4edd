"""Unbiased stochastic quantization: TernGrad and QSGD, without state.

Both round each entry at random (with the per-worker `worker_key`) so that the expected
decoded value is the entry itself; the noise averages out over workers and steps instead of
being fed back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from alpa_lite.compression.base import Compressor, check_axis, safe_divide
from alpa_lite.compression.collectives import (
    all_gather_bytes,
    all_gather_exact,
    ring_all_reduce_bytes,
)


def _ternary_dtype(num_workers: int):
    # The all-reduced sum of n ternaries lies in [-n, n].
    return jnp.int8 if num_workers <= 127 else jnp.int16


@dataclasses.dataclass(frozen=True)
class TernGrad(Compressor):
    """TernGrad (Wen et al. 2017): each entry sent as s * {-1, 0, +1}.

    s = max over workers of max|g| (the paper's scalar sharing, one float32 pmax), then
    t_i = sign(g_i) with probability |g_i| / s, else 0, so E[s * t_i] = g_i. With s shared,
    the ternaries themselves are summed by an integer all-reduce (int8 up to 127 workers,
    whose sums fit) and scaled once: 2 (n-1)/n * numel bytes, flat in n.

    Args:
      clip_sigma: the paper's gradient clipping, to clip_sigma standard deviations of the
        leaf (2.5 in the paper) before ternarizing. It shrinks s and so the variance, at the
        cost of a bias on the clipped entries. None (default): no clipping, unbiased.
    """

    clip_sigma: float | None = None

    name: ClassVar[str] = "terngrad"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 4.0

    def latency_hops(self, num_workers):
        return 4 * (num_workers - 1)

    def __post_init__(self):
        if self.clip_sigma is not None and not self.clip_sigma > 0:
            raise ValueError(f"TernGrad: clip_sigma must be > 0 or None, got {self.clip_sigma!r}")

    def init_state(self, shape, dtype):
        return ()

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        g = grad.astype(jnp.float32)
        if self.clip_sigma is not None:
            bound = self.clip_sigma * jnp.std(g)
            g = jnp.clip(g, -bound, bound)
        scale = jax.lax.pmax(jnp.max(jnp.abs(g)), axis_name)
        keep = jax.random.uniform(worker_key, g.shape) < safe_divide(jnp.abs(g), scale)
        ternary = (jnp.sign(g) * keep).astype(_ternary_dtype(num_workers))
        total = jax.lax.psum(ternary, axis_name)
        return (scale * total.astype(jnp.float32)).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        ternary_bytes = numel * jnp.dtype(_ternary_dtype(num_workers)).itemsize
        scale_bytes = 4
        return ring_all_reduce_bytes(ternary_bytes + scale_bytes, num_workers)

    def describe(self):
        clip = f", clipped at {self.clip_sigma:g} sigma" if self.clip_sigma is not None else ""
        return f"TernGrad{clip}: int8 ternaries, integer ring all-reduce + shared float32 scale"


@dataclasses.dataclass(frozen=True)
class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): stochastic rounding to `levels` levels of the norm.

    Per bucket of `bucket_size` entries (the whole leaf by default), with norm ||x||_2 and
    r_i = levels * |x_i| / ||x||_2 in [0, levels], send sign(x_i) * l_i with
    l_i = floor(r_i) + Bernoulli(r_i - floor(r_i)), so E[||x||_2 * sign * l_i / levels] = x_i.
    The levels travel as int8 and the norms as float32. The norms differ per worker, so the
    payload is all-gathered and decoded locally: (n-1) * (padded numel + 4 * buckets) bytes.

    Args:
      levels: s, the number of nonzero levels, 1 <= s <= 127 (int8 payload).
      bucket_size: entries per norm; the paper uses 512 to lower the variance. None: the leaf.
    """

    levels: int = 8
    bucket_size: int | None = None

    name: ClassVar[str] = "qsgd"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 5.0

    def latency_hops(self, num_workers):
        return num_workers - 1

    def __post_init__(self):
        if not (isinstance(self.levels, int) and 1 <= self.levels <= 127):
            raise ValueError(f"QSGD: levels must be an int in [1, 127] (int8 payload), "
                             f"got {self.levels!r}")
        if self.bucket_size is not None and not (isinstance(self.bucket_size, int)
                                                 and self.bucket_size >= 1):
            raise ValueError(f"QSGD: bucket_size must be an int >= 1 or None, "
                             f"got {self.bucket_size!r}")

    def _buckets(self, numel: int) -> tuple[int, int]:
        """(number of buckets, bucket size) for a leaf of numel entries."""
        size = min(self.bucket_size or numel, max(numel, 1))
        return math.ceil(numel / size), size

    def init_state(self, shape, dtype):
        return ()

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        count, size = self._buckets(grad.size)
        flat = grad.reshape(-1).astype(jnp.float32)
        x = jnp.pad(flat, (0, count * size - grad.size)).reshape(count, size)
        norm = jnp.linalg.norm(x, axis=1)                             # (buckets,)
        r = self.levels * safe_divide(jnp.abs(x), norm[:, None])
        level = jnp.floor(r) + (jax.random.uniform(worker_key, r.shape) < r - jnp.floor(r))
        # |x_i| / ||x|| may round to just above 1: keep the level in range.
        level = jnp.minimum(level, self.levels)
        q = (jnp.sign(x) * level).astype(jnp.int8)
        all_q = all_gather_exact(q, axis_name).astype(jnp.float32)     # (n, buckets, size)
        all_norm = all_gather_exact(norm, axis_name)                  # (n, buckets)
        total = (all_q * (all_norm / self.levels)[..., None]).sum(0)
        return total.reshape(-1)[: grad.size].reshape(grad.shape).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        count, size = self._buckets(numel)
        return all_gather_bytes(count * size + 4 * count, num_workers)

    def describe(self):
        bucket = f", buckets of {self.bucket_size}" if self.bucket_size else ""
        return (f"QSGD {self.levels} levels{bucket}: int8 levels + float32 norms, "
                "all-gather and local sum")
