"""Calibration: measure the devices at hand and describe them as a `Cluster` a plan can use.

    cluster, report = calibrate()                 # ~1 min on 8 virtual CPU devices
    plan = step.plan(*args, cluster=cluster)      # priced with measured figures
    Path("mycluster.json").write_text(cluster.to_json())   # or: alpa-lite calibrate -o ...

What is measured (every program runs on ALL local devices at once, one SPMD program over a
mesh of them, because a plan keeps every device busy: 8 virtual CPU devices share the
machine's cores, so one device alone would look several times faster than it is in a plan):

- dispatch: one call of a trivial program (an add on a small array), the fixed cost every
  other timing contains and from which it is subtracted;
- matmuls: per device one chain of R dependent matmuls ``x (m,k) @ w1 (k,n) @ w2 (n,k) @ w1
  ...``, each of ``2 m k n`` FLOPs, for square and skinny shapes from tiny to large;
  per-matmul time = (call time - dispatch) / R. The smallest (8 x 8 x 8, ~1 kFLOP) gives
  ``op_overhead_s``, the fixed cost per matmul kernel; the others, less that overhead, give
  the efficiency curve (``cost_models.calibration.fit_matmul_efficiency_curve``). Chains,
  not one matmul per call: inside a train step matmuls do not pay a dispatch each. dtype:
  bfloat16 on GPUs, float32 on CPUs;
- memory bandwidth: a chain of R element-wise passes ``x = x + 1`` per device, each kept
  a pass of its own by ``lax.optimization_barrier`` (XLA would fuse them into one loop),
  over arrays of several sizes; per-pass time = (call time - dispatch) / R, and
  ``t = c + bytes / B`` fitted with bytes = read + written (``fit_memory_bandwidth``), the
  way the traced graph counts an op's bytes. Inside one program, not one pass per call: a
  call allocates its output afresh, and on CPU the page faults of that first touch made a
  lone pass over 16 MB ~8x slower than the same pass inside a program (measured here:
  ~1 against ~9 GB/s per device). ``c`` (the fixed cost of an element-wise kernel) is
  reported, not used: XLA fuses element-wise ops, so the traced equations overstate their
  kernel count (``compute.py``);
- links: for each collective the planner prices (all-reduce, all-gather, reduce-scatter,
  all-to-all, send/recv as a ``ppermute`` ring shift), a chain of R dependent ones of
  several sizes over the local devices (the intra-node link) and, when there are several
  JAX processes, over the process axis with every local device in its own group (the
  inter-node link). Each collective's alpha and beta are fitted with the formula
  ``collectives.py`` prices it with (``fit_link_collectives``): the all-reduce's become the
  link's figures, the others its measured collectives, since they differ by more than their
  formulas say (``cluster.py``, "Measured collectives"). A chain keeps its R collectives
  dependent: an all-gather's next input is a block of its output, a reduce-scatter's
  output is written back into its next input; the compiled HLO is checked to hold all R,
  so XLA folding one away is an error, not a wrong figure.

Timing: one call compiles, one more warms up, then the median of ``repeats`` calls, each
ended by ``jax.block_until_ready``; the coefficient of variation is kept in the report.

The device spec: the peaks of a known GPU (a datasheet row of ``DEVICES``: H200, H100,
A100, V100) stay the datasheet's and the curve is relative to the peak of the measured
dtype; a CPU has no datasheet peak that XLA reaches, and an accelerator alpa_lite has no row
for no datasheet here, so their peak for the measured dtype is the best measured matmul rate
(the curve then tops out at 1.0). Memory size and element-wise efficiency stay those of
``Cluster.local(allow_unknown=True)``'s spec (for an unknown accelerator: the memory JAX
reports, else a ``[Nominal]`` 16 GB to check and edit in the JSON); ``matmul_efficiency`` becomes the curve's highest point (used
only by code that ignores the curve). Nodes are the JAX processes, as in ``Cluster.local``.

Multi-process (multi-controller) JAX: every process must call `calibrate` (each runs the
same programs); process 0's timings are broadcast to all before fitting, so every process
returns the same cluster (plans check cluster fingerprints). The library prints nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpa_lite.cost_models.calibration import (
    CollectiveSample,
    best_flop_rate,
    fit_link_collectives,
    fit_matmul_efficiency_curve,
    fit_memory_bandwidth,
)
from alpa_lite.cost_models.cluster import Cluster, LinkSpec
from alpa_lite.cost_models.collectives import CollectiveKind
from alpa_lite.cost_models.devices import DEVICES
from alpa_lite.progress import Progress, report
from alpa_lite.runtime.distributed import share_from_first
from alpa_lite.runtime.hlo import collectives_in_hlo

__all__ = ["calibrate", "CalibrationReport", "MatmulSample", "TimedSample", "LinkReport"]

DISPATCH, MATMULS, MEMORY, LINKS = "dispatch", "matmuls", "memory", "links"
"""The progress phases `calibrate` reports (`progress(phase, done, total)`)."""

# Shapes (m, k, n) per device. The first is the overhead probe (op_overhead_s): 8 x 8 x 8
# is ~1 kFLOP, nanoseconds of arithmetic on any device, so its time is the fixed cost.
# Then square sizes (m = k = n) and skinny ones shaped like transformer layers (tokens x
# hidden x 4 hidden, and its transposes) at the sizes a CPU-sized model has.
_OVERHEAD_SHAPE = (8, 8, 8)
_CPU_SHAPES = ((16, 16, 16), (32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256),
               (512, 512, 512), (1024, 1024, 1024), (256, 64, 256), (1024, 64, 256),
               (256, 128, 512), (1024, 512, 128), (2048, 128, 512), (64, 1024, 1024))
_CPU_SHAPES_QUICK = ((32, 32, 32), (128, 128, 128), (256, 64, 256), (512, 512, 512),
                     (1024, 128, 512))
# GPU sizes follow the H100 sweep (HARDWARE.md): tokens 512 ... 8192, hidden 1024 ... 8192.
_GPU_SHAPES = tuple((s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)) + tuple(
    (t, h, 4 * h) for t in (512, 2048, 8192) for h in (1024, 2048, 4096)) + tuple(
    (t, 4 * h, h) for t in (512, 2048, 8192) for h in (1024, 4096))
_GPU_SHAPES_QUICK = ((512, 512, 512), (2048, 2048, 2048), (8192, 8192, 8192),
                     (512, 1024, 4096), (2048, 4096, 16384))
# Work per timed chain: enough that the chain outlasts the dispatch noise (on CPU calls vary
# by ~0.1 ms, DESIGN.md), small enough to keep calibration within a minute.
_CHAIN_TARGET_S = {"cpu": 5e-3, "gpu": 2e-3}
_MAX_CHAIN = 64
# Element-wise pass sizes (float32 elements per device) and collective sizes (bytes as
# collectives.py counts each collective's).
_CPU_MEMORY_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20)
# The quick sweep's two sizes lie 64x apart: nearer sizes let a busy machine's noise tilt
# the fitted slope negative (seen once in about a dozen runs at 16x).
_CPU_MEMORY_SIZES_QUICK = (1 << 14, 1 << 20)
_GPU_MEMORY_SIZES = (1 << 24, 1 << 26, 1 << 28)
_CPU_COLLECTIVE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
_CPU_COLLECTIVE_BYTES_QUICK = (1 << 12, 1 << 18, 1 << 22)
_GPU_COLLECTIVE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28)
_REPEATS = {False: 5, True: 3}  # timed calls per measurement (quick: 3)
# Rough per-device rates used only to choose chain lengths (never as results): CPU ~30
# GFLOP/s (measured here with 8 virtual devices on 2 cores), GPUs ~100 TFLOP/s.
_GUESS_FLOPS_PER_S = {"cpu": 3e10, "gpu": 1e14}
_GUESS_COLLECTIVE_S = {"cpu": 3e-4, "gpu": 3e-5}


@dataclasses.dataclass(frozen=True)
class TimedSample:
    """One timed program: ``seconds`` per operation (dispatch taken off, divided by the
    chain length ``repeats``), ``cv`` the coefficient of variation of the calls."""

    nbytes: float
    seconds: float
    repeats: int
    cv: float


@dataclasses.dataclass(frozen=True)
class MatmulSample:
    """One matmul shape: ``(m, k, n)`` per device, ``flops = 2 m k n``, ``seconds`` per
    matmul (dispatch taken off), over a chain of ``repeats``; ``cv`` of the calls."""

    m: int
    k: int
    n: int
    flops: float
    seconds: float
    repeats: int
    cv: float

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


@dataclasses.dataclass(frozen=True)
class LinkReport:
    """One collective timed on one link: ``level`` ("intra_node" or "inter_node"), the
    ``collective`` (a ``CollectiveKind`` value), the devices in one group, the timings
    (``nbytes`` as ``collectives.py`` counts that collective's bytes), the alpha and beta
    fitted to them as a ``LinkSpec``, and its relative error per timing. A level with one
    device per group (a single GPU) is not timed and has no report: its link stays
    ``Cluster.local()``'s."""

    level: str
    collective: str
    group_size: int
    samples: tuple[TimedSample, ...]
    link: LinkSpec
    relative_errors: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
    """What `calibrate` measured and fitted (module docstring for how)."""

    platform: str
    device_kind: str
    dtype: str
    num_processes: int
    devices_per_process: int
    quick: bool
    dispatch_s: float                   # one call of a trivial program
    op_overhead_s: float                # per matmul: the 8 x 8 x 8 chain's time per matmul
    peak_flops_per_s: float             # what the curve is relative to
    peak_source: str                    # "datasheet <name>" or "best measured"
    matmuls: tuple[MatmulSample, ...]
    matmul_efficiency_curve: tuple[tuple[float, float], ...]
    memory: tuple[TimedSample, ...]     # seconds per element-wise pass
    memory_bandwidth_bytes_per_s: float
    memory_intercept_s: float           # fixed cost per element-wise pass (reported only)
    links: tuple[LinkReport, ...]
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (links as their `LinkSpec.to_dict`)."""
        d = dataclasses.asdict(self)
        d["matmul_efficiency_curve"] = [list(p) for p in self.matmul_efficiency_curve]
        d["links"] = [dict(dataclasses.asdict(r), link=r.link.to_dict()) for r in self.links]
        return d


def calibrate(devices: Sequence[jax.Device] | None = None, *, quick: bool = False,
              progress: Progress | None = None) -> tuple[Cluster, CalibrationReport]:
    """Measures the local devices and returns a calibrated `Cluster` and the report.

    Args:
      devices: The devices of this process to measure (default ``jax.local_devices()``);
        they must be all of this process's devices of one kind (a plan runs on all).
      quick: Fewer shapes and sizes and 3 timed calls instead of 5 (~3x faster).
      progress: Told ``(phase, done, total)`` for the phases ``DISPATCH``, ``MATMULS``,
        ``MEMORY``, ``LINKS``.

    Returns:
      ``(cluster, report)``: the cluster has ``Cluster.local()``'s shape, platform and
      name with ``-calibrated`` appended, and measured device and link figures.

    Raises:
      ValueError: for devices that are not this process's local devices, or processes
        holding unequal device counts (`Cluster.local`).
    """
    t_start = time.perf_counter()
    # Validates the device counts; an accelerator without a DEVICES row is measured too.
    local = Cluster.local(allow_unknown=True)
    local_devices = jax.local_devices()
    devices = list(local_devices if devices is None else devices)
    if sorted(d.id for d in devices) != sorted(d.id for d in local_devices):
        raise ValueError(
            f"calibrate: devices must be all of this process's devices "
            f"({len(local_devices)}: {local_devices[:2]}...), got {len(devices)}: a plan "
            f"keeps every device busy, so they are measured together. Restrict the devices "
            f"JAX sees instead (e.g. CUDA_VISIBLE_DEVICES, XLA_FLAGS).")
    platform = local.platform
    kind = "cpu" if platform == "cpu" else "gpu"
    dtype = jnp.float32 if kind == "cpu" else jnp.bfloat16
    repeats = _REPEATS[bool(quick)]
    mesh = Mesh(np.array(devices), ("d",))

    report(progress, DISPATCH, 0, 1)
    dispatch_s, _ = _time_calls(_elementwise_fn(mesh), _sharded(mesh, (len(devices), 8),
                                                                jnp.float32),
                                repeats=max(20, 4 * repeats))
    report(progress, DISPATCH, 1, 1)

    if kind == "cpu":
        shapes = _CPU_SHAPES_QUICK if quick else _CPU_SHAPES
    else:
        shapes = _GPU_SHAPES_QUICK if quick else _GPU_SHAPES
    shapes = (_OVERHEAD_SHAPE,) + tuple(shapes)
    matmuls = []
    for i, shape in enumerate(shapes):
        report(progress, MATMULS, i, len(shapes))
        matmuls.append(_time_matmul(mesh, shape, dtype, kind, dispatch_s, repeats))
    report(progress, MATMULS, len(shapes), len(shapes))

    if kind == "cpu":
        mem_sizes = _CPU_MEMORY_SIZES_QUICK if quick else _CPU_MEMORY_SIZES
        ar_sizes = _CPU_COLLECTIVE_BYTES_QUICK if quick else _CPU_COLLECTIVE_BYTES
    else:
        mem_sizes, ar_sizes = _GPU_MEMORY_SIZES, _GPU_COLLECTIVE_BYTES
    memory = []
    for i, size in enumerate(mem_sizes):
        report(progress, MEMORY, i, len(mem_sizes))
        memory.append(_time_elementwise(mesh, size, kind, dispatch_s, repeats))
    report(progress, MEMORY, len(mem_sizes), len(mem_sizes))

    # A group of one device has no link to time (a single GPU): the nominal link stays.
    levels = [("intra_node", mesh, "d", len(devices))] if len(devices) > 1 else []
    if jax.process_count() > 1:
        # Devices grouped (process, local index): the psum over "node" is one group per
        # local index, one device per process in each: the inter-node link alone.
        grid = np.array([[d for d in jax.devices() if d.process_index == p]
                         for p in range(jax.process_count())])
        levels.append(("inter_node", Mesh(grid, ("node", "d")), "node", jax.process_count()))
    raw_links = []
    total = len(levels) * len(CollectiveKind) * len(ar_sizes)
    done = 0
    for level, m, axis, n in levels:
        for collective in CollectiveKind:
            samples = []
            for nbytes in ar_sizes:
                report(progress, LINKS, done, total)
                samples.append(_time_collective(m, axis, collective, nbytes, kind, dispatch_s,
                                                repeats))
                done += 1
            raw_links.append((level, n, collective, samples))
    report(progress, LINKS, total, total)

    # Multi-controller: every process fits process 0's numbers (module docstring).
    timings = _share_timings(_Timings(dispatch_s, tuple(matmuls), tuple(memory),
                                      tuple(raw_links)))
    return _fit(local, _Setting(platform, str(devices[0].device_kind),
                                jnp.dtype(dtype).name, bool(quick)),
                timings, time.perf_counter() - t_start)


# ---- fitting -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Setting:
    """What was calibrated: the platform and device kind JAX reports, the matmul dtype,
    and whether the quick sweep ran."""
    platform: str
    device_kind: str
    dtype: str
    quick: bool


@dataclasses.dataclass(frozen=True)
class _Timings:
    """What calibration measured, before fitting: the dispatch of a trivial program, the
    matmul and element-wise samples, and per link level and collective
    `(level, devices, collective, samples)`."""
    dispatch_s: float
    matmuls: tuple[MatmulSample, ...]
    memory: tuple[TimedSample, ...]
    links: tuple


def _fit(local: Cluster, setting: _Setting, timings: _Timings,
         elapsed_s: float) -> tuple[Cluster, CalibrationReport]:
    platform, device_kind, dtype = setting.platform, setting.device_kind, setting.dtype
    matmuls, memory, raw_links = timings.matmuls, timings.memory, timings.links
    overhead_s = matmuls[0].seconds
    timed = matmuls[1:]
    flops = [s.flops for s in timed]
    seconds = [s.seconds for s in timed]
    base = local.device
    if base in DEVICES.values() and base != DEVICES["CPU"]:       # a datasheet row
        peak = base.peak_flops(dtype)
        peak_source = f"datasheet {base.name} {dtype}"
        peaks, name = base.peak_flops_per_s, base.name
    else:
        peak = best_flop_rate(flops, seconds, overhead_s)
        peak_source = "best measured"
        peaks, name = ((dtype, peak),), f"{device_kind}-{platform}"
    curve = fit_matmul_efficiency_curve(flops, seconds, peak, overhead_s=overhead_s)
    bandwidth, intercept = fit_memory_bandwidth([s.nbytes for s in memory],
                                                [s.seconds for s in memory])
    device = dataclasses.replace(
        base,
        name=f"{name}-calibrated",
        peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=bandwidth,
        matmul_efficiency=max(e for _, e in curve),
        matmul_efficiency_curve=curve,
        op_overhead_s=overhead_s,
    )
    link_reports = []
    fitted: dict[str, LinkSpec] = {}
    nominal = {"intra_node": local.intra_node, "inter_node": local.inter_node}
    for level in dict.fromkeys(level for level, *_ in raw_links):
        timed = {collective: (n, samples) for lv, n, collective, samples in raw_links
                 if lv == level}
        fitted[level], fits = fit_link_collectives(
            [CollectiveSample(collective, n, s.nbytes, s.seconds)
             for collective, (n, samples) in timed.items() for s in samples],
            f"{nominal[level].name}-calibrated")
        for collective, fit in fits:
            n, samples = timed[collective]
            link_reports.append(LinkReport(level, collective.value, n, tuple(samples),
                                           fit.link, fit.relative_errors))
    cluster = Cluster(
        name=f"{local.name}-calibrated",
        device=device,
        num_nodes=local.num_nodes,
        devices_per_node=local.devices_per_node,
        intra_node=fitted.get("intra_node", local.intra_node),
        inter_node=fitted.get("inter_node"),
        platform=platform,
    )
    rep = CalibrationReport(
        platform=platform, device_kind=device_kind, dtype=dtype,
        num_processes=local.num_nodes, devices_per_process=local.devices_per_node,
        quick=setting.quick, dispatch_s=timings.dispatch_s, op_overhead_s=overhead_s,
        peak_flops_per_s=peak, peak_source=peak_source, matmuls=tuple(matmuls),
        matmul_efficiency_curve=curve, memory=tuple(memory),
        memory_bandwidth_bytes_per_s=bandwidth, memory_intercept_s=intercept,
        links=tuple(link_reports), elapsed_s=elapsed_s)
    return cluster, rep


# ---- measuring -----------------------------------------------------------------------------


def _sharded(mesh: Mesh, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
    """An array of `shape` whose first axis (one row block per device) is split over the
    mesh's axes; random normal values times `scale` (finite through long matmul chains)."""
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    make = jax.jit(lambda key: (scale * jax.random.normal(key, shape, jnp.float32)
                                ).astype(dtype), out_shardings=sharding)
    return make(jax.random.key(0))


def _time_calls(fn: Callable, *args, repeats: int) -> tuple[float, float]:
    """(median seconds per call, coefficient of variation) after a compile and a warm-up."""
    jax.block_until_ready(fn(*args))     # compiles
    jax.block_until_ready(fn(*args))     # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    cv = statistics.pstdev(times) / median if median > 0 else 0.0
    return median, cv


def _elementwise_fn(mesh: Mesh) -> Callable:
    # One element-wise pass per device: read x, write x + 1.
    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(lambda x: x + 1.0, mesh=mesh, in_specs=spec, out_specs=spec))


def _chain_length(work_s: float, kind: str) -> int:
    return int(min(_MAX_CHAIN, max(2, math.ceil(_CHAIN_TARGET_S[kind] / max(work_s, 1e-9)))))


def matmul_chain(mesh: Mesh, shape: tuple[int, int, int], dtype,
                 chain: int) -> tuple[Callable, tuple[jax.Array, ...]]:
    """(program, its arguments): `chain` dependent matmuls of ``(m, k, n) = shape`` per
    device of `mesh` (one axis), each ``2 m k n`` FLOPs, in one SPMD program."""
    m, k, n = shape
    nd = mesh.size
    # Per device x (m, k), w1 (k, n), w2 (n, k): x @ w1 @ w2 @ w1 ... keeps the shape
    # alternating (m, n), (m, k), and every matmul does 2 m k n FLOPs. Weights scaled by
    # 1/sqrt(fan-in) keep the values finite however long the chain.
    x = _sharded(mesh, (nd * m, k), dtype)
    w1 = _sharded(mesh, (nd * k, n), dtype, k ** -0.5)
    w2 = _sharded(mesh, (nd * n, k), dtype, n ** -0.5)

    def body(x, w1, w2):
        for i in range(chain):
            x = x @ (w1 if i % 2 == 0 else w2)
        return x

    spec = P(mesh.axis_names)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    return fn, (x, w1, w2)


def _time_matmul(mesh: Mesh, shape: tuple[int, int, int], dtype, kind: str,
                 dispatch_s: float, repeats: int) -> MatmulSample:
    m, k, n = shape
    flops = 2.0 * m * k * n
    chain = _MAX_CHAIN if shape == _OVERHEAD_SHAPE else \
        _chain_length(flops / _GUESS_FLOPS_PER_S[kind], kind)
    fn, args = matmul_chain(mesh, shape, dtype, chain)
    t, cv = _time_calls(fn, *args, repeats=repeats)
    return MatmulSample(m, k, n, flops, _per_op(t, dispatch_s, chain), chain, cv)


def _time_elementwise(mesh: Mesh, size: int, kind: str, dispatch_s: float,
                      repeats: int) -> TimedSample:
    nbytes = 2.0 * size * 4                    # float32, read + written
    guess = nbytes / (1e10 if kind == "cpu" else 2e12)
    chain = min(16, _chain_length(guess, kind))
    x = _sharded(mesh, (mesh.size * size,), jnp.float32)

    def body(v):
        for _ in range(chain):
            v = jax.lax.optimization_barrier(v + 1.0)
        return v

    spec = P("d")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    t, cv = _time_calls(fn, x, repeats=repeats)
    return TimedSample(nbytes, _per_op(t, dispatch_s, chain), chain, cv)


def _time_collective(mesh: Mesh, axis: str, collective: CollectiveKind, nbytes: int,
                     kind: str, dispatch_s: float, repeats: int) -> TimedSample:
    """A chain of `collective`s over `axis` (module docstring); ``nbytes`` as
    ``collectives.py`` counts the collective's bytes (an all-gather's result, a
    reduce-scatter's input, the per-device buffer of the others)."""
    n = mesh.shape[axis]
    whole = collective in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                           CollectiveKind.ALL_TO_ALL)
    block = max(1, nbytes // (4 * n)) if whole else max(1, nbytes // 4)   # float32 elements
    elems = block if collective is CollectiveKind.ALL_GATHER else \
        (n * block if whole else block)                                  # per device input
    counted = 4.0 * (n * block if whole else block)
    guess = _GUESS_COLLECTIVE_S[kind] + counted / (1e9 if kind == "cpu" else 1e11)
    chain = min(8, _chain_length(guess, kind))
    # Zeros stay zeros through any collective; the compiler cannot know they are zeros.
    x = jax.device_put(np.zeros((mesh.size * elems,), np.float32),
                       NamedSharding(mesh, P(mesh.axis_names)))

    def body(v):
        i = jax.lax.axis_index(axis)
        for _ in range(chain):
            if collective is CollectiveKind.ALL_REDUCE:
                v = jax.lax.psum(v, axis)
            elif collective is CollectiveKind.ALL_GATHER:
                # Another device's block of the result: own block would let XLA drop the
                # gather.
                y = jax.lax.all_gather(v, axis, tiled=True)
                v = jax.lax.dynamic_slice(y, (((i + 1) % n) * block,), (block,))
            elif collective is CollectiveKind.REDUCE_SCATTER:
                y = jax.lax.psum_scatter(v, axis, tiled=True)
                v = jax.lax.dynamic_update_slice(v, y, (i * block,))
            elif collective is CollectiveKind.ALL_TO_ALL:
                v = jax.lax.all_to_all(v, axis, 0, 0, tiled=True)
            else:
                v = jax.lax.ppermute(v, axis, [(j, (j + 1) % n) for j in range(n)])
        return v

    spec = P(mesh.axis_names)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    # CollectiveKind values are the HLO op names, but for send/recv (a ppermute).
    op = "collective-permute" if collective is CollectiveKind.SEND_RECV else collective.value
    found = sum(c.kind == op for c in collectives_in_hlo(fn.lower(x).compile().as_text()))
    if found < chain:
        raise RuntimeError(
            f"calibrate: the compiled chain of {chain} {collective.value}s over {n} devices "
            f"holds {found} {op} ops: XLA merged or dropped some, so its time would not "
            f"measure the link. Please report this with your JAX version "
            f"({jax.__version__}).")
    t, cv = _time_calls(fn, x, repeats=repeats)
    return TimedSample(counted, _per_op(t, dispatch_s, chain), chain, cv)


def _per_op(call_s: float, dispatch_s: float, chain: int) -> float:
    """Seconds per operation of a chain of `chain` in one call: (call - dispatch) / chain.
    Chains are sized to outlast the dispatch many times over; should noise still make a
    call faster than the dispatch estimate, the whole call is kept (an over-estimate)."""
    work_s = call_s - dispatch_s
    return (work_s if work_s > 0 else call_s) / chain


def _share_timings(t: _Timings) -> _Timings:
    """Process 0's timings on every process (as measured, with one process).

    Through the coordination service, not a collective: a collective could interleave with
    work another process has already dispatched (`alpa_lite.runtime.distributed`)."""
    flat = [t.dispatch_s] + [s.seconds for s in t.matmuls] + [s.seconds for s in t.memory] + \
        [s.seconds for *_, samples in t.links for s in samples]
    shared = share_from_first(lambda: flat, encode=json.dumps, decode=json.loads)
    it = iter(shared[1:])
    return _Timings(
        dispatch_s=shared[0],
        matmuls=tuple(dataclasses.replace(s, seconds=next(it)) for s in t.matmuls),
        memory=tuple(dataclasses.replace(s, seconds=next(it)) for s in t.memory),
        links=tuple((level, n, collective,
                     [dataclasses.replace(s, seconds=next(it)) for s in samples])
                    for level, n, collective, samples in t.links))
