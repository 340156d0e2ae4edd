"""Wide-ResNet (bottleneck blocks) image classifier trained with AdamW.

Plain JAX: convolutions are `lax.conv_general_dilated` in NHWC / HWIO, and batch norm uses
the statistics of the current batch (training mode, no running averages), so the train step
stays a pure function of (params, opt_state, batch). The statistics are taken over fixed
groups of `norm_group_size` images ("ghost batch norm", Hoffer et al., NeurIPS 2017), as
large-batch training does anyway: every group's result depends on its own images only, so
a step split into data-parallel shards or pipeline micro-batches of whole groups computes
exactly what one device computes for the whole batch.
The blocks follow Alpa's Wide-ResNet (`alpa/model/wide_resnet.py`, from Flax's ImageNet
ResNet v1): 1x1 conv to `filters`, 3x3 conv (carrying the stride) to `filters x width_factor`,
1x1 conv to `4 x filters`, and a 1x1 projection on the shortcut when the shape changes.

Sizes 250M ... 13B are the Alpa paper's Wide-ResNets (Zheng et al., OSDI 2022, Table 4;
alpa `benchmark/alpa/suite_wresnet.py`, `wresnet_specs`): 224x224 images, 1024 classes.

    alpa-lite plan wide_resnet-1b --cluster 8xA100           # a size planned by name
    python examples/wide_resnet.py                           # tiny, 5 steps on 8 CPU devices
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from alpa_lite.tools.models import common

# The model's public names: what examples/wide_resnet.py re-exports with `import *`.
__all__ = [
    "STAGE_SIZES", "Config", "CONFIGS", "init_conv", "init_norm", "conv", "norm", "max_pool",
    "bottleneck", "init_params", "abstract_params", "make_batch", "abstract_batch", "forward",
    "loss_fn", "make_train_step", "abstract_args",
]


# Bottleneck blocks per stage for each depth (depth = 3 x blocks + 2: stem conv and head).
STAGE_SIZES: dict[int, tuple[int, ...]] = {
    14: (1, 1, 1, 1),
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}


@dataclass(frozen=True)
class Config:
    image_size: int = 224       # square H = W
    num_layers: int = 50        # depth, a key of STAGE_SIZES
    num_channels: int = 160     # base filters C; stage i uses C * 2**i, blocks output 4x that
    width_factor: int = 2       # widens the 3x3 conv of every bottleneck
    num_classes: int = 1024
    in_channels: int = 3        # RGB
    dtype: str = "float32"      # parameter and activation dtype; normalisation stats in float32
    batch_size: int = 1536      # global batch, images (Alpa's Wide-ResNet benchmark uses 1536)
                                # (Alpa splits it into micro-batches; plan a smaller
                                # --batch-size where the planner has none)
    norm_eps: float = 1e-5
    norm_group_size: int = 16   # images per batch-norm group (batch must be a multiple)

    def __post_init__(self):
        if self.num_layers not in STAGE_SIZES:
            raise ValueError(f"num_layers must be one of {sorted(STAGE_SIZES)}, "
                             f"got {self.num_layers}")

    def blocks(self) -> list[tuple[int, int]]:
        """(filters, stride) of every bottleneck block, in order."""
        return [(self.num_channels * 2 ** i, 2 if i > 0 and j == 0 else 1)
                for i, n in enumerate(STAGE_SIZES[self.num_layers]) for j in range(n)]


def _wrn(num_layers: int, num_channels: int, width_factor: int) -> Config:
    return Config(num_layers=num_layers, num_channels=num_channels, width_factor=width_factor,
                  dtype="bfloat16")


CONFIGS: dict[str, Config] = {
    # For tests and laptops: 32x32 images, 4 bottleneck blocks of 8..64 filters, 16 classes.
    "tiny": Config(image_size=32, num_layers=14, num_channels=8, width_factor=2,
                   num_classes=16, dtype="float32", batch_size=16, norm_group_size=4),
    #                 layers  channels  width     (Alpa paper Table 4)
    "250M": _wrn(50, 160, 2),
    "500M": _wrn(50, 224, 2),
    "1B": _wrn(50, 320, 2),
    "2B": _wrn(50, 448, 2),
    "4B": _wrn(50, 640, 2),
    "6.8B": _wrn(50, 320, 16),
    "13B": _wrn(101, 320, 16),
}


# -----------------------------------------------------------------------------
# building blocks

def init_conv(key, kh: int, kw: int, c_in: int, c_out: int, dtype) -> dict:
    """{'w': (kh, kw, c_in, c_out)} with He-normal init; no bias (a norm follows)."""
    std = (2.0 / (kh * kw * c_in)) ** 0.5
    return {"w": (std * jax.random.normal(key, (kh, kw, c_in, c_out), jnp.float32)).astype(dtype)}


def init_norm(channels: int, dtype, scale: float = 1.0) -> dict:
    return {"scale": jnp.full((channels,), scale, dtype), "bias": jnp.zeros((channels,), dtype)}


def conv(p: dict, x: jax.Array, stride: int = 1, padding: Any = "SAME") -> jax.Array:
    """2-D convolution, NHWC input, HWIO kernel."""
    return lax.conv_general_dilated(x, p["w"], window_strides=(stride, stride), padding=padding,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def norm(p: dict, x: jax.Array, eps: float, group_size: int) -> jax.Array:
    """Batch norm in training mode without running statistics: per channel over H, W and
    each group of `group_size` images."""
    N, H, W, C = x.shape
    if N % group_size:
        raise ValueError(f"batch of {N} images is not a multiple of norm_group_size "
                         f"({group_size}); change the batch size or the group size")
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # float32 or wider
    xg = x32.reshape(N // group_size, group_size, H, W, C)
    mean = xg.mean(axis=(1, 2, 3), keepdims=True)                   # (G, 1, 1, 1, C)
    var = jnp.square(xg - mean).mean(axis=(1, 2, 3), keepdims=True)
    y = ((xg - mean) * lax.rsqrt(var + eps)).reshape(N, H, W, C)
    return y.astype(x.dtype) * p["scale"] + p["bias"]


def max_pool(x: jax.Array, window: int, stride: int) -> jax.Array:
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, window, window, 1),
                             (1, stride, stride, 1), "SAME")


def bottleneck(p: dict, x: jax.Array, stride: int, eps: float, group: int) -> jax.Array:
    """(N, H, W, C_in) -> (N, H/stride, W/stride, 4 * filters)."""
    y = jax.nn.relu(norm(p["norm1"], conv(p["conv1"], x), eps, group))             # (N, H, W, f)
    y = jax.nn.relu(norm(p["norm2"], conv(p["conv2"], y, stride), eps, group))     # (N, H/s, W/s, f*w)
    y = norm(p["norm3"], conv(p["conv3"], y), eps, group)                          # (N, H/s, W/s, 4f)
    shortcut = x
    if "proj" in p:
        shortcut = norm(p["proj_norm"], conv(p["proj"], x, stride), eps, group)    # (N, H/s, W/s, 4f)
    return jax.nn.relu(shortcut + y)


# -----------------------------------------------------------------------------
# the model

def init_params(cfg: Config, key: jax.Array) -> dict:
    """{'stem': {'conv', 'norm'}, 'blocks': [{'conv1', 'norm1', 'conv2', 'norm2', 'conv3',
    'norm3'[, 'proj', 'proj_norm']}, ...], 'head': {'w', 'b'}}."""
    dtype = jnp.dtype(cfg.dtype)
    layout = cfg.blocks()
    k_stem, k_head, *k_blocks = jax.random.split(key, 2 + len(layout))
    C = cfg.num_channels
    params = {"stem": {"conv": init_conv(k_stem, 7, 7, cfg.in_channels, C, dtype),
                       "norm": init_norm(C, dtype)}}
    blocks, c_in = [], C
    for (filters, stride), k in zip(layout, k_blocks):
        k1, k2, k3, k4 = jax.random.split(k, 4)
        wide, c_out = filters * cfg.width_factor, 4 * filters
        block = {"conv1": init_conv(k1, 1, 1, c_in, filters, dtype),
                 "norm1": init_norm(filters, dtype),
                 "conv2": init_conv(k2, 3, 3, filters, wide, dtype),
                 "norm2": init_norm(wide, dtype),
                 "conv3": init_conv(k3, 1, 1, wide, c_out, dtype),
                 # zero-init last scale: each block starts as the identity (Goyal et al. 2017)
                 "norm3": init_norm(c_out, dtype, scale=0.0)}
        if c_in != c_out or stride != 1:
            block["proj"] = init_conv(k4, 1, 1, c_in, c_out, dtype)
            block["proj_norm"] = init_norm(c_out, dtype)
        blocks.append(block)
        c_in = c_out
    params["blocks"] = blocks  # a list keeps block order in the flattened pytree
    std = c_in ** -0.5
    params["head"] = {
        "w": (std * jax.random.normal(k_head, (c_in, cfg.num_classes), jnp.float32)).astype(dtype),
        "b": jnp.zeros((cfg.num_classes,), dtype)}
    return params


def abstract_params(cfg: Config) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s; nothing is allocated."""
    return common.abstract_params(init_params, cfg)


def make_batch(cfg: Config, batch_size: int, key: jax.Array) -> dict:
    """Random images {'images': (B, H, W, 3) cfg.dtype} with random int32 'labels' (B,)."""
    k_img, k_lbl = jax.random.split(key)
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
    return {"images": jax.random.normal(k_img, shape, jnp.float32).astype(cfg.dtype),
            "labels": jax.random.randint(k_lbl, (batch_size,), 0, cfg.num_classes, jnp.int32)}


def abstract_batch(cfg: Config, batch_size: int) -> dict:
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
    return {"images": jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype)),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}


def forward(params: dict, images: jax.Array, cfg: Config) -> jax.Array:
    """Logits (B, classes) for images (B, H, W, 3)."""
    eps = cfg.norm_eps
    x = conv(params["stem"]["conv"], images, 2, ((3, 3), (3, 3)))   # (B, H/2, W/2, C)
    x = jax.nn.relu(norm(params["stem"]["norm"], x, eps, cfg.norm_group_size))
    x = max_pool(x, 3, 2)                                           # (B, H/4, W/4, C)
    for block, (_, stride) in zip(params["blocks"], cfg.blocks()):
        x = bottleneck(block, x, stride, eps, cfg.norm_group_size)                       # (B, H', W', 4f)
    x = x.mean(axis=(1, 2))                                         # (B, 32C)
    return x @ params["head"]["w"] + params["head"]["b"]            # (B, classes)


def loss_fn(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Mean softmax cross-entropy (float32 scalar)."""
    logits = forward(params, batch["images"], cfg)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), batch["labels"]).mean()


def make_train_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss): one optax update."""
    return common.make_train_step(loss_fn, cfg, tx)


def abstract_args(cfg: Config, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without allocating."""
    return common.abstract_args(init_params, abstract_batch, cfg, batch_size, tx)
