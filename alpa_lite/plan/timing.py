"""Where a step's estimated time goes: one line per cause, summing to the step time.

The planner fills a `StepTime` for every plan (`planning.step_time`); `Plan.step_time_s` is
its total, and `plan.summary()` and `alpa-lite explain` print its lines, so a user sees what
the estimate is made of: compute, collectives on the critical path, the pipeline's bubble
and sends, the gradient sync left after the backward, the optimizer update. Work that runs
beside other work (gradient reduction hidden under the backward, pipeline sends under
compute) is reported beside the total (`hidden`), not in it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["StepTime", "TimeKind", "TimeLine", "step_time_from_obj", "step_time_to_obj"]


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


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The estimate of one step, line by line.

    Attributes:
      lines: the parts of the critical path; they sum to `total_s`.
      hidden: work that ran beside the critical path, by kind (e.g. the gradient sync
        overlapped with the backward): reported, not added.
    """
    lines: tuple[TimeLine, ...]
    hidden: tuple[TimeLine, ...] = ()

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
    return {"lines": [_line_to_obj(x) for x in t.lines],
            "hidden": [_line_to_obj(x) for x in t.hidden]}


def step_time_from_obj(o: dict[str, Any]) -> StepTime:
    """The `StepTime` of `step_time_to_obj`'s dict."""
    return StepTime(lines=tuple(_line_from_obj(x) for x in o["lines"]),
                    hidden=tuple(_line_from_obj(x) for x in o["hidden"]))
