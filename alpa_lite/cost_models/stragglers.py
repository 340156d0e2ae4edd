"""Stragglers: the expected step time of synchronous data parallelism when workers are late,
and of two schemes that avoid waiting for the slowest, which SPMD collectives cannot run.

The model
---------
``n`` data-parallel workers (replicas) each compute their share of the batch, then all of
them join one all-reduce of the gradients, then the optimizer update runs. Worker ``i``
finishes its share at

    F_i = load * T + D_i,

where ``T`` is the time of one plain share (``compute_s``), ``load`` is how many plain
shares the scheme gives a worker (1, or s+1 for gradient coding), and ``D_i`` are i.i.d.
delays from a delay model. With ``ShiftedExponential`` the delay is ``D_i ~ Exp(rate
1/mean)`` on top of the deterministic shift ``load * T``: the lecture on CodedReduce
(Reisizadeh et al. 2020, ``seeds/002``: "assuming exponentially distributed computation
times") and the shifted-exponential runtime of coded computing (Lee et al., "Speeding Up
Distributed Machine Learning Using Codes", IEEE Trans. Inf. Theory 64(3), 2018: a task of
load l takes a shifted exponential time whose shift and exponential part both grow with l,
``l * (1 + Exp(mu))``). By default the delay does not grow
with the load (a hiccup: a preemption, a slow link, a GC pause); ``scales_with_load=True``
takes Lee et al.'s form, ``D_i ~ load * Exp``.

A step waits for the r-th earliest of the ``n`` finishes, then the all-reduce
(``sync_s``), then the update (``fixed_s``):

    E[step] = load * T + E[D_(r:n)] + sync_s + fixed_s          (delays scaled by load
                                                                 when scales_with_load)

Policies (`StragglerPolicy`), with ``r`` and what they cost:

- ``SYNC``: ``r = n``, every gradient. ``E[D_(n:n)] = mean * H_n`` for exponential delays
  (``H_n = 1 + 1/2 + ... + 1/n``): by Renyi's representation the spacings of n i.i.d.
  Exp(lambda) order statistics are independent Exp((n - j) lambda), so
  ``E[D_(r:n)] = (1/lambda) * sum_{j=n-r+1}^{n} 1/j = mean * (H_n - H_{n-r})``
  (David & Nagaraja, "Order Statistics", 3rd ed., 2003, §2.5).
- ``DROP_SLOWEST`` with ``k``: ``r = n - k``, the k latest gradients are dropped (Chen et
  al., "Revisiting Distributed Synchronous SGD", arXiv:1604.00981, 2016: n + b workers,
  the first n gradients taken). ``E[D_(n-k:n)] = mean * (H_n - H_k)``. Each worker's loss
  is scaled 1/n for the mean over the global batch, so the sum of n - k gradients must be
  multiplied by ``n / (n - k)`` to stay unbiased, and it then averages ``(n - k) / n`` of
  the batch: its variance grows by ``n / (n - k)`` (a minibatch mean of b samples has
  variance sigma^2 / b: the minibatch SGD slides, ``seeds/001``). Unbiased only while
  which workers are late is independent of their data (persistently slow workers leave
  their shards under-represented).
- ``CODED`` with ``s``: gradient coding (Tandon et al., "Gradient Coding: Avoiding
  Stragglers in Distributed Learning", ICML 2017; the lecture's "Background - Gradient
  Coding" slide, ``seeds/002``): the data is split into n parts, each worker computes
  s + 1 of them (load ``(s+1)/n`` of the batch, the minimum for s stragglers, Tandon et
  al. Theorem 1) and sends one linear combination, from which any n - s workers' messages
  decode the exact full gradient. ``r = n - s``, ``load = s + 1``: extra compute ``s * T``
  per worker; ``E[D_(n-s:n)] = mean * (H_n - H_s)`` (times s + 1 if scaled). No rescaling,
  no extra variance. (CodedReduce's tree of such codes, the lecture's subject, changes the
  communication topology as well and is not simulated here.)

The all-reduce is charged ``sync_s`` in every policy (a ring over n - k workers moves
``2(n-k-1)/(n-k)`` of the bytes where n workers move ``2(n-1)/n``: the same to a few %).

Each policy's expectation is also estimated by Monte Carlo with a fixed seed (common random
numbers across the policies): a cross-check of the closed form for exponential delays, the
estimate itself for `EmpiricalDelays`, which has none here.

Executing them: drop-k and coded gradients need a collective over whichever workers
finished first. An SPMD program's collectives take every device of their mesh axes (each
must join, or the collective hangs), so alpa_lite simulates these two policies only
(``StragglerEstimate.spmd_executable`` is False).

This module needs neither JAX nor PuLP.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import re

import numpy as np

from alpa_lite.cost_models.devices import require_int, require_non_negative

__all__ = ["STRAGGLER_MODEL_SYNTAX", "DelayModel", "EmpiricalDelays", "ShiftedExponential",
           "StragglerEstimate", "StragglerPolicy", "StragglerScheme", "default_schemes",
           "expected_step_times", "harmonic", "parse_delay_model"]

STRAGGLER_MODEL_SYNTAX = (
    "exp:MEAN[:scaled] (exponential delays of mean MEAN ms, or with a unit: exp:20, "
    "exp:0.5s) or samples:FILE[:scaled] (delays in ms read from FILE); ':scaled' makes a "
    "delay grow with the worker's load")


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n (H_0 = 0)."""
    return math.fsum(1.0 / j for j in range(1, n + 1))


@dataclasses.dataclass(frozen=True)
class ShiftedExponential:
    """Each worker finishes at ``load * T + D``, ``D ~ Exp(rate 1 / mean_delay_s)`` i.i.d.
    (module docstring); ``scales_with_load``: ``D ~ load * Exp`` instead."""
    mean_delay_s: float
    scales_with_load: bool = False

    def __post_init__(self) -> None:
        require_non_negative("ShiftedExponential", "mean_delay_s", self.mean_delay_s)

    def expected_order_statistic(self, r: int, n: int) -> float | None:
        """E[D_(r:n)], the r-th smallest of n delays: mean * (H_n - H_{n-r})."""
        return self.mean_delay_s * (harmonic(n) - harmonic(n - r))

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.exponential(self.mean_delay_s, size=shape) if self.mean_delay_s > 0 \
            else np.zeros(shape)

    def describe(self) -> str:
        return (f"Exp(mean {self.mean_delay_s * 1e3:.4g} ms)"
                + (" x load" if self.scales_with_load else ""))


@dataclasses.dataclass(frozen=True)
class EmpiricalDelays:
    """Delays drawn uniformly, with replacement, from measured samples (seconds)."""
    samples_s: tuple[float, ...]
    scales_with_load: bool = False
    source: str = ""            # where the samples came from, for the printout

    def __post_init__(self) -> None:
        if not self.samples_s:
            raise ValueError("EmpiricalDelays: samples_s is empty; give at least one delay")
        for i, x in enumerate(self.samples_s):
            require_non_negative("EmpiricalDelays", f"samples_s[{i}]", x)

    def expected_order_statistic(self, r: int, n: int) -> float | None:
        """No closed form here: the Monte Carlo estimate is the answer."""
        return None

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.choice(np.asarray(self.samples_s, dtype=float), size=shape, replace=True)

    def describe(self) -> str:
        a = np.asarray(self.samples_s)
        where = f" from {self.source}" if self.source else ""
        return (f"{len(a)} measured delays{where} (mean {a.mean() * 1e3:.4g} ms, max "
                f"{a.max() * 1e3:.4g} ms)" + (" x load" if self.scales_with_load else ""))


DelayModel = ShiftedExponential | EmpiricalDelays
"""A per-worker delay distribution: ``expected_order_statistic(r, n)`` (None where there is
no closed form), ``sample(rng, shape)``, ``scales_with_load`` and ``describe()``."""


class StragglerPolicy(enum.Enum):
    """What a step does about late workers (module docstring)."""
    SYNC = "sync"                   # wait for every worker: what SPMD runs
    DROP_SLOWEST = "drop-slowest"   # take the first n - k gradients, rescale by n / (n - k)
    CODED = "coded"                 # gradient coding: load s + 1, decode from any n - s


@dataclasses.dataclass(frozen=True)
class StragglerScheme:
    """A policy with its parameter: k workers dropped (DROP_SLOWEST), s stragglers
    tolerated (CODED), 0 for SYNC."""
    policy: StragglerPolicy
    k: int = 0

    def __post_init__(self) -> None:
        if self.policy is StragglerPolicy.SYNC:
            if self.k != 0:
                raise ValueError(f"StragglerScheme: SYNC waits for every worker, so k must "
                                 f"be 0, got {self.k!r}")
        else:
            require_int("StragglerScheme", f"k of {self.policy.value}", self.k, 1)

    @property
    def label(self) -> str:
        if self.policy is StragglerPolicy.SYNC:
            return "sync all-reduce"
        if self.policy is StragglerPolicy.DROP_SLOWEST:
            return f"drop {self.k} slowest"
        return f"coded, s={self.k}"

    def waits_for(self, n: int) -> int:
        """The rank r of the finish the step waits for."""
        return n - self.k

    @property
    def load(self) -> int:
        """Plain shares of the batch a worker computes."""
        return self.k + 1 if self.policy is StragglerPolicy.CODED else 1


@dataclasses.dataclass(frozen=True)
class StragglerEstimate:
    """One policy's expected step under a delay model (module docstring).

    Attributes:
      expected_step_s: the closed form where there is one, else the Monte Carlo mean.
      compute_s: a worker's compute before its delay (load x T).
      extra_compute_s: what the scheme adds to each worker's compute ((load - 1) x T).
      expected_delay_s: E[D_(r:n)] (scaled by the load where the model says so).
      gradient_scale: what the summed gradients are multiplied by to stay unbiased.
      gradient_variance_factor: the gradient's variance against the full batch's.
      spmd_executable: whether an SPMD program (every device in every collective) runs it.
    """
    scheme: StragglerScheme
    num_workers: int
    waits_for: int
    compute_s: float
    extra_compute_s: float
    expected_delay_s: float
    sync_s: float
    fixed_s: float
    expected_step_s: float
    closed_form_s: float | None
    monte_carlo_s: float
    monte_carlo_stderr_s: float
    monte_carlo_samples: int
    gradient_scale: float
    gradient_variance_factor: float
    spmd_executable: bool
    note: str


def default_schemes(num_workers: int,
                    ks: tuple[int, ...] | None = None) -> tuple[StragglerScheme, ...]:
    """SYNC, then DROP_SLOWEST and CODED for each k of `ks` (default: 1, 2 and n/8, those
    below n)."""
    n = require_int("default_schemes", "num_workers", num_workers, 1)
    if ks is None:
        ks = tuple(sorted({k for k in (1, 2, n // 8) if 1 <= k < n}))
    for k in ks:
        if not 1 <= k < n:
            raise ValueError(f"k={k}: with {n} data-parallel worker(s) a policy can drop or "
                             f"tolerate 1..{n - 1} of them" if n > 1 else
                             f"k={k}: with one data-parallel worker there is none to drop "
                             "or code around")
    return (StragglerScheme(StragglerPolicy.SYNC),) + tuple(
        StragglerScheme(p, k) for p in (StragglerPolicy.DROP_SLOWEST, StragglerPolicy.CODED)
        for k in ks)


def expected_step_times(num_workers: int, compute_s: float, sync_s: float, delays: DelayModel,
                        schemes: tuple[StragglerScheme, ...] | None = None, fixed_s: float = 0.0,
                        samples: int = 20_000, seed: int = 0) -> tuple[StragglerEstimate, ...]:
    """The expected step of each scheme (module docstring for the model and formulas).

    Args:
      num_workers: n, the data-parallel workers.
      compute_s: T, one worker's compute of its plain 1/n share, without delay.
      sync_s: the gradient all-reduce after the last awaited worker.
      delays: the per-worker delay model.
      schemes: the policies (default: `default_schemes(n)`).
      fixed_s: per-step time that does not grow with a worker's share (optimizer update).
      samples: Monte Carlo draws of the n delays.
      seed: the Monte Carlo generator's seed.

    Returns:
      One `StragglerEstimate` per scheme, in order.

    Example:
      >>> sync, = expected_step_times(8, 0.1, 0.01, ShiftedExponential(0.02),
      ...                             (StragglerScheme(StragglerPolicy.SYNC),))
      >>> round(sync.expected_step_s, 6)    # 0.1 + 0.02 * H_8 + 0.01
      0.164365
    """
    n = require_int("expected_step_times", "num_workers", num_workers, 1)
    compute_s = require_non_negative("expected_step_times", "compute_s", compute_s)
    sync_s = require_non_negative("expected_step_times", "sync_s", sync_s)
    fixed_s = require_non_negative("expected_step_times", "fixed_s", fixed_s)
    samples = require_int("expected_step_times", "samples", samples, 2)
    schemes = default_schemes(n) if schemes is None else tuple(schemes)
    for sc in schemes:
        if sc.policy is not StragglerPolicy.SYNC and sc.k >= n:
            raise ValueError(f"{sc.label}: with {n} worker(s) a policy can drop or tolerate "
                             f"at most {n - 1}")
    mc = _monte_carlo_order_statistics(delays, n, {sc.waits_for(n) for sc in schemes},
                                       samples, seed)
    out = []
    for sc in schemes:
        r, load = sc.waits_for(n), sc.load
        delay_scale = load if delays.scales_with_load else 1
        base = load * compute_s + sync_s + fixed_s
        exact = delays.expected_order_statistic(r, n)
        mc_mean, mc_std = mc[r]
        mc_step = base + delay_scale * mc_mean
        closed = None if exact is None else base + delay_scale * exact
        scale = n / r if sc.policy is StragglerPolicy.DROP_SLOWEST else 1.0
        out.append(StragglerEstimate(
            scheme=sc, num_workers=n, waits_for=r, compute_s=load * compute_s,
            extra_compute_s=(load - 1) * compute_s,
            expected_delay_s=delay_scale * (mc_mean if exact is None else exact),
            sync_s=sync_s, fixed_s=fixed_s,
            expected_step_s=mc_step if closed is None else closed, closed_form_s=closed,
            monte_carlo_s=mc_step, monte_carlo_stderr_s=delay_scale * mc_std / math.sqrt(samples),
            monte_carlo_samples=samples, gradient_scale=scale, gradient_variance_factor=scale,
            spmd_executable=sc.policy is StragglerPolicy.SYNC, note=_note(sc, n)))
    return tuple(out)


def _note(sc: StragglerScheme, n: int) -> str:
    if sc.policy is StragglerPolicy.SYNC:
        return "what the SPMD program runs"
    if sc.policy is StragglerPolicy.DROP_SLOWEST:
        r = n - sc.k
        return f"variance x {n / r:.3g} ({r}/{n} of the batch)"
    return f"{sc.k + 1}/{n} of batch each; any {n - sc.k} decode"


def _monte_carlo_order_statistics(delays: DelayModel, n: int, ranks: set[int], samples: int,
                                  seed: int) -> dict[int, tuple[float, float]]:
    """(mean, standard deviation) of D_(r:n) over `samples` draws, for each rank r."""
    rng = np.random.default_rng(seed)
    kth = sorted(r - 1 for r in ranks)
    total = {r: 0.0 for r in ranks}
    squares = {r: 0.0 for r in ranks}
    chunk = max(1, min(samples, 2_000_000 // n))     # at most ~16 MB of float64 at once
    done = 0
    while done < samples:
        m = min(chunk, samples - done)
        d = np.partition(delays.sample(rng, (m, n)), kth, axis=1)
        for r in ranks:
            col = d[:, r - 1]
            total[r] += float(col.sum())
            squares[r] += float(np.square(col).sum())
        done += m
    out = {}
    for r in ranks:
        mean = total[r] / samples
        var = max(0.0, squares[r] / samples - mean * mean) * samples / (samples - 1)
        out[r] = (mean, math.sqrt(var))
    return out


_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|us|µs)?\s*$")
_UNIT_S = {None: 1e-3, "ms": 1e-3, "s": 1.0, "us": 1e-6, "µs": 1e-6}


def parse_delay_model(text: str) -> DelayModel:
    """A delay model from its command-line form (`STRAGGLER_MODEL_SYNTAX`).

    Raises:
      ValueError: naming what is wrong and what to write.
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"straggler model {text!r}: {why}; write {STRAGGLER_MODEL_SYNTAX}")

    kind, sep, rest = text.strip().partition(":")
    scaled = False
    if rest.endswith(":scaled"):
        rest, scaled = rest[:-len(":scaled")], True
    if not sep or not rest:
        raise bad("expected KIND:VALUE")
    if kind == "exp":
        m = _NUMBER.match(rest)
        if not m:
            raise bad(f"the mean delay {rest!r} is not a non-negative number with an optional "
                      "unit ms, s or us")
        return ShiftedExponential(float(m.group(1)) * _UNIT_S[m.group(2)], scaled)
    if kind == "samples":
        path = pathlib.Path(rest)
        try:
            raw = path.read_text()
        except OSError as e:
            raise bad(f"cannot read {rest!r} ({e.strerror or e})") from None
        if not raw.strip():
            raise bad(f"{rest!r} holds no delays")
        values = []
        for word in re.split(r"[\s,]+", raw.strip()):
            try:
                x = float(word)
            except ValueError:
                raise bad(f"{rest!r} holds {word!r}, not a delay in ms") from None
            if not math.isfinite(x) or x < 0:
                raise bad(f"{rest!r} holds {word!r}: delays must be finite and >= 0 ms")
            values.append(x * 1e-3)
        return EmpiricalDelays(tuple(values), scaled, source=path.name)
    raise bad(f"unknown kind {kind!r}")
