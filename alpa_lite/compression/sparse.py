"""Sparse communication: send k of the gradient's entries, keep the rest for later.

* `TopK`: the k largest entries by magnitude, with local accumulation of the rest (error
  feedback, Aji & Heafield 2017). Each worker picks its own k positions, so the payload is
  (values, int32 indices), all-gathered and scatter-added locally: (n-1) * k * (itemsize + 4)
  bytes, growing with n (a sparse sum gets denser, so a ring all-reduce would not stay sparse).
* `RandomK`: k positions drawn from the key shared by all workers, so they agree and the k
  values go through a psum: 2 (n-1)/n * k * itemsize, flat in n.
* `DGC`: Deep Gradient Compression (Lin et al. 2018), top-k with a sampled threshold,
  momentum correction, momentum factor masking, local gradient clipping and an exponential
  sparsity warm-up; vectors and small matrices go whole. It carries the momentum itself:
  the step's optimizer must be plain SGD (`alpa_lite.compression.momentum` checks).

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


# DGC's threshold (Lin et al. 2018, system analysis): the k-th largest of a 0.1%-1% random
# sample estimates the threshold, and when far more than k entries pass it a precise one is
# computed from the entries already selected. The authors' code (github.com/synxlin/
# deep-gradient-compression, dgc/compression.py) accepts a threshold passing between 0.8 k and 1.3 k entries, else
# scales it by that factor and counts again, at most 10 times, and takes the exact top-k
# of the passing entries when more than 1.3 k pass.
_LOWER, _UPPER, _MAX_ADJUSTMENTS = 0.8, 1.3, 10
# The sample must hold a few entries above the threshold for its k-th largest to mean
# anything (the authors' code samples at least 2 / density entries).
_MIN_SAMPLE_HITS = 2


def _select_by_sampled_threshold(magnitude: jax.Array, k: int, num_samples: int,
                                 key: jax.Array) -> jax.Array:
    """Indices of the k largest entries of `magnitude`, padded with `magnitude.size` to k slots.

    1. Estimate: t = the (k x num_samples / numel)-th largest magnitude of `num_samples`
       random entries (a top-k over the sample only, never over the whole tensor).
    2. Adjust by counting the entries >= t, at most 10 times while the count is outside
       [0.8 k, 1.3 k]: t x 1.3 when too many pass, t x 0.8 when too few, each further move
       the same way squaring the factor (x 0.64, x 0.41, ...: a far-off estimate is reached
       in a few counts), until one threshold on each side is known; from then on t is the
       geometric mean of the closest two (bisection), so it cannot jump back and forth over
       the range.
    3. Precise: gather the entries >= t (at most ceil(1.3 k) of them) and keep their k
       largest.

    When step 2 ends in range the result is the exact top-k of the tensor, or, with between
    0.8 k and k entries passing, all of them. Zeros are never selected. If the 10 counts do
    not bring it into range (ties, or fewer than 0.8 k nonzero entries), step 3 takes the k
    largest of the first ceil(1.3 k) passing entries by position.
    """
    numel = magnitude.size
    if num_samples >= numel:
        sample = magnitude
    else:
        sample = magnitude[jax.random.randint(key, (num_samples,), 0, numel)]
    threshold = jax.lax.top_k(sample, max(1, round(num_samples * k / numel)))[0][-1]
    # A zero estimate (mostly zero entries): start from the smallest nonzero magnitude.
    threshold = jax.lax.cond(threshold > 0, lambda: threshold,
                             lambda: jnp.min(jnp.where(magnitude > 0, magnitude, jnp.inf)))

    def count(t):
        return jnp.sum((magnitude >= t) & (magnitude > 0))

    def out_of_range(carry):
        i, _, n, _, _, _, _ = carry
        return (i < _MAX_ADJUSTMENTS) & ((n > _UPPER * k) | (n < _LOWER * k))

    def adjust(carry):
        i, t, n, low, high, up, down = carry
        too_many = n > _UPPER * k
        low = jnp.where(too_many, t, low)          # t passes too many: the answer is above t
        high = jnp.where(too_many, high, t)        # t passes too few: the answer is below t
        bracketed = (low > 0) & jnp.isfinite(high)
        t = jnp.where(bracketed, jnp.sqrt(low * jnp.where(bracketed, high, 1.0)),
                      t * jnp.where(too_many, up, down))
        up, down = jnp.where(too_many, up * up, up), jnp.where(too_many, down, down * down)
        return i + 1, t, count(t), low, high, up, down

    # No bound known yet: low 0, high inf. (Made from `threshold`, so that under shard_map
    # they vary over the workers like it does.)
    zero = jnp.minimum(threshold, 0.0)
    start = (0, threshold, count(threshold), zero, jnp.maximum(threshold, jnp.inf),
             zero + _UPPER, zero + _LOWER)
    threshold = jax.lax.while_loop(out_of_range, adjust, start)[1]
    cap = min(numel, math.ceil(_UPPER * k))
    (candidates,) = jnp.nonzero((magnitude >= threshold) & (magnitude > 0), size=cap,
                                fill_value=numel)
    scores = magnitude.at[candidates].get(mode="fill", fill_value=-1.0)   # padding ranks last
    _, best = jax.lax.top_k(scores, k)
    return candidates[best].astype(jnp.int32)


# Lin et al. 2018, warm-up training: the sparsity rises exponentially over the first four
# epochs, 75%, 93.75%, 98.4375%, 99.6%, then 99.9%: the density divided by 4 per epoch.
DGC_WARMUP_STAGES = (0.75, 0.9375, 0.984375, 0.996)


@dataclasses.dataclass(frozen=True)
class DGC(Compressor):
    """Deep Gradient Compression (Lin et al. 2018).

    DGC MOVES THE MOMENTUM INTO THE COMPRESSOR: with `momentum` > 0 what it returns is
    already momentum SGD's velocity, so the step's optimizer must be plain SGD
    (`optax.sgd(lr)`, no `momentum=`) with the same learning rate schedule. A momentum
    optimizer on top applies the momentum twice; `al.parallelize` refuses that combination
    (`alpa_lite.compression.momentum`). To keep your own optimizer's momentum (or Adam) use
    `DGC(momentum=0.0)`: top-k of the accumulated gradients, without momentum correction.

    Per step, on each worker, for a leaf it compresses (g = this worker's gradient,
    m = momentum; Sec. 3 of the paper):

      g = g * min(1, (clip_norm / sqrt(n)) / ||g||)   local gradient clipping (if clip_norm)
      u = m * u + g;  v = v + u                      momentum correction: accumulate velocity
      send the k = (1 - sparsity) * numel largest |v| (sampled threshold, see below)
      v = v - sent;  u = 0 where sent                momentum factor masking

    Small leaves are sent whole (`compresses`), as in the paper, whose ratios leave biases
    unpruned (597x rather than 1000x on AlexNet at 99.9%): vectors and scalars (biases, norm
    scales; the authors' code compresses only parameters with more than one dimension) and
    matrices under `min_compressed_numel` entries, by default 2 / (1 - sparsity): those where
    top-k would send fewer than 2 entries (the authors' code warns that such a layer
    "transmits 1 gradient element"). A whole leaf goes through a psum of u = m * u + g,
    momentum SGD's velocity: nothing kept, no masking (masking every entry each step would
    remove the momentum).

    The result is the sum over workers; the caller's mean (the loss scale, 1/n for a mean
    loss) makes it the mean velocity, which plain SGD applies as momentum SGD would, the
    learning rate once. `momentum=0` gives top-k with local accumulation of gradients.

    Selection (`_select_by_sampled_threshold`): the k-th largest of a sample of
    `sample_ratio` of the entries (at least 2 / (1 - sparsity) of them) estimates the
    threshold, counting adjusts it into [0.8 k, 1.3 k] passing entries, and the k largest of
    those are sent as exactly k (value, int32 index) slots; unused slots carry index numel
    and value 0. Clipping is per leaf (the paper clips the whole model's gradient; a leaf is
    what `reduce` sees).

    Warm-up: over the first `warmup_steps` steps the sparsity runs through `warmup_stages`
    (equal numbers of steps each; the paper uses one epoch per stage), then `sparsity`.
    `phase(step)` returns the step's sparsity, so each stage compiles with a static k.

    Args:
      sparsity: fraction of entries NOT sent after warm-up, in (0, 1).
      warmup_steps: length of the sparsity warm-up, >= 0 (0: no warm-up).
      momentum: m in [0, 1).
      clip_norm: global gradient-norm bound; each worker clips to clip_norm / sqrt(n). None: off.
      sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1].
      warmup_stages: the warm-up sparsities, each in (0, 1) (capped at `sparsity`).
      min_compressed_numel: matrices with fewer entries are sent whole, >= 0; None (the
        default): ceil(2 / (1 - sparsity)), 2000 at sparsity 0.999.
    """

    sparsity: float = 0.999
    warmup_steps: int = 0
    momentum: float = 0.9
    clip_norm: float | None = None
    sample_ratio: float = 0.01
    warmup_stages: tuple[float, ...] = DGC_WARMUP_STAGES
    min_compressed_numel: int | None = None

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
        if self.min_compressed_numel is not None and not (
                isinstance(self.min_compressed_numel, int) and self.min_compressed_numel >= 0):
            raise ValueError(f"DGC: min_compressed_numel must be an int >= 0 or None, got "
                             f"{self.min_compressed_numel!r}")

    @property
    def smallest_compressed(self) -> int:
        """Entries a matrix needs to be compressed: `min_compressed_numel`, or by default
        enough for top-k at the final sparsity to send 2 of them."""
        if self.min_compressed_numel is not None:
            return self.min_compressed_numel
        return math.ceil(round(_MIN_SAMPLE_HITS / (1 - self.sparsity), 9))   # 2000.0000000000018

    def compresses(self, shape: tuple[int, ...]) -> bool:
        """Whether a leaf of this shape is sparsified (else: sent whole, with momentum).
        Decided by the final sparsity, so the state keeps its shape through the warm-up."""
        return len(shape) >= 2 and math.prod(shape) >= self.smallest_compressed

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
        if not self.compresses(tuple(shape)):
            return {"u": zeros} if self.momentum else ()
        return {"u": zeros, "v": zeros} if self.momentum else {"v": zeros}

    def reduce(self, grad, state, *, axis_name, num_workers, phase, shared_key, worker_key):
        check_axis(axis_name, num_workers)
        g = grad.reshape(-1).astype(accumulator_dtype(grad.dtype))
        if self.clip_norm is not None:
            bound = self.clip_norm / math.sqrt(num_workers)
            g = g * jnp.minimum(1.0, safe_divide(bound, jnp.linalg.norm(g)))
        u = self.momentum * state["u"].reshape(-1) + g if self.momentum else g
        if not self.compresses(tuple(grad.shape)):
            summed = jax.lax.psum(u.astype(grad.dtype), axis_name)   # the velocity, whole
            new_state = {"u": u.reshape(grad.shape)} if self.momentum else ()
            return summed.reshape(grad.shape), new_state
        v = state["v"].reshape(-1) + u
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
        """Without `shape` the leaf is taken to be compressed (a matrix)."""
        if shape is not None and not self.compresses(tuple(shape)):
            return ring_all_reduce_bytes(numel * itemsize, num_workers)
        k = count_of(numel, 1 - self._sparsity(phase))
        return all_gather_bytes(k * (itemsize + 4), num_workers)

    def describe(self):
        warmup = f", warm-up {self.warmup_steps} steps" if self.warmup_steps else ""
        return (f"DGC sparsity {self.sparsity:g} (momentum {self.momentum:g}{warmup}): "
                f"k values + int32 indices, all-gather; vectors and matrices under "
                f"{self.smallest_compressed} entries whole (psum)")
