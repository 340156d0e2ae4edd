"""`Auto()` with no knobs: single stage or pipeline, micro-batches, schedule and remat chosen
by the cost model, stated in `Plan.choices`; plans that fit or a clear error; the disk
cache; structural reuse; the exhaustive mode."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import gpt
import jax
import optax
import pytest

import alpa_lite as al
from alpa_lite.ir.step_parts import split_step, structure_hash
from alpa_lite.planning.auto_search import micro_batch_counts
from alpa_lite.planning.layers import forward_layers
from alpa_lite.planning.pipeline import layer_node_ranges

TX = optax.adamw(1e-3)
CFG = gpt.CONFIGS["tiny"]


# Four GPUs keep the searches small (fewer submeshes, meshes and Megatron layouts).
FOUR_H100 = al.Cluster.of_gpus("H100", num_nodes=1, devices_per_node=4)
FOUR_V100 = al.Cluster.of_gpus("V100", num_nodes=1, devices_per_node=4)


def _plan(method, cluster=FOUR_H100, cfg=CFG, batch=8):
    step = al.parallelize(gpt.make_train_step(cfg, TX), method=method)
    return step.plan(*gpt.abstract_args(cfg, batch, TX), cluster=cluster)


def test_auto_weighs_single_stage_against_pipelines_and_says_what_it_chose():
    plan = _plan(al.Auto())
    by_what = {c.what: c for c in plan.choices}
    assert "pipeline" in by_what and not by_what["pipeline"].by_user
    weighed = [a for a in plan.explanation.alternatives if a.kind == "plan"]
    labels = [a.label for a in weighed]
    assert "one SPMD stage" in labels and any(lbl.startswith("pipeline") for lbl in labels)
    chosen = [a for a in weighed if a.chosen]
    assert len(chosen) == 1 and chosen[0].time_s == pytest.approx(plan.step_time_s)
    # The fastest plan that was made wins.
    assert plan.step_time_s == min(a.time_s for a in weighed if a.fits)
    # The runner-up of the pipeline choice is the best plan of the other kind.
    other = by_what["pipeline"]
    assert other.runner_up and other.runner_up_s >= plan.step_time_s
    if plan.pipeline is not None:
        assert by_what["micro-batches"].value == str(plan.pipeline.num_micro_batches)
        assert {"schedule", "remat"} <= set(by_what)
    assert plan.stats.plans_weighed == len(weighed)
    assert "choices" in plan.summary() and "runner-up" in plan.summary()
    assert al.Plan.from_json(plan.to_json()) == plan
    assert plan.method == al.Auto()


def test_every_knob_narrows_the_search_and_is_shown_as_the_users():
    single = _plan(al.Auto(pipeline=False))
    assert single.pipeline is None
    assert [a.label for a in single.explanation.alternatives if a.kind == "plan"] == \
        ["one SPMD stage"]
    assert single.choices[0].by_user
    fixed = _plan(al.Auto(num_micro_batches=2))
    assert fixed.pipeline.num_micro_batches == 2
    by_what = {c.what: c for c in fixed.choices}
    assert by_what["micro-batches"].by_user and by_what["pipeline"].by_user
    assert not by_what["schedule"].by_user
    gpipe = _plan(al.Auto(num_micro_batches=2, schedule="gpipe"))
    assert gpipe.pipeline.schedule == "gpipe"
    assert {c.what: c for c in gpipe.choices}["schedule"].by_user
    with pytest.raises(ValueError, match="pipeline=False plans one SPMD stage"):
        al.Auto(pipeline=False, num_micro_batches=4)
    with pytest.raises(ValueError, match="mesh_shapes is for single-stage plans"):
        al.Auto(mesh_shapes=((2, 4),), num_micro_batches=4)


def test_a_step_that_cannot_be_pipelined_is_planned_as_one_stage_and_says_why():
    # jax.value_and_grad: the pipeline planner needs al.value_and_grad's marker.
    def loss_fn(params, batch):
        return gpt.loss_fn(params, batch, CFG)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    plan = al.parallelize(step).plan(*gpt.abstract_args(CFG, 8, TX), cluster=FOUR_H100)
    assert plan.pipeline is None
    assert "al.value_and_grad" in plan.choices[0].note


def test_micro_batch_counts_are_the_batch_divisors():
    assert micro_batch_counts(12) == (1, 2, 3, 4, 6, 12)
    assert micro_batch_counts(1) == (1,)


def test_the_planner_never_returns_a_stage_over_budget():
    # A budget the stage DP's per-layer sums underestimate for the whole stages (the
    # 24.4 GiB-for-14.9 GiB GPT-6.7B pipeline on geo-4, at the tiny GPT's scale): every
    # plan returned fits, or the error gives the smallest peak reached.
    loose = _plan(al.Auto(num_micro_batches=4), cluster=FOUR_V100)
    peak = loose.peak_memory_bytes
    for factor in (0.6, 0.3):
        budget = peak * factor
        try:
            plan = _plan(al.Auto(num_micro_batches=4, memory_budget_bytes=budget),
                         cluster=FOUR_V100)
        except al.MemoryBudgetError as e:
            assert e.peak_bytes > budget
            assert "smallest" in str(e) or "smallest peak" in str(e) or "GiB" in str(e)
            continue
        assert all(st.peak_memory_bytes <= budget for st in plan.stages)
        assert all(st.memory.total <= budget for st in plan.stages)


def test_structural_hash_is_stable_and_identical_layers_share_it():
    first, second = _hashes_for_subprocess(), _hashes_for_subprocess()
    assert first == second                  # two traces of the same step
    assert len(set(first)) < len(first)     # the repeated transformer blocks share one
    # The hash is a function of the traced program alone (no ids, no addresses): the
    # same in another process.
    code = ("import sys; sys.path.insert(0, 'tests'); sys.path.insert(0, 'examples'); "
            "import test_auto_search as t; print(','.join(t._hashes_for_subprocess()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ | {"JAX_PLATFORMS": "cpu"}, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].split(",") == first


def _hashes_for_subprocess():
    """The structural hash of each of 6 layers the tiny GPT of 6 blocks is clustered into."""
    cfg = dataclasses.replace(CFG, num_layers=6)
    args = gpt.abstract_args(cfg, 8, TX)
    parts = split_step(gpt.make_train_step(cfg, TX), args, (2,), 2)
    fwd = parts.forward
    bounds = layer_node_ranges(forward_layers(fwd, num_layers=6), len(fwd.graph.nodes))
    return [structure_hash(fwd, a, b) for a, b in bounds]


def test_identical_layers_are_solved_once():
    cfg = dataclasses.replace(CFG, num_layers=6)
    plan = _plan(al.Auto(num_micro_batches=2, num_layers=6), cfg=cfg)
    s = plan.stats
    assert s.layer_ilps_reused > 0
    exhaustive = _plan(al.Auto(num_micro_batches=2, num_layers=6, exhaustive=True), cfg=cfg)
    # Every layer range of the stage DP's search solved on its own: more problems, fewer
    # answered by another's solve (the Megatron layouts weighed beside it keep theirs).
    assert exhaustive.stats.layer_ilps > s.layer_ilps
    assert exhaustive.stats.layer_ilps_reused < s.layer_ilps_reused
    # Reuse and pruning are exact: the same estimate.
    assert plan.step_time_s == pytest.approx(exhaustive.step_time_s, rel=1e-9)


def test_fast_search_is_within_one_percent_of_the_exhaustive_one():
    fast = _plan(al.Auto(), batch=4)
    full = _plan(al.Auto(exhaustive=True), batch=4)
    labels = [a.label for a in full.explanation.alternatives if a.kind == "plan"]
    # Every divisor of the batch was planned.
    assert {f"pipeline, {m} micro-batches" for m in (1, 2, 4)} <= set(labels)
    assert fast.step_time_s <= full.step_time_s * 1.01


def test_disk_cache_makes_a_second_plan_instant_and_a_new_cluster_reuses_layers(
        tmp_path, monkeypatch):
    monkeypatch.setenv("ALPA_LITE_CACHE", "on")
    monkeypatch.setenv("ALPA_LITE_CACHE_DIR", str(tmp_path))
    method = al.Auto(num_micro_batches=2)
    base = al.Cluster.preset("8x8xV100")
    two = dataclasses.replace(base, name="2x8xV100", num_nodes=2)

    def plan_on(cluster):
        step = al.parallelize(gpt.make_train_step(CFG, TX), method=method)
        return step.plan(*gpt.abstract_args(CFG, 8, TX), cluster=cluster)

    first = plan_on(two)
    assert not first.stats.plan_cache_hit and first.stats.layer_ilps > 0
    t0 = time.perf_counter()
    again = plan_on(two)
    assert again.stats.plan_cache_hit and again == first
    assert time.perf_counter() - t0 < 60      # a trace and a file read (not a timing claim)
    # Fewer nodes of the same GPUs: the layer solutions on meshes that still exist are
    # read back (the Megatron layouts of the new grid are new problems), and the plan is
    # the one planned without the cache.
    one = dataclasses.replace(base, name="1x8xV100", num_nodes=1, inter_node=None)
    plan = plan_on(one)
    monkeypatch.setenv("ALPA_LITE_CACHE", "off")
    cold = plan_on(one)
    monkeypatch.setenv("ALPA_LITE_CACHE", "on")
    assert plan.stats.layer_cache_hits > 0
    assert plan.stats.layer_ilps + plan.stats.layer_cache_hits <= cold.stats.layer_ilps
    assert plan.stats.layer_ilps < cold.stats.layer_ilps
    assert plan == cold
    # A corrupt entry is a miss, not an error: the plan is made again (its layers still
    # read back), the same.
    for f in (tmp_path / "plans").iterdir():
        f.write_text("{not json")
    remade = plan_on(one)
    assert not remade.stats.plan_cache_hit and remade == cold


def test_cli_ctrl_c_stops_planning_cleanly(tmp_path):
    # Ctrl-C reaches a terminal's foreground process. A shell's background job starts with
    # SIGINT ignored, which a child inherits and Python then leaves alone: the CLI starts
    # with Python's own handler, as from a terminal, however the test runner was started.
    cli = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "runpy.run_module('alpa_lite.tools.cli', run_name='__main__')")
    proc = subprocess.Popen(
        [sys.executable, "-c", cli, "plan", "gpt-1.3b", "--cluster",
         "8x8xV100", "--batch-size", "64", "-o", str(tmp_path / "plan.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ | {"ALPA_LITE_CACHE": "off"})
    time.sleep(8)             # into tracing or the layer ILPs
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted (Ctrl-C); nothing was written" in err
    assert "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()
