"""Multi-layer perceptron regression (Linear - relu - ... - Linear) trained with AdamW.

The smallest example: the model is a list of dense layers, the loss a mean squared error,
the step plain JAX + optax with `al.value_and_grad` as the one alpa_lite change.

Two named sizes are the 2-layer MLPs whose best sharding is known (DESIGN.md, intra-op ILP):
with a large batch and a narrow layer ("b1024_h128") data parallelism wins; with a small
batch and a wide layer ("b128_h1024") Megatron-style model parallelism does.

    alpa-lite plan mlp-b128_h1024 --cluster 8xV100           # a size planned by name
    python examples/mlp.py                                   # tiny, 5 steps on 8 CPU devices
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from alpa_lite.tools.models import common

# The model's public names: what examples/mlp.py re-exports with `import *`.
__all__ = [
    "Config", "CONFIGS", "init_params", "abstract_params", "make_batch", "abstract_batch",
    "forward", "loss_fn", "make_train_step", "abstract_args",
]


@dataclass(frozen=True)
class Config:
    in_dim: int = 32            # input features
    hidden: int = 32            # width of every hidden layer
    out_dim: int = 32           # regression targets
    num_layers: int = 2         # dense layers (>= 2): in -> hidden -> ... -> hidden -> out
    dtype: str = "float32"      # parameter and activation dtype; the loss is float32
    batch_size: int = 64

    def __post_init__(self):
        if self.num_layers < 2:
            raise ValueError(f"num_layers must be >= 2 (Linear-relu-Linear), got {self.num_layers}")

    def dims(self) -> list[int]:
        """Feature sizes between the layers: [in_dim, hidden, ..., hidden, out_dim]."""
        return [self.in_dim] + [self.hidden] * (self.num_layers - 1) + [self.out_dim]


CONFIGS: dict[str, Config] = {
    "tiny": Config(in_dim=32, hidden=32, out_dim=32, num_layers=2, batch_size=64),
    # the ILP reference cases: data parallel wins ...
    "b1024_h128": Config(in_dim=128, hidden=128, out_dim=128, num_layers=2, batch_size=1024),
    # ... and Megatron-style model parallel wins
    "b128_h1024": Config(in_dim=1024, hidden=1024, out_dim=1024, num_layers=2, batch_size=128),
}


def init_params(cfg: Config, key: jax.Array) -> dict:
    """{'layers': [{'w': (d_in, d_out), 'b': (d_out,)}, ...]}, LeCun-normal weights."""
    dtype = jnp.dtype(cfg.dtype)
    dims = cfg.dims()
    keys = jax.random.split(key, cfg.num_layers)
    layers = []
    for k, d_in, d_out in zip(keys, dims[:-1], dims[1:]):
        w = jax.random.normal(k, (d_in, d_out), jnp.float32) * d_in ** -0.5
        layers.append({"w": w.astype(dtype), "b": jnp.zeros((d_out,), dtype)})
    return {"layers": layers}


def abstract_params(cfg: Config) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s; nothing is allocated."""
    return common.abstract_params(init_params, cfg)


def make_batch(cfg: Config, batch_size: int, key: jax.Array) -> dict:
    """Random inputs {'x': (B, in_dim)} and random targets {'y': (B, out_dim)}."""
    k_x, k_y = jax.random.split(key)
    return {"x": jax.random.normal(k_x, (batch_size, cfg.in_dim), jnp.float32).astype(cfg.dtype),
            "y": jax.random.normal(k_y, (batch_size, cfg.out_dim), jnp.float32).astype(cfg.dtype)}


def abstract_batch(cfg: Config, batch_size: int) -> dict:
    dtype = jnp.dtype(cfg.dtype)
    return {"x": jax.ShapeDtypeStruct((batch_size, cfg.in_dim), dtype),
            "y": jax.ShapeDtypeStruct((batch_size, cfg.out_dim), dtype)}


def forward(params: dict, x: jax.Array) -> jax.Array:
    *hidden_layers, last = params["layers"]
    for layer in hidden_layers:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])                # (B, hidden)
    return x @ last["w"] + last["b"]                                # (B, out_dim)


def loss_fn(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Mean squared error (float32 scalar)."""
    del cfg  # the shapes say everything
    pred = forward(params, batch["x"])
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - batch["y"].astype(jnp.float32)))


def make_train_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss): one optax update."""
    return common.make_train_step(loss_fn, cfg, tx)


def abstract_args(cfg: Config, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without allocating."""
    return common.abstract_args(init_params, abstract_batch, cfg, batch_size, tx)
