"""GPT-2 style decoder trained with AdamW, parallelized by alpa_lite.

The model is written in plain JAX: a pytree of arrays and pure functions, one Python loop
over the layers (no `lax.scan`, so the planner sees every layer). The train step is what a
user would write with optax (`common.make_train_step`); the one alpa_lite change is
`al.value_and_grad` in place of `jax.value_and_grad`, which marks the parameters and
gradients for the planner.

Sizes 125M ... 39B are the GPT-3-style models of the Alpa paper's GPT benchmark
(Zheng et al., OSDI 2022, Table 4; alpa `benchmark/alpa/suite_paper_manual_gpt.py`,
`gpt_specs`): seq 1024, vocab 51200.

    alpa-lite plan gpt-2.6b --cluster 8xA100                 # a size planned by name
    python examples/gpt.py                                   # tiny, 5 steps on 8 CPU devices
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from alpa_lite.tools.models import common

# The model's public names: what examples/gpt.py re-exports with `import *`.
__all__ = [
    "Config", "CONFIGS", "init_linear", "init_layer_norm", "linear", "layer_norm",
    "init_attention", "causal_self_attention", "mlp", "lm_loss", "init_params",
    "abstract_params", "make_batch", "abstract_batch", "forward", "loss_fn", "make_train_step",
    "abstract_args",
]


@dataclass(frozen=True)
class Config:
    vocab_size: int = 51200     # GPT-2's 50257 padded up to a multiple of 1024, as in Alpa/Megatron
    seq_len: int = 1024         # context length; also the size of the learned position table
    hidden: int = 768           # model width H
    num_layers: int = 12
    num_heads: int = 12         # head_dim = hidden // num_heads
    dtype: str = "float32"      # parameter and activation dtype; losses and softmax are float32
    batch_size: int = 1024      # global batch, sequences (Alpa's GPT benchmark uses 1024)
                                # (Alpa splits it into micro-batches; plan a smaller
                                # --batch-size where the planner has none)
    init_std: float = 0.02      # GPT-2's normal init; residual projections get std/sqrt(2L)
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by num_heads "
                             f"({self.num_heads})")


def _gpt(hidden: int, num_layers: int, num_heads: int) -> Config:
    return Config(hidden=hidden, num_layers=num_layers, num_heads=num_heads, dtype="bfloat16")


CONFIGS: dict[str, Config] = {
    # For tests and laptops: < 1 s per step on one CPU core; every width divisible by 8.
    "tiny": Config(vocab_size=256, seq_len=16, hidden=64, num_layers=2, num_heads=8,
                   dtype="float32", batch_size=16),
    #                 hidden  layers  heads      (Alpa paper Table 4)
    "125M": _gpt(768, 12, 12),
    "350M": _gpt(1024, 24, 16),
    "1.3B": _gpt(2048, 24, 32),
    "2.6B": _gpt(2560, 32, 32),
    "6.7B": _gpt(4096, 32, 32),
    "15B": _gpt(5120, 48, 40),
    "39B": _gpt(8192, 48, 64),
    # GPT-3 (Brown et al., 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048).
    "175B": dataclasses.replace(_gpt(12288, 96, 96), seq_len=2048),
    # Megatron-LM's "1T" model (Narayanan et al., SC21, Table 1: 1008B, 128 layers, hidden
    # 25600, 160 heads, sequence 2048).
    "1008B": dataclasses.replace(_gpt(25600, 128, 160), seq_len=2048),
}


# -----------------------------------------------------------------------------
# building blocks (moe.py reuses these)

def init_linear(key, d_in: int, d_out: int, std: float, dtype) -> dict:
    """A dense layer {'w': (d_in, d_out), 'b': (d_out,)}: normal(std) weights, zero bias."""
    return {"w": (std * jax.random.normal(key, (d_in, d_out), jnp.float32)).astype(dtype),
            "b": jnp.zeros((d_out,), dtype)}


def init_layer_norm(hidden: int, dtype) -> dict:
    return {"scale": jnp.ones((hidden,), dtype), "bias": jnp.zeros((hidden,), dtype)}


def linear(p: dict, x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def layer_norm(p: dict, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis; statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return y.astype(x.dtype) * p["scale"] + p["bias"]


def init_attention(key, hidden: int, std: float, proj_std: float, dtype) -> dict:
    k_qkv, k_proj = jax.random.split(key)
    return {"qkv": init_linear(k_qkv, hidden, 3 * hidden, std, dtype),  # fused q, k, v
            "proj": init_linear(k_proj, hidden, hidden, proj_std, dtype)}


def causal_self_attention(p: dict, x: jax.Array, num_heads: int) -> jax.Array:
    """Multi-head causal self-attention with a fused qkv projection.

    The fused projection's 3C outputs are laid out head-major, (nh, 3, hs), as in
    Megatron-LM: a split of those outputs into contiguous blocks then gives each block
    whole heads with their q, k and v, so tensor parallelism splits heads without moving
    data.
    """
    B, T, C = x.shape
    hs = C // num_heads
    qkv = linear(p["qkv"], x).reshape(B, T, num_heads, 3, hs)       # (B, T, nh, 3, hs)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]     # 3 x (B, T, nh, hs)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))                 # (T, T)
    att = jnp.where(causal, att.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    att = jax.nn.softmax(att, axis=-1).astype(x.dtype)              # (B, nh, T, T)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v)                       # (B, T, nh, hs)
    y = y.reshape(B, T, C)                                          # (B, T, C)
    return linear(p["proj"], y)                                     # (B, T, C)


def mlp(p: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(linear(p["fc"], x), approximate=True)           # (B, T, 4C)
    return linear(p["proj"], h)                                     # (B, T, C)


def lm_loss(wte: jax.Array, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Next-token cross-entropy with logits from the tied token embedding, in float32."""
    logits = x @ wte.T                                              # (B, T, V)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets)                        # (B, T)
    return losses.mean()


# -----------------------------------------------------------------------------
# the model

def init_params(cfg: Config, key: jax.Array) -> dict:
    """{'wte', 'wpe', 'blocks': [{'ln_1', 'attn': {'qkv', 'proj'}, 'ln_2',
    'mlp': {'fc', 'proj'}}, ...], 'ln_f'}."""
    dtype = jnp.dtype(cfg.dtype)
    H, std = cfg.hidden, cfg.init_std
    proj_std = std / (2 * cfg.num_layers) ** 0.5  # GPT-2: scale residual projections by 1/sqrt(2L)
    k_wte, k_wpe, *k_blocks = jax.random.split(key, 2 + cfg.num_layers)
    blocks = []
    for k in k_blocks:
        k_attn, k_fc, k_proj = jax.random.split(k, 3)
        blocks.append({
            "ln_1": init_layer_norm(H, dtype),
            "attn": init_attention(k_attn, H, std, proj_std, dtype),
            "ln_2": init_layer_norm(H, dtype),
            "mlp": {"fc": init_linear(k_fc, H, 4 * H, std, dtype),
                    "proj": init_linear(k_proj, 4 * H, H, proj_std, dtype)},
        })
    return {
        "wte": (std * jax.random.normal(k_wte, (cfg.vocab_size, H), jnp.float32)).astype(dtype),
        "wpe": (std * jax.random.normal(k_wpe, (cfg.seq_len, H), jnp.float32)).astype(dtype),
        "blocks": blocks,  # a list keeps layer order in the flattened pytree
        "ln_f": init_layer_norm(H, dtype),
    }


def abstract_params(cfg: Config) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s; nothing is allocated."""
    return common.abstract_params(init_params, cfg)


def make_batch(cfg: Config, batch_size: int, key: jax.Array) -> dict:
    """Random token sequences: {'tokens': int32 (B, T), 'targets': the same shifted by one}."""
    seq = jax.random.randint(key, (batch_size, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def abstract_batch(cfg: Config, batch_size: int) -> dict:
    shape = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    return {"tokens": shape, "targets": shape}


def forward(params: dict, tokens: jax.Array, cfg: Config) -> jax.Array:
    """Final hidden states (B, T, C) for token ids (B, T)."""
    B, T = tokens.shape
    x = params["wte"][tokens] + params["wpe"][:T]                   # (B, T, C)
    for block in params["blocks"]:
        x = x + causal_self_attention(block["attn"], layer_norm(block["ln_1"], x), cfg.num_heads)
        x = x + mlp(block["mlp"], layer_norm(block["ln_2"], x))     # (B, T, C)
    return layer_norm(params["ln_f"], x)                            # (B, T, C)


def loss_fn(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar)."""
    x = forward(params, batch["tokens"], cfg)
    return lm_loss(params["wte"], x, batch["targets"])


def make_train_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss): one optax update."""
    return common.make_train_step(loss_fn, cfg, tx)


def abstract_args(cfg: Config, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without allocating."""
    return common.abstract_args(init_params, abstract_batch, cfg, batch_size, tx)
