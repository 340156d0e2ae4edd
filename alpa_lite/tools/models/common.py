"""What every built-in model shares: its train step, its arguments as abstract shapes or
as initial arrays, and its size.

A model module (`gpt`, `moe`, `wide_resnet`, `mlp`, and the Flax example) supplies its
`init_params(cfg, key)`, `make_batch(cfg, batch_size, key)`, `abstract_batch(cfg,
batch_size)` and `loss_fn(params, batch, cfg)`; these functions build the rest from them:

    step = make_train_step(gpt.loss_fn, cfg, optax.adamw(1e-4))
    params, opt_state, batch = abstract_args(gpt.init_params, gpt.abstract_batch, cfg, 64, tx)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import optax

from alpa_lite.ir.markers import value_and_grad

LossFn = Callable[[Any, Any, Any], jax.Array]
"""`loss_fn(params, batch, cfg) -> float32 scalar`."""


def make_train_step(loss_fn: LossFn, cfg: Any, tx: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, batch) -> (params, opt_state, loss)`: one optax update of
    `loss_fn` for `cfg`, written as a user writes it with `al.value_and_grad` in place of
    `jax.value_and_grad` (the one alpa_lite change: it marks parameters and gradients)."""

    def train_step(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def abstract_params(init_params: Callable, cfg: Any) -> Any:
    """The parameter pytree of `init_params(cfg, key)` as `jax.ShapeDtypeStruct`s; nothing
    is allocated."""
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def abstract_args(init_params: Callable, abstract_batch: Callable, cfg: Any, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without
    allocating."""
    params = abstract_params(init_params, cfg)
    return params, jax.eval_shape(tx.init, params), abstract_batch(cfg, batch_size)


def init_args(init_params: Callable, make_batch: Callable, cfg: Any, batch_size: int,
              tx: optax.GradientTransformation, seed: int = 0) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as arrays: initial parameters and optimizer state and one
    random batch, from `seed`. Each is built by one jitted call (one compilation instead of
    an eager dispatch per array)."""
    params_key, batch_key = jax.random.split(jax.random.key(seed))
    params = jax.jit(init_params, static_argnums=0)(cfg, params_key)
    opt_state = jax.jit(tx.init)(params)
    batch = jax.jit(make_batch, static_argnums=(0, 1))(cfg, batch_size, batch_key)
    return params, opt_state, batch


def count_params(params: Any) -> int:
    """Number of scalars in a pytree of arrays or `jax.ShapeDtypeStruct`s."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
