"""The compressed gradient exchange of one stage of a hybrid plan.

A hybrid plan (data parallelism beside tensor or pipeline parallelism) accumulates each
stage's gradients per device over its data-parallel axes and exchanges them once per step
(`planning.gradient_sync`). With `compression=` set, that exchange may go through a
compressor: each device compresses its own shard of each gradient (PowerSGD on its block of
the matrix, top-k or DGC on its shard) and exchanges it with the devices holding the same
shard on the other replicas.

`ExchangeRequest.of` reads what the user asked (a compressor, or `AutoCompression` and the
compressors it allows); `choose_exchange` prices every candidate on the stage's
accumulation axes (`cost_models.axis_exchange`), compresses only the gradients where that
saves time (small tensors stay dense), and keeps the fastest. Whether a lossy choice is
worth it on the whole step (`AutoCompression.min_speedup`) is the pipeline planner's call,
which sees the step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax.numpy as jnp

from alpa_lite import compression as C
from alpa_lite.cost_models.axis_exchange import (
    exchange_latency,
    group_link,
    shard_cost,
)
from alpa_lite.errors import PlanningError
from alpa_lite.plan import StageExchange
from alpa_lite.plan.sharding import CommModel, itemsize


@dataclasses.dataclass(frozen=True)
class ExchangeRequest:
    """The compressors a hybrid plan may exchange its data-parallel gradients with.

    Attributes:
      candidates: synchronous compressors to weigh (an explicit choice: one).
      min_speedup: a lossy candidate must make the step this many times faster than the
        full-precision all-reduce (`AutoCompression.min_speedup`; 1.0 for an explicit one).
      explicit: the user named the compressor.
    """
    candidates: tuple[C.Compressor, ...]
    min_speedup: float
    explicit: bool

    @staticmethod
    def of(setting) -> "ExchangeRequest":
        """From `compression=`: a compressor or an `AutoCompression`.

        Raises:
          PlanningError: for a setting hybrid plans do not run (delayed averaging keeps a
            copy of the parameters per worker, which a tensor- or pipeline-parallel
            replica spread over several devices does not have here).
        """
        if isinstance(setting, C.AutoCompression):
            usable = tuple(c for c in setting.allow
                           if isinstance(c, C.Compressor) and c.synchronous)
            return ExchangeRequest(usable, setting.min_speedup, False)
        if isinstance(setting, C.Compressor):
            if not setting.synchronous:
                raise PlanningError(
                    f"compression={setting!r} leaves the workers with different gradients; "
                    "hybrid plans (tensor or pipeline parallelism beside data parallelism) "
                    "need a synchronous compressor: every replica must apply the same update")
            return ExchangeRequest((setting,), 1.0, True)
        raise PlanningError(
            f"compression={setting!r} runs only in pure data-parallel plans "
            "(al.DataParallel(), or al.Auto() choosing data parallelism): it keeps a copy of "
            "the parameters per worker, which hybrid plans do not hold; use a compressor "
            "(e.g. C.PowerSGD(rank=4)) or AutoCompression, or plan with al.DataParallel()")


@dataclasses.dataclass(frozen=True)
class GradShard:
    """One gradient as a device holds it: its shard's shape and dtype."""
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class ChosenExchange:
    """A stage's exchange: the record the Plan keeps, and the time of each gradient's part
    (its bytes and compression, or its share of the full-precision all-reduce; the
    compressed exchange's latency is shared out over the compressed gradients)."""
    exchange: StageExchange
    compressor: C.Compressor
    grad_s: tuple[float, ...]
    grad_wire_bytes: tuple[float, ...]


def choose_exchange(request: ExchangeRequest, shards: Sequence[GradShard], comm: CommModel,
                    axes: tuple[str, ...]) -> ChosenExchange | None:
    """The fastest exchange of `shards` over `axes` among the request's candidates; None
    when no candidate compresses any gradient (the stage then all-reduces in full)."""
    cluster = comm.cluster
    workers = math.prod(comm.mesh.axis_size(a) for a in axes)
    link = group_link([comm.topology(a) for a in axes])
    total = sum(s.nbytes for s in shards)
    dense_s = comm.all_reduce(total, axes)
    dense_wire = sum(2 * (workers - 1) / workers * s.nbytes for s in shards)
    best = None
    for c in request.candidates:
        costs = [shard_cost(c, s.shape, s.itemsize, workers, link, cluster.device)
                 for s in shards]
        # Even a compressor the user named leaves the gradients it cannot help dense.
        use = [k.worth_compressing for k in costs]
        if not any(use):
            continue
        plain = sum(s.nbytes for s, u in zip(shards, use) if not u)
        plain_s = comm.all_reduce(plain, axes)
        latency = exchange_latency(c, workers, link)
        n_used = sum(use)
        grad_s = tuple(
            (k.bytes_s + k.compress_s + latency / n_used) if u
            else (plain_s * s.nbytes / plain if plain else 0.0)
            for s, k, u in zip(shards, costs, use))
        wire = tuple(k.wire_bytes if u else k.dense_wire_bytes for k, u in zip(costs, use))
        state = sum(c.state_bytes(s.shape, jnp.dtype(s.dtype)) for s, u in zip(shards, use)
                    if u)
        sync_s = sum(grad_s)
        if best is None or sync_s < best.exchange.sync_s:
            best = ChosenExchange(
                StageExchange(method=C.to_config(c), compressed=tuple(use),
                              num_workers=workers, wire_bytes=float(sum(wire)),
                              dense_wire_bytes=float(dense_wire), sync_s=float(sync_s),
                              dense_sync_s=float(dense_s), state_bytes=float(state)),
                c, grad_s, wire)
    return best
