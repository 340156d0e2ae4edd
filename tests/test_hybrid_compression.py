"""Compression on the data-parallel axis of hybrid plans (issue "10 ·", point 1): a
Hugging Face Flax BERT (tiny) and an MLP under Manual(dp=2, tp=4) and a dp=4 x pp=2
pipeline, the dp exchange compressed per tensor-parallel shard after gradient
accumulation (`StagePlan.exchange`, `runtime.stage_exchange`).

The local 8 devices are described as nodes joined by a slow link, so that compressing
the exchange between them pays and the planner compresses (on the fast local link it
would, rightly, all-reduce in full precision)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lite as al
from alpa_lite import compression as C
from alpa_lite.cost_models.cluster import LinkSpec
from alpa_lite.errors import PlanningError
from alpa_lite.plan import Plan, SyncCollective
from alpa_lite.runtime.hlo import collectives_in_hlo

import library_models as lm

DP2_TP4 = al.Manual(dp=2, tp=4)
DP4_PP2 = al.Manual(dp=4, pp=2, num_micro_batches=2)


def slow_nodes(n: int, bandwidth: float = 1e8) -> al.Cluster:
    """The 8 local devices as `n` nodes joined by a link of `bandwidth` bytes/s."""
    local = al.Cluster.local()
    return dataclasses.replace(local, name=f"local-{n}-slow-{bandwidth:g}", num_nodes=n,
                               devices_per_node=8 // n,
                               inter_node=LinkSpec("slow test link", bandwidth, 1e-5))


# dp crosses the slow link: dp=2 x tp=4 on 2 nodes of 4; dp=4 x pp=2 on 8 nodes of 1
# (each stage's 4 replicas on 4 nodes).
CLUSTERS = {"dp2_tp4": (DP2_TP4, 2), "dp4_pp2": (DP4_PP2, 8)}


def tiny_encoder(batch_size: int = 16, vocab: int = 512, seq: int = 8, hidden: int = 32,
                 layers: int = 2, heads: int = 4):
    """A BERT-like encoder written here: token and position embeddings, `layers`
    bidirectional self-attention + MLP blocks with pre-layer-norm, and an untied output
    layer, trained on masked-LM-style token targets with plain SGD."""
    ks = iter(jax.random.split(jax.random.key(3), 64))
    dense = lambda a, b: {"w": jax.random.normal(next(ks), (a, b)) * 0.05,   # noqa: E731
                          "b": jnp.zeros(b)}
    norm = lambda: {"g": jnp.ones(hidden), "b": jnp.zeros(hidden)}           # noqa: E731
    params = {"tok": jax.random.normal(next(ks), (vocab, hidden)) * 0.05,
              "pos": jax.random.normal(next(ks), (seq, hidden)) * 0.05,
              "blocks": [{"ln1": norm(), "qkv": dense(hidden, 3 * hidden),
                          "out": dense(hidden, hidden), "ln2": norm(),
                          "up": dense(hidden, 4 * hidden), "down": dense(4 * hidden, hidden)}
                         for _ in range(layers)],
              "head": dense(hidden, vocab)}

    def ln(p, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]

    def lin(p, x):
        return x @ p["w"] + p["b"]

    def loss_fn(p, tokens, targets):
        x = p["tok"][tokens] + p["pos"]
        b, t, _ = x.shape
        for blk in p["blocks"]:
            q, k, v = jnp.split(lin(blk["qkv"], ln(blk["ln1"], x)), 3, axis=-1)
            split = lambda z: z.reshape(b, t, heads, hidden // heads)     # noqa: E731
            att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k))
                                 / np.sqrt(hidden // heads), axis=-1)
            x = x + lin(blk["out"], jnp.einsum("bhqk,bkhd->bqhd", att, split(v))
                        .reshape(b, t, hidden))
            x = x + lin(blk["down"], jax.nn.gelu(lin(blk["up"], ln(blk["ln2"], x))))
        logits = lin(p["head"], x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    tx = optax.sgd(0.5)

    def step(p, s, batch):
        loss, g = al.value_and_grad(loss_fn)(p, batch["tokens"], batch["targets"])
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    k1, k2 = jax.random.split(jax.random.key(4))
    batch = {"tokens": jax.random.randint(k1, (batch_size, seq), 0, vocab),
             "targets": jax.random.randint(k2, (batch_size, seq), 0, vocab)}
    return lm.Case(step, (params, tx.init(params), batch))


@functools.lru_cache(maxsize=None)
def transformer(layout: str):
    """The tiny Hugging Face Flax BERT for dp2 x tp4. For the pipeline, the encoder above:
    BERT's output layer is tied to its input embedding, and the tied weight's transpose
    crosses the stage boundary as a value without a batch dimension, so that stage's
    backward cannot run per replica (the planner refuses compression there, saying so)."""
    return lm.hf_bert(batch_size=8) if layout == "dp2_tp4" else tiny_encoder()


def mlp_case(tx=None):
    def loss_fn(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    tx = tx or optax.sgd(0.1)

    def step(p, s, batch):
        loss, g = al.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    k = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k[0], (32, 64)) * 0.3, "b1": jnp.zeros(64),
         "w2": jax.random.normal(k[1], (64, 8)) * 0.3}
    batch = (jax.random.normal(k[2], (64, 32)), jax.random.normal(k[3], (64, 8)))
    return step, (p, tx.init(p), batch)


def run_steps(step, args, n):
    state, losses = args, []
    for _ in range(n):
        out = step(*state[:2], state[2])
        out[2].block_until_ready()
        losses.append(float(out[2]))
        state = (out[0], out[1], state[2])
    return state, losses


@pytest.mark.parametrize("layout", sorted(CLUSTERS))
def test_dense_exchange_equals_one_device(layout):
    """A lossless exchange (Dense) in a hybrid plan is the single-device step."""
    method, nodes = CLUSTERS[layout]
    step, args = mlp_case()
    hybrid = al.parallelize(step, method=method, cluster=slow_nodes(nodes),
                            compression=C.Dense())
    got, _ = run_steps(hybrid, args, 3)
    want, _ = run_steps(jax.jit(step), args, 3)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    plan = hybrid.plan(*args)
    # Dense saves nothing over the all-reduce: the plan says the exchange is a plain one.
    assert all(s.exchange is None for s in plan.stages)
    assert all(s.accumulate_axes == ("dp",) for s in plan.stages)


def exchange_hlo_sent(step, plan: Plan, args) -> list[float]:
    """Per stage, the bytes one device sends in the compiled exchange (ring formulas)."""
    ex = step.compile(*args)
    sent = []
    for s, st in enumerate(ex.stages):
        fb = st.prog.fb.graph
        stacked = [jax.ShapeDtypeStruct((st.replicas,) + tuple(fb.tensors[t].shape),
                                        jnp.dtype(fb.tensors[t].dtype), sharding=sh)
                   for t, sh in zip(st.prog.fb_param_grads, st.grad_stacked)]
        text = st.exchange.compiled_text(stacked, 10_000)
        n = plan.stages[s].exchange.num_workers
        sent.append(sum(c.sent_bytes(n) for c in collectives_in_hlo(text)))
    return sent


@pytest.mark.parametrize("layout,compressor", [
    ("dp2_tp4", C.PowerSGD(rank=2)), ("dp4_pp2", C.DGC(sparsity=0.99, momentum=0.0))],
    ids=["dp2_tp4-powersgd", "dp4_pp2-dgc"])
def test_bert_trains_with_compressed_dp(layout, compressor):
    """PowerSGD and DGC on the dp axis of a tiny transformer's hybrid plan (each compressor
    on one layout; test_dense_exchange_equals_one_device runs both layouts): the plan
    compresses the large gradients, the loss falls, and the compiled exchange moves the
    bytes the plan predicts."""
    method, nodes = CLUSTERS[layout]
    case = transformer(layout)
    step = al.parallelize(case.step, method=method, cluster=slow_nodes(nodes),
                          compression=compressor)
    plan = step.plan(*case.args)
    assert all(s.exchange is not None for s in plan.stages)
    compressed = [r for r in plan.gradient_sync if r.collective is SyncCollective.COMPRESSED]
    dense = [r for r in plan.gradient_sync if r.collective is SyncCollective.ALL_REDUCE]
    assert compressed
    # What stays dense (PowerSGD: the vectors, which it cannot shrink) is the small part.
    assert sum(r.nbytes for r in dense) < 0.2 * sum(s.exchange.dense_wire_bytes
                                                    for s in plan.stages)
    for st in plan.stages:
        assert st.exchange.wire_bytes < st.exchange.dense_wire_bytes
        assert st.memory.compression_state == st.exchange.state_bytes > 0
    _, losses = run_steps(step, case.args, 6)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]
    sent = exchange_hlo_sent(step, plan, case.args)
    for st, got in zip(plan.stages, sent):
        assert got == pytest.approx(st.exchange.wire_bytes, rel=1e-6)


def test_tensor_parallel_shards_compress_their_own_block():
    """Under dp=2 x tp=4 each device's PowerSGD state is for its block of the matrix
    (the tensor-parallel shard), not the whole gradient."""
    step, args = mlp_case()
    hybrid = al.parallelize(step, method=DP2_TP4, cluster=slow_nodes(2),
                            compression=C.PowerSGD(rank=2))
    plan = hybrid.plan(*args)
    ex = hybrid.compile(*args)
    reduce = ex.stages[0].exchange
    specs = dict(plan.stages[0].shardings)
    w1 = specs["p/w1"]
    assert any(w1.dims), "the test needs w1 split over tp"
    shapes = [s for s, c in zip(reduce.local_shapes, reduce.compressed) if c]
    assert (32, 64) not in shapes and any(np.prod(s) == 32 * 64 // 4 for s in shapes)
    run_steps(hybrid, args, 2)


def test_plan_round_trips_with_exchange():
    step, args = mlp_case()
    plan = al.parallelize(step, method=DP2_TP4, cluster=slow_nodes(2),
                          compression=C.TopK(ratio=0.05)).plan(*args)
    back = Plan.from_json(plan.to_json())
    assert back.stages[0].exchange == plan.stages[0].exchange
    assert back.stages[0].memory == plan.stages[0].memory


def test_hybrid_refusals_name_the_problem():
    step, args = mlp_case()
    with pytest.raises(PlanningError, match="no mesh axis of this stage splits the batch"):
        al.parallelize(step, method=al.Manual(dp=1, tp=8), cluster=slow_nodes(2),
                       compression=C.PowerSGD(rank=2)).plan(*args)
    with pytest.raises(PlanningError, match="pure data-parallel plans"):
        al.parallelize(step, method=DP2_TP4, cluster=slow_nodes(2),
                       compression=C.DelayedAveraging(delay=2)).plan(*args)


def test_replicas_of_one_example_compress_their_own_gradients():
    """An Equinox transformer traced at one example is another program than at several
    (JAX treats size-1 dimensions specially); aligned to the micro-batch's trace
    (`ir.one_example`), each replica of a dp=4 pipeline with micro-batches of 4 runs its
    backward on its own example and a compressed plan is not refused (Dense: lossless,
    so the run equals jit's; over slow links PowerSGD, in the same place, compresses)."""
    pytest.importorskip("equinox")
    case = lm.eqx_transformer(batch_size=8)
    step = al.parallelize(case.step, method=al.Manual(dp=4, pp=2, num_micro_batches=2),
                          cluster=slow_nodes(8), compression=C.Dense())
    assert all(st.accumulate_axes == ("dp",) for st in step.plan(*case.args).stages)
    lossy = al.parallelize(case.step, method=al.Manual(dp=4, pp=2, num_micro_batches=2),
                           cluster=slow_nodes(8), compression=C.PowerSGD(rank=2))
    assert any(st.exchange is not None for st in lossy.plan(*case.args).stages)
    (params, _, _), losses = run_steps(step, case.args, 2)
    (ref, _, _), ref_losses = run_steps(jax.jit(case.step), case.args, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(lm.array_leaves(params), lm.array_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_hybrid_layouts_of_auto_compression():
    """The layouts Auto + AutoCompression weighs: dp > 1 beside tp or pp, each with a
    micro-batch count that leaves every replica at least two examples."""
    from alpa_lite.planning.hybrid_search import hybrid_layouts, micro_batch_count
    layouts = hybrid_layouts(32, 8, 64)
    assert {(m.dp, m.tp, m.pp) for m in layouts} >= {(4, 8, 1), (4, 4, 2), (2, 8, 2)}
    for m in layouts:
        assert m.dp > 1 and (m.tp > 1 or m.pp > 1)
        assert 64 % (m.num_micro_batches * m.dp) == 0
        assert 64 // (m.num_micro_batches * m.dp) >= 2
    assert micro_batch_count(64, 4, 2) == 8          # 4 x pp
    assert micro_batch_count(64, 4, 1) == 1
    assert micro_batch_count(8, 4, 2) is None        # one example per replica at best


def test_a_layout_that_does_not_fit_gets_more_micro_batches_then_remat():
    """As Megatron-LM users do: a layout whose activations do not fit is planned again with
    more micro-batches, then with recomputation; variants whose memory floor is over the
    budget are skipped unplanned, and the first variant that fits stands for the layout."""
    from alpa_lite.planning.hybrid_search import best_hybrid, layout_variants
    layout = al.Manual(dp=4, tp=8, pp=1, num_micro_batches=1)
    variants = layout_variants(layout, 64)
    assert [(v.num_micro_batches, v.remat) for v in variants] == [
        (m, r) for m in (1, 2, 4, 8) for r in (False, True)]

    class FakePlan:
        def __init__(self, layout):
            self.layout = layout
            # Memory falls with more micro-batches and with remat; so does speed.
            self.peak_memory_bytes = 100.0 / layout.num_micro_batches / (
                2 if layout.remat else 1)
            self.step_time_s = layout.num_micro_batches + (0.5 if layout.remat else 0.0)

    planned = []

    def plan_layout(v):
        planned.append(v)
        return FakePlan(v)

    def floor(v):      # m = 1 cannot fit whatever the ILP does
        return 1e9 if v.num_micro_batches == 1 else 0.0

    best, outcomes = best_hybrid([layout], plan_layout, 20.0, 64, floor)
    assert [(v.num_micro_batches, v.remat) for v in planned] == [
        (2, False), (2, True), (4, False), (4, True)]
    assert best.layout == dataclasses.replace(layout, num_micro_batches=4, remat=True)
    assert len(outcomes) == 1 and outcomes[0].plan is best and outcomes[0].note == ""


def test_dgc_momentum_beside_a_momentum_optimizer_is_refused_in_hybrid_plans():
    """The double-momentum check (compression.momentum) covers hybrid plans too."""
    step, args = mlp_case(tx=optax.sgd(0.1, momentum=0.9))
    with pytest.raises(PlanningError, match="momentum would be applied twice"):
        al.parallelize(step, method=DP2_TP4, cluster=slow_nodes(2),
                       compression=C.DGC(0.99)).plan(*args)
