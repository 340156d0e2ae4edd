"""A stock Flax (linen) CNN classifier trained with optax, parallelized by alpa_lite.

Written the way the Flax examples write it: an `nn.Module` of `nn.Conv` and `nn.Dense`
layers, parameters from `model.init(...)["params"]`, the loss calling `model.apply`. The only
change from stock Flax code is `al.value_and_grad` in place of `jax.value_and_grad`.

    python examples/flax_mlp.py                              # 5 steps on 8 CPU devices
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools
import pathlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import alpa_lite as al

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or imported
import _common  # noqa: E402


@dataclass(frozen=True)
class Config:
    image_size: int = 16        # square H = W
    in_channels: int = 1        # grayscale
    channels: tuple[int, ...] = (8, 16)  # conv widths; each conv is followed by a 2x2 avg pool
    hidden: int = 32            # the dense layer before the classifier
    num_classes: int = 8
    dtype: str = "float32"      # parameter and activation dtype; the loss is float32
    batch_size: int = 32


CONFIGS: dict[str, Config] = {"tiny": Config()}


class CNN(nn.Module):
    """Conv-relu-pool blocks, then Dense-relu-Dense."""
    channels: Sequence[int]
    hidden: int
    num_classes: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):                                          # (B, H, W, C_in)
        for i, c in enumerate(self.channels):
            x = nn.Conv(c, (3, 3), dtype=self.dtype, param_dtype=self.dtype, name=f"conv_{i}")(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))              # (B, H/2, W/2, c)
        x = x.reshape(x.shape[0], -1)                               # (B, H' * W' * c)
        x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, param_dtype=self.dtype,
                             name="dense")(x))                      # (B, hidden)
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.dtype,
                        name="head")(x)                             # (B, classes)


def make_model(cfg: Config) -> CNN:
    return CNN(channels=cfg.channels, hidden=cfg.hidden, num_classes=cfg.num_classes,
               dtype=jnp.dtype(cfg.dtype))


def init_params(cfg: Config, key: jax.Array) -> dict:
    """Flax's params: {'conv_0': {'kernel', 'bias'}, 'conv_1', 'dense', 'head'}."""
    dummy = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.in_channels), cfg.dtype)
    return make_model(cfg).init(key, dummy)["params"]


def abstract_params(cfg: Config) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s; nothing is allocated."""
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def make_batch(cfg: Config, batch_size: int, key: jax.Array) -> dict:
    """Random images {'images': (B, H, W, C_in)} with random int32 'labels' (B,)."""
    k_img, k_lbl = jax.random.split(key)
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
    return {"images": jax.random.normal(k_img, shape, jnp.float32).astype(cfg.dtype),
            "labels": jax.random.randint(k_lbl, (batch_size,), 0, cfg.num_classes, jnp.int32)}


def abstract_batch(cfg: Config, batch_size: int) -> dict:
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
    return {"images": jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype)),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}


def loss_fn(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Mean softmax cross-entropy (float32 scalar)."""
    logits = make_model(cfg).apply({"params": params}, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["labels"]).mean()


def make_train_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss): one optax update."""

    def train_step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch, cfg)  # the one alpa_lite change
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def abstract_args(cfg: Config, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without allocating."""
    params = abstract_params(cfg)
    return params, jax.eval_shape(tx.init, params), abstract_batch(cfg, batch_size)


def main(argv=None) -> None:
    _common.run_example(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
