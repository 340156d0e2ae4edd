"""Progress reports from the planners, for a display such as the CLI's.

A planner given a `Progress` callback calls it as `progress(phase, done, total)` while it
works: when a phase starts (done = 0) and as its units of work finish. The phases, in the
order a plan goes through them:

    TRACE    tracing the step (1 unit)
    CLUSTER  cutting the loss function into layers (pipelined plans; 1 unit)
    ILPS     intra-op problems solved; `total` grows as the search queues more of them
    DP       the inter-op stage DP (Auto pipelines; 1 unit)
    SEARCH   whole plans weighed by `Auto()` (single stage, pipelines per micro-batch
             count); `total` is 0: the search decides as it goes how many it plans

The callback may be called from the planner's solver threads; it must be quick and
thread-safe (rich's progress display is). Planning does the same with or without one.
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]
"""`progress(phase, done, total)`: see the module docstring."""

TRACE = "trace"
CLUSTER = "cluster layers"
ILPS = "intra-op ILPs"
DP = "stage DP"
SEARCH = "plans weighed"


def report(progress: Progress | None, phase: str, done: int, total: int) -> None:
    """Calls `progress` if there is one."""
    if progress is not None:
        progress(phase, done, total)
