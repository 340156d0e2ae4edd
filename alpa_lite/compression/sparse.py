"""Sparse communication: send k of the gradient's entries, keep the rest for later.

* `TopK`: the k largest entries by magnitude, with local accumulation of the rest (error
  feedback, Aji & Heafield 2017). Each worker picks its own k positions, so the payload is
  (values, int32 indices), all-gathered and scatter-added locally: (n-1) * k * (itemsize + 4)
  bytes, growing with n (a sparse sum gets denser, so a ring all-reduce would not stay sparse).
* `RandomK`: k positions drawn from the key shared by all workers, so they agree and the k
  values go through a psum: 2 (n-1)/n * k * itemsize, flat in n.
* `DGC`: Deep Gradient Compression (Lin et al. 2018), top-k with a sampled threshold,
  momentum correction, momentum factor masking, local gradient clipping and an exponential
  sparsity warm-up.

All three work on the flattened leaf; the accumulator (residual) is float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from alpa_lite.compression.base import (
    Compressor,
    accumulator_dtype,
    check_axis,
    count_of,
    require_fraction,
    safe_divide,
)
from alpa_lite.compression.collectives import (
    all_gather_bytes,
    all_gather_exact,
    ring_all_reduce_bytes,
)


def _scatter(numel: int, indices: jax.Array, values: jax.Array, dtype) -> jax.Array:
    """A dense (numel,) vector: zeros plus `values` added at `indices`; indices >= numel dropped."""
    return jnp.zeros(numel, dtype).at[indices.reshape(-1)].add(
        values.reshape(-1).astype(dtype), mode="drop")


def _all_gather_sparse(values: jax.Array, indices: jax.Array, numel: int, axis_name: str,
                       dtype) -> jax.Array:
    """Every worker's (values, indices) gathered and summed into a dense (numel,) vector."""
    return _scatter(numel, all_gather_exact(indices, axis_name),
                    all_gather_exact(values, axis_name), dtype)


def _accumulate(grad: jax.Array, state, error_feedback: bool) -> jax.Array:
    """The flat float32 vector to compress: the gradient plus the carried residual."""
    flat = grad.reshape(-1).astype(accumulator_dtype(grad.dtype))
    return flat + state["residual"].reshape(-1) if error_feedback else flat


def _residual_state(shape, dtype, error_feedback: bool):
    return {"residual": jnp.zeros(shape, accumulator_dtype(dtype))} if error_feedback else ()


def _ef_note(error_feedback: bool) -> str:
    return " with error feedback" if error_feedback else " without error feedback"


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """Top-k by magnitude with local gradient accumulation.

    acc = grad + residual; send the k = ratio * numel entries of acc largest in |acc|;
    residual = acc - sent. Values travel in the gradient's dtype, indices as int32.

    Args:
      ratio: fraction of entries sent, in (0, 1]; 1.0 sends everything (exact).
      error_feedback: keep what was not sent and add it to the next step's gradient.
    """

    ratio: float = 0.01
    error_feedback: bool = True

    name: ClassVar[str] = "topk"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 10.0

    def latency_hops(self, num_workers):
        return num_workers - 1

    def __post_init__(self):
        require_fraction("TopK", "ratio", self.ratio, closed_above=True)

    def init_state(self, shape, dtype):
        return _residual_state(shape, dtype, self.error_feedback)

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        acc = _accumulate(grad, state, self.error_feedback)
        _, indices = jax.lax.top_k(jnp.abs(acc), count_of(acc.size, self.ratio))
        values = acc[indices].astype(grad.dtype)                      # the wire payload
        summed = _all_gather_sparse(values, indices, acc.size, axis_name, acc.dtype)
        if self.error_feedback:
            residual = acc - _scatter(acc.size, indices, values, acc.dtype)
            state = {"residual": residual.reshape(grad.shape)}
        return summed.reshape(grad.shape).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        k = count_of(numel, self.ratio)
        return all_gather_bytes(k * (itemsize + 4), num_workers)

    def describe(self):
        return (f"top-k {self.ratio:.3g} by magnitude{_ef_note(self.error_feedback)}: "
                "k values + int32 indices, all-gather")


def _stratified_indices(key: jax.Array, numel: int, k: int) -> jax.Array:
    """k distinct indices, one uniformly drawn in each of k near-equal strata of [0, numel).

    Distinct without a sort over numel (which `random.choice(replace=False)` does), and every
    index has probability about k/numel; for k == numel it is every index.
    """
    bounds = np.arange(k + 1) * numel // k
    starts, sizes = bounds[:-1], np.diff(bounds)                    # sizes >= 1 as k <= numel
    offsets = jnp.floor(jax.random.uniform(key, (k,)) * sizes).astype(jnp.int32)
    return jnp.asarray(starts, jnp.int32) + jnp.minimum(offsets, jnp.asarray(sizes - 1, jnp.int32))


@dataclasses.dataclass(frozen=True)
class RandomK(Compressor):
    """Random-k with local accumulation: the same k positions on every worker, summed by psum.

    The positions come from `shared_key`, one per stratum of the flattened leaf, so every
    coordinate is visited equally often. No rescaling by numel/k: with error feedback the
    entries not sent stay in the residual and go out in a later step.

    Args:
      ratio: fraction of entries sent, in (0, 1]; 1.0 sends everything (exact).
      error_feedback: keep what was not sent and add it to the next step's gradient.
    """

    ratio: float = 0.01
    error_feedback: bool = True

    name: ClassVar[str] = "randomk"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 3.0

    def __post_init__(self):
        require_fraction("RandomK", "ratio", self.ratio, closed_above=True)

    def init_state(self, shape, dtype):
        return _residual_state(shape, dtype, self.error_feedback)

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        acc = _accumulate(grad, state, self.error_feedback)
        indices = _stratified_indices(shared_key, acc.size, count_of(acc.size, self.ratio))
        values = acc[indices].astype(grad.dtype)                      # the wire payload
        summed = _scatter(acc.size, indices, jax.lax.psum(values, axis_name), acc.dtype)
        if self.error_feedback:
            residual = acc - _scatter(acc.size, indices, values, acc.dtype)
            state = {"residual": residual.reshape(grad.shape)}
        return summed.reshape(grad.shape).astype(grad.dtype), state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        return ring_all_reduce_bytes(count_of(numel, self.ratio) * itemsize, num_workers)

    def describe(self):
        return (f"random-k {self.ratio:.3g} at shared positions{_ef_note(self.error_feedback)}: "
                "k values, ring all-reduce")


# DGC's threshold adjustment (as in the authors' code): accept a threshold selecting between
# 0.8 k and 1.3 k entries, else scale it by that factor and count again, at most 10 times.
_LOWER, _UPPER, _MAX_ADJUSTMENTS = 0.8, 1.3, 10
# The sample must hold a few entries above the threshold for its k-th largest to mean anything.
_MIN_SAMPLE_HITS = 2


def _select_by_sampled_threshold(magnitude: jax.Array, k: int, num_samples: int,
                                 key: jax.Array) -> jax.Array:
    """Indices of about k large entries of `magnitude`, padded with `magnitude.size` to k slots.

    The threshold is the k-th largest magnitude estimated from `num_samples` random entries
    (a top-k over the sample only, never over the whole tensor), adjusted by counting. If more
    than k entries pass, the first k by position are taken; the others stay in the
    accumulator. Zeros are never selected.
    """
    numel = magnitude.size
    if num_samples >= numel:
        sample = magnitude
    else:
        sample = magnitude[jax.random.randint(key, (num_samples,), 0, numel)]
    threshold = jax.lax.top_k(sample, max(1, round(num_samples * k / numel)))[0][-1]

    def count(t):
        return jnp.sum((magnitude >= t) & (magnitude > 0))

    def out_of_range(carry):
        i, _, n = carry
        return (i < _MAX_ADJUSTMENTS) & ((n > _UPPER * k) | (n < _LOWER * k))

    def adjust(carry):
        i, t, n = carry
        t = t * jnp.where(n > _UPPER * k, _UPPER, _LOWER)
        return i + 1, t, count(t)

    _, threshold, _ = jax.lax.while_loop(out_of_range, adjust, (0, threshold, count(threshold)))
    (indices,) = jnp.nonzero((magnitude >= threshold) & (magnitude > 0), size=k, fill_value=numel)
    return indices.astype(jnp.int32)


# Lin et al. 2018, Sec. 3.4: sparsity rises exponentially over the warm-up epochs.
DGC_WARMUP_STAGES = (0.75, 0.9375, 0.984375, 0.996)


@dataclasses.dataclass(frozen=True)
class DGC(Compressor):
    """Deep Gradient Compression (Lin et al. 2018).

    Per step, on each worker (g = this worker's gradient, m = momentum):

      g = g * min(1, (clip_norm / sqrt(n)) / ||g||)   local gradient clipping (if clip_norm)
      u = m * u + g;  v = v + u                      momentum correction: accumulate velocity
      send the k = (1 - sparsity) * numel largest |v| (sampled threshold, see below)
      v = v - sent;  u = 0 where sent                momentum factor masking

    The result is the sum of the sent velocities, so the momentum already lives here: the
    user's optimizer must be plain SGD (no momentum), with the caller's mean as the update.
    `momentum=0` gives top-k with local accumulation of gradients.

    Selection samples `sample_ratio` of the entries (at least enough to hold a couple above
    the threshold), takes the k-th largest of the sample as the threshold, adjusts it by
    counting, and gathers exactly k slots with `jnp.nonzero(..., size=k)`; unused slots carry
    index numel and value 0. Clipping is per leaf (the paper clips the whole model's
    gradient; a leaf is what `reduce` sees).

    Warm-up: over the first `warmup_steps` steps the sparsity runs through `warmup_stages`
    (equal numbers of steps each), then `sparsity`. `phase(step)` returns the step's sparsity,
    so each stage compiles with a static k.

    Args:
      sparsity: fraction of entries NOT sent after warm-up, in (0, 1).
      warmup_steps: length of the sparsity warm-up, >= 0 (0: no warm-up).
      momentum: m in [0, 1).
      clip_norm: global gradient-norm bound; each worker clips to clip_norm / sqrt(n). None: off.
      sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1].
      warmup_stages: the warm-up sparsities, each in (0, 1) (capped at `sparsity`).
    """

    sparsity: float = 0.999
    warmup_steps: int = 0
    momentum: float = 0.9
    clip_norm: float | None = None
    sample_ratio: float = 0.01
    warmup_stages: tuple[float, ...] = DGC_WARMUP_STAGES

    name: ClassVar[str] = "dgc"
    lossy: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True
    memory_passes: ClassVar[float] = 8.0

    def latency_hops(self, num_workers):
        return num_workers - 1

    def __post_init__(self):
        require_fraction("DGC", "sparsity", self.sparsity, closed_above=False)
        require_fraction("DGC", "sample_ratio", self.sample_ratio, closed_above=True)
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"DGC: warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"DGC: momentum must be in [0, 1), got {self.momentum!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"DGC: clip_norm must be > 0 or None, got {self.clip_norm!r}")
        if self.warmup_steps and not self.warmup_stages:
            raise ValueError("DGC: warmup_steps > 0 needs at least one warm-up stage")
        for s in self.warmup_stages:
            require_fraction("DGC", "each warmup_stages entry", s, closed_above=False)

    def phase(self, step: int) -> float:
        """The sparsity used at `step`."""
        if step < self.warmup_steps:
            stage = step * len(self.warmup_stages) // self.warmup_steps
            return min(self.warmup_stages[stage], self.sparsity)
        return self.sparsity

    def _sparsity(self, phase) -> float:
        return self.sparsity if phase == () else float(phase)

    def init_state(self, shape, dtype):
        zeros = jnp.zeros(shape, accumulator_dtype(dtype))
        return {"u": zeros, "v": zeros} if self.momentum else {"v": zeros}

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        g = grad.reshape(-1).astype(accumulator_dtype(grad.dtype))
        if self.clip_norm is not None:
            bound = self.clip_norm / math.sqrt(num_workers)
            g = g * jnp.minimum(1.0, safe_divide(bound, jnp.linalg.norm(g)))
        if self.momentum:
            u = self.momentum * state["u"].reshape(-1) + g
            v = state["v"].reshape(-1) + u
        else:
            v = state["v"].reshape(-1) + g
        sparsity = self._sparsity(phase)
        k = count_of(v.size, 1 - sparsity)
        num_samples = min(v.size, max(math.ceil(v.size * self.sample_ratio),
                                      math.ceil(_MIN_SAMPLE_HITS / (1 - sparsity))))
        indices = _select_by_sampled_threshold(jnp.abs(v), k, num_samples, worker_key)
        values = v.at[indices].get(mode="fill", fill_value=0).astype(grad.dtype)  # wire payload
        summed = _all_gather_sparse(values, indices, v.size, axis_name, v.dtype)
        v = v - _scatter(v.size, indices, values, v.dtype)
        new_state = {"v": v.reshape(grad.shape)}
        if self.momentum:
            sent = jnp.zeros(v.size, bool).at[indices].set(True, mode="drop")
            new_state["u"] = jnp.where(sent, 0, u).reshape(grad.shape)
        return summed.reshape(grad.shape).astype(grad.dtype), new_state

    def wire_bytes(self, numel, itemsize, num_workers, phase=(), *, shape=None):
        k = count_of(numel, 1 - self._sparsity(phase))
        return all_gather_bytes(k * (itemsize + 4), num_workers)

    def describe(self):
        warmup = f", warm-up {self.warmup_steps} steps" if self.warmup_steps else ""
        return (f"DGC sparsity {self.sparsity:g} (momentum {self.momentum:g}{warmup}): "
                "k values + int32 indices, all-gather")
