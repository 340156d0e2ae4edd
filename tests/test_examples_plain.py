"""The example models under plain `jax.jit`, and their named sizes as abstract shapes.

No alpa_lite planning here: these tests check that the examples are correct JAX programs
(they train, `al.value_and_grad` matches `jax.value_and_grad`) and that every named size has
the parameter count its name promises, without allocating it (`jax.eval_shape` only).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import _common  # noqa: E402
import flax_mlp  # noqa: E402
import gpt  # noqa: E402
import mlp  # noqa: E402
import moe  # noqa: E402
import wide_resnet  # noqa: E402

MODULES = [mlp, gpt, moe, wide_resnet, flax_mlp]
SIZED_MODULES = [gpt, moe, wide_resnet]
MODULE_API = ("Config", "CONFIGS", "init_params", "abstract_params", "make_batch",
              "abstract_batch", "loss_fn", "make_train_step", "abstract_args", "main")


def _name(module):
    return module.__name__


# Compile time dominates these tests. XLA's backend optimisation level 0 roughly halves it
# on CPU and leaves the numerics alone (it only skips LLVM optimisation passes).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _compile(fn, *args):
    """jax.jit(fn) compiled for args, quickly."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)


@functools.lru_cache(maxsize=None)
def _tiny(module):
    cfg = module.CONFIGS["tiny"]
    # rbg keys: XLA compiles RngBitGenerator several times faster than threefry on CPU;
    # jit: one compile instead of dozens of eager op dispatches.
    params_key, batch_key = jax.random.split(jax.random.key(0, impl="rbg"))
    params = _compile(functools.partial(module.init_params, cfg), params_key)(params_key)
    make_batch = functools.partial(module.make_batch, cfg, cfg.batch_size)
    batch = _compile(make_batch, batch_key)(batch_key)
    return cfg, params, batch


def _count_from_name(name: str) -> float:
    """'1.3B' -> 1.3e9, '380M' -> 3.8e8."""
    match = re.fullmatch(r"([0-9.]+)([MB])", name)
    assert match, f"size name {name!r} is not <number>M or <number>B"
    return float(match.group(1)) * {"M": 1e6, "B": 1e9}[match.group(2)]


@pytest.mark.parametrize("module", MODULES, ids=_name)
def test_module_api(module):
    missing = [attr for attr in MODULE_API if not hasattr(module, attr)]
    assert not missing, f"{module.__name__} lacks {missing}"
    cfg = module.CONFIGS["tiny"]
    assert cfg.batch_size % 8 == 0
    assert cfg.dtype == "float32"


@pytest.mark.parametrize("module", MODULES, ids=_name)
def test_tiny_trains_under_plain_jit(module):
    cfg, params, batch = _tiny(module)
    tx = optax.adam(1e-2)
    opt_state = _compile(tx.init, params)(params)
    step = _compile(module.make_train_step(cfg, tx), params, opt_state, batch)
    losses = []
    for _ in range(3):  # the same batch every step: the loss must fall
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)), losses
    assert losses[2] < losses[0], losses
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        module.abstract_params(cfg))


@pytest.mark.parametrize("module", MODULES, ids=_name)
def test_al_value_and_grad_matches_jax(module):
    cfg, params, batch = _tiny(module)

    def both(p, b):
        return (jax.value_and_grad(module.loss_fn)(p, b, cfg),
                alpa_lite.value_and_grad(module.loss_fn)(p, b, cfg))

    (expected_loss, expected_grads), (loss, grads) = _compile(both, params, batch)(params, batch)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                           grads, expected_grads)


@pytest.mark.parametrize("module", MODULES, ids=_name)
def test_train_step_marks_params_and_grads(module):
    """The step uses al.value_and_grad: its jaxpr carries the alpa_marker primitive."""
    cfg = module.CONFIGS["tiny"]
    tx = optax.adamw(1e-3)
    jaxpr = jax.make_jaxpr(module.make_train_step(cfg, tx))(
        *module.abstract_args(cfg, cfg.batch_size, tx))
    kinds = {eqn.params["kind"] for eqn in jaxpr.jaxpr.eqns
             if eqn.primitive is alpa_lite.ir.markers.marker_p}
    assert kinds == {alpa_lite.ir.markers.PARAM, alpa_lite.ir.markers.GRAD}


@pytest.mark.parametrize("module", SIZED_MODULES, ids=_name)
def test_named_sizes_have_the_named_parameter_count(module):
    tx = optax.adamw(1e-3)
    for name, cfg in module.CONFIGS.items():
        if name == "tiny":
            continue
        args = module.abstract_args(cfg, cfg.batch_size, tx)
        leaves = jax.tree_util.tree_leaves(args)
        assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), name
        params, _, batch = args
        assert all(x.shape[0] == cfg.batch_size for x in jax.tree_util.tree_leaves(batch))
        count = _common.count_params(params)
        target = _count_from_name(name)
        assert abs(count - target) <= 0.15 * target, (
            f"{module.__name__} {name}: {count:,} parameters, expected {target:,.0f} +- 15%")


def test_gpt_sizes_match_alpa_table():
    # (hidden, layers, heads) from Alpa's benchmark/alpa/suite_paper_manual_gpt.py gpt_specs.
    table = {"125M": (768, 12, 12), "350M": (1024, 24, 16), "1.3B": (2048, 24, 32),
             "2.6B": (2560, 32, 32), "6.7B": (4096, 32, 32), "15B": (5120, 48, 40),
             "39B": (8192, 48, 64)}
    for name, (hidden, layers, heads) in table.items():
        cfg = gpt.CONFIGS[name]
        assert (cfg.hidden, cfg.num_layers, cfg.num_heads, cfg.seq_len, cfg.vocab_size) == (
            hidden, layers, heads, 1024, 51200), name


def test_moe_routes_within_capacity():
    cfg = moe.CONFIGS["tiny"]
    G, S, E = 3, cfg.expert_group_size, cfg.num_experts
    gates = jax.nn.softmax(jax.random.normal(jax.random.key(0), (G, S, E)), axis=-1)
    gating = functools.partial(moe.top2_gating, capacity=cfg.capacity)
    combine, dispatch, aux = _compile(gating, gates)(gates)
    assert combine.shape == dispatch.shape == (G, S, E, cfg.capacity)
    # every slot of every expert holds at most one token; every token takes at most 2 slots
    assert float(dispatch.sum(axis=1).max()) <= 1.0
    assert float(dispatch.sum(axis=(2, 3)).max()) <= 2.0
    # kept gates of a routed token sum to one
    weight = np.asarray(combine.sum(axis=(2, 3)))
    assert np.allclose(weight[weight > 0], 1.0, atol=1e-5)
    assert np.isfinite(float(aux)) and float(aux) > 0


def test_command_line_rejects_inconsistent_flags():
    with pytest.raises(SystemExit):
        _common.parse_args(gpt, ["--cluster", "8xA100"])  # needs --plan-only
    with pytest.raises(SystemExit):
        _common.parse_args(gpt, ["--method", "auto", "--tp", "2"])
    args = _common.parse_args(gpt, ["--size", "1.3B", "--plan-only", "--method", "manual",
                                    "--dp", "2", "--tp", "4"])
    assert (args.size, args.plan_only, args.dp, args.tp) == ("1.3B", True, 2, 4)
