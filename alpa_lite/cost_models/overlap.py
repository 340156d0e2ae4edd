"""Gradient reduction overlapped with the backward pass, in buckets.

A data-parallel step need not wait for its whole backward before reducing gradients: a
gradient can be reduced as soon as the backward has formed it, while the backward goes on
with earlier layers. PyTorch DDP does this in buckets of ``bucket_cap_mb`` (Li et al.,
"PyTorch Distributed", VLDB 2020), Megatron-LM in its gradient buffer's buckets, and XLA on
GPUs by combining small all-reduces into one up to a threshold (``AllReduceCombiner``,
default ``kDefaultAllReduceCombineThreshold`` = 30 MiB + 7 bytes,
``xla/service/collective_utils.h``) and letting its latency-hiding scheduler run the
combined collective asynchronously beside the remaining backward.

`bucketed_sync` plays that out: gradients, in the order the backward forms them, fill
buckets of ``bucket_bytes``; a bucket's reduction starts when its last gradient is formed
and the previous bucket's reduction has finished (one collective stream), and lasts the
sum of its gradients' own reduction times less their latencies but one (a bucket is one
collective: it pays one latency). What is left of the last reduction after the backward's
end is *exposed*: it adds to the step. On a platform without asynchronous collectives
(XLA:CPU runs them in line, but combines them too: the 30 gradient all-reduces of a
data-parallel GPT step compile to one, `bench/fidelity.py`) nothing overlaps and every
bucket is exposed (`overlaps=False`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from alpa_lite.cost_models.devices import require_non_negative, require_positive

__all__ = ["XLA_COMBINE_THRESHOLD_BYTES", "FormedGradient", "SyncOverlap", "bucketed_sync"]

# XLA's default all-reduce combine threshold (xla/service/collective_utils.h,
# kDefaultAllReduceCombineThreshold = 30 * 1024 * 1024 + 7).
XLA_COMBINE_THRESHOLD_BYTES = 30 * 1024 * 1024 + 7


@dataclasses.dataclass(frozen=True)
class FormedGradient:
    """One gradient: when in the backward it is complete (seconds from the start of the
    step), its bytes per device, the time of its reduction priced alone, and the latency
    part of that time (what combining it with others saves)."""
    formed_s: float
    nbytes: float
    reduce_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        for field in ("formed_s", "nbytes", "reduce_s", "latency_s"):
            require_non_negative("FormedGradient", field, getattr(self, field))
        if self.latency_s > self.reduce_s:
            raise ValueError(f"FormedGradient: latency_s {self.latency_s} exceeds reduce_s "
                             f"{self.reduce_s}; the latency is a part of the reduction's time")


@dataclasses.dataclass(frozen=True)
class SyncOverlap:
    """The reduction of a step's gradients beside its backward.

    Attributes:
      total_s: every reduction, end to end, as if nothing overlapped.
      exposed_s: the part after the backward ends (what the step waits for).
      buckets: reductions run (buckets of combined gradients).
    """
    total_s: float
    exposed_s: float
    buckets: int

    @property
    def hidden_s(self) -> float:
        """Reduction time spent while the backward still ran."""
        return self.total_s - self.exposed_s


def bucketed_sync(grads: Sequence[FormedGradient], backward_end_s: float,
                  bucket_bytes: float = XLA_COMBINE_THRESHOLD_BYTES,
                  overlaps: bool = True) -> SyncOverlap:
    """Plays out the bucketed reduction of `grads` beside a backward ending at
    `backward_end_s` (module docstring).

    Args:
      grads: the gradients reduced (those reduced by no collective left out).
      backward_end_s: when the backward's last operator ends, from the same origin as
        `FormedGradient.formed_s`.
      bucket_bytes: a bucket closes once it holds at least this many bytes.
      overlaps: False where collectives cannot run beside compute: all of it is exposed.

    Returns:
      The `SyncOverlap`; its `total_s` is the buckets' reductions end to end.

    Example:
      Two 20 MB gradients formed at 1 s and 3 s, each reduced in 0.5 s, a backward that
      ends at 4 s, buckets of 30 MB: one bucket, closed by the second gradient at 3 s,
      reduced from 3 s to 4 s: nothing exposed.

      >>> g = [FormedGradient(1.0, 20e6, 0.5), FormedGradient(3.0, 20e6, 0.5)]
      >>> bucketed_sync(g, 4.0, 30e6)
      SyncOverlap(total_s=1.0, exposed_s=0.0, buckets=1)
    """
    end = require_non_negative("bucketed_sync", "backward_end_s", backward_end_s)
    cap = require_positive("bucketed_sync", "bucket_bytes", bucket_bytes)
    if not grads:
        return SyncOverlap(total_s=0.0, exposed_s=0.0, buckets=0)
    ordered = sorted(grads, key=lambda g: g.formed_s)
    stream_free = total = 0.0
    buckets = 0
    filled, ready, duration, latency = 0.0, 0.0, 0.0, 0.0
    for i, g in enumerate(ordered):
        filled += g.nbytes
        ready = max(ready, g.formed_s)
        duration += g.reduce_s - g.latency_s
        latency = max(latency, g.latency_s)
        if filled >= cap or i == len(ordered) - 1:
            stream_free = max(stream_free, ready) + duration + latency
            total += duration + latency
            buckets += 1
            filled, duration, latency = 0.0, 0.0, 0.0
    exposed = max(0.0, stream_free - end) if overlaps else total
    return SyncOverlap(total_s=total, exposed_s=exposed, buckets=buckets)
