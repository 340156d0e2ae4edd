"""Tests for alpa_lite.planning.workers (forked workers give what running in order gives)
and alpa_lite.planning.collector (the collector paced while planning)."""

import dataclasses
import gc
import os
import time

import pytest

from alpa_lite.errors import MemoryBudgetError, PlanningError, detached
from alpa_lite.planning import workers
from alpa_lite.planning.collector import PLANNING_YOUNG_THRESHOLD, fewer_collections
from alpa_lite.planning.workers import map_forked, stream_forked


def test_answers_come_back_in_task_order_from_other_processes():
    scale = [10]          # a closure: workers inherit it by fork, nothing is pickled
    seen = []

    def square(x):
        return x * x * scale[0], os.getpid()

    outcomes = map_forked(square, list(range(7)), lambda i, o: seen.append(i))
    assert [o.get()[0] for o in outcomes] == [10 * x * x for x in range(7)]
    assert sorted(seen) == list(range(7))
    if workers.usable_cores() > 1:
        assert {o.get()[1] for o in outcomes} - {os.getpid()}, "nothing ran in a worker"


def test_a_planning_error_is_an_answer_and_keeps_its_fields():
    def solve(x):
        if x == 2:
            raise MemoryBudgetError("stage 2 needs 20 GiB", 20.0 * 2**30)
        return x

    outcomes = map_forked(solve, [0, 1, 2, 3])
    assert [o.value for o in outcomes] == [0, 1, None, 3]
    err = outcomes[2].error
    assert isinstance(err, MemoryBudgetError) and err.peak_bytes == 20.0 * 2**30
    with pytest.raises(MemoryBudgetError, match="needs 20 GiB"):
        outcomes[2].get()


def test_any_other_error_propagates():
    def solve(x):
        if x == 1:
            raise KeyError("a bug")
        return x

    with pytest.raises(KeyError, match="a bug"):
        map_forked(solve, [0, 1, 2])


def test_one_core_runs_in_this_process(monkeypatch):
    monkeypatch.setattr(workers, "usable_cores", lambda: 1)
    outcomes = map_forked(lambda x: os.getpid(), [0, 1])
    assert {o.get() for o in outcomes} == {os.getpid()}


@pytest.mark.skipif(workers.usable_cores() < 2, reason="forking needs two usable cores")
def test_small_tasks_run_here_once_measured_and_grown_ones_are_forked_again():
    def task(seconds):
        time.sleep(seconds)
        return os.getpid()

    def processes(seconds, n=4):
        return {o.get() for o in map_forked(task, [seconds] * n)}

    me = {os.getpid()}
    # Never measured: forked. Then a pool costs more than four 1 ms tasks save.
    assert processes(0.001) - me
    assert processes(0.001) == me
    # The tasks grew: this call still runs them here (it measures them), the next forks.
    assert processes(0.5) == me
    assert processes(0.5) - me


def _chains(monkeypatch, forked: bool):
    """Three chains of tasks run by `stream_forked`, each asking for its next task only
    when its last is answered (as the stages of a pipeline walk their candidate meshes):
    chain c's tasks are 10c, 10c+1, ..., and it stops after an answer >= 10c + 30 or
    after its tenth task."""
    if forked:
        monkeypatch.setattr(workers, "forking_pays", lambda *_: True)
    else:
        monkeypatch.setattr(workers, "usable_cores", lambda: 1)
    tasks = list(range(40))
    ran, pids = [], set()

    def work(x):
        time.sleep(0.01 * (x % 3))       # uneven: chains finish out of step
        return x * 3, os.getpid()

    def answered(i, outcome):
        value, pid = outcome.get()
        ran.append(i)
        pids.add(pid)
        return [] if value >= 10 * (i // 10) + 30 or i % 10 == 9 else [i + 1]

    stream_forked(work, tasks, [0, 10, 20], answered, expected=3)
    return ran, pids


@pytest.mark.parametrize("forked", [True, False])
def test_streamed_tasks_run_as_asked_each_once(monkeypatch, forked):
    ran, pids = _chains(monkeypatch, forked)
    # Each chain ran its tasks in its own order up to its stop, and nothing twice.
    for c in range(3):
        mine = [i for i in ran if i // 10 == c]
        assert mine == list(range(10 * c, 10 * c + len(mine)))
        assert 3 * mine[-1] >= 10 * c + 30 or mine[-1] % 10 == 9
        assert all(3 * i < 10 * c + 30 for i in mine[:-1])
    assert len(ran) == len(set(ran))
    if forked and workers.usable_cores() > 1:
        assert pids - {os.getpid()}, "nothing ran in a worker"
    if not forked:
        assert pids == {os.getpid()}


def test_a_streamed_task_that_fails_stops_the_stream():
    def work(x):
        if x == 2:
            raise KeyError("a bug")
        return x

    with pytest.raises(KeyError, match="a bug"):
        stream_forked(work, [0, 1, 2, 3], [0], lambda i, o: [i + 1] if i < 3 else [], 2)


def test_planning_errors_pickle_with_their_fields():
    import pickle
    e = pickle.loads(pickle.dumps(MemoryBudgetError("over", 3.0)))
    assert isinstance(e, PlanningError) and str(e) == "over" and e.peak_bytes == 3.0


def test_the_records_workers_send_back_pickle_whole():
    # Meshes, specs and collectives pickle by their constructor's arguments (for speed):
    # every field comes back, in its place.
    import pickle
    from alpa_lite.cost_models.collectives import CollectiveKind
    from alpa_lite.plan.sharding import CollectiveOp, LogicalMesh, TensorSpec
    for record in (LogicalMesh((2, 4), ("x", "y"), device_offset=8),
                   TensorSpec(((), ("x", "y"), ("z",))),
                   CollectiveOp(CollectiveKind.REDUCE_SCATTER, ("y", "x"), 96, 2.5e-3)):
        back = pickle.loads(pickle.dumps(record))
        assert type(back) is type(record) and back == record
        assert all(getattr(back, f.name) == getattr(record, f.name)
                   for f in dataclasses.fields(record))


def test_a_remembered_error_keeps_its_fields_and_lets_its_frames_go():
    """The planners' memos keep and re-raise `detached` copies: the same type, message and
    fields, without the frames (and their locals) of the raise that made the original."""
    import gc
    import weakref

    class Problem:      # stands for a whole stage's intra-op problem
        pass

    def solve(problem):
        try:
            raise KeyError("inner")
        except KeyError:
            raise MemoryBudgetError("stage 1 needs 20 GiB", 20.0) from None

    problem = Problem()
    alive = weakref.ref(problem)
    try:
        solve(problem)
    except MemoryBudgetError as e:
        kept = detached(e)
    del problem
    gc.collect()
    assert alive() is None
    assert type(kept) is MemoryBudgetError and str(kept) == "stage 1 needs 20 GiB"
    assert kept.peak_bytes == 20.0 and kept.__traceback__ is None and kept.__context__ is None
    again = detached(kept)
    assert again is not kept and str(again) == str(kept)


@pytest.mark.parametrize("method", [dict(num_micro_batches=2), dict(pipeline=False)])
def test_a_plan_made_on_every_core_is_the_plan_made_in_order(method, monkeypatch):
    """The pipeline search's layer and stage problems and the single stage's meshes,
    planned in workers and in this process: the same plan, and the same count of
    intra-op problems solved."""
    import gpt
    import optax

    import alpa_lite as al

    tx = optax.adamw(1e-3)
    cfg = gpt.CONFIGS["tiny"]
    cluster = al.Cluster.of_gpus("H100", num_nodes=1, devices_per_node=4)
    args = gpt.abstract_args(cfg, 8, tx)

    def plan():
        step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.Auto(**method))
        return step.plan(*args, cluster=cluster)

    # (The tiny GPT's problems are too small for a pool to pay: forced here.)
    monkeypatch.setattr(workers, "forking_pays", lambda *_: True)
    forked = plan()
    monkeypatch.setattr(workers, "usable_cores", lambda: 1)
    in_order = plan()
    assert forked.to_json() == in_order.to_json()
    assert forked.stats.layer_ilps == in_order.stats.layer_ilps


def test_planning_paces_the_collector_and_gives_the_users_settings_back():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with fewer_collections():
            assert gc.get_threshold() == (PLANNING_YOUNG_THRESHOLD, 10, 10)
            # Planning's forked workers inherit the pace.
            seen = map_forked(lambda _: gc.get_threshold(), [0, 1])
            assert [o.get() for o in seen] == [(PLANNING_YOUNG_THRESHOLD, 10, 10)] * 2
        assert gc.get_threshold() == (700, 10, 10)
        with pytest.raises(PlanningError):
            with fewer_collections():
                raise PlanningError("no plan")
        assert gc.get_threshold() == (700, 10, 10)
        # A collector the user turned off stays off.
        gc.set_threshold(0, 10, 10)
        with fewer_collections():
            assert gc.get_threshold() == (0, 10, 10)
    finally:
        gc.set_threshold(*before)
