"""Independent planning problems on every core, in forked worker processes.

The intra-op problems of a search (each layer structure on each logical mesh, each mesh of
a single stage) are independent of one another, and most of each is Python: strategies,
follower groups and resharding edges are built before HiGHS sees a model. Threads cannot
overlap that part (HiGHS releases the GIL, the build does not): measured on GPT-39B at 128
micro-batches on the 2-core box, two planner threads took as long as one (61 s against
64 s). `map_forked` runs the problems in worker processes instead.

Why fork. A forked worker starts with everything the planner holds (the traced stage
programs, the per-mesh memos) without pickling any of it, and sends back only its answer
(a `StageCost` or `StageResult`, which the disk cache pickles already). A spawned worker
would import JAX and unpickle the programs first, about 2 s each here.

What a worker may run: pure planning (cost models, strategies, the ILP and its solver),
never JAX, whose runtime threads do not survive a fork (JAX warns about exactly that; the
warning is silenced around the fork because the workers never call JAX). HiGHS' own thread
pool is reset in each worker for the same reason.

Where it runs in this process instead, in order: one usable core, a single problem, a
platform other than Linux (macOS' system libraries are not safe to use after a fork
without exec, and Windows has no fork), a call made inside a worker, or tasks too small
to pay for the fork (`forking_pays`). The answers are the same either way; only the time
differs.

When forking pays. Starting and joining a pool costs tens of milliseconds (more as the
planner's memory grows: the fork copies its page tables), and a small model's problems
take a few milliseconds each: planning the test suite's small models, forking cost more
than the second core saved (tests/test_cli.py and test_planning_reuse.py in one process
on the 2-core box: 115 s forking, 108 s without). So this process keeps what its last
pool cost and what a task of each kind took (per task function, whichever process ran
it), and runs a call's tasks here where the cores would save less than a pool costs. A
kind never measured is forked, and so is a kind whose tasks grew, after the one call that
measures them.

Ctrl-C: workers ignore SIGINT; the planner's KeyboardInterrupt stops them (terminated, so
no half-solved problem outlives the planner) and propagates.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import sys
import time
import traceback
import types
import warnings
from typing import Callable, Generic, Sequence, TypeVar

from alpa_lite.errors import PlanningError

T = TypeVar("T")
R = TypeVar("R")

# The work of the current `map_forked` call, read by forked workers from their copy of this
# module (only a task's index crosses the pipe).
_work: tuple[Callable, Sequence] | None = None
_in_worker = False
# What forking costs here and what tasks take (module docstring, "When forking pays"):
# the last pool's start and join, and per task function (its code object), the mean
# seconds of a task in the last call that ran it.
_pool_s: float | None = None
_task_s: dict[types.CodeType, float] = {}


@dataclasses.dataclass(frozen=True)
class Outcome(Generic[R]):
    """One task's answer: its value, or the PlanningError it raised (a problem with no plan
    is an answer, not a failure of the search)."""
    value: R | None = None
    error: PlanningError | None = None

    def get(self) -> R:
        """The value; raises the task's PlanningError where it had none."""
        if self.error is not None:
            raise self.error
        return self.value


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def map_forked(fn: Callable[[T], R], tasks: Sequence[T],
               on_done: Callable[[int, Outcome[R]], None] | None = None) -> list[Outcome[R]]:
    """`fn` over `tasks`, in forked workers where more than one core is usable.

    Args:
      fn: the task's work; pure planning, no JAX (module docstring). It may be a closure:
        workers inherit it by fork, it is never pickled. Its value must pickle.
      tasks: the tasks, also inherited, never pickled.
      on_done: called in this process as each task finishes (in any order), with its index
        and outcome; for progress.

    Returns:
      One `Outcome` per task, in the order of `tasks`. Exceptions other than PlanningError
      propagate (the first met), after the workers are stopped.
    """
    outcomes: list[Outcome[R] | None] = [None] * len(tasks)

    def done(i: int, outcome: Outcome[R]) -> tuple[int, ...]:
        outcomes[i] = outcome
        if on_done is not None:
            on_done(i, outcome)
        return ()

    stream_forked(fn, tasks, range(len(tasks)), done, len(tasks))
    return outcomes


def stream_forked(fn: Callable[[T], R], tasks: Sequence[T], first: Sequence[int],
                  on_done: Callable[[int, Outcome[R]], Sequence[int]],
                  expected: int) -> None:
    """`fn` over the tasks of `tasks` that are asked for, in forked workers where more than
    one core is usable: `first` (indices) at once, then, as each task finishes (in any
    order), those that `on_done(i, outcome)` returns. Each is run at most once: the caller
    asks for a task only once. Ends when none is running.

    For searches whose next problems depend on answers (a walk per pipeline stage): every
    problem a search may ask for is in `tasks` before the workers fork, and the cores stay
    busy while any search has a problem to solve, instead of waiting, round by round, for
    the slowest problem of each round. `expected`: about how many tasks will run, for
    deciding whether forking pays. `fn`, `tasks` and the exceptions are as in `map_forked`.
    """
    global _work, _pool_s
    workers = min(expected, len(tasks), usable_cores())
    code = getattr(fn, "__code__", None)
    if workers <= 1 or _in_worker or not sys.platform.startswith("linux") or \
            not forking_pays(code, expected, workers):
        t0 = time.perf_counter()
        queue, ran = list(first), 0
        while queue:
            i = queue.pop(0)
            ran += 1
            queue.extend(on_done(i, _run(fn, tasks[i])))
        if code is not None and ran:
            _task_s[code] = (time.perf_counter() - t0) / ran
        return
    _work = (fn, tasks)
    task_s, ran = 0.0, 0
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # JAX (and Python 3.12+) warn that forking a threaded process may deadlock the
            # child; the workers never touch JAX or the threads that warning is about.
            warnings.filterwarnings("ignore", message=r".*fork\(\)", category=RuntimeWarning)
            warnings.filterwarnings("ignore", message=r".*fork\(\)",
                                    category=DeprecationWarning)
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker)
        started_s = time.perf_counter() - t0
        finished: "queue_module.SimpleQueue" = queue_module.SimpleQueue()
        try:
            running = 0
            for i in first:
                pool.apply_async(_run_index, (i,), callback=finished.put)
                running += 1
            while running:
                i, (kind, payload, took_s) = finished.get()
                running -= 1
                if kind == "raised":
                    raise payload
                task_s += took_s
                ran += 1
                for j in on_done(i, payload):
                    pool.apply_async(_run_index, (j,), callback=finished.put)
                    running += 1
        except BaseException:
            pool.terminate()
            raise
        t1 = time.perf_counter()
        pool.close()
        pool.join()
        _pool_s = started_s + time.perf_counter() - t1
        if code is not None and ran:
            _task_s[code] = task_s / ran
    finally:
        _work = None


def forking_pays(code: types.CodeType | None, num_tasks: int, workers: int) -> bool:
    """Whether `num_tasks` tasks of the function with this code object finish sooner on
    `workers` forked processes than here, by what this process last measured of a pool
    and of such a task (module docstring): True where either was never measured."""
    task_s = _task_s.get(code) if code is not None else None
    if task_s is None or _pool_s is None:
        return True
    saved_s = (num_tasks - math.ceil(num_tasks / workers)) * task_s
    return saved_s > _pool_s


def _start_worker() -> None:
    global _in_worker
    _in_worker = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import highspy
        # The parent's HiGHS scheduler threads are not in the child.
        highspy.Highs.resetGlobalScheduler(True)
    except ImportError:
        pass


def _run(fn: Callable[[T], R], task: T) -> Outcome[R]:
    try:
        return Outcome(value=fn(task))
    except PlanningError as e:
        return Outcome(error=e)


def _run_index(i: int):
    fn, tasks = _work
    t0 = time.perf_counter()
    try:
        return i, ("done", _run(fn, tasks[i]), time.perf_counter() - t0)
    except Exception as e:         # sent back and raised in the planner
        try:
            pickle.dumps(e)
        except Exception:
            e = RuntimeError("a planning worker failed:\n" + traceback.format_exc())
        return i, ("raised", e, time.perf_counter() - t0)
