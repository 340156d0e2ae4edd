"""Textbook plans on every device: the cases of Alpa's shard-parallel tests
(alpa-projects/alpa tests/shard_parallel/test_mlp.py, test_bert.py, test_moe.py,
test_conv.py) planned on a 4-device mesh (logical 4x1, 1x4 and 2x2) for two device kinds.

- A GPU preset (4 H100s on NVLink), planning only, at sizes where the textbook plan is the
  fast one on that hardware: the chosen shardings and `plan.collectives()`.
- The local CPU (4 of the 8 virtual devices), with tiny models: the chosen shardings, the
  plan compiled, its predicted collectives compared with those of the compiled program
  (per kind, in bytes: XLA combines the gradient all-reduces of a step into one), and one
  step's numbers compared with plain `jax.jit`.

On CPU, XLA has no reduce-scatter: the partitioner's reduce-scatter runs as an all-reduce
and a dynamic-slice. A CPU plan therefore predicts, and its program runs, an all-reduce
where a GPU plan runs a reduce-scatter (ZeRO's gradient sync); the test checks each
platform against what its compiled program runs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import step_of  # tests/_reference.py

import alpa_lite as al
from alpa_lite.ir.op_rules import dim_labels
from alpa_lite.plan import SyncCollective
from alpa_lite.runtime.executable import compile_plan

CPU4 = dataclasses.replace(al.Cluster.local(), name="local-cpu-1x4", devices_per_node=4)
GPU4 = dataclasses.replace(al.Cluster.preset("8xH100"), name="4xH100", devices_per_node=4)
MESHES_1D = [(4, 1), (1, 4)]
F32 = 4


def _axis(mesh_shape) -> str:
    """The name of the mesh axis of size 4 (Auto names its axes x, y)."""
    return "x" if mesh_shape[0] == 4 else "y"


def _split(rank: int, dim: int, axis: str) -> str:
    return "[" + ",".join(axis if d == dim else "-" for d in range(rank)) + "]"


def _by_kind(collectives, min_bytes: int = 0) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        if c.nbytes > min_bytes:
            out[c.kind] = out.get(c.kind, 0) + c.nbytes * c.count
    return dict(sorted(out.items()))


def _megatron_comm(plan, act_bytes: int, reductions: int) -> None:
    """The activation traffic of Megatron layers: `reductions` partial sums of activations,
    each an all-reduce, or (Megatron-LM's sequence parallelism, which GPU plans choose) a
    reduce-scatter whose split result a later all-gather joins; no all-to-all."""
    colls = [c for c in plan.collectives() if c.nbytes > F32]
    assert not [c for c in colls if c.kind == "all-to-all"]
    summed = sum(c.count for c in colls if (c.kind, c.nbytes) in {
        ("all-reduce", act_bytes), ("reduce-scatter", act_bytes // 4)})
    assert summed == reductions, colls
    gathers = sum(c.count for c in colls if c.kind == "all-gather")
    scatters = sum(c.count for c in colls if c.kind == "reduce-scatter")
    assert scatters <= gathers <= scatters + 1, colls    # + the batch, loaded split


def _plan(step_fn, args, method, cluster):
    step = al.parallelize(step_fn, method=method)
    return step, step.plan(*args, cluster=cluster)


def _run_on_cpu(step, step_fn, args, plan, atol=1e-5):
    """Compiles `plan` on 4 local devices: its collectives are the plan's, and one step
    computes what plain jax.jit does."""
    exe = compile_plan(plan, step.program(plan, *args), jax.devices()[:4])
    assert _by_kind(exe.collectives(*args)) == _by_kind(plan.collectives())
    got, want = exe(*args), jax.jit(step_fn)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol)
    return exe


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(key, shape, jnp.float32)


def _concrete_or_abstract(make, cluster):
    """Real arrays for the CPU (it runs them), shapes for the GPU preset (plans only)."""
    return make() if cluster is CPU4 else jax.eval_shape(make)


# ---- MLP (test_mlp.py): data parallel, Megatron, 2-D mesh, ZeRO -----------------------------

NUM_LAYERS = 6


def _mlp_loss(params, batch):
    h = batch["x"]
    for i in range(NUM_LAYERS):
        h = h @ params[f"w{i}"]
        if i < NUM_LAYERS - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - batch["y"]) ** 2)


def _mlp_args(batch, hidden, tx, dim=None):
    """NUM_LAYERS square layers of `hidden`; `dim` (default `hidden`) is the input and
    output width."""
    dim = dim or hidden
    keys = jax.random.split(jax.random.PRNGKey(0), NUM_LAYERS + 2)
    shapes = [(dim if i == 0 else hidden, dim if i == NUM_LAYERS - 1 else hidden)
              for i in range(NUM_LAYERS)]
    params = {f"w{i}": _normal(keys[i], s, s[0] ** -0.5) for i, s in enumerate(shapes)}
    batch = {"x": _normal(keys[-2], (batch, dim)), "y": _normal(keys[-1], (batch, dim))}
    return params, tx.init(params), batch


# Data parallel: a wide batch of narrow layers. Model parallel: a few rows of wide layers
# (on the GPU, narrow input and output so the batch is small next to the hidden width).
DP_SIZES = {"cpu": dict(batch=256, hidden=32), "gpu": dict(batch=16384, hidden=1024)}
MP_SIZES = {"cpu": dict(batch=32, hidden=256), "gpu": dict(batch=64, hidden=8192, dim=1024)}
CLUSTERS = {"cpu": CPU4, "gpu": GPU4}


# The intra-op ILP charges every gradient all-reduce (and the loss's) its own latency, but
# XLA combines a step's gradient all-reduces into one (XLA:CPU's all-reduce combiner: one
# tuple all-reduce, checked below; GPUs: AllReduceCombiner up to 30 MiB). Six 4 KiB
# gradients pay 6 x 60 us on the CPU link where one combined all-reduce runs, so the ILP
# prefers a Megatron split of two layers and replicated compute for the rest (CPU), or
# reduce-scatters and gathers (GPU). Amortizing the latency of gradient-forming reductions
# over the step's gradients in `planning.strategies.Units` makes all of these pass.
_GRADS_EACH_PAY_LATENCY = pytest.mark.xfail(strict=True, reason=(
    "strategies.Units prices each gradient all-reduce with its own latency; XLA combines "
    "them into one collective, so data parallelism is overpriced"))


@pytest.mark.parametrize("device", ["gpu", "cpu"])
@pytest.mark.parametrize("mesh_shape", MESHES_1D)
@_GRADS_EACH_PAY_LATENCY
def test_mlp_data_parallel_is_one_gradient_all_reduce(device, mesh_shape):
    cluster, tx = CLUSTERS[device], optax.adam(1e-2)
    args = _concrete_or_abstract(lambda: _mlp_args(**DP_SIZES[device], tx=tx), cluster)
    step_fn = step_of(_mlp_loss, tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=(mesh_shape,)), cluster)
    st, axis = plan.stages[0], _axis(mesh_shape)
    assert str(st.sharding_of("batch/x")) == _split(2, 0, axis)
    for i in range(NUM_LAYERS):
        assert str(st.sharding_of(f"params/w{i}")) == "R"
    # The only traffic: each weight's gradient all-reduced once (and the scalar loss).
    weight_bytes = sum(int(np.prod(w.shape)) * F32 for w in jax.tree.leaves(args[0]))
    assert _by_kind(plan.collectives()) == {"all-reduce": weight_bytes + F32}
    assert all(g.collective is SyncCollective.ALL_REDUCE and g.axes == (axis,)
               for g in plan.gradient_sync)
    if device == "cpu":
        exe = _run_on_cpu(step, step_fn, args, plan)
        # XLA combines them: one all-reduce in the program.
        assert [(c.kind, c.count) for c in exe.collectives(*args)] == [("all-reduce", 1)]


@pytest.mark.parametrize("device", ["gpu", "cpu"])
@pytest.mark.parametrize("mesh_shape", MESHES_1D)
def test_mlp_model_parallel_is_megatron(device, mesh_shape):
    cluster, tx = CLUSTERS[device], optax.adam(1e-2)
    sizes = MP_SIZES[device]
    args = _concrete_or_abstract(lambda: _mlp_args(**sizes, tx=tx), cluster)
    step_fn = step_of(_mlp_loss, tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=(mesh_shape,)), cluster)
    st, axis = plan.stages[0], _axis(mesh_shape)
    for i in range(NUM_LAYERS):     # column, row, column, ...
        assert str(st.sharding_of(f"params/w{i}")) == _split(2, 1 - i % 2, axis), i
    # Forward: after each row layer; backward: before each column layer but the first.
    act = sizes["batch"] * sizes["hidden"] * F32
    if device == "gpu":     # the narrow last layer's output is reduced at its own size
        _megatron_comm(plan, act, NUM_LAYERS - 2)
        assert ("all-reduce", sizes["batch"] * sizes["dim"] * F32) in [
            (c.kind, c.nbytes) for c in plan.collectives()]
    else:
        big = [(c.kind, c.nbytes, c.count) for c in plan.collectives() if c.nbytes > F32]
        assert big == [("all-reduce", act, NUM_LAYERS - 1)]
    if device == "cpu":
        _run_on_cpu(step, step_fn, args, plan, atol=1e-3)   # Adam divides by tiny moments


@_GRADS_EACH_PAY_LATENCY
def test_mlp_2d_mesh_on_cpu_is_data_parallel():
    # Alpa's 2-D case (its mesh has a slow and a fast axis): data parallel over one axis,
    # Megatron over the other. On 4 equal CPU devices with this small model, data
    # parallelism over both axes is cheaper, and it is what the plan says and runs.
    tx = optax.adam(1e-2)
    args = _mlp_args(**DP_SIZES["cpu"], tx=tx)
    step_fn = step_of(_mlp_loss, tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=((2, 2),)), CPU4)
    st = plan.stages[0]
    assert str(st.sharding_of("batch/x")) == "[(x,y),-]"
    assert all(str(st.sharding_of(f"params/w{i}")) == "R" for i in range(NUM_LAYERS))
    assert set(_by_kind(plan.collectives())) == {"all-reduce"}
    _run_on_cpu(step, step_fn, args, plan)


# On CPU, strategies.Units offers no split-result variant of a partial sum (no
# reduce-scatter there), so a gradient leaves its matmul replicated and its followers (the
# whole optimizer update, one follower group) stay replicated: the plan gathers the sharded
# Adam moments (two all-gathers per weight) instead of updating the shards and gathering the
# weights, or all-to-alls activations to avoid the separately-priced gradient all-reduces.
# Offering on CPU the variant "all-reduce, then a free slice" (what XLA:CPU runs for the
# partitioner's reduce-scatter) plus the latency amortization above makes it pass.
_NO_SPLIT_RESULT_ON_CPU = pytest.mark.xfail(strict=True, reason=(
    "strategies.Units offers no split-result (all-reduce + slice) variant on CPU, so the "
    "optimizer update follows the replicated gradient; and gradient all-reduces are each "
    "charged a latency XLA pays once"))


@pytest.mark.parametrize("device", ["gpu", pytest.param("cpu", marks=_NO_SPLIT_RESULT_ON_CPU)])
@pytest.mark.parametrize("method", [al.DataParallel(shard_optimizer_state=True),
                                    al.Manual(dp=4, shard_optimizer_state=True)],
                         ids=["DataParallel", "Manual"])
def test_zero_is_reduce_scatter_and_all_gather(device, method):
    cluster, tx = CLUSTERS[device], optax.adam(1e-2)
    args = _concrete_or_abstract(lambda: _mlp_args(**DP_SIZES[device], tx=tx), cluster)
    step_fn = step_of(_mlp_loss, tx)
    step, plan = _plan(step_fn, args, method, cluster)
    st = plan.stages[0]
    hidden = DP_SIZES[device]["hidden"]
    weight_bytes = hidden * hidden * F32
    for i in range(NUM_LAYERS):
        assert str(st.sharding_of(f"params/w{i}")) == "R"
        assert str(st.sharding_of(f"opt_state/0/mu/w{i}")) == "[dp,-]"
        assert str(st.sharding_of(f"opt_state/0/nu/w{i}")) == "[dp,-]"
    got = _by_kind(plan.collectives(), min_bytes=F32)
    # Each gradient reduced into its shard, the updated shards gathered into the weights.
    # A GPU reduce-scatters; XLA:CPU all-reduces and slices (module docstring).
    sync = "all-reduce" if device == "cpu" else "reduce-scatter"
    sync_bytes = weight_bytes if device == "cpu" else weight_bytes // 4
    assert got == {sync: NUM_LAYERS * sync_bytes, "all-gather": NUM_LAYERS * weight_bytes}
    want = SyncCollective.ALL_REDUCE if device == "cpu" else SyncCollective.REDUCE_SCATTER
    assert all(g.collective is want for g in plan.gradient_sync)
    if device == "cpu":
        _run_on_cpu(step, step_fn, args, plan)


# ---- Transformer layers (test_bert.py): Megatron attention and MLP ----------------------------

ATTN_SIZES = {"cpu": dict(batch=8, seq=8, hidden=128, heads=8),
              "gpu": dict(batch=8, seq=128, hidden=4096, heads=32)}
ATTN_LAYERS = 2


def _layer_norm(x):
    mu = jnp.mean(x, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True) + 1e-5)


def _block(p, x, heads):
    b, s, d = x.shape
    # Heads major in the fused projection (Megatron-LM's layout), so that its column split
    # is a split of the heads.
    qkv = (x @ p["qkv"]).reshape(b, s, heads, 3, d // heads)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5, -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
    x = _layer_norm(x + o @ p["proj"])
    return _layer_norm(x + jax.nn.gelu(x @ p["fc"]) @ p["fc2"])


def _attn_args(batch, seq, hidden, heads, tx):
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 * ATTN_LAYERS + 2))
    params = {str(i): {"qkv": _normal(next(keys), (hidden, 3 * hidden), hidden ** -0.5),
                       "proj": _normal(next(keys), (hidden, hidden), hidden ** -0.5),
                       "fc": _normal(next(keys), (hidden, 4 * hidden), hidden ** -0.5),
                       "fc2": _normal(next(keys), (4 * hidden, hidden), (4 * hidden) ** -0.5)}
              for i in range(ATTN_LAYERS)}
    batch = {"x": _normal(next(keys), (batch, seq, hidden)),
             "y": _normal(next(keys), (batch, seq, hidden))}
    return params, tx.init(params), batch


def _attn_loss_fn(heads):
    def loss(params, batch):
        x = batch["x"]
        for i in range(ATTN_LAYERS):
            x = _block(params[str(i)], x, heads)
        return jnp.mean((x - batch["y"]) ** 2)
    return loss


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_attention_layers_are_megatron(device):
    cluster, tx = CLUSTERS[device], optax.sgd(1e-2)
    sizes = ATTN_SIZES[device]
    args = _concrete_or_abstract(lambda: _attn_args(**sizes, tx=tx), cluster)
    step_fn = step_of(_attn_loss_fn(sizes["heads"]), tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=((1, 4),)), cluster)
    st = plan.stages[0]
    for i in range(ATTN_LAYERS):
        # Heads split (qkv by column), the output projection by row; the MLP likewise.
        assert str(st.sharding_of(f"params/{i}/qkv")) == "[-,y]"
        assert str(st.sharding_of(f"params/{i}/proj")) == "[y,-]"
        assert str(st.sharding_of(f"params/{i}/fc")) == "[-,y]"
        assert str(st.sharding_of(f"params/{i}/fc2")) == "[y,-]"
    act = sizes["batch"] * sizes["seq"] * sizes["hidden"] * F32
    # Two reductions per layer forward, two backward, none for the input's gradient.
    _megatron_comm(plan, act, 4 * ATTN_LAYERS - 1)
    if device == "cpu":
        big = [(c.kind, c.nbytes, c.count) for c in plan.collectives() if c.nbytes > F32]
        assert big == [("all-reduce", act, 4 * ATTN_LAYERS - 1)]
    if device == "cpu":
        _run_on_cpu(step, step_fn, args, plan, atol=1e-4)


# ---- Mixture of experts (test_moe.py): experts on the expert axis ----------------------------

MOE_SIZES = {"cpu": dict(tokens=256, hidden=16, experts=4, ffn=64),
             "gpu": dict(tokens=16384, hidden=1024, experts=8, ffn=4096)}


def _moe_args(tokens, hidden, experts, ffn, tx):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"gate": _normal(k[0], (hidden, experts), hidden ** -0.5),
              "wi": _normal(k[1], (experts, hidden, ffn), hidden ** -0.5),
              "wo": _normal(k[2], (experts, ffn, hidden), ffn ** -0.5)}
    batch = {"x": _normal(k[3], (tokens, hidden)), "y": _normal(k[4], (tokens, hidden))}
    return params, tx.init(params), batch


def _moe_loss(params, batch):
    """Top-1 routing with a dense dispatch (GShard's einsums, capacity = all tokens)."""
    x = batch["x"]
    logits = x @ params["gate"]
    probs = jax.nn.softmax(logits, -1)
    mask = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1])          # (t, e)
    dispatched = jnp.einsum("te,th->eth", mask, x)                             # (e, t, h)
    h = jax.nn.relu(jnp.einsum("eth,ehf->etf", dispatched, params["wi"]))
    out = jnp.einsum("etf,efh->eth", h, params["wo"])
    y = jnp.einsum("eth,te->th", out, mask * probs)
    return jnp.mean((y - batch["y"]) ** 2)


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_moe_experts_split_on_the_expert_axis(device):
    cluster, tx = CLUSTERS[device], optax.sgd(1e-2)
    args = _concrete_or_abstract(lambda: _moe_args(**MOE_SIZES[device], tx=tx), cluster)
    step_fn = step_of(_moe_loss, tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=((1, 4),)), cluster)
    st = plan.stages[0]
    assert str(st.sharding_of("params/wi")) == "[y,-,-]"
    assert str(st.sharding_of("params/wo")) == "[y,-,-]"
    if device == "cpu":
        _run_on_cpu(step, step_fn, args, plan)


# ---- Convolutions (test_conv.py): depthwise and grouped, split on their channel groups -------

CONV_SIZES = {"cpu": dict(batch=4, image=8, channel=32),
              "gpu": dict(batch=4, image=8, channel=256)}      # Alpa's sizes


def _conv(x, w, groups=1):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=groups,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _conv_args(batch, image, channel, tx, groups):
    wide = 8 * channel
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"w_in": _normal(k[0], (3, 3, channel, wide), 0.1),
              "w_group": _normal(k[1], (3, 3, wide // groups, wide), 0.1),
              "w_out": _normal(k[2], (3, 3, wide, channel), 0.1)}
    batch = {"x": _normal(k[3], (batch, image, image, channel)),
             "y": _normal(k[4], (batch, image, image, channel))}
    return params, tx.init(params), batch


def _conv_loss_fn(groups):
    def loss(params, batch):
        h = _conv(batch["x"], params["w_in"])
        h = _conv(h, params["w_group"], groups)
        h = jax.nn.relu(_conv(h, params["w_out"]))
        return jnp.mean((h - batch["y"]) ** 2)
    return loss


_GROUPED_GATHERED = pytest.mark.xfail(strict=True, reason=(
    "XLA's SPMD partitioner (Shardy, XLA:CPU) all-gathers the operands of a grouped "
    "convolution with 8 groups of 32 channels split 4 ways (2 groups per device) instead of "
    "partitioning it by group as the plan says: the compiled program runs an all-gather the "
    "plan does not predict. Depthwise (groups = channels) partitions as planned."))


@pytest.mark.parametrize("device, kind", [
    ("gpu", "depthwise"), ("cpu", "depthwise"), ("gpu", "grouped"),
    pytest.param("cpu", "grouped", marks=_GROUPED_GATHERED)])
def test_grouped_convolutions_split_on_channel_groups(device, kind):
    cluster, tx = CLUSTERS[device], optax.sgd(1e-2, momentum=0.9)
    sizes = CONV_SIZES[device]
    groups = 8 * sizes["channel"] if kind == "depthwise" else 8
    args = _concrete_or_abstract(lambda: _conv_args(**sizes, tx=tx, groups=groups), cluster)
    step_fn = step_of(_conv_loss_fn(groups), tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=((1, 4),)), cluster)
    st = plan.stages[0]
    assert not plan.unsharded_primitives
    # Alpa's depthwise block: the wide convolution split by output channel, the grouped one
    # by channel group, the narrowing one by input channel: one all-reduce in all.
    assert str(st.sharding_of("params/w_in")) == "[-,-,-,y]"
    assert str(st.sharding_of("params/w_group")) == "[-,-,-,y]"
    assert str(st.sharding_of("params/w_out")) == "[-,-,y,-]"
    out = sizes["batch"] * sizes["image"] ** 2 * sizes["channel"] * F32
    big = [(c.kind, c.nbytes, c.count) for c in plan.collectives() if c.nbytes > F32]
    assert big == [("all-reduce", out, 1)]
    if device == "cpu":
        _run_on_cpu(step, step_fn, args, plan)


def test_grouped_conv_rule_shares_the_group_label():
    dn = jax.lax.conv_dimension_numbers((4, 8, 8, 32), (3, 3, 4, 32), ("NHWC", "HWIO", "NHWC"))
    params = dict(dimension_numbers=dn, feature_group_count=8, batch_group_count=1)
    labels = dim_labels("conv_general_dilated", params, [(4, 8, 8, 32), (3, 3, 4, 32)],
                        [(4, 8, 8, 32)])
    (lhs, rhs), (out,) = labels.operands, labels.outputs
    group = lhs[3]
    assert rhs[3] == out[3] == group and labels.sizes[group] == 8   # 8 groups of 4 channels
    assert lhs[0] == out[0] and lhs[0] not in labels.fixed           # the batch splits too
    assert rhs[2] in labels.fixed                                    # a group's channels whole
    # The weight gradient of a grouped convolution groups the batch (lhs dim 0 here is the
    # channels of the forward input): lhs batch, rhs and result features by group.
    dn = jax.lax.conv_dimension_numbers((32, 8, 8, 4), (4, 8, 8, 32), ("NHWC", "HWIO", "NHWC"))
    params = dict(dimension_numbers=dn, feature_group_count=1, batch_group_count=8)
    labels = dim_labels("conv_general_dilated", params, [(32, 8, 8, 4), (4, 8, 8, 32)],
                        [(4, 8, 8, 32)])
    (lhs, rhs), (out,) = labels.operands, labels.outputs
    assert lhs[0] == rhs[3] == out[3] and labels.sizes[lhs[0]] == 8
    assert lhs[3] == rhs[2] and lhs[3] in labels.reduced             # contracted: partial sums
    assert out[0] in labels.fixed


def test_reshape_with_dimensions_rule():
    # jax writes a grouped convolution's weight as a transpose-then-reshape.
    params = dict(new_sizes=(3, 3, 256, 1), dimensions=(0, 1, 3, 2, 4), sharding=None)
    labels = dim_labels("reshape", params, [(3, 3, 1, 256, 1)], [(3, 3, 256, 1)])
    (src,), (dst,) = labels.operands, labels.outputs
    assert src[3] == dst[2] and labels.sizes[src[3]] == 256


# ---- Tied embeddings (test_bert.py test_embedding_2d_mesh) -----------------------------------

EMBED_SIZES = {"cpu": dict(vocab=1024, hidden=8, batch=8, seq=8),
               "gpu": dict(vocab=65536, hidden=1024, batch=8, seq=512)}


def _embed_args(vocab, hidden, batch, seq, tx):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"embed": _normal(k[0], (vocab, hidden), 0.02)}
    data = {"ids": jax.random.randint(k[1], (batch, seq), 0, vocab),
            "labels": jax.random.randint(k[2], (batch, seq), 0, vocab)}
    return params, tx.init(params), data


def _embed_loss(params, batch):
    x = params["embed"][batch["ids"]]                    # input lookup
    logits = x @ params["embed"].T                        # output projection, same matrix
    onehot = jax.nn.one_hot(batch["labels"], logits.shape[-1])
    return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits, -1), -1))


_VOCAB_LOOKUP = pytest.mark.xfail(strict=True, reason=(
    "op_rules' gather rule keeps the gathered-from (vocab) dimension of the table whole, so "
    "the input lookup cannot read a vocab-split table (Megatron's masked lookup and "
    "all-reduce); the logits matmul wants E^T split by vocab, the lookup wants E split by "
    "hidden, and the plan all-to-alls E^T (64 MiB) between them and all-gathers the "
    "1 GiB logits in the softmax backward."))


@pytest.mark.parametrize("device, mesh_shape", [
    pytest.param("gpu", (2, 2), marks=_VOCAB_LOOKUP),
    pytest.param("gpu", (1, 4), marks=_VOCAB_LOOKUP),
    ("cpu", (2, 2)), ("cpu", (1, 4))])
def test_tied_embedding_has_no_all_to_all(device, mesh_shape):
    cluster, tx = CLUSTERS[device], optax.adam(1e-2)
    args = _concrete_or_abstract(lambda: _embed_args(**EMBED_SIZES[device], tx=tx), cluster)
    step_fn = step_of(_embed_loss, tx)
    step, plan = _plan(step_fn, args, al.Auto(mesh_shapes=(mesh_shape,)), cluster)
    assert "all-to-all" not in _by_kind(plan.collectives())
    if device == "cpu":
        exe = _run_on_cpu(step, step_fn, args, plan)
        assert "all-to-all" not in _by_kind(exe.collectives(*args))
