"""Pipeline schedules: simulate one training step of ``p`` stages and ``m`` micro-batches.

:func:`simulate` plays a schedule forward in time and returns the step length, every task's
start and end (for a Gantt chart), each stage's busy time and its peak number of
micro-batches in flight (a proxy for activation memory).

Schedules (stage ``s`` is 0-based, micro-batch ``i`` runs ``0 .. m-1``; ``F``/``B`` are a
micro-batch's forward and backward on one stage):

==========  ==============================================================  =================
schedule    order of tasks on stage ``s``                                   source
==========  ==============================================================  =================
GPipe       ``F0 F1 .. F(m-1)``, then ``B(m-1) .. B1 B0``                   Huang et al. 2019
1F1B        ``w = min(p-s-1, m)`` warm-up forwards ``F0 .. F(w-1)``; then   Narayanan et al.
            ``F(w+k) B(k)`` for ``k = 0 .. m-w-1``; then the remaining      2021 (PipeDream-
            backwards ``B(m-w) .. B(m-1)``                                  Flush)
==========  ==============================================================  =================

GPipe's backwards run last in, first out (our choice: the last stage can start on the
micro-batch it just finished); with uniform stages the step time is the same in either order.

Dependencies. A stage runs one task at a time, in its schedule's order (a task waits for
its predecessor on the stage even if a later one is ready: the order is fixed, not greedy),
and each task starts as soon as allowed:

* ``F(s, i)`` needs ``F(s-1, i)`` plus the activation transfer ``s-1 -> s``
  (``stages[s-1].send_activation_s``);
* ``B(s, i)`` needs ``F(s, i)``, and ``B(s+1, i)`` plus the gradient transfer ``s+1 -> s``
  (``stages[s+1].send_gradient_s``).

Transfers occupy the link between two stages, not the stages (compute and communication
overlap). Each link is full duplex: activations ``s -> s+1`` and gradients ``s+1 -> s``
travel on separate channels. By default (``serialize_links=True``) a channel carries one
message at a time, first in first out, so a transfer issued while the previous one is
still on the wire waits for it; with ``serialize_links=False`` a transfer is a pure delay
and any number may overlap. The two agree whenever every ``send_activation_s <= forward_s``
and ``send_gradient_s <= backward_s`` of the sending stage, since a stage issues at most one
message per task it runs.

Recomputation. With ``remat=True`` a stage keeps only its input during the forward and
recomputes the forward at the start of each backward: the backward is preceded by a
``"recompute"`` task of ``forward_s`` that starts when the backward could (after the
gradient arrives, as in Megatron-LM, whose 1F1B loop receives the gradient before
``backward_step`` re-runs the checkpointed forward). A
recompute and its backward are therefore back to back: ``f_s + b_s`` in all.

Closed forms (tests check them). Uniform stages ``f``, ``b``, no transfers, ``p`` stages,
``m`` micro-batches, both schedules::

    step   = (m + p - 1) * (f + b)
    bubble = 1 - p*m*(f+b) / (p * step) = (p - 1) / (m + p - 1)

(Huang et al. 2019: bubble ``O((K-1)/(M+K-1))`` for ``K`` partitions and ``M`` micro-batches;
MaxText ``configs/base.yml``: ``(stages-1)/(repeats*microbatches+stages-1)`` with one repeat.)

The bubble fraction of a result is ``1 - sum(busy_s) / (p * step_time_s)``.
Peak micro-batches in flight on stage ``s``: ``m`` for GPipe, ``min(p - s, m)`` for 1F1B.

With every transfer ``c <= min(f, b)`` (so serialising links changes nothing), GPipe's
forward wave crosses the ``p-1`` links once and its backward wave once::

    step_gpipe = (m + p - 1)(f + b) + 2(p - 1) c

1F1B pays more, because stage 0 holds at most ``p`` micro-batches: the cycle ``F(0,j) ->
F(1,j) .. F(p-1,j) -> B(p-1,j) .. B(0,j) -> F(0,j+p)`` weighs ``p(f + b) + 2(p - 1)c`` per
``p`` micro-batches, so the latency of one more round trip shows every ``p`` micro-batches::

    step_1f1b = (m + p - 1)(f + b) + 2c * [(p - 1) + ceil((m - 2)(p - 1) / p)]

[Empirical] this closed form was fitted to the simulator and matches it exactly for
``p <= 8``, ``m <= 24``, ``c <= min(f, b)``; its slope ``2(p-1)c/p`` per micro-batch is the
cycle above. It equals GPipe's ``2(p-1)c`` for ``m <= 2`` and ``2c * ceil(m/2)`` for ``p = 2``
(worked by hand in the tests).

A lower bound that holds for any stage timings and either schedule: the first micro-batch
reaches stage ``s`` no earlier than ``sum_{t<s} (f_t + a_t)``; stage ``s`` is then busy for
``m (f_s + b_s)``; its last backward still has to go back down through stages
``s-1 .. 0``: ``sum_{t<s} (b_t + g_{t+1})``. The step is at least the largest of these over
``s`` (``a``: activation send, ``g``: gradient send; with remat ``b_t`` includes ``f_t``).
So the slowest stage bounds the step, ``step >= m * max_s (f_s + b_s)``, but ``m * (max_s
f_s + max_s b_s)`` does not when the two maxima sit on different stages (a test shows 1F1B
under it).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from alpa_lite.cost_models.devices import require_int, require_non_negative

__all__ = [
    "Schedule",
    "StageTiming",
    "TaskKind",
    "Task",
    "ScheduleResult",
    "simulate",
    "schedule_from_name",
    "stage_order",
]


class Schedule(enum.Enum):
    """Pipeline schedules :func:`simulate` knows (orders in the module docstring)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class TaskKind(str, enum.Enum):
    """What a :class:`Task` computes. A ``str`` enum: ``TaskKind.FORWARD == "forward"``."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"  # only on stages with remat=True, right before each backward
    BACKWARD = "backward"


def schedule_from_name(name: str) -> Schedule:
    """The :class:`Schedule` called ``name`` ("gpipe" or "1f1b", any case).

    Raises:
      ValueError: for an unknown name; the message lists the known ones.

    Example:
      >>> schedule_from_name("1F1B")
      <Schedule.ONE_F_ONE_B: '1f1b'>
    """
    known = [s.value for s in Schedule]
    if isinstance(name, str):
        key = name.strip().lower()
        for s in Schedule:
            if s.value == key:
                return s
    raise ValueError(
        f"schedule_from_name: unknown pipeline schedule {name!r}; known names are {known} "
        f"(case-insensitive)."
    )


@dataclass(frozen=True)
class StageTiming:
    """Per-micro-batch times of one pipeline stage, in seconds.

    Attributes:
      forward_s: Forward pass of one micro-batch on the stage.
      backward_s: Backward pass of one micro-batch (without any recomputation).
      send_activation_s: Sending the stage's output to the next stage; ignored on the last.
      send_gradient_s: Sending the gradient of the stage's input to the previous stage;
        ignored on the first.
      remat: Recompute the forward at the start of each backward (adds ``forward_s`` to
        each backward, as a separate ``"recompute"`` task).
    """

    forward_s: float
    backward_s: float
    send_activation_s: float = 0.0
    send_gradient_s: float = 0.0
    remat: bool = False

    def __post_init__(self) -> None:
        owner = "StageTiming"
        for field in ("forward_s", "backward_s", "send_activation_s", "send_gradient_s"):
            value = require_non_negative(owner, field, getattr(self, field))
            object.__setattr__(self, field, value)
        if not isinstance(self.remat, bool):
            raise ValueError(
                f"{owner}: remat must be True or False, got {self.remat!r} "
                f"(type {type(self.remat).__name__})."
            )


@dataclass(frozen=True)
class Task:
    """One task of the timeline: ``kind`` of ``micro_batch`` on ``stage``, ``[start_s, end_s)``."""

    stage: int
    micro_batch: int
    kind: TaskKind
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class ScheduleResult:
    """The simulated step.

    Attributes:
      step_time_s: From the first task's start (0.0) to the last task's end.
      busy_s: Per stage, the seconds it computes (forward + recompute + backward).
      peak_in_flight: Per stage, the most micro-batches whose forward has run and whose
        backward has not: ``m`` for GPipe, ``min(p - s, m)`` for 1F1B. Times the
        activations a micro-batch keeps on a stage, this bounds activation memory.
      finish_s: Per stage, when its last task (a backward) ends.
      timeline: Per stage, its tasks in execution order as ``(micro_batch, kind, start_s,
        end_s)``; :attr:`tasks` gives them as :class:`Task` records. (A step of 96 stages
        and 384 micro-batches has 73,728 tasks: the planner reads only the figures above,
        so the records are made when asked for.)
    """

    step_time_s: float
    busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    finish_s: tuple[float, ...]
    timeline: tuple[tuple[tuple[int, TaskKind, float, float], ...], ...] = \
        field(repr=False)

    @functools.cached_property
    def tasks(self) -> tuple[Task, ...]:
        """Every task, stage by stage, each stage's in its execution order."""
        return tuple(Task(s, i, kind, start, end) for s, rows in enumerate(self.timeline)
                     for i, kind, start, end in rows)

    @property
    def num_stages(self) -> int:
        return len(self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step: ``1 - sum(busy_s) / (p * step_time_s)``; 0.0 for a 0 s step."""
        if self.step_time_s <= 0.0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (self.num_stages * self.step_time_s)


# --------------------------------------------------------------------------------------
# Stage orders.
# --------------------------------------------------------------------------------------

_F, _B = TaskKind.FORWARD, TaskKind.BACKWARD


def _stage_order(
    schedule: Schedule, stage: int, num_stages: int, m: int
) -> list[tuple[TaskKind, int]]:
    """The (kind, micro-batch) sequence stage ``stage`` runs (module docstring table)."""
    if schedule is Schedule.GPIPE:
        return [(_F, i) for i in range(m)] + [(_B, i) for i in reversed(range(m))]
    warmup = min(num_stages - stage - 1, m)
    order = [(_F, i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [(_F, warmup + k), (_B, k)]
    order += [(_B, i) for i in range(m - warmup, m)]
    return order


def stage_order(schedule: Schedule, stage: int, num_stages: int,
                m: int) -> list[tuple[TaskKind, int]]:
    """The (kind, micro-batch) sequence stage ``stage`` of ``num_stages`` runs under
    ``schedule`` with ``m`` micro-batches (forwards and backwards; recomputation is part of
    a backward). Runtimes issue tasks in this order."""
    return _stage_order(schedule, stage, num_stages, m)


def _peak_in_flight(order: list[tuple[TaskKind, int]]) -> int:
    in_flight = peak = 0
    for kind, _ in order:
        in_flight += 1 if kind is _F else -1
        peak = max(peak, in_flight)
    return peak


# --------------------------------------------------------------------------------------
# Simulation.
# --------------------------------------------------------------------------------------


def _check_inputs(stages: Any, num_micro_batches: Any, schedule: Any) -> tuple[StageTiming, ...]:
    owner = "simulate"
    if isinstance(stages, StageTiming) or not isinstance(stages, Sequence):
        raise ValueError(
            f"{owner}: stages must be a sequence of StageTiming, got {stages!r}; "
            f"wrap a single stage in a list: [StageTiming(...)]."
        )
    if len(stages) == 0:
        raise ValueError(
            f"{owner}: stages is empty; give at least one StageTiming (one stage is no "
            f"pipeline: the step is then m * (forward_s + backward_s))."
        )
    for s, st in enumerate(stages):
        if not isinstance(st, StageTiming):
            raise ValueError(
                f"{owner}: stages[{s}] must be a StageTiming, got {st!r} "
                f"(type {type(st).__name__}); build it with StageTiming(forward_s, backward_s)."
            )
    require_int(owner, "num_micro_batches", num_micro_batches, 1)
    if not isinstance(schedule, Schedule):
        raise ValueError(
            f"{owner}: schedule must be a Schedule, got {schedule!r}; use "
            f"{[str(s) for s in Schedule]} or schedule_from_name({schedule!r})."
        )
    return tuple(stages)


def simulate(
    stages: Sequence[StageTiming],
    num_micro_batches: int,
    schedule: Schedule,
    *,
    serialize_links: bool = True,
) -> ScheduleResult:
    """Simulates one training step of a pipeline and returns its timeline.

    Each task starts at the latest of: its predecessor's end on the same stage, and the
    arrival of what it depends on (module docstring). Stages are swept round-robin, each
    advancing through its fixed order while its next task's inputs are known; the orders of
    GPipe and 1F1B never deadlock.

    Args:
      stages: Per-stage timings, stage 0 first (``p = len(stages)``).
      num_micro_batches: ``m >= 1``.
      schedule: :attr:`Schedule.GPIPE` or :attr:`Schedule.ONE_F_ONE_B`.
      serialize_links: If True (default), each direction of a link carries one transfer at
        a time, first in first out; if False, transfers are pure delays that may overlap.

    Returns:
      A :class:`ScheduleResult`.

    Raises:
      ValueError: for no stages, a non-StageTiming entry, ``m < 1`` or a non-Schedule.

    Example:
      >>> r = simulate([StageTiming(1.0, 1.0)] * 4, 8, Schedule.ONE_F_ONE_B)
      >>> r.step_time_s, round(r.bubble_fraction, 4)   # (8+4-1)*2, 3/11
      (22.0, 0.2727)
    """
    stages = _check_inputs(stages, num_micro_batches, schedule)
    p, m = len(stages), int(num_micro_batches)
    orders = [_stage_order(schedule, s, p, m) for s in range(p)]
    # act_arrival[s][i]: when F(s, i)'s activation is at stage s+1 (s < p-1).
    # grad_arrival[s][i]: when B(s, i)'s input gradient is at stage s-1 (s > 0).
    act_arrival: list[list[float | None]] = [[None] * m for _ in range(p)]
    grad_arrival: list[list[float | None]] = [[None] * m for _ in range(p)]
    fwd_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    act_link_free = [0.0] * p  # channel s -> s+1
    grad_link_free = [0.0] * p  # channel s -> s-1
    stage_free = [0.0] * p
    next_task = [0] * p
    timeline: list[list[tuple[int, TaskKind, float, float]]] = [[] for _ in range(p)]

    # (Below, `b if b > a else a` is max(a, b), spelled out: it is most of the work.)
    # Each stage advances through its fixed order while its next task's inputs are known.
    # A stage that stops waits on a neighbour, so it is visited again only after one of
    # its neighbours has advanced. Every time is a function of the stage orders alone (a
    # channel carries only its sending stage's messages, in that stage's order), so the
    # order in which stages are visited changes nothing.
    pending = list(reversed(range(p)))       # a stack: stage 0 first
    queued = [True] * p
    while pending:
        s = pending.pop()
        queued[s] = False
        st, order, rows = stages[s], orders[s], timeline[s]
        k, free = next_task[s], stage_free[s]
        first = k
        while k < len(order):
            kind, i = order[k]
            if kind is _F:
                ready = 0.0 if s == 0 else act_arrival[s - 1][i]
            else:
                ready = fwd_end[s][i]
                if ready is not None and s < p - 1:
                    arrived = grad_arrival[s + 1][i]
                    ready = None if arrived is None else arrived if arrived > ready else ready
            if ready is None:
                break  # waits on a stage that has not got there yet
            start = ready if ready > free else free
            if kind is _F:
                end = start + st.forward_s
                fwd_end[s][i] = end
                rows.append((i, _F, start, end))
                if s < p - 1:   # onto channel s -> s+1, after the message before it
                    link = act_link_free[s]
                    sent = (link if serialize_links and link > end else end) \
                        + st.send_activation_s
                    act_link_free[s] = act_arrival[s][i] = sent
            else:
                if st.remat:
                    recompute_end = start + st.forward_s
                    rows.append((i, TaskKind.RECOMPUTE, start, recompute_end))
                    start = recompute_end
                end = start + st.backward_s
                rows.append((i, _B, start, end))
                if s > 0:       # onto channel s -> s-1
                    link = grad_link_free[s]
                    sent = (link if serialize_links and link > end else end) \
                        + st.send_gradient_s
                    grad_link_free[s] = grad_arrival[s][i] = sent
            free = end
            k += 1
        if k == first:
            continue
        next_task[s], stage_free[s] = k, free
        for w in (s - 1, s + 1):
            if 0 <= w < p and not queued[w] and next_task[w] < len(orders[w]):
                queued[w] = True
                pending.append(w)
    if any(next_task[s] < len(orders[s]) for s in range(p)):  # unreachable for the two orders
        raise RuntimeError(
            f"simulate: schedule {schedule} deadlocked at tasks "
            f"{[orders[s][next_task[s]] for s in range(p) if next_task[s] < len(orders[s])]}"
        )

    # A stage's tasks end in order (each starts after the one before it ends), so its last
    # ends latest.
    finish = tuple(rows[-1][3] for rows in timeline)
    return ScheduleResult(
        step_time_s=max(finish),
        busy_s=tuple(math.fsum(end - start for _, _, start, end in rows) for rows in timeline),
        peak_in_flight=tuple(_peak_in_flight(o) for o in orders),
        finish_s=finish,
        timeline=tuple(tuple(rows) for rows in timeline),
    )
