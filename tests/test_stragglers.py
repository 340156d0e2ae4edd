"""Stragglers (`cost_models.stragglers`): the closed forms against Monte Carlo and against
the arithmetic written out, the limits (no delay, more dropped), the delay-model syntax,
and `alpa-lite explain --stragglers` on a small data-parallel plan."""

import subprocess
import sys
from fractions import Fraction

import pytest

import alpa_lite as al
from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.cost_models.stragglers import (
    EmpiricalDelays,
    ShiftedExponential,
    StragglerPolicy,
    StragglerScheme,
    default_schemes,
    expected_step_times,
    harmonic,
    parse_delay_model,
)
from alpa_lite.plan.timing import TimeKind
from alpa_lite.tools import cli, explain
from alpa_lite.tools.targets import load_target

SYNC = StragglerScheme(StragglerPolicy.SYNC)


def drop(k):
    return StragglerScheme(StragglerPolicy.DROP_SLOWEST, k)


def coded(s):
    return StragglerScheme(StragglerPolicy.CODED, s)


def test_closed_forms_are_the_order_statistics_written_out():
    # n = 4 workers, T = 100 ms, all-reduce 10 ms, update 5 ms, delays Exp(mean 20 ms).
    # E[max of 4] = 20 ms x H_4 = 20 x (1 + 1/2 + 1/3 + 1/4) = 20 x 25/12;
    # E[3rd of 4] = 20 x (H_4 - H_1) = 20 x 13/12; E[2nd of 4] = 20 x (H_4 - H_2) = 20 x 7/12.
    assert harmonic(4) == pytest.approx(float(Fraction(25, 12)))
    rows = expected_step_times(4, 0.100, 0.010, ShiftedExponential(0.020),
                               (SYNC, drop(1), drop(2), coded(1)), fixed_s=0.005)
    sync, drop1, drop2, coded1 = rows
    assert sync.closed_form_s == pytest.approx(0.100 + 0.020 * 25 / 12 + 0.010 + 0.005)
    assert drop1.closed_form_s == pytest.approx(0.100 + 0.020 * 13 / 12 + 0.015)
    assert drop2.closed_form_s == pytest.approx(0.100 + 0.020 * 7 / 12 + 0.015)
    # Gradient coding, s = 1: each worker computes 2 shares (200 ms) and the step waits for
    # any 3 of the 4; the delay does not grow with the load in this model.
    assert coded1.closed_form_s == pytest.approx(0.200 + 0.020 * 13 / 12 + 0.015)
    assert coded1.extra_compute_s == pytest.approx(0.100)
    assert [r.waits_for for r in rows] == [4, 3, 2, 3]
    # Dropping k of 4: the sum of the others x 4/(4-k), its variance x 4/(4-k).
    assert [r.gradient_scale for r in rows] == [1.0, 4 / 3, 2.0, 1.0]
    assert [r.gradient_variance_factor for r in rows] == [1.0, 4 / 3, 2.0, 1.0]
    assert [r.spmd_executable for r in rows] == [True, False, False, False]
    # Lee et al.'s form: the exponential part grows with the load too (x 2 for s = 1).
    scaled = expected_step_times(4, 0.100, 0.010, ShiftedExponential(0.020, True),
                                 (coded(1),), fixed_s=0.005)[0]
    assert scaled.closed_form_s == pytest.approx(0.200 + 2 * 0.020 * 13 / 12 + 0.015)


@pytest.mark.parametrize("n", [1, 8, 64, 512])
@pytest.mark.parametrize("scaled", [False, True])
def test_closed_forms_match_monte_carlo(n, scaled):
    model = ShiftedExponential(0.030, scaled)
    schemes = (SYNC,) if n == 1 else default_schemes(n)
    rows = expected_step_times(n, 0.050, 0.004, model, schemes, fixed_s=0.002,
                               samples=8_000, seed=1)
    for r in rows:
        assert r.expected_step_s == r.closed_form_s
        # Within 4.5 standard errors of the Monte Carlo mean (a failure ~1 in 10^5 per row,
        # and the seed is fixed).
        assert abs(r.monte_carlo_s - r.closed_form_s) <= 4.5 * r.monte_carlo_stderr_s, r
        assert r.monte_carlo_stderr_s > 0


def test_zero_delay_every_policy_is_sync_and_coding_pays_its_compute():
    n, t, sync_s, update = 16, 0.080, 0.006, 0.003
    for model in (ShiftedExponential(0.0), ShiftedExponential(0.0, True),
                  EmpiricalDelays((0.0, 0.0))):
        rows = expected_step_times(n, t, sync_s, model, default_schemes(n, (1, 3, 15)),
                                   fixed_s=update, samples=100)
        for r in rows:
            load = r.scheme.k + 1 if r.scheme.policy is StragglerPolicy.CODED else 1
            assert r.expected_step_s == pytest.approx(load * t + sync_s + update, abs=1e-15)
            assert r.monte_carlo_s == pytest.approx(r.expected_step_s, abs=1e-15)
            assert r.expected_delay_s == 0.0
        assert rows[0].expected_step_s == pytest.approx(t + sync_s + update)


def test_dropping_more_workers_is_faster():
    n = 32
    for model in (ShiftedExponential(0.010), EmpiricalDelays((0.0, 0.001, 0.002, 0.050))):
        rows = expected_step_times(n, 0.020, 0.001, model,
                                   (SYNC,) + tuple(drop(k) for k in range(1, n)),
                                   samples=4_000)
        times = [r.expected_step_s for r in rows]
        assert all(a > b for a, b in zip(times, times[1:])), times
        assert rows[-1].gradient_scale == n     # one gradient left, x 32


def test_empirical_delays_use_monte_carlo():
    # Two workers, each late by 0 or 10 ms with probability 1/2: the max is 10 ms unless
    # both are on time (1/4): E[max] = 7.5 ms; the min is 10 ms only if both are late.
    rows = expected_step_times(2, 0.0, 0.0, EmpiricalDelays((0.0, 0.010)), (SYNC, drop(1)),
                               samples=40_000, seed=3)
    assert rows[0].closed_form_s is None
    assert rows[0].expected_step_s == rows[0].monte_carlo_s
    assert rows[0].expected_step_s == pytest.approx(0.0075, abs=5 * rows[0].monte_carlo_stderr_s)
    assert rows[1].expected_step_s == pytest.approx(0.0025, abs=5 * rows[1].monte_carlo_stderr_s)
    # The same seed gives the same draws.
    again = expected_step_times(2, 0.0, 0.0, EmpiricalDelays((0.0, 0.010)), (SYNC, drop(1)),
                                samples=40_000, seed=3)
    assert again == rows


def test_schemes_refuse_what_the_workers_cannot_do():
    with pytest.raises(ValueError, match="1..7"):
        default_schemes(8, (8,))
    with pytest.raises(ValueError, match="none to drop"):
        default_schemes(1, (1,))
    with pytest.raises(ValueError, match="at most 3"):
        expected_step_times(4, 0.1, 0.0, ShiftedExponential(0.01), (coded(4),))
    with pytest.raises(ValueError, match="k must be 0"):
        StragglerScheme(StragglerPolicy.SYNC, 2)
    with pytest.raises(ValueError, match=">= 1"):
        drop(0)
    with pytest.raises(ValueError, match="mean_delay_s"):
        ShiftedExponential(-1.0)
    assert [s.label for s in default_schemes(64)] == [
        "sync all-reduce", "drop 1 slowest", "drop 2 slowest", "drop 8 slowest",
        "coded, s=1", "coded, s=2", "coded, s=8"]


def test_delay_model_syntax(tmp_path):
    assert parse_delay_model("exp:20") == ShiftedExponential(0.020)
    assert parse_delay_model("exp:20ms") == ShiftedExponential(0.020)
    assert parse_delay_model("exp:0.5s:scaled") == ShiftedExponential(0.5, True)
    assert parse_delay_model("exp:250us").mean_delay_s == pytest.approx(250e-6)
    (tmp_path / "d.txt").write_text("1, 2\n3.5\n")
    m = parse_delay_model(f"samples:{tmp_path / 'd.txt'}")
    assert m.samples_s == pytest.approx((0.001, 0.002, 0.0035)) and not m.scales_with_load
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "words.txt").write_text("1 two 3")
    for text, why in [("exp", "expected KIND:VALUE"), ("exp:", "expected KIND:VALUE"),
                      ("exp:-3", "not a non-negative number"),
                      ("exp:fast", "not a non-negative number"),
                      ("exp:20min", "not a non-negative number"),
                      ("weibull:3", "unknown kind 'weibull'"),
                      ("samples:/no/such/file", "cannot read"),
                      (f"samples:{tmp_path / 'empty.txt'}", "holds no delays"),
                      (f"samples:{tmp_path / 'words.txt'}", "'two', not a delay")]:
        with pytest.raises(ValueError, match=why) as e:
            parse_delay_model(text)
        assert "write exp:MEAN" in str(e.value)       # and what to write instead


# ---- from a plan, and the CLI --------------------------------------------------------------


@pytest.fixture(scope="module")
def dp_plan():
    # mlp-tiny, DataParallel over 8xV100: 8 replicas (about a second to plan).
    target = load_target("mlp-tiny")
    return al.parallelize(target.step_fn, method=al.DataParallel()).plan(
        *target.args, cluster=Cluster.preset("8xV100"))


def test_plan_gives_the_replicas_and_the_step(dp_plan):
    inp = explain.straggler_inputs(dp_plan)
    assert inp.num_workers == 8 and "dp=8" in inp.workers_note
    assert inp.compute_s + inp.sync_s + inp.fixed_s == pytest.approx(dp_plan.step_time_s)
    assert inp.sync_s == pytest.approx(dp_plan.step_time.seconds(TimeKind.GRADIENT_SYNC))
    # With no delay, synchronous all-reduce is the plan's own estimate.
    sync = expected_step_times(inp.num_workers, inp.compute_s, inp.sync_s,
                               ShiftedExponential(0.0), (SYNC,), fixed_s=inp.fixed_s)[0]
    assert sync.expected_step_s == pytest.approx(dp_plan.step_time_s)


def test_explain_prints_the_straggler_table(dp_plan, tmp_path, capsys):
    path = tmp_path / "dp.json"
    path.write_text(dp_plan.to_json())
    # As a user runs it (one subprocess), ...
    proc = subprocess.run([sys.executable, "-m", "alpa_lite.tools.cli", "explain", str(path),
                           "--stragglers", "exp:1", "--straggler-k", "1,4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "stragglers: 8 data-parallel replicas" in out and "Exp(mean 1 ms)" in out
    inp = explain.straggler_inputs(dp_plan)
    rows = expected_step_times(8, inp.compute_s, inp.sync_s, ShiftedExponential(0.001),
                               default_schemes(8, (1, 4)), fixed_s=inp.fixed_s)
    lines = out.splitlines()
    for r in rows:
        line = next(x for x in lines if x.lstrip().startswith(r.scheme.label))
        assert explain.fmt_time(r.expected_step_s) in line
        assert f"{r.expected_step_s / rows[0].expected_step_s:.3f}x" in line
        assert ("simulated" in line) != r.spmd_executable
    assert "simulated only: every device must join each SPMD collective" in " ".join(
        out.split())
    # ... and the bad inputs in-process: one line on stderr, exit 2, what to write.
    for args, fragment in [(["--stragglers", "exp:soon"], "write exp:MEAN"),
                           (["--stragglers", "exp:1", "--straggler-k", "8"], "1..7"),
                           (["--stragglers", "exp:1", "--straggler-k", "two"],
                            "positive integers"),
                           (["--straggler-k", "1"], "needs --stragglers"),
                           (["--stragglers", "exp:1", "--op", "x"], "leave out --op")]:
        capsys.readouterr()
        assert cli.main(["explain", str(path), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("alpa-lite: error:"), err
        assert fragment in err[0], (fragment, err[0])
