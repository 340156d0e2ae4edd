"""Mixture-of-experts transformer (GShard-style top-2 gating) trained with AdamW.

A GPT-style pre-LN decoder (attention, layer norm and the tied-embedding loss come from
gpt.py) whose every other MLP is a mixture of experts, as in GShard and the Alpa paper's MoE
benchmark: layers 0, 2, 4, ... are MoE, layers 1, 3, 5, ... dense. Tokens are split into
groups of `expert_group_size`; each group routes its tokens to their top-2 experts with a
fixed capacity per expert, and the dispatch and combine steps are dense einsums over one-hot
tensors, so every expert weight carries an explicit expert axis E (`wi`: (E, M, F),
`wo`: (E, F, M)) for the planner to shard. A load-balancing auxiliary loss keeps the
routing even.

Sizes 380M ... 70B are the Alpa paper's MoE models (Zheng et al., OSDI 2022, Table 4; alpa
`benchmark/alpa/suite_manual_moe.py`, `moe_specs`): seq 1024, vocab 32000, 16 heads, expert
MLPs 8x wide, expert group size 2048. The size in each name is the parameter count of
Alpa's `compute_moe_parameter_count` (all experts counted).

Differences from Alpa's model: a causal decoder with pre-LN (Alpa's is BERT-style post-LN);
the load-balancing loss, which Alpa's `top2_gating` leaves as a TODO, is GShard's.

    alpa-lite plan moe-690m --cluster 8xA100 --batch-size 16 # a size planned by name
    python examples/moe.py                                   # tiny, 5 steps on 8 CPU devices
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from alpa_lite.tools.models import (
    common,
    gpt,  # shared transformer pieces: attention, layer norm, loss
)

# The model's public names: what examples/moe.py re-exports with `import *`.
__all__ = [
    "Config", "CONFIGS", "top2_gating", "moe_mlp", "init_params", "abstract_params",
    "make_batch", "abstract_batch", "loss_fn", "make_train_step", "abstract_args",
]


@dataclass(frozen=True)
class Config:
    vocab_size: int = 32000
    seq_len: int = 1024
    hidden: int = 768           # model width M
    num_layers: int = 8         # even layers are MoE, odd layers dense
    num_heads: int = 16
    num_experts: int = 8        # E, experts per MoE layer
    expert_group_size: int = 2048  # S, tokens routed together (GShard's "group")
    mlp_factor: int = 8         # F = mlp_factor * M, for dense MLPs and experts alike (Alpa)
    capacity_factor: float = 1.0   # expert capacity = capacity_factor * 2 * S / E slots (top-2)
    aux_loss_weight: float = 0.01  # weight of the load-balancing loss (GShard uses 0.01)
    dtype: str = "float32"      # parameter and activation dtype; gating and losses are float32
    batch_size: int = 1024      # global batch, sequences (Alpa's MoE benchmark uses 1024)
                                # (Alpa splits it into micro-batches; plan a smaller
                                # --batch-size where the planner has none)
    init_std: float = 0.02

    @property
    def capacity(self) -> int:
        """Slots per expert per group: each token takes up to 2 slots, spread over E experts."""
        slots = self.capacity_factor * 2 * self.expert_group_size / self.num_experts
        return max(1, math.ceil(slots))

    def is_moe_layer(self, i: int) -> bool:
        return i % 2 == 0

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by num_heads "
                             f"({self.num_heads})")


def _moe(hidden: int, num_layers: int, num_experts: int) -> Config:
    return Config(hidden=hidden, num_layers=num_layers, num_experts=num_experts, dtype="bfloat16")


CONFIGS: dict[str, Config] = {
    # For tests and laptops: 16 x 16 tokens = 8 groups of 32; E = 8 experts of capacity 8.
    "tiny": Config(vocab_size=256, seq_len=16, hidden=64, num_layers=2, num_heads=8,
                   num_experts=8, expert_group_size=32, dtype="float32", batch_size=16),
    #                 hidden  layers  experts     (Alpa paper Table 4; 16 heads)
    "380M": _moe(768, 8, 8),
    "690M": _moe(768, 8, 16),
    "1.3B": _moe(768, 16, 16),
    "2.4B": _moe(1024, 16, 16),
    "10B": _moe(1536, 16, 32),
    "27B": _moe(2048, 16, 48),
    "70B": _moe(2048, 32, 64),
}


# -----------------------------------------------------------------------------
# the mixture-of-experts layer

def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 routing with a fixed capacity per expert.

    Every token goes to its best expert and, if there is room, its second best; a token
    whose expert is full is dropped there (its residual connection still carries it).

    Args:
      gates: (G, S, E) router probabilities, float32.
      capacity: C, slots per expert per group.

    Returns:
      combine: (G, S, E, C) weight of token s in slot c of expert e (0 where not routed).
      dispatch: (G, S, E, C) the same as a 0/1 mask.
      aux_loss: GShard's load-balancing loss, E^2 * mean(fraction of tokens whose top-1
        is e * mean gate of e); 1.0 when routing is uniform.
    """
    G, S, E = gates.shape
    index_1 = jnp.argmax(gates, axis=-1)                            # (G, S)
    mask_1 = jax.nn.one_hot(index_1, E, dtype=gates.dtype)          # (G, S, E)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)                       # (G, S)
    gates_without_1 = gates * (1.0 - mask_1)
    index_2 = jnp.argmax(gates_without_1, axis=-1)                  # (G, S)
    mask_2 = jax.nn.one_hot(index_2, E, dtype=gates.dtype)          # (G, S, E)
    gate_2 = jnp.sum(gates_without_1 * mask_2, axis=-1)             # (G, S)

    density = jnp.mean(mask_1, axis=1)                              # (G, E) top-1 share per expert
    density_proxy = jnp.mean(gates, axis=1)                         # (G, E) differentiable proxy
    aux_loss = jnp.mean(density * density_proxy) * E * E

    # Slot of each token in its expert's buffer: top-1 choices first, then top-2 choices.
    pos_1 = jnp.cumsum(mask_1, axis=1) - mask_1                     # (G, S, E)
    mask_1 = mask_1 * (pos_1 < capacity)
    pos_1 = jnp.sum(pos_1 * mask_1, axis=-1)                        # (G, S)
    count_1 = jnp.sum(mask_1, axis=1, keepdims=True)                # (G, 1, E)
    pos_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + count_1           # (G, S, E)
    mask_2 = mask_2 * (pos_2 < capacity)
    pos_2 = jnp.sum(pos_2 * mask_2, axis=-1)                        # (G, S)

    # Renormalise the two kept gates to sum to one.
    gate_1 = gate_1 * jnp.sum(mask_1, axis=-1)
    gate_2 = gate_2 * jnp.sum(mask_2, axis=-1)
    denom = gate_1 + gate_2
    denom = jnp.where(denom > 0, denom, 1.0)
    gate_1, gate_2 = gate_1 / denom, gate_2 / denom

    slot_1 = jax.nn.one_hot(pos_1.astype(jnp.int32), capacity, dtype=gates.dtype)  # (G, S, C)
    slot_2 = jax.nn.one_hot(pos_2.astype(jnp.int32), capacity, dtype=gates.dtype)
    combine = (jnp.einsum("gse,gsc->gsec", gate_1[..., None] * mask_1, slot_1)
               + jnp.einsum("gse,gsc->gsec", gate_2[..., None] * mask_2, slot_2))  # (G, S, E, C)
    dispatch = (combine > 0).astype(gates.dtype)                    # (G, S, E, C)
    return combine, dispatch, aux_loss


def moe_mlp(p: dict, x: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Position-wise mixture of experts: returns (output like x, load-balancing loss)."""
    B, T, M = x.shape
    S = cfg.expert_group_size
    if (B * T) % S:
        raise ValueError(f"batch x seq_len = {B} x {T} = {B * T} tokens must be a multiple of "
                         f"expert_group_size ({S}); change the batch size or the group size")
    xs = x.reshape(B * T // S, S, M)                                # (G, S, M)
    logits = jnp.einsum("gsm,me->gse", xs, p["gate"])               # (G, S, E)
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    combine, dispatch, aux_loss = top2_gating(gates, cfg.capacity)  # 2 x (G, S, E, C)
    expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), xs)  # (E, G, C, M)
    h = jax.nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, p["wi"]))       # (E, G, C, F)
    expert_out = jnp.einsum("egcf,efm->egcm", h, p["wo"])                   # (E, G, C, M)
    y = jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), expert_out)   # (G, S, M)
    return y.reshape(B, T, M), aux_loss


# -----------------------------------------------------------------------------
# the model

def init_params(cfg: Config, key: jax.Array) -> dict:
    """{'wte', 'wpe', 'blocks': [{'ln_1', 'attn', 'ln_2', 'moe': {'gate', 'wi', 'wo'}} |
    {'ln_1', 'attn', 'ln_2', 'mlp': {'fc', 'proj'}}, ...], 'ln_f'}."""
    dtype = jnp.dtype(cfg.dtype)
    M, F, E, std = cfg.hidden, cfg.mlp_factor * cfg.hidden, cfg.num_experts, cfg.init_std
    proj_std = std / (2 * cfg.num_layers) ** 0.5

    def normal(k, shape, scale):
        return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    k_wte, k_wpe, *k_blocks = jax.random.split(key, 2 + cfg.num_layers)
    blocks = []
    for i, k in enumerate(k_blocks):
        k_attn, k_1, k_2, k_3 = jax.random.split(k, 4)
        block = {"ln_1": gpt.init_layer_norm(M, dtype),
                 "attn": gpt.init_attention(k_attn, M, std, proj_std, dtype),
                 "ln_2": gpt.init_layer_norm(M, dtype)}
        if cfg.is_moe_layer(i):
            block["moe"] = {"gate": normal(k_1, (M, E), std),       # router
                            "wi": normal(k_2, (E, M, F), std),      # experts, in
                            "wo": normal(k_3, (E, F, M), proj_std)}  # experts, out
        else:
            block["mlp"] = {"fc": gpt.init_linear(k_1, M, F, std, dtype),
                            "proj": gpt.init_linear(k_2, F, M, proj_std, dtype)}
        blocks.append(block)
    return {"wte": normal(k_wte, (cfg.vocab_size, M), std),
            "wpe": normal(k_wpe, (cfg.seq_len, M), std),
            "blocks": blocks,
            "ln_f": gpt.init_layer_norm(M, dtype)}


def abstract_params(cfg: Config) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s; nothing is allocated."""
    return common.abstract_params(init_params, cfg)


def make_batch(cfg: Config, batch_size: int, key: jax.Array) -> dict:
    """Random token sequences, as GPT's (`gpt.make_batch`: it reads seq_len, vocab_size)."""
    return gpt.make_batch(cfg, batch_size, key)


def abstract_batch(cfg: Config, batch_size: int) -> dict:
    return gpt.abstract_batch(cfg, batch_size)


def loss_fn(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Next-token cross-entropy + aux_loss_weight x the MoE layers' load-balancing losses."""
    tokens = batch["tokens"]
    B, T = tokens.shape
    x = params["wte"][tokens] + params["wpe"][:T]                   # (B, T, M)
    aux_loss = jnp.zeros((), jnp.float32)
    for block in params["blocks"]:
        x = x + gpt.causal_self_attention(block["attn"], gpt.layer_norm(block["ln_1"], x),
                                          cfg.num_heads)
        h = gpt.layer_norm(block["ln_2"], x)
        if "moe" in block:
            y, layer_aux = moe_mlp(block["moe"], h, cfg)
            aux_loss = aux_loss + layer_aux
        else:
            y = gpt.mlp(block["mlp"], h)
        x = x + y                                                   # (B, T, M)
    x = gpt.layer_norm(params["ln_f"], x)
    return gpt.lm_loss(params["wte"], x, batch["targets"]) + cfg.aux_loss_weight * aux_loss


def make_train_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss): one optax update."""
    return common.make_train_step(loss_fn, cfg, tx)


def abstract_args(cfg: Config, batch_size: int,
                  tx: optax.GradientTransformation) -> tuple[Any, Any, Any]:
    """(params, opt_state, batch) as `jax.ShapeDtypeStruct`s, for planning without allocating."""
    return common.abstract_args(init_params, abstract_batch, cfg, batch_size, tx)
