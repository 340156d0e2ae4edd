"""The `alpa-lite` command line, driven as a user drives it (subprocesses), and the Python
functions under it (compare, the step-time breakdown, pictures, explanations).

Each subprocess imports JAX (~2 s), so a test runs a few commands that each check several
things, and the bad-input cases run side by side.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import pytest

import alpa_lite as al
from alpa_lite import progress
from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.solvers.sharding_ilp import evaluate
from alpa_lite.tools import cli, explain, pictures
from alpa_lite.tools import report as plan_report
from alpa_lite.tools.targets import TargetError, load_target

USER_FILE = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    import numpy as np

    import alpa_lite as al


    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


    def step(params, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


    def make_step():
        f = jax.ShapeDtypeStruct
        params = {"w1": f((64, 128), jnp.float32), "w2": f((128, 32), jnp.float32)}
        batch = {"x": f((32, 64), jnp.float32), "y": f((32, 32), jnp.float32)}
        return step, (params, batch)


    def make_real():
        rng = np.random.default_rng(0)
        params = {"w1": rng.normal(size=(64, 128)).astype(np.float32) * 0.1,
                  "w2": rng.normal(size=(128, 32)).astype(np.float32) * 0.1}
        batch = {"x": rng.normal(size=(32, 64)).astype(np.float32),
                 "y": rng.normal(size=(32, 32)).astype(np.float32)}
        return step, (params, batch)


    def make_huge():
        # 4 x 100000 x 100000 float32 = 160 GB of parameters: no sharding fits the 80 GB of
        # the one device of 1xH100.
        f = jax.ShapeDtypeStruct
        params = {f"w{i}": f((100000, 100000), jnp.float32) for i in range(4)}
        return huge_step, (params, {"x": f((8, 100000), jnp.float32)})


    def huge_step(params, batch):
        def loss(p, b):
            h = b["x"]
            for i in range(4):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean(h)
        value, grads = al.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - g, params, grads), value
''')


def run(*args, cwd, check_rc=None):
    """`python -m alpa_lite.tools.cli ARGS` in `cwd`: (rc, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "alpa_lite.tools.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    if check_rc is not None:
        assert proc.returncode == check_rc, (proc.returncode, proc.stdout[-2000:],
                                             proc.stderr[-2000:])
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(rc, out, err, code, *fragments):
    assert rc == code, (rc, out, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("alpa-lite") and "error" in lines[0], err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "my_model.py").write_text(USER_FILE)
    (d / "no_step.py").write_text("x = 1\n")
    custom = Cluster.preset("8xA100").to_json().replace('"8xA100"', '"my-a100s"')
    (d / "cluster.json").write_text(custom)
    (d / "broken_cluster.json").write_text('{"format": "alpa_lite.cluster/1", "name": ')
    return d


def test_clusters_and_builtin_list(workdir):
    rc, out, err = run("clusters", cwd=workdir, check_rc=0)
    for name in Cluster.presets():
        assert name in out
    assert "V100-SXM2-16GB" in out and "nvlink2" in out and "eth-25gbit-per-node" in out
    rc, out, err = run("plan", "--list", cwd=workdir, check_rc=0)
    for name in ("gpt-2.6b", "moe-380m", "wide_resnet-250m", "mlp-tiny"):
        assert name in out
    # The console script installed with this interpreter's package (beside it in a virtual
    # environment, which `venv/bin/python -m pytest` need not have put on PATH), else the
    # one on PATH.
    beside = os.path.join(os.path.dirname(sys.executable), "alpa-lite")
    script = beside if os.access(beside, os.X_OK) else shutil.which("alpa-lite")
    if script:
        proc = subprocess.run([script, "clusters", "--json", "8xV100"], cwd=workdir,
                              capture_output=True, text=True)
        assert proc.returncode == 0
        assert Cluster.from_json(proc.stdout) == Cluster.preset("8xV100")


def test_builtin_plan_show_explain(workdir):
    rc, out, err = run("plan", "gpt-tiny", "--cluster", "8xV100", "--micro-batches", "4",
                       "-o", "gpt.json", "-v", cwd=workdir, check_rc=0)
    assert "estimated step" in out and "wrote gpt.json" in out
    # --verbose: one line per planning phase, in order.
    phases = [line.split(":")[1].strip() for line in err.splitlines()]
    assert phases[:2] == ["trace", "cluster layers"] and "intra-op ILPs" in phases
    assert "stage DP" in phases
    plan = al.Plan.from_json((workdir / "gpt.json").read_text())
    assert plan.pipeline is not None and plan.pipeline.num_micro_batches == 4
    assert dict(plan.explanation.source) == {"target": "gpt-tiny", "batch_size": "16",
                                             "dtype": "float32"}
    rc, out, err = run("show", "gpt.json", "--png", "gpt.png", "--cluster", "8xV100",
                       cwd=workdir, check_rc=0)
    for text in ("pipeline:", "collective", "step-time breakdown", "bubble", "memory/device",
                 "params/wte"):
        assert text in out, text
    png = (workdir / "gpt.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    rc, out, err = run("explain", "gpt.json", cwd=workdir, check_rc=0)
    assert "whole plans Auto weighed" in out and "choices" in out and "* " in out
    if {c.what: c.value for c in plan.choices}["stages"] == "stage DP":
        assert "whole pipelines under the stage DP's cost" in out
    rc, out, err = run("explain", "gpt.json", "--op", "params/wte", "--stage", "0",
                       cwd=workdir, check_rc=0)
    assert "chosen:" in out and "stage objective" in out


def test_user_file_plan_explain_compare(workdir):
    rc, out, err = run("plan", "my_model.py:make_step", "--cluster", "cluster.json",
                       "--method", "manual", "--dp", "4", "--tp", "2", "-o", "mine.json",
                       cwd=workdir, check_rc=0)
    assert "my-a100s" in out and "dp=4 x tp=2" in out
    # The plan's cluster is not a preset: explaining an operator needs its JSON.
    assert_one_line_error(*run("explain", "mine.json", "--op", "params/w1", cwd=workdir), 2,
                          "not a preset")
    rc, out, err = run("explain", "mine.json", "--op", "params/w1", "--cluster",
                       "cluster.json", cwd=workdir, check_rc=0)
    assert "chosen: [-,tp]" in out      # Megatron: the first weight column-split over tp
    assert "no alternatives" not in out
    # compare: ShapeDtypeStruct arguments cannot be measured.
    assert_one_line_error(*run("compare", "my_model.py", "--cluster", "local", "--measure",
                               cwd=workdir), 2, "--measure needs real arrays")


def test_compare_measures_a_user_file_on_the_local_devices(workdir):
    rc, out, err = run("compare", "my_model.py:make_real", "--cluster", "local", "--measure",
                       "--micro-batches", "1", "--steps", "1", "--json", "rows.json",
                       cwd=workdir, check_rc=0)
    rows = json.loads((workdir / "rows.json").read_text())
    measured = [r for r in rows if r["measured_step_s"] is not None]
    assert measured and all(r["fits"] for r in measured)
    assert all(r["measured_step_s"] > 0 for r in measured)
    assert "measured" in out and rows[0]["label"] in out


def test_bad_input_is_one_line_and_a_nonzero_exit(workdir):
    (workdir / "old.json").write_text('{"format": "alpa_lite.plan/2", "stages": []}')
    cases = [
        (["plan", "gpt-9000b", "--cluster", "8xV100"], 2, "unknown model"),
        (["plan", "nonsense", "--cluster", "8xV100"], 2, "unknown model"),
        (["plan", "mlp-tiny", "--cluster", "16xTPU"], 2, "unknown cluster '16xTPU'"),
        (["plan", "missing.py", "--cluster", "8xV100"], 2, "no such file: missing.py"),
        (["plan", "no_step.py", "--cluster", "8xV100"], 2, "no function make_step()"),
        (["plan", "mlp-tiny", "--cluster", "broken_cluster.json"], 2, "not valid JSON"),
        (["show", "old.json"], 2, "expected format 'alpa_lite.plan/4'"),
        (["show", "nowhere.json"], 2, "no such plan file"),
        (["plan", "mlp-tiny", "--method", "manual", "--dp", "3", "--cluster", "8xV100"], 2,
         "= 3 devices, but the cluster has 8"),
        (["plan", "my_model.py:make_huge", "--cluster", "1xH100", "--micro-batches", "none"],
         1, "no logical mesh gives a plan that fits"),
        (["plan", "mlp-tiny", "--cluster", "8xV100", "--micro-batches", "zero"], 2,
         "--micro-batches"),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "alpa_lite.tools.cli", *args], cwd=workdir,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, _, _ in cases]
    for (args, code, fragment), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=300)
        assert_one_line_error(proc.returncode, out, err, code, fragment)


def test_plan_for_another_cluster_is_refused(workdir):
    plan = _tiny_plans()["single"]
    (workdir / "v100.json").write_text(plan.to_json())
    assert_one_line_error(*run("show", "v100.json", "--cluster", "8xA100", cwd=workdir), 2,
                          "'8xV100' is the cluster this plan was made for, not '8xA100'")


# ---- compare: the CLI table is al.compare's ------------------------------------------------


def test_compare_ranks_auto_first_and_prints_al_compare_rows(workdir, monkeypatch, capsys):
    # The tiny GPT (GPT-2.6B on 8xV100 took a minute of the suite's ten, and the full-size
    # comparisons are bench/pipeline_search.py's). The command runs in this process, with
    # al.compare wrapped to keep what the command asked it and the rows it got back: the
    # comparison is planned once, not once by a CLI subprocess and again here (the
    # subprocess entry point and its exit codes are the other tests' concern).
    from alpa_lite.tools import compare as compare_module
    calls = []
    real_compare = compare_module.compare

    def recording_compare(step_fn, *args, **kwargs):
        rows = real_compare(step_fn, *args, **kwargs)
        calls.append((args, kwargs, rows))
        return rows

    monkeypatch.setattr(compare_module, "compare", recording_compare)
    monkeypatch.chdir(workdir)
    assert cli.main(["compare", "gpt-tiny", "--cluster", "8xV100", "--batch-size", "8",
                     "--micro-batches", "1", "--json", "gpt_rows.json"]) == 0
    out = capsys.readouterr().out
    (args, kwargs, rows), = calls
    # The command asked al.compare what this Python call would:
    # al.compare(target.step_fn, *target.args, cluster=cluster, micro_batches=(1,)).
    cluster = Cluster.preset("8xV100")
    target = load_target("gpt-tiny", batch_size=8, cluster=cluster)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)    # noqa: E731
    assert shapes(args) == shapes(tuple(target.args))
    assert kwargs["cluster"] == cluster and tuple(kwargs["micro_batches"]) == (1,)
    assert kwargs["batch_argnums"] == target.batch_argnums is None
    assert not kwargs["measure"] and kwargs["real_args"] is None
    assert rows[0].kind == "auto" or rows[0].step_time_s == min(
        r.step_time_s for r in rows if r.kind == "auto" and r.fits)
    best_manual = min(r.step_time_s for r in rows if r.kind != "auto" and r.fits)
    assert rows[0].speedup_vs_best_manual == pytest.approx(best_manual / rows[0].step_time_s)
    assert rows[0].speedup_vs_best_manual >= 1.0
    # The table the CLI printed is the one al.compare's rows make.
    console = cli._stdout()
    with console.capture() as cap:
        console.print(cli.compare_table(rows))
    assert cap.get() in out
    assert json.loads((workdir / "gpt_rows.json").read_text()) == json.loads(cli.rows_json(rows))
    assert cli.compare_summary(rows) in out


# ---- the Python functions under the CLI ----------------------------------------------------


_PLANS = {}


def _tiny_plans():
    if not _PLANS:
        cluster = Cluster.preset("8xV100")
        target = load_target("gpt-tiny")
        events = []
        step = al.parallelize(target.step_fn, method=al.Auto(num_micro_batches=4))
        _PLANS["pipeline"] = step.plan(*target.args, cluster=cluster,
                                       progress=lambda *e: events.append(e))
        _PLANS["events"] = events
        _PLANS["manual"] = al.parallelize(target.step_fn, method=al.Manual(
            dp=1, tp=2, pp=4, num_micro_batches=8, remat=True)).plan(*target.args,
                                                                      cluster=cluster)
        _PLANS["single"] = al.parallelize(target.step_fn, method=al.Auto(pipeline=False)).plan(
            *target.args, cluster=cluster)
        _PLANS["target"] = target
    return _PLANS


def test_progress_reports_every_phase_in_order():
    events = _tiny_plans()["events"]
    order = list(dict.fromkeys(e[0] for e in events))
    assert order == [progress.TRACE, progress.CLUSTER, progress.ILPS, progress.DP,
                     progress.SEARCH]
    ilps = [e for e in events if e[0] == progress.ILPS]
    assert all(0 <= done <= total for _, done, total in ilps)
    assert ilps[-1][1] == ilps[-1][2] > 0       # every queued problem was solved


def test_breakdown_reproduces_the_estimate_and_json_keeps_the_explanation():
    plans = _tiny_plans()
    for key in ("pipeline", "manual", "single"):
        plan = plans[key]
        b = plan_report.step_breakdown(plan)
        assert b.step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)
        again = al.Plan.from_json(plan.to_json())
        assert again == plan and again.to_json() == plan.to_json()
    b = plan_report.step_breakdown(plans["manual"])
    # 1F1B with 4 stages and 8 micro-batches: busy + bubble = the pipeline part per stage.
    for st in b.stages:
        assert st.busy_s + st.idle_s == pytest.approx(b.pipeline_s)
        assert st.recompute_s == st.forward_s > 0
    alts = plans["pipeline"].explanation.alternatives
    kinds = {a.kind for a in alts}
    # Auto weighed whole plans (the DP's pipeline, the Megatron layouts) and kept the
    # fastest on the whole-step estimate.
    weighed = [a for a in alts if a.kind == "plan"]
    assert [a.chosen for a in weighed].count(True) == 1
    assert min(a.time_s for a in weighed if a.fits) == \
        pytest.approx(plans["pipeline"].step_time_s)
    if {c.what: c.value for c in plans["pipeline"].choices}["stages"] == "stage DP":
        assert {"stages", "option", "mesh"} <= kinds
        chosen = [a for a in alts if a.kind == "stages" and a.chosen]
        assert len(chosen) == 1
        others = [a.time_s for a in alts if a.kind == "stages" and not a.chosen and a.fits]
        assert all(t >= chosen[0].time_s * (1 - 1e-9) for t in others)   # the DP is optimal
    assert plans["manual"].explanation is None and '"explanation"' not in \
        plans["manual"].to_json()


def test_pictures_render_png_and_svg(tmp_path):
    plans = _tiny_plans()
    pictures.save(plans["manual"], tmp_path / "m.svg")
    assert "<svg" in (tmp_path / "m.svg").read_text()[:2000]
    pictures.save(plans["single"], tmp_path / "s.png", panels=("timeline",))
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="must end in .png or .svg"):
        pictures.save(plans["single"], tmp_path / "s.gif")


def test_explained_choice_is_the_ilp_optimum():
    plans = _tiny_plans()
    target = plans["target"]
    cluster = Cluster.preset("8xV100")
    plan = plans["single"]
    built = explain.rebuild_stage(plan, target.step_fn, target.args, cluster)
    choices = explain.plan_choices(built, plan.stages[0])
    node, edge, _ = evaluate(built.problem, choices)
    assert node + edge == pytest.approx(built.solve(cluster.device.memory_bytes).objective_s,
                                        rel=1e-9)
    e = explain.explain_op(plan, target.step_fn, target.args, cluster, "params/wte")
    assert e.strategies[0].chosen and len(e.strategies) > 1
    assert all(r.objective_s >= e.strategies[0].objective_s * (1 - 1e-9)
               for r in e.strategies if r.memory_bytes <= e.memory_budget_bytes)
    with pytest.raises(ValueError, match="no operator or input named"):
        explain.explain_op(plan, target.step_fn, target.args, cluster, "dot_general_99999")
    assert "whole step" in explain.stage_text(plan)


def test_compare_rows_on_a_small_model():
    target = load_target("mlp-tiny")
    rows = al.compare(target.step_fn, *target.args, cluster=Cluster.preset("8xV100"),
                      micro_batches=(1, 4))
    labels = [r.label for r in rows]
    assert "auto" in labels and "auto m=4" in labels and "ZeRO dp=8" in labels
    assert "dp=2 tp=2 pp=2 m=1 remat" in labels and "dp=8 tp=1 pp=1 m=1" in labels
    assert all(r.error == "" for r in rows[:3])
    fit = [r for r in rows if r.fits]
    assert [r.step_time_s for r in fit] == sorted(r.step_time_s for r in fit)
    for r in fit:
        assert r.samples_per_s == pytest.approx(64 / r.step_time_s)
        assert r.model_tflops_per_device == pytest.approx(r.model_flops / r.step_time_s / 8e12)
    # Model FLOPs: two 32x32 layers at batch 64, 2 x 64 x 32 x 32 FLOPs per matmul (a
    # multiply-add is 2): two forward matmuls, and three backward ones (both weight
    # gradients, and the activation gradient of the second layer only: the batch needs
    # none); the element-wise work adds a little.
    matmuls = 5 * 2 * 64 * 32 * 32
    assert matmuls <= rows[0].model_flops < 1.1 * matmuls


def test_targets_say_what_is_wrong(tmp_path):
    flags = os.environ.get("XLA_FLAGS")          # as tests/conftest.py set them
    with pytest.raises(TargetError, match="sizes are"):
        load_target("gpt-3b")
    with pytest.raises(TargetError, match="--batch-size and --dtype apply to built-in"):
        load_target("x.py", batch_size=4)
    (tmp_path / "bad.py").write_text("def make_step():\n    return 3\n")
    with pytest.raises(TargetError, match=r"must return \(step_fn, example_args\)"):
        load_target(str(tmp_path / "bad.py"))
    (tmp_path / "boom.py").write_text("raise RuntimeError('oops')\n")
    with pytest.raises(TargetError, match="importing .* failed: RuntimeError: oops"):
        load_target(str(tmp_path / "boom.py"))
    v100 = load_target("gpt-125m", batch_size=2, cluster=Cluster.preset("8xV100"))
    assert dict(v100.source)["dtype"] == "float16"     # no bfloat16 tensor cores on V100
    h100 = load_target("gpt-125m", batch_size=2, cluster=Cluster.preset("8xH100"))
    assert dict(h100.source)["dtype"] == "bfloat16"
    # Loading the targets left the test set-up's XLA flags alone.
    assert os.environ.get("XLA_FLAGS") == flags
    assert "--xla_force_host_platform_device_count=8" in flags.split()
    assert jax.device_count() == 8
