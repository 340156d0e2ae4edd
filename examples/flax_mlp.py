"""A stock Flax (linen) CNN classifier trained with optax, parallelized by alpa_lite.

Written the way the Flax examples write it: an `nn.Module` of `nn.Conv` and `nn.Dense`
layers, parameters from `model.init(...)["params"]`, the loss calling `model.apply`. The only
change from stock Flax code is `al.value_and_grad` in place of `jax.value_and_grad`, in the
train step the built-in models share (`alpa_lite.tools.models.common.make_train_step`).

    python examples/flax_mlp.py                              # 5 steps on 8 CPU devices
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from alpa_lite.tools.models import common

# The same random images and labels as the Wide-ResNet's: fields image_size, in_channels,
# num_classes and dtype.
from alpa_lite.tools.models.wide_resnet import abstract_batch, make_batch

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
    return common.abstract_params(init_params, cfg)


def loss_fn(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Mean softmax cross-entropy (float32 scalar)."""
    logits = make_model(cfg).apply({"params": params}, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["labels"]).mean()


def make_train_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss): one optax update, with
    `al.value_and_grad` in place of `jax.value_and_grad` (`common.make_train_step`)."""
    return common.make_train_step(loss_fn, cfg, tx)


def abstract_args(cfg: Config, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without allocating."""
    return common.abstract_args(init_params, abstract_batch, cfg, batch_size, tx)


def main(argv=None) -> None:
    _common.run_example(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
