"""Checkpoints of the training state (alpa_lite.tools.checkpoint) on 8 virtual CPU devices.

Each test trains the tiny MLP example a few steps, saves, goes on (the uninterrupted run),
and compares with a fresh `al.parallelize`d step restored from the checkpoint, as a
restarted job would be: onto the same plan the continuation is bit-identical, onto another
plan it matches within float tolerance and every array arrives in the target's sharding.
"""

import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _reference import reference_run, run_steps
from test_compression import nodes

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.errors import CheckpointMismatchError

BEFORE, AFTER = 2, 2        # steps before the save, and after it


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def train_save_continue(method, directory, compression=None, before=BEFORE, after=AFTER):
    """Trains `before` steps, saves at step `before`, trains `after` more.

    Returns (the step, args of the example, the uninterrupted run's (params, opt_state,
    losses) after the save)."""
    step_fn, args, _, _ = reference_run("mlp")
    step = al.parallelize(step_fn, method=method, compression=compression)
    p, s, _ = run_steps(step, args, before)
    al.checkpoint.save(directory, (p, s), step_number=before, step=step)
    return step, args, run_steps(step, (p, s, args[2]), after)


def restore_and_continue(directory, method, compression=None, after=AFTER, **kw):
    """A fresh step restored from `directory`; returns (step, restored, its continuation)."""
    step_fn, args, _, _ = reference_run("mlp")
    step = al.parallelize(step_fn, method=method, compression=compression)
    p, s = al.checkpoint.restore(directory, (args[0], args[1]), step=step, batch=args[2], **kw)
    return step, (p, s), run_steps(step, (p, s, args[2]), after)


@pytest.fixture(scope="module")
def dp_checkpoint(tmp_path_factory):
    """A DataParallel run saved after BEFORE steps, with its uninterrupted continuation."""
    directory = tmp_path_factory.mktemp("dp")
    _, _, continued = train_save_continue(al.DataParallel(), directory)
    return directory, continued


# ---- continuation ------------------------------------------------------------------------

def test_same_plan_data_parallel_continues_bit_identically(dp_checkpoint):
    directory, (p_ref, s_ref, losses_ref) = dp_checkpoint
    _, _, (p, s, losses) = restore_and_continue(directory, al.DataParallel())
    assert losses == losses_ref
    assert_trees_equal((p, s), (p_ref, s_ref))


def test_same_plan_tensor_parallel_continues_bit_identically(tmp_path):
    method = al.Manual(dp=2, tp=4)
    _, _, (p_ref, s_ref, losses_ref) = train_save_continue(method, tmp_path)
    _, _, (p, s, losses) = restore_and_continue(tmp_path, method)
    assert losses == losses_ref
    assert_trees_equal((p, s), (p_ref, s_ref))


@pytest.mark.parametrize("method", [al.Manual(dp=2, tp=4),
                                    al.Manual(dp=4, pp=2, num_micro_batches=2)],
                         ids=["dp2_tp4", "dp4_pp2_m2"])
def test_other_plan_reads_into_its_shardings_and_continues(dp_checkpoint, method):
    """Saved under DataParallel on 8 devices, restored onto tensor parallelism or a
    2-stage pipeline: each leaf is read into the target plan's sharding (a pipeline
    stage's parameters onto that stage's devices only) and training goes on."""
    directory, (p_ref, s_ref, losses_ref) = dp_checkpoint
    step_fn, args, _, _ = reference_run("mlp")
    step = al.parallelize(step_fn, method=method)
    p, s = al.checkpoint.restore(directory, (args[0], args[1]), step=step, batch=args[2])
    want = step.input_shardings(*args)
    for x, sharding in zip(jax.tree.leaves((p, s)), jax.tree.leaves(want[:2])):
        assert x.sharding == sharding
    if method.pp > 1:   # the last layer's weight lives on the second stage's devices only
        w = p["layers"][-1]["w"]
        assert w.sharding.device_set == set(jax.devices()[4:])
    p, s, losses = run_steps(step, (p, s, args[2]), AFTER)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p_ref, s_ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", [
    C.DGC(sparsity=0.9, warmup_steps=4, warmup_stages=(0.5, 0.75), sample_ratio=0.5,
          momentum=0.0),   # the step's optimizer keeps the momentum
    C.DelayedAveraging(delay=2, compressor=C.TopK(0.25)),
], ids=["dgc_warmup", "delayed_topk"])
def test_compressed_step_continues_bit_identically(tmp_path, compression):
    """The compressor's state, step count (DGC's warm-up moves from sparsity 0.75 to 0.9
    after the save), PRNG key and delayed averaging's per-worker copies all come back."""
    method = al.DataParallel()
    before, after = 3, 2
    ref_step, _, (p_ref, s_ref, losses_ref) = train_save_continue(
        method, tmp_path, compression, before=before, after=after)
    saved = al.checkpoint.read_metadata(tmp_path)["compressor"]
    assert saved["step"] == before and saved["kind"] == "state"
    if isinstance(compression, C.DelayedAveraging):
        assert saved["replicas"]        # every parameter and momentum leaf, per worker
    step, _, (p, s, losses) = restore_and_continue(tmp_path, method, compression, after)
    assert losses == losses_ref
    assert_trees_equal((p, s), (p_ref, s_ref))
    assert_trees_equal(step.compression_state, ref_step.compression_state)
    assert step.active_compressed.step == ref_step.active_compressed.step == before + after
    with pytest.raises(ValueError, match="one of this step's own executables"):
        step.active_compressed = ref_step.active_compressed


def test_reset_starts_the_compressor_fresh_and_says_so(tmp_path):
    dgc = C.DGC(sparsity=0.9, warmup_steps=4, sample_ratio=0.5, momentum=0.0)
    train_save_continue(al.DataParallel(), tmp_path, dgc, after=0)
    with pytest.raises(CheckpointMismatchError, match="method: saved.*compression_state='reset'"):
        restore_and_continue(tmp_path, al.DataParallel(), C.TopK(0.25), after=0)
    step, _, _ = restore_and_continue(tmp_path, al.DataParallel(), C.TopK(0.25), after=0,
                                      compression_state="reset")
    assert step.active_compressed is None or step.active_compressed.step == 0
    # Two "nodes" of four: the same 8 devices, but the exchange (and its state) differ.
    step_fn, args, _, _ = reference_run("mlp")
    other = al.parallelize(step_fn, method=al.DataParallel(), cluster=nodes(2),
                           compression=dgc)
    with pytest.raises(CheckpointMismatchError,
                       match=r"workers: saved 8 workers \(1 node\(s\) x 8\), this plan 8 "
                             r"workers \(2 node\(s\) x 4\)"):
        al.checkpoint.restore(tmp_path, args[:2], step=other, batch=args[2])


def test_compressor_state_is_never_dropped_or_invented_silently(tmp_path, dp_checkpoint):
    train_save_continue(al.DataParallel(), tmp_path, C.TopK(0.25), after=0)
    with pytest.raises(CheckpointMismatchError, match="this step has no compression"):
        restore_and_continue(tmp_path, al.DataParallel(), after=0)
    restore_and_continue(tmp_path, al.DataParallel(), after=0, compression_state="reset")
    directory, _ = dp_checkpoint
    with pytest.raises(CheckpointMismatchError, match="holds no compressor state"):
        restore_and_continue(directory, al.DataParallel(), C.TopK(0.25), after=0)


# ---- refusals ----------------------------------------------------------------------------

@pytest.fixture()
def no_array_reads(monkeypatch):
    """Fails the test if a restore asks orbax for the arrays item."""
    original = ocp.CheckpointManager.restore

    def restore(self, step, *a, args=None, **kw):
        assert "arrays" not in (args.keys() if args is not None else ()), "arrays were read"
        return original(self, step, *a, args=args, **kw)
    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)


def test_another_model_is_refused_before_reading_arrays(dp_checkpoint, no_array_reads):
    directory, _ = dp_checkpoint
    _, args, _, _ = reference_run("mlp")
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args[:2])
    wider = dict(like[0], layers=[dict(like[0]["layers"][0],
                                       w=jax.ShapeDtypeStruct((32, 64), np.float32)),
                                  like[0]["layers"][1]])
    with pytest.raises(CheckpointMismatchError,
                       match=r"\[0\]\['layers'\]\[0\]\['w'\]: saved float32\[32,32\], "
                             r"expected float32\[32,64\]"):
        al.checkpoint.restore(directory, (wider, like[1]))
    halves = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float16), like)
    with pytest.raises(CheckpointMismatchError, match="8 leaf difference.*first 5 shown"):
        al.checkpoint.restore(directory, halves)


def test_missing_and_extra_leaves_are_listed(tmp_path, no_array_reads):
    _, args, _, _ = reference_run("mlp")
    params, opt_state = args[0], args[1]
    al.checkpoint.save(tmp_path, (params,), step_number=0)
    with pytest.raises(CheckpointMismatchError,
                       match=r"\[1\]\[0\]\.trace\['layers'\]\[0\]\['b'\]: missing from the "
                             r"checkpoint \(expected float32\[32\]\)"):
        al.checkpoint.restore(tmp_path, (params, opt_state))
    with pytest.raises(CheckpointMismatchError, match="saved float32.*not in the state"):
        al.checkpoint.restore(tmp_path, ({"layers": params["layers"][:1]},))
    shutil.rmtree(tmp_path / "0" / "arrays")          # a damaged checkpoint
    with pytest.raises(CheckpointMismatchError, match="has no 'arrays' item"):
        al.checkpoint.restore(tmp_path, (params,))


def test_bad_arguments_name_the_fix(tmp_path, dp_checkpoint):
    directory, _ = dp_checkpoint
    step_fn, args, _, _ = reference_run("mlp")
    step = al.parallelize(step_fn, method=al.DataParallel())
    with pytest.raises(TypeError, match="needs batch="):
        al.checkpoint.restore(directory, args[:2], step=step)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args[:2])
    with pytest.raises(ValueError, match="has no sharding to restore onto; pass step="):
        al.checkpoint.restore(directory, like)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        al.checkpoint.restore(tmp_path / "empty", like)
    with pytest.raises(FileNotFoundError, match="holds steps"):
        al.checkpoint.restore(directory, like, step_number=7)
    with pytest.raises(ValueError, match="already holds a checkpoint for step 2"):
        al.checkpoint.save(directory, args[:2], step_number=BEFORE)
    with pytest.raises(TypeError, match=r"leaf \[1\] is a float"):
        al.checkpoint.save(tmp_path, (args[0], 0.5), step_number=0)


# ---- layout --------------------------------------------------------------------------------

def test_layout_latest_step_and_an_interrupted_save(tmp_path):
    """One directory per step; the latest is restored by default; a save that died before
    its rename (orbax's tmp directory) is invisible and leaves the older steps intact."""
    _, args, _, _ = reference_run("mlp")
    params = args[0]
    doubled = jax.tree.map(lambda x: 2 * x, params)
    al.checkpoint.save(tmp_path, params, step_number=1)
    path = al.checkpoint.save(tmp_path, doubled, step_number=2)
    assert {"metadata", "arrays"} <= set(os.listdir(path))
    (tmp_path / "3.orbax-checkpoint-tmp-1700000000").mkdir()     # a crash mid-save
    meta = al.checkpoint.read_metadata(tmp_path)
    assert meta["format"] == al.checkpoint.FORMAT and meta["step_number"] == 2
    assert meta["leaves"][0] == {"path": "['layers'][0]['b']", "shape": [32],
                                 "dtype": "float32"}
    assert_trees_equal(al.checkpoint.restore(tmp_path, params), doubled)
    assert_trees_equal(al.checkpoint.restore(tmp_path, params, step_number=1), params)


def test_plans_are_recorded_for_information(dp_checkpoint):
    directory, _ = dp_checkpoint
    plans = al.checkpoint.read_metadata(directory)["plans"]
    assert [p["method"].split("(")[0] for p in plans] == ["DataParallel"]
    assert len(plans[0]["fingerprint"]) == 16 and plans[0]["plan"]["stages"]
