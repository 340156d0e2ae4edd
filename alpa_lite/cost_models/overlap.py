"""Gradient reduction overlapped with the backward pass, in buckets, and the bucket size.

A data-parallel step need not wait for its whole backward before reducing gradients: a
gradient can be reduced as soon as the backward has formed it, while the backward goes on
with earlier layers. PyTorch DDP does this in buckets of ``bucket_cap_mb`` (Li et al.,
"PyTorch Distributed", VLDB 2020), Megatron-LM in its gradient buffer's buckets, and XLA on
GPUs by combining small all-reduces into one up to a threshold (``AllReduceCombiner``,
default ``kDefaultAllReduceCombineThreshold`` = 30 MiB + 7 bytes,
``xla/service/collective_utils.h``) and letting its latency-hiding scheduler run the
combined collective asynchronously beside the remaining backward.

`bucket_schedule` plays that out: gradients, in the order the backward forms them, fill
buckets by XLA's combiner rule (a bucket takes the next gradient while its bytes stay
within ``bucket_bytes``; a gradient larger than that is a bucket of its own), so the
threshold alpa_lite hands XLA yields the buckets priced here. A bucket's reduction starts
when its last gradient is formed and the previous bucket's reduction has finished (one
collective stream), and lasts the sum of its gradients' own reduction times less their
latencies but one (a bucket is one collective: it pays one latency). What is left of the
last reduction after the backward's end is *exposed*: it adds to the step. On a platform
without asynchronous collectives (XLA:CPU runs them in line, and combines every
independent all-reduce into one whatever the threshold: `CpuAllReduceCombiner` with
``kCombineBytes = int64 max`` in ``xla/service/cpu/cpu_compiler.cc``) nothing overlaps and
every bucket is exposed (``overlaps=False``).

Issue order (TicTac's question, Hashemi et al., SysML 2019, asked for the reduction side).
With one collective stream, each bucket *released* when its last gradient is formed and a
fixed duration, nothing in the step waits on one bucket rather than another: the update
waits for all of them. So the order to choose is the one that finishes the whole exchange
earliest, the single-machine problem 1|r_j|C_max, which issuing in order of release solves
(an exchange argument: where a later-released bucket runs just before an earlier-released
one, swapping them starts the earlier one no later and ends the pair at the same time, so
C_max never grows). Buckets are contiguous runs of gradients in formation order, so their
release order is the formation order: the reductions are issued in the order the backward
forms the gradients, and `bucket_schedule` records that order.

Bucket size (Caramel's batching, Hashemi et al. 2020). Small buckets start early but each
pays a collective's latency; large ones pay it once but start late, after more of the
backward has gone by, so less of them hides. `choose_bucket_bytes` plays every candidate
size out and keeps the one with the least exposed time (a tie goes to fewer buckets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from alpa_lite.cost_models.devices import require_non_negative, require_positive

__all__ = ["CANDIDATE_BUCKET_BYTES", "XLA_COMBINE_THRESHOLD_BYTES", "BucketChoice",
           "BucketRun", "BucketSchedule", "FormedGradient", "SyncOverlap", "bucket_ranges",
           "bucket_schedule", "bucketed_sync", "choose_bucket_bytes"]

# XLA's default all-reduce combine threshold (xla/service/collective_utils.h,
# kDefaultAllReduceCombineThreshold = 30 * 1024 * 1024 + 7).
XLA_COMBINE_THRESHOLD_BYTES = 30 * 1024 * 1024 + 7

# Bucket sizes weighed, besides one bucket for everything: 1 MiB (below it a ring
# all-reduce on NVLink or InfiniBand is mostly latency) to 512 MiB in powers of two, and
# XLA's own default threshold (what runs where nobody chooses).
CANDIDATE_BUCKET_BYTES = tuple(sorted([2 ** k for k in range(20, 30)]
                                      + [XLA_COMBINE_THRESHOLD_BYTES]))


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


@dataclasses.dataclass(frozen=True)
class BucketRun:
    """One bucket as played out: gradients ``start`` up to ``stop`` (exclusive) of the
    formation order, their bytes, when the last of them is formed (``ready_s``) and when
    the bucket's reduction starts and ends on the collective stream."""
    start: int
    stop: int
    nbytes: float
    ready_s: float
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class BucketSchedule:
    """The bucketed reduction at one bucket size.

    Attributes:
      bucket_bytes: the size it was played at.
      order: indices into the gradients given, in formation order (the issue order; ties
        keep the order given).
      runs: the buckets, in issue order, each a contiguous run of `order`.
      sync: its totals.
    """
    bucket_bytes: float
    order: tuple[int, ...]
    runs: tuple[BucketRun, ...]
    sync: SyncOverlap


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """What `choose_bucket_bytes` kept, and the best size it beat.

    Attributes:
      chosen: the schedule kept.
      runner_up: the best other schedule (None when every candidate made the same buckets).
      weighed: (bucket_bytes, exposed_s, buckets) of each distinct candidate, by size (the
        smallest size of those that cut the same buckets; a size between two entries cuts
        the buckets of the smaller one).
    """
    chosen: BucketSchedule
    runner_up: BucketSchedule | None
    weighed: tuple[tuple[float, float, int], ...]


def bucket_ranges(sizes: Sequence[float], bucket_bytes: float) -> tuple[tuple[int, int], ...]:
    """Cuts gradients of `sizes` (bytes, in issue order) into buckets by XLA's combiner
    rule: a bucket takes the next gradient while its total stays within `bucket_bytes`; a
    gradient larger than that is a bucket of its own. Returns (start, stop) per bucket.

    >>> bucket_ranges([10, 10, 25, 5], 20)
    ((0, 2), (2, 3), (3, 4))
    """
    cap = require_positive("bucket_ranges", "bucket_bytes", bucket_bytes)
    out, start, filled = [], 0, 0.0
    for i, size in enumerate(sizes):
        if i > start and filled + size > cap:
            out.append((start, i))
            start, filled = i, 0.0
        filled += size
    if sizes:
        out.append((start, len(sizes)))
    return tuple(out)


def bucket_schedule(grads: Sequence[FormedGradient], backward_end_s: float,
                    bucket_bytes: float = XLA_COMBINE_THRESHOLD_BYTES,
                    overlaps: bool = True) -> BucketSchedule:
    """Plays out the bucketed reduction of `grads` beside a backward ending at
    `backward_end_s` (module docstring), issued in formation order.

    Args:
      grads: the gradients reduced (those reduced by no collective left out).
      backward_end_s: when the backward's last operator ends, from the same origin as
        `FormedGradient.formed_s`.
      bucket_bytes: a bucket holds at most this many bytes (but for a gradient larger
        than it, alone in its bucket).
      overlaps: False where collectives cannot run beside compute: each bucket starts
        after the backward, and all of it is exposed.
    """
    end = require_non_negative("bucket_schedule", "backward_end_s", backward_end_s)
    cap = require_positive("bucket_schedule", "bucket_bytes", bucket_bytes)
    order = tuple(sorted(range(len(grads)), key=lambda i: grads[i].formed_s))
    ordered = [grads[i] for i in order]
    stream_free = total = 0.0
    runs = []
    for start, stop in bucket_ranges([g.nbytes for g in ordered], cap):
        part = ordered[start:stop]
        ready = max(g.formed_s for g in part)
        # One collective: the gradients' bandwidth terms add up, one latency is paid.
        latency = max(g.latency_s for g in part)
        duration = sum(g.reduce_s - g.latency_s for g in part) + latency
        begin = max(stream_free, ready if overlaps else max(ready, end))
        stream_free = begin + duration
        total += duration
        runs.append(BucketRun(start, stop, float(sum(g.nbytes for g in part)), ready, begin,
                              stream_free))
    exposed = max(0.0, stream_free - end) if overlaps else total
    return BucketSchedule(bucket_bytes=cap, order=order, runs=tuple(runs),
                          sync=SyncOverlap(total_s=total, exposed_s=exposed,
                                           buckets=len(runs)))


def bucketed_sync(grads: Sequence[FormedGradient], backward_end_s: float,
                  bucket_bytes: float = XLA_COMBINE_THRESHOLD_BYTES,
                  overlaps: bool = True) -> SyncOverlap:
    """The totals of `bucket_schedule` (same arguments).

    Example:
      Two 20 MB gradients formed at 1 s and 3 s, each reduced in 0.5 s, a backward that
      ends at 4 s, buckets of 50 MB: one bucket, ready at 3 s, reduced from 3 s to 4 s:
      nothing exposed.

      >>> g = [FormedGradient(1.0, 20e6, 0.5), FormedGradient(3.0, 20e6, 0.5)]
      >>> bucketed_sync(g, 4.0, 50e6)
      SyncOverlap(total_s=1.0, exposed_s=0.0, buckets=1)
    """
    return bucket_schedule(grads, backward_end_s, bucket_bytes, overlaps).sync


def choose_bucket_bytes(grads: Sequence[FormedGradient], backward_end_s: float,
                        overlaps: bool = True,
                        candidates: Sequence[float] = CANDIDATE_BUCKET_BYTES) -> BucketChoice:
    """The bucket size that leaves the least reduction exposed after the backward.

    Plays each candidate size out (`bucket_schedule`), and one bucket for everything
    (size = all the gradients' bytes); sizes that cut the same buckets are weighed once,
    at the smallest. Keeps the least exposed time; a tie goes to fewer buckets (fewer
    latencies, and the shorter stream when nothing overlaps), then to the smaller size.

    Raises:
      ValueError: no gradient to bucket, or a candidate that is not > 0.
    """
    if not grads:
        raise ValueError("choose_bucket_bytes: no gradients to bucket; a step without "
                         "gradient reductions needs no bucket size")
    whole = max(1.0, float(sum(g.nbytes for g in grads)))
    seen: dict[tuple, BucketSchedule] = {}
    for size in sorted({float(c) for c in candidates} | {whole}):
        s = bucket_schedule(grads, backward_end_s, size, overlaps)
        key = tuple((r.start, r.stop) for r in s.runs)
        if key not in seen:
            seen[key] = s
    ranked = sorted(seen.values(), key=lambda s: (round(s.sync.exposed_s, 12), s.sync.buckets,
                                                  s.bucket_bytes))
    weighed = tuple((s.bucket_bytes, s.sync.exposed_s, s.sync.buckets)
                    for s in sorted(seen.values(), key=lambda s: s.bucket_bytes))
    return BucketChoice(chosen=ranked[0], runner_up=ranked[1] if len(ranked) > 1 else None,
                        weighed=weighed)
