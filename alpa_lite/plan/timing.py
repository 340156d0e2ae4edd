"""Where a step's estimated time goes: one line per cause, summing to the step time.

The planner fills a `StepTime` for every plan (`planning.step_time`); `Plan.step_time_s` is
its total, and `plan.summary()` and `alpa-lite explain` print its lines, so a user sees what
the estimate is made of: compute, collectives on the critical path, the pipeline's bubble
and sends, the gradient sync left after the backward, the optimizer update. Work that runs
beside other work (gradient reduction hidden under the backward, pipeline sends under
compute) is reported beside the total (`hidden`), not in it.

The gradient-sync line rests on a decision the runtime carries out: how the gradient
reductions are cut into buckets and in which order they are issued (`SyncBuckets`, chosen
by `cost_models.overlap.choose_bucket_bytes`). It is kept here, with the estimate it was
chosen for, so that the estimate and what runs cannot drift apart; `Plan.sync_buckets`
reads it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["BucketIssue", "StepTime", "SyncBucket", "SyncBuckets", "TimeKind", "TimeLine",
           "step_time_from_obj", "step_time_to_obj"]


class TimeKind(enum.Enum):
    """What a line of the step time is."""
    COMPUTE = "compute"                        # forward, backward and recomputation kernels
    INTRA_OP_COMM = "intra-op collectives"     # inside forward/backward: on the critical path
    PIPELINE_BUBBLE = "pipeline bubble"        # the critical stage idle, waiting on others
    PIPELINE_SENDS = "pipeline sends"          # transfers between stages not under compute
    GRADIENT_SYNC = "gradient sync"            # reduction the step waits for after the backward
    OPTIMIZER_UPDATE = "optimizer update"
    COMPRESSION = "compressed exchange"        # a compressed plan's gradient exchange


@dataclasses.dataclass(frozen=True)
class TimeLine:
    """One cause of step time, in seconds, with a note on how it was found."""
    kind: TimeKind
    seconds: float
    note: str = ""


class BucketIssue(enum.Enum):
    """Who cuts a stage's gradient reductions into the planned buckets when it runs."""
    # The partitioner places one reduction per gradient (where the plan's shardings resolve
    # its partial sums); on GPUs the runtime hands XLA the bucket size as its all-reduce /
    # reduce-scatter combine threshold and turns on its latency-hiding scheduler.
    XLA_COMBINER = "xla-combiner"
    # The runtime issues one all-reduce per bucket itself, in the planned order (the
    # per-worker engine of `runtime.compressed` with a full-precision exchange).
    RUNTIME = "runtime"


@dataclasses.dataclass(frozen=True)
class SyncBucket:
    """One bucket of gradient reductions: one collective.

    Attributes:
      grads: the gradients it reduces, by the names `Plan.gradient_sync` gives them, in
        the order the backward forms them.
      nbytes: per device.
      ready_s: when its last gradient is formed, from the start of the step (estimate).
      end_s: when its reduction ends on the collective stream (estimate).
    """
    grads: tuple[str, ...]
    nbytes: int
    ready_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class SyncBuckets:
    """How one stage's gradient reductions are bucketed and ordered (module docstring).

    Buckets are issued in `buckets` order, the order the backward forms their gradients
    (with one collective stream that finishes the exchange earliest:
    `cost_models.overlap`). `bucket_bytes` cuts them by XLA's combiner rule (a bucket takes
    gradients while its bytes stay within it; a larger gradient is alone).

    Attributes:
      stage: the stage whose reductions these are.
      bucket_bytes: the chosen size (all the gradients' bytes: one bucket).
      buckets: in issue order.
      exposed_s: reduction time left after the backward ends (the step's gradient-sync
        line where the partitioner places the reductions; a compressed plan prices its
        exchange apart, after the backward).
      total_s: every bucket's reduction end to end.
      backward_end_s: when the backward's last operator ends, from the start of the step.
      overlaps: whether the cluster runs collectives beside compute (False: in line, every
        bucket exposed, and one bucket is best).
      issue: who cuts the reductions into these buckets at run time.
      runner_up_bytes: the best other size weighed (0: every size made the same buckets).
      runner_up_exposed_s: its exposed time.
      runner_up_buckets: its bucket count.
      weighed: (bucket_bytes, exposed_s, buckets) of every distinct size weighed, by size
        (each the smallest of the sizes that cut the same buckets; XLA's default size and
        one bucket for everything among them).
    """
    stage: int
    bucket_bytes: int
    buckets: tuple[SyncBucket, ...]
    exposed_s: float
    total_s: float
    backward_end_s: float
    overlaps: bool
    issue: BucketIssue
    runner_up_bytes: int = 0
    runner_up_exposed_s: float = 0.0
    runner_up_buckets: int = 0
    weighed: tuple[tuple[int, float, int], ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"SyncBuckets: bucket_bytes must be > 0, got {self.bucket_bytes}")
        names = [n for b in self.buckets for n in b.grads]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"SyncBuckets: gradients {twice[:5]} are in more than one "
                             "bucket; each gradient is reduced once")

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def weighed_at(self, nbytes: float) -> tuple[int, float, int]:
        """(size, exposed_s, buckets) of the weighed entry whose buckets a size of `nbytes`
        cuts: the largest weighed size not above it (sizes between two entries cut the
        smaller one's buckets)."""
        fit = [w for w in self.weighed if w[0] <= nbytes]
        if not fit:
            raise ValueError(f"no size weighed at or below {nbytes} bytes; the smallest is "
                             f"{self.weighed[0][0] if self.weighed else 'none'}")
        return fit[-1]

    def to_obj(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self) | {
            "issue": self.issue.value,
            "weighed": [[int(n), float(e), int(k)] for n, e, k in self.weighed],
            "buckets": [{"grads": list(b.grads), "nbytes": int(b.nbytes),
                         "ready_s": float(b.ready_s), "end_s": float(b.end_s)}
                        for b in self.buckets]}

    @staticmethod
    def from_obj(o: dict[str, Any]) -> "SyncBuckets":
        """The record of `to_obj`'s dict."""
        fields = {f.name for f in dataclasses.fields(SyncBuckets)}
        if set(o) != fields:
            raise ValueError(f"sync_buckets: keys {sorted(o)}, expected {sorted(fields)}")
        return SyncBuckets(
            stage=int(o["stage"]), bucket_bytes=int(o["bucket_bytes"]),
            buckets=tuple(SyncBucket(tuple(str(n) for n in b["grads"]), int(b["nbytes"]),
                                     float(b["ready_s"]), float(b["end_s"]))
                          for b in o["buckets"]),
            exposed_s=float(o["exposed_s"]), total_s=float(o["total_s"]),
            backward_end_s=float(o["backward_end_s"]), overlaps=bool(o["overlaps"]),
            issue=BucketIssue(o["issue"]), runner_up_bytes=int(o["runner_up_bytes"]),
            runner_up_exposed_s=float(o["runner_up_exposed_s"]),
            runner_up_buckets=int(o["runner_up_buckets"]),
            weighed=tuple((int(n), float(e), int(k)) for n, e, k in o["weighed"]))


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The estimate of one step, line by line.

    Attributes:
      lines: the parts of the critical path; they sum to `total_s`.
      hidden: work that ran beside the critical path, by kind (e.g. the gradient sync
        overlapped with the backward): reported, not added.
      sync_buckets: per stage whose gradient reductions the estimate bucketed, the buckets
        and their order (what the runtime issues; module docstring).
    """
    lines: tuple[TimeLine, ...]
    hidden: tuple[TimeLine, ...] = ()
    sync_buckets: tuple[SyncBuckets, ...] = ()

    @property
    def total_s(self) -> float:
        return float(sum(line.seconds for line in self.lines))

    def seconds(self, kind: TimeKind) -> float:
        """The time of one kind on the critical path (0.0 where there is none)."""
        return float(sum(line.seconds for line in self.lines if line.kind is kind))

    def hidden_seconds(self, kind: TimeKind) -> float:
        """The time of one kind that ran beside the critical path."""
        return float(sum(line.seconds for line in self.hidden if line.kind is kind))


def _line_to_obj(line: TimeLine) -> dict[str, Any]:
    return {"kind": line.kind.value, "seconds": float(line.seconds), "note": line.note}


def _line_from_obj(o: dict[str, Any]) -> TimeLine:
    return TimeLine(TimeKind(o["kind"]), float(o["seconds"]), str(o["note"]))


def step_time_to_obj(t: StepTime) -> dict[str, Any]:
    """A JSON-ready dict of `t`."""
    obj = {"lines": [_line_to_obj(x) for x in t.lines],
           "hidden": [_line_to_obj(x) for x in t.hidden]}
    # Written only when present, so plans without buckets keep the JSON they always had.
    if t.sync_buckets:
        obj["sync_buckets"] = [b.to_obj() for b in t.sync_buckets]
    return obj


def step_time_from_obj(o: dict[str, Any]) -> StepTime:
    """The `StepTime` of `step_time_to_obj`'s dict."""
    return StepTime(lines=tuple(_line_from_obj(x) for x in o["lines"]),
                    hidden=tuple(_line_from_obj(x) for x in o["hidden"]),
                    sync_buckets=tuple(SyncBuckets.from_obj(b)
                                       for b in o.get("sync_buckets", ())))
