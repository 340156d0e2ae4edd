"""Models written as their own libraries' docs write them, with a train step each, for
tests/test_library_models.py and bench/real_models.py. Every builder returns a `Case`:
the step (as the docs write it, the gradient call being `al.value_and_grad`) and its
arguments. Builders import their library lazily, so a missing library skips only its own
tests (`pytest.importorskip` in the test file).

Sizes are tiny: the file runs many plans, each compiled once. `hf_full_size` is the
exception: GPT-2 small and BERT-base at their published sizes, as shapes only, for
planning (bench/real_models.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

import alpa_lite as al


@dataclasses.dataclass(frozen=True)
class Case:
    step: Callable            # (params, opt_state, batch) -> (params, opt_state, loss)
    args: tuple               # (params, opt_state, batch); flax_bn_cnn: params is
                              # (params, batch_stats), returned first as new; eqx_mlp:
                              # the whole Equinox model
    # How the library's docs compile the step: the reference the plans are compared with.
    reference_jit: Callable = jax.jit


def array_leaves(tree) -> list:
    """A result's array leaves (an Equinox model's functions left out), to compare."""
    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def other_leaves(tree) -> list:
    """A result's non-array leaves (an Equinox model's functions), which must come back
    as they went in."""
    return [x for x in jax.tree.leaves(tree) if not hasattr(x, "shape")]


# SGD for the exact comparisons: Adam divides by the gradient's magnitude, turning
# round-off in near-zero gradients (summation order differs between plans) into visible
# differences. (f) uses the AdamW chain on purpose.
SGD = optax.sgd(0.1)


# ---- (c) flax.nnx: split outside, merge inside the loss ---------------------------------

def nnx_mlp(batch_size: int = 16) -> Case:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
            self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
            self.norm = nnx.LayerNorm(dhidden, rngs=rngs)
            self.linear2 = nnx.Linear(dhidden, dhidden, rngs=rngs)
            self.linear3 = nnx.Linear(dhidden, dout, rngs=rngs)

        def __call__(self, x):
            x = nnx.gelu(self.norm(self.linear1(x)))
            x = nnx.relu(self.linear2(x))
            return self.linear3(x)

    model = MLP(16, 256, 8, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss_fn(state, x, y):
        model = nnx.merge(graphdef, state)
        return jnp.mean((model(x) - y) ** 2)

    def train_step(state, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state, batch["x"], batch["y"])
        updates, opt_state = SGD.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    k = jax.random.split(jax.random.key(1), 2)
    batch = {"x": jax.random.normal(k[0], (batch_size, 16)),
             "y": jax.random.normal(k[1], (batch_size, 8))}
    return Case(train_step, (state, SGD.init(state), batch))


# ---- (d) Equinox: partition into arrays and the static rest; models written per example -

def eqx_mlp(batch_size: int = 16) -> Case:
    """As Equinox's docs write a train step: the whole model goes in and out (its
    activation functions are non-array leaves, held static as `eqx.filter_jit` holds
    them), the arrays partitioned out to be differentiated, and the loss reads the batch
    from the step."""
    import equinox as eqx

    model = eqx.nn.MLP(in_size=16, out_size=8, width_size=256, depth=2,
                       activation=jax.nn.tanh, key=jax.random.key(0))

    def loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return jnp.mean((y - pred_y) ** 2)

    def train_step(model, opt_state, batch):
        # The docs' `eqx.filter_value_and_grad(loss)(model, x, y)`, with al.value_and_grad.
        params, static = eqx.partition(model, eqx.is_array)
        value, grads = al.value_and_grad(
            lambda p: loss(eqx.combine(p, static), batch["x"], batch["y"]))(params)
        updates, opt_state = SGD.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    k = jax.random.split(jax.random.key(1), 2)
    batch = {"x": jax.random.normal(k[0], (batch_size, 16)),
             "y": jax.random.normal(k[1], (batch_size, 8))}
    opt_state = SGD.init(eqx.filter(model, eqx.is_array))
    return Case(train_step, (model, opt_state, batch), reference_jit=eqx.filter_jit)


def eqx_transformer(batch_size: int = 8) -> Case:
    """A small Equinox transformer written per example, as Equinox's docs write models:
    `eqx.nn.LayerNorm` and `eqx.nn.MLP` act on one position (vmapped over the sequence),
    `eqx.nn.MultiheadAttention` on one sequence, and the loss vmaps the model over the
    batch. (eqx.nn.LayerNorm's variance, `jnp.var`, holds a literal NaN for an empty
    sample: a constant that the micro-batching guard must not take for a batch size.)"""
    import equinox as eqx

    dim, heads, vocab, seq = 32, 4, 256, 16

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        norm1: eqx.nn.LayerNorm
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
            self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, depth=1, activation=jax.nn.gelu,
                                  key=k2)

        def __call__(self, x):
            y = jax.vmap(self.norm1)(x)
            x = x + self.attention(y, y, y)
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class Model(eqx.Module):
        embedding: eqx.nn.Embedding
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            self.embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:3]]
            self.head = eqx.nn.Linear(dim, vocab, key=keys[3])

        def __call__(self, ids):
            x = jax.vmap(self.embedding)(ids)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(x)

    params, static = eqx.partition(Model(jax.random.key(0)), eqx.is_array)

    def loss(params, ids, labels):
        model = eqx.combine(params, static)
        logits = jax.vmap(model)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def train_step(params, opt_state, batch):
        value, grads = al.value_and_grad(loss)(params, batch["ids"], batch["labels"])
        updates, opt_state = SGD.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, value

    k = jax.random.split(jax.random.key(1), 2)
    batch = {"ids": jax.random.randint(k[0], (batch_size, seq), 0, vocab),
             "labels": jax.random.randint(k[1], (batch_size, seq), 0, vocab)}
    return Case(train_step, (params, SGD.init(params), batch))


# ---- (e) Hugging Face transformers Flax GPT-2, BERT, Llama, ViT and ResNet, from a config -

# A vocabulary of 2048: the token embedding, tied to the output layer, is then the largest
# weight, as in the real models.
VOCAB, SEQ = 2048, 16


def token_batch(batch_size: int):
    k = jax.random.split(jax.random.key(1), 2)
    return {"input_ids": jax.random.randint(k[0], (batch_size, SEQ), 0, VOCAB),
            "labels": jax.random.randint(k[1], (batch_size, SEQ), 0, VOCAB)}


def _hf_train_step(model, tx, inputs: str = "input_ids"):
    """The train step of a Hugging Face Flax model with a classifier or LM head:
    cross-entropy of its logits on `batch["labels"]`, the model fed `batch[inputs]`
    (token ids, or an image classifier's "pixel_values"), in inference mode (no dropout;
    BatchNorm's running statistics). As Hugging Face's Flax examples write it, the loss
    function takes the parameters and reads the batch from the step."""

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = model(batch[inputs], params=params, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()

        loss, grads = al.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def hf_model(cls, config):
    """The model and its random weights, no download: `_do_init=False` and the weights from
    `init_weights` under jit (the seed-0 key `_do_init=True` would use; op by op, as
    `_do_init=True` runs it, initialising takes seconds)."""
    model = cls(config, _do_init=False)
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0),
                                                          model.input_shape)
    return model, params


def hf_gpt2(batch_size: int = 8) -> Case:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32)
    model, params = hf_model(FlaxGPT2LMHeadModel, config)
    return Case(_hf_train_step(model, SGD),
                (params, SGD.init(params), token_batch(batch_size)))


def hf_bert(batch_size: int = 8) -> Case:
    from transformers import BertConfig, FlaxBertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=32)
    model, params = hf_model(FlaxBertForMaskedLM, config)
    return Case(_hf_train_step(model, SGD),
                (params, SGD.init(params), token_batch(batch_size)))


def hf_full_size(kind: str, batch_size: int, seq: int, tx=None) -> Case:
    """GPT-2 small (124M; kind "gpt2") or BERT-base (110M, masked LM; kind "bert") at their
    published sizes, as shapes only, to plan for a cluster without allocating anything:
    the model is built with `_do_init=False` (Hugging Face's way to skip the random
    weights), the parameters are `jax.eval_shape` of `model.init_weights(key, input_shape)`
    and every argument is a `jax.ShapeDtypeStruct`. `tx` defaults to AdamW."""
    from transformers import (BertConfig, FlaxBertForMaskedLM, FlaxGPT2LMHeadModel,
                              GPT2Config)

    if kind == "gpt2":
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                            n_positions=1024)
        model = FlaxGPT2LMHeadModel(config, _do_init=False)
    elif kind == "bert":
        config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                            num_attention_heads=12, intermediate_size=3072,
                            max_position_embeddings=512)
        model = FlaxBertForMaskedLM(config, _do_init=False)
    else:
        raise ValueError(f"hf_full_size: kind must be 'gpt2' or 'bert', got {kind!r}")
    tx = optax.adamw(1e-4) if tx is None else tx
    params = jax.eval_shape(lambda: model.init_weights(jax.random.key(0), (1, seq)))
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch_size, seq), jnp.int32)
    batch = {"input_ids": tokens, "labels": tokens}
    return Case(_hf_train_step(model, tx), (params, opt_state, batch))


def hf_llama(batch_size: int = 8) -> Case:
    """A tiny Hugging Face Flax Llama: rotary positions, RMSNorm, SwiGLU, grouped-query
    attention (4 query heads sharing 2 key/value heads)."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)
    model, params = hf_model(FlaxLlamaForCausalLM, config)
    return Case(_hf_train_step(model, SGD),
                (params, SGD.init(params), token_batch(batch_size)))


def hf_vit(batch_size: int = 8) -> Case:
    """A tiny Hugging Face Flax ViT classifier: patch embedding (a strided convolution),
    a class token, pre-norm encoder blocks."""
    from transformers import FlaxViTForImageClassification, ViTConfig

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       num_labels=10)
    model, params = hf_model(FlaxViTForImageClassification, config)
    return Case(_hf_train_step(model, SGD, "pixel_values"),
                (params, SGD.init(params), image_batch(batch_size, key=1)))


def hf_resnet(batch_size: int = 8) -> Case:
    """A Hugging Face Flax ResNet (BatchNorm in inference mode: `train=False`, its running
    statistics among the parameters). At initialisation (BatchNorm's bias 0) ReLU meets
    inputs of exactly 0, where `jax.nn.relu`'s own derivative rule (0) and the max(x, 0)
    it computes with (0.5) differ: a pipeline must keep the rule."""
    from transformers import FlaxResNetForImageClassification, ResNetConfig

    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                          depths=[1, 1], num_labels=10)
    model, params = hf_model(FlaxResNetForImageClassification, config)
    # Inputs for which some ReLU input is exactly 0 (so are most: 3 of the keys 0-3).
    return Case(_hf_train_step(model, SGD, "pixel_values"),
                (params, SGD.init(params), image_batch(batch_size, key=3)))


def image_batch(batch_size: int, key: int):
    """Images (NCHW, as Hugging Face's Flax vision models take them) and class labels."""
    k = jax.random.split(jax.random.key(key), 2)
    return {"pixel_values": jax.random.normal(k[0], (batch_size, 3, 16, 16)),
            "labels": jax.random.randint(k[1], (batch_size,), 0, 10)}


# ---- (f) an optax chain with a schedule and a decay mask; bf16 mixed precision ----------

def _decay_mask_fn(params):
    # As the Hugging Face Flax examples write it (run_mlm_flax.py): no weight decay on
    # biases and LayerNorm scales.
    from flax import traverse_util
    flat = traverse_util.flatten_dict(params)
    mask = {path: (path[-1] != "bias" and path[-2:] != ("LayerNorm_0", "scale"))
            for path in flat}
    return traverse_util.unflatten_dict(mask)


def optax_chain(compute_dtype=None, batch_size: int = 16) -> Case:
    """`compute_dtype` None: all fp32; else fp32 master weights, compute in that dtype."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.LayerNorm()(nn.Dense(256)(x)))
            x = nn.relu(nn.Dense(256)(x))
            return nn.Dense(8)(x)

    model = MLP()
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=1e-3, peak_value=1e-2, warmup_steps=2, decay_steps=10, end_value=1e-4)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=0.01, mask=_decay_mask_fn))

    def loss_fn(params, x, y):
        if compute_dtype is not None:
            # fp32 master weights, bf16 (or fp16) compute, the loss in fp32.
            params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
            x = x.astype(compute_dtype)
        pred = model.apply({"params": params}, x).astype(jnp.float32)
        return jnp.mean((pred - y) ** 2)

    def train_step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    k = jax.random.split(jax.random.key(1), 3)
    batch = {"x": jax.random.normal(k[0], (batch_size, 16)),
             "y": jax.random.normal(k[1], (batch_size, 8))}
    params = model.init(k[2], batch["x"])["params"]
    return Case(train_step, (params, tx.init(params), batch))


# ---- (g) Flax linen: a decoder-only transformer, its blocks under nn.scan(nn.remat(...)) -

# As the Flax guides write a deep stack ("Scan over layers", flax.linen.scan): one Block,
# rematerialised, scanned LAYERS times with its parameters stacked on a leading axis and a
# fresh params / dropout key per layer; the causal mask is broadcast to every layer. The
# loss runs with dropout on, its key taken from the batch.
TF_VOCAB, TF_SEQ, TF_DIM, TF_HEADS, TF_LAYERS, TF_DROPOUT = 256, 16, 32, 4, 2, 0.1


def flax_scan_transformer(batch_size: int = 8, layers: int = TF_LAYERS) -> Case:
    import flax.linen as nn

    class Block(nn.Module):
        num_heads: int
        dropout_rate: float
        deterministic: bool

        @nn.compact
        def __call__(self, x, mask):
            # nn.MultiHeadDotProductAttention called on one input is self-attention (the
            # replacement Flax names for the deprecated nn.SelfAttention).
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, mask=mask)
            x = x + nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(y)
            y = nn.LayerNorm()(x)
            y = nn.gelu(nn.Dense(4 * x.shape[-1])(y))
            y = nn.Dense(x.shape[-1])(y)
            x = x + nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(y)
            return x, None            # (carry, per-layer output) as nn.scan expects

    class Transformer(nn.Module):
        vocab: int = TF_VOCAB
        dim: int = TF_DIM
        num_heads: int = TF_HEADS
        num_layers: int = layers
        dropout_rate: float = TF_DROPOUT

        @nn.compact
        def __call__(self, ids, train: bool):
            x = nn.Embed(self.vocab, self.dim)(ids)
            x = x + self.param("pos_embedding", nn.initializers.normal(0.02),
                               (ids.shape[-1], self.dim))
            x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
            mask = nn.make_causal_mask(ids)
            Blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                             split_rngs={"params": True, "dropout": True},
                             length=self.num_layers, in_axes=nn.broadcast)
            x, _ = Blocks(self.num_heads, self.dropout_rate, not train, name="blocks")(x, mask)
            x = nn.LayerNorm()(x)
            return nn.Dense(self.vocab)(x)

    model = Transformer()

    def loss_fn(params, ids, key):
        logits = model.apply({"params": params}, ids, train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], ids[:, 1:]).mean()

    def train_step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch["ids"], batch["key"])
        updates, opt_state = SGD.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ids = jax.random.randint(jax.random.key(1), (batch_size, TF_SEQ), 0, TF_VOCAB)
    # Jitted: run op by op, initialising the scanned, rematerialised blocks takes seconds.
    params = jax.jit(model.init, static_argnames="train")(jax.random.key(0), ids,
                                                          train=False)["params"]
    batch = {"ids": ids, "key": jax.random.key(2)}
    return Case(train_step, (params, SGD.init(params), batch))


# ---- (h) Flax linen: a CNN with BatchNorm, its statistics through has_aux ---------------

def flax_bn_cnn(batch_size: int = 16) -> Case:
    """As Flax's BatchNorm guide writes it: `mutable=["batch_stats"]` in training, the new
    statistics returned beside the loss (`has_aux=True`) and carried with the parameters.
    Here the first argument is `(params, batch_stats)` and the step returns its new value
    first: `((params, batch_stats), opt_state, loss)`."""
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            x = nn.relu(nn.Dense(32)(x))
            return nn.Dense(4)(x)

    model = CNN()

    def loss_fn(params, batch_stats, x, y):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                      train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    def train_step(state, opt_state, batch):
        params, batch_stats = state
        (loss, batch_stats), grads = al.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, batch["x"], batch["y"])
        updates, opt_state = SGD.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), batch_stats), opt_state, loss

    k = jax.random.split(jax.random.key(1), 3)
    batch = {"x": jax.random.normal(k[0], (batch_size, 8, 8, 3)),
             "y": jax.random.randint(k[1], (batch_size,), 0, 4)}
    variables = jax.jit(model.init, static_argnames="train")(k[2], batch["x"], train=False)
    state = (variables["params"], variables["batch_stats"])
    return Case(train_step, (state, SGD.init(state[0]), batch))


BUILDERS: dict[str, tuple[str, Callable[[], Case]]] = {
    # name: (the library pytest.importorskip needs, builder)
    "nnx_mlp": ("flax.nnx", nnx_mlp),
    "eqx_mlp": ("equinox", eqx_mlp),
    "hf_gpt2": ("transformers", hf_gpt2),
    "hf_bert": ("transformers", hf_bert),
    "hf_resnet": ("transformers", hf_resnet),
    "hf_llama": ("transformers", hf_llama),
    "hf_vit": ("transformers", hf_vit),
    "eqx_transformer": ("equinox", eqx_transformer),
    "optax_chain": ("flax.linen", optax_chain),
    "optax_chain_bf16": ("flax.linen", lambda: optax_chain(jnp.bfloat16)),
    "flax_scan_transformer": ("flax.linen", flax_scan_transformer),
    "flax_bn_cnn": ("flax.linen", flax_bn_cnn),
}
