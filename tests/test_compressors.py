"""Tests for alpa_lite.compression: exactness, error feedback, unbiasedness, payloads and bytes.

Workers are simulated with `jax.vmap(..., axis_name="dp")` over a stacked batch of per-worker
gradients; payload and byte checks look inside a `jax.shard_map` over the 8 CPU devices.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from alpa_lite.compression import (
    DGC,
    QSGD,
    Cast,
    Dense,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    TopK,
    by_name,
    init_tree,
    reduce_tree,
)
from alpa_lite.compression.powersgd import low_rank_sum

KEY = jax.random.key(0)

# One of each, with parameters that still compress the small leaves used below.
ALL = [Dense(), Cast("bf16"), Cast("fp16"), TopK(0.1), RandomK(0.1),
       DGC(sparsity=0.9, momentum=0.9, clip_norm=5.0), PowerSGD(rank=2), OneBit(), SignSGD(),
       TernGrad(), QSGD(levels=4), QSGD(levels=4, bucket_size=50)]


def ids(compressors):
    return [c.describe().split(":")[0] for c in compressors]


def normal(shape, seed=0, dtype=np.float32):
    """Standard normal numbers as a numpy array (no JAX op, so nothing to compile)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def zero_states(comp, grads):
    """Per-worker initial states stacked along dim 0, like the gradients (numpy)."""
    state = comp.init_state(tuple(grads.shape[1:]), grads.dtype)
    return jax.tree.map(lambda a: np.zeros((grads.shape[0], *a.shape), a.dtype), state)


@functools.lru_cache(maxsize=None)
def vmapped_reduce(comp, num_workers, phase=()):
    """jit(vmap(reduce)) of (stacked grads, stacked states, seed); cached so shapes compile once.

    The seed plays the step: it picks the shared key and the workers' keys.
    """
    def run_all(grads, states, seed):
        shared_key = jax.random.fold_in(KEY, seed)
        worker_keys = jax.random.split(jax.random.key(seed), num_workers)
        return jax.vmap(lambda grad, state, worker_key: comp.reduce(
            grad, state, axis_name="dp", num_workers=num_workers, phase=phase,
            shared_key=shared_key, worker_key=worker_key), axis_name="dp")(
                grads, states, worker_keys)
    return jax.jit(run_all)


def run(comp, grads, states=None, phase=(), seed=1):
    """One reduce on every worker: (per-worker outputs (n, ...), new stacked states), numpy."""
    states = zero_states(comp, grads) if states is None else states
    return jax.device_get(vmapped_reduce(comp, grads.shape[0], phase)(grads, states, seed))


def sharded_reduce(comp, shape, phase=()):
    """(jitted shard_map of reduce over 8 devices, its sharded arguments). Result: out_specs=P()."""
    mesh = jax.make_mesh((8,), ("dp",))

    def step(grad, state, seed):                             # each holds this device's block
        state = jax.tree.map(lambda a: a[0], state)
        worker_key = jax.random.fold_in(jax.random.key(seed[0]), jax.lax.axis_index("dp"))
        out, state = comp.reduce(grad[0], state, axis_name="dp", num_workers=8, phase=phase,
                                 shared_key=KEY, worker_key=worker_key)
        return out, jax.tree.map(lambda a: a[None], state)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("dp"), out_specs=(P(), P("dp"))))
    grads = normal((8, *shape))
    args = (grads, zero_states(comp, grads), np.zeros(8, np.uint32))
    return fn, jax.device_put(args, NamedSharding(mesh, P("dp")))


def equations(closed_jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (jit, while, shard_map) included."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jaxprs_in_params(eqn.params):
                yield from walk(getattr(sub, "jaxpr", sub))
    return list(walk(closed_jaxpr.jaxpr))


def collectives(closed_jaxpr):
    """(primitive name, operand avals) of every collective."""
    return [(e.primitive.name, [v.aval for v in e.invars]) for e in equations(closed_jaxpr)
            if e.primitive.name.startswith(("psum", "pmax", "all_gather", "all_to_all"))]


# --- exact methods -------------------------------------------------------------------------


# Exact on a (6, 10) leaf: k = numel for the sparse ones; rank 6 = min dim is sent dense.
EXACT = [Dense(), TopK(1.0), RandomK(1.0), PowerSGD(rank=6)]


@pytest.mark.parametrize("comp", EXACT, ids=ids(EXACT))
def test_exact_methods_return_the_sum_on_every_worker(comp):
    grads = normal((4, 6, 10))
    out, _ = run(comp, grads)
    np.testing.assert_allclose(out, np.broadcast_to(grads.sum(0), out.shape), atol=1e-5)


def test_exact_methods_through_shard_map_on_8_devices():
    for comp in EXACT:
        fn, args = sharded_reduce(comp, (6, 10))
        out, _ = fn(*args)
        np.testing.assert_allclose(out, np.asarray(args[0]).sum(0), atol=1e-5,
                                   err_msg=comp.describe())
        assert out.sharding.is_fully_replicated


def test_powersgd_power_iteration_is_exact_at_full_rank():
    # rank = min(rows, cols) = 6: the orthonormal P spans every column, so P P^T M = M.
    # (PowerSGD itself sends such leaves dense; this checks the low-rank algebra.)
    grads = normal((4, 6, 10))
    q = normal((10, 6), seed=3)
    approx, _, _ = jax.jit(jax.vmap(lambda m: low_rank_sum(m, q, "dp"), axis_name="dp"))(grads)
    np.testing.assert_allclose(approx[0], grads.sum(0), atol=1e-4)


def test_powersgd_is_exact_when_the_sum_has_rank_r():
    # Workers' matrices share a column space of rank 2, so rank-2 PowerSGD loses nothing.
    basis = normal((16, 2), seed=1)
    grads = np.einsum("rk,wkc->wrc", basis, normal((4, 2, 12), seed=2))
    comp = PowerSGD(rank=2)
    assert comp.compresses((16, 12))
    out, state = run(comp, grads)
    np.testing.assert_allclose(out[0], grads.sum(0), atol=1e-4)
    # Warm start: the summed Q is kept, identical on every worker.
    assert np.all(state["q"] == state["q"][0]) and np.any(state["q"] != 0)


# --- error feedback ------------------------------------------------------------------------


# (compressor, the state entries that hold residuals, leaf shape)
RESIDUALS = [(TopK(0.1), ("residual",), (16, 12)), (RandomK(0.1), ("residual",), (16, 12)),
             (DGC(sparsity=0.9, momentum=0.0), ("v",), (16, 12)),
             (OneBit(), ("residual", "chunk_residual"), (16, 12)),
             (OneBit(), ("residual", "chunk_residual"), (37,)),   # a vector: n equal columns
             (PowerSGD(rank=2), ("error",), (16, 12))]


@pytest.mark.parametrize("comp,keys,shape", RESIDUALS,
                         ids=[f"{c.name}{s}" for c, _, s in RESIDUALS])
def test_error_feedback_conserves_mass(comp, keys, shape):
    """sum over workers of (grad + old residuals) == result + sum of new residuals."""
    grads = normal((4, *shape))
    _, state = run(comp, normal((4, *shape), seed=5))           # a first step leaves residuals
    out, new_state = run(comp, grads, state, seed=2)

    def total(s):
        return sum(s[k] for k in keys).sum(0)

    np.testing.assert_allclose(out[0] + total(new_state), grads.sum(0) + total(state), atol=1e-4)


@pytest.mark.parametrize("comp,key", [(TopK(0.1), "residual"), (RandomK(0.1), "residual"),
                                      (DGC(sparsity=0.9, momentum=0.0), "v")],
                         ids=["topk", "randomk", "dgc"])
def test_sparse_methods_send_k_entries_of_the_accumulator(comp, key):
    grads = normal((4, 16, 12))
    _, state = run(comp, normal((4, 16, 12), seed=5))
    out, new_state = run(comp, grads, state, seed=2)
    acc = grads + state[key]
    sent = acc - new_state[key]                                   # what each worker sent
    k = round(0.1 * 16 * 12)
    for w in range(4):
        support = sent[w] != 0
        assert 0.8 * k <= support.sum() <= k
        np.testing.assert_allclose(sent[w][support], acc[w][support], rtol=1e-6)
    np.testing.assert_allclose(out[0], sent.sum(0), atol=1e-5)
    if isinstance(comp, RandomK):                                  # positions from shared_key
        assert np.all((sent != 0) == (sent[0] != 0))
    if isinstance(comp, TopK):                                     # the largest ones
        assert np.abs(acc[0][sent[0] != 0]).min() >= np.abs(acc[0][sent[0] == 0]).max()


def test_onebit_code_keeps_column_sums_and_two_values_per_column():
    grads = normal((4, 16, 12))
    out, state = run(OneBit(), grads)
    sent = grads - state["residual"]                               # first step: acc == grad
    np.testing.assert_allclose(sent.sum(1), grads.sum(1), atol=1e-5)
    for column in sent[0].T:                                       # up to rounding of acc - res
        assert len(np.unique(np.round(column, 5))) <= 2
    assert np.all(out == out[0])


# --- unbiased stochastic quantizers --------------------------------------------------------


@pytest.mark.parametrize("comp", [TernGrad(), QSGD(levels=4)], ids=["terngrad", "qsgd"])
def test_stochastic_quantizers_are_unbiased(comp):
    """Mean over T = 4096 draws (512 groups of 8 workers with the same x) approaches x.

    Each draw of an entry lies within one quantization step `delta` of x, so its variance is at
    most delta^2 / 4 and the mean's standard deviation at most delta / (2 sqrt(T)). We allow
    5 such deviations (for 64 entries, a false failure has probability below 1e-4; the seed
    is fixed anyway).
    """
    x = normal((64,))
    groups, n = 512, 8
    draw_group = jax.vmap(vmapped_reduce(comp, n), in_axes=(None, None, 0))   # group g: seed g
    out, _ = jax.device_get(jax.jit(draw_group)(np.broadcast_to(x, (n, 64)), (),
                                                np.arange(groups, dtype=np.uint32)))
    mean = out[:, 0].mean(0) / n
    delta = np.abs(x).max() if isinstance(comp, TernGrad) else np.linalg.norm(x) / comp.levels
    bound = 5 * delta / (2 * math.sqrt(groups * n))
    assert np.abs(mean - x).max() <= bound
    assert np.abs(out[0, 0] / n - x).max() > bound                 # one group alone is far off


# --- DGC -------------------------------------------------------------------------------------


def test_dgc_warmup_is_exponential_through_the_paper_stages():
    comp = DGC(sparsity=0.999, warmup_steps=400)
    phases = [comp.phase(s) for s in (0, 99, 100, 200, 300, 399, 400, 10**6)]
    assert phases == [0.75, 0.75, 0.9375, 0.984375, 0.996, 0.996, 0.999, 0.999]
    densities = [1 - comp.phase(s) for s in (0, 100, 200, 300)]
    np.testing.assert_allclose(np.array(densities[:-1]) / densities[1:], 4.0, rtol=0.03)
    assert DGC(sparsity=0.99, warmup_steps=4).phase(3) == 0.99   # stages capped at the target
    assert DGC().phase(0) == 0.999                                 # no warm-up
    # k = (1 - sparsity) * numel slots of (float32 value, int32 index), all-gathered to 7 peers.
    shape = (1000, 1000)
    assert comp.wire_bytes(10**6, 4, 8, comp.phase(0), shape=shape) == 7 * 250_000 * 8
    assert comp.wire_bytes(10**6, 4, 8, comp.phase(400), shape=shape) == 7 * 1000 * 8


@pytest.mark.parametrize("step", [0, 100, 400])
def test_dgc_payload_is_exactly_k_slots(step):
    comp = DGC(sparsity=0.999, warmup_steps=400, momentum=0.0)
    phase = comp.phase(step)
    fn, args = sharded_reduce(comp, (64, 64), phase=phase)
    k = round(64 * 64 * (1 - phase))
    gathered = [(a[0].shape, str(a[0].dtype)) for _, a in collectives(jax.make_jaxpr(fn)(*args))]
    assert sorted(gathered) == [((k,), "float32"), ((k,), "int32")]


def test_dgc_selects_by_sampled_threshold_without_sorting_the_tensor():
    shape, comp = (256, 256), DGC(sparsity=0.99, momentum=0.0)
    k, num_samples = 655, 656                                      # 1% of numel, 1% sampled
    cap = math.ceil(1.3 * k)                                       # the precise step's pool
    grads = normal((2, *shape))
    jaxpr = jax.make_jaxpr(vmapped_reduce(comp, 2))(grads, zero_states(comp, grads), 0)
    sorts = [e.invars[0].aval.shape for e in equations(jaxpr)
             if e.primitive.name in ("sort", "top_k", "argsort")]
    assert sorted(sorts) == [(2, num_samples), (2, cap)]           # never the whole tensor
    _, state = run(comp, grads)
    sent = grads - state["v"]
    assert np.all((sent != 0).sum((1, 2)) <= k) and np.all((sent != 0).sum((1, 2)) >= 0.8 * k)


@pytest.mark.parametrize("sparsity,shape", [(0.999, (64, 128)), (0.999, (256, 256)),
                                            (0.99, (64, 128))])
def test_dgc_threshold_sampling_sends_close_to_k_of_the_largest(sparsity, shape):
    """Over 64 tensors, Gaussian and heavy-tailed (Student t, 2 degrees of freedom): every one
    sends between 0.8 k and k entries, 0.93 k on average, and what is sent are the largest
    entries. (The sampled threshold alone, moved by x1.3 / x0.8 without bracketing, sent
    fewer than 0.8 k in a fifth of the Gaussian draws at 99.9%, sometimes none.)"""
    comp = DGC(sparsity=sparsity, momentum=0.0)
    k = round(math.prod(shape) * (1 - sparsity))
    rng = np.random.default_rng(7)
    draws = 32
    grads = np.concatenate([rng.standard_normal((draws, *shape)),
                            rng.standard_t(2, (draws, *shape))]).astype(np.float32)
    _, state = run(comp, grads)
    sent = (grads - state["v"]).reshape(2 * draws, -1)
    counts = (sent != 0).sum(1)
    assert counts.min() >= 0.8 * k and counts.max() <= k
    assert counts.mean() >= 0.93 * k
    flat = np.abs(grads.reshape(2 * draws, -1))
    for w in range(2 * draws):                                     # the top |sent| entries
        chosen = sent[w] != 0
        assert flat[w][chosen].min() >= flat[w][~chosen].max()


def test_dgc_sends_vectors_and_small_matrices_whole_with_plain_momentum():
    """Biases and matrices under 2 / (1 - sparsity) entries go through a psum of momentum
    SGD's velocity u = m u + g, kept unmasked; larger matrices are sparsified."""
    comp = DGC(sparsity=0.999, momentum=0.9)
    assert comp.smallest_compressed == 2000
    assert not comp.compresses((37,)) and not comp.compresses((10, 199))
    assert comp.compresses((10, 200)) and comp.compresses((64, 64))
    assert not DGC(sparsity=0.999, min_compressed_numel=10**6).compresses((64, 64))
    assert DGC(sparsity=0.999, min_compressed_numel=0).compresses((2, 2))
    for shape in [(37,), (10, 20)]:
        assert set(comp.init_state(shape, jnp.float32)) == {"u"}
        assert comp.wire_bytes(math.prod(shape), 4, 8, shape=shape) == \
            Dense().wire_bytes(math.prod(shape), 4, 8)
        grads = normal((4, *shape))
        state = {"u": normal((4, *shape), seed=1)}
        out, new = run(comp, grads, state)
        u = 0.9 * state["u"] + grads
        np.testing.assert_allclose(new["u"], u, rtol=1e-6, atol=1e-6)   # not masked
        np.testing.assert_allclose(out[0], u.sum(0), rtol=1e-5, atol=1e-6)
    assert set(comp.init_state((64, 64), jnp.float32)) == {"u", "v"}
    assert comp.init_state((37,), jnp.float32) != () and \
        DGC(momentum=0.0).init_state((37,), jnp.float32) == ()


def test_dgc_with_the_whole_tensor_as_sample_sends_the_top_k():
    comp = DGC(sparsity=0.9, momentum=0.0, sample_ratio=1.0)
    grads = normal((4, 10, 20))
    _, state = run(comp, grads)
    sent = (grads - state["v"]).reshape(4, -1)
    for w in range(4):
        top = set(np.argsort(-np.abs(grads[w].reshape(-1)))[:20].tolist())
        assert set(np.flatnonzero(sent[w]).tolist()) == top


def test_dgc_momentum_correction_and_factor_masking():
    comp = DGC(sparsity=0.5, momentum=0.9, sample_ratio=1.0)      # exact top-16 of 32
    grads = normal((4, 4, 8))
    state = {"u": normal((4, 4, 8), seed=1), "v": normal((4, 4, 8), seed=2)}
    out, new = run(comp, grads, state)
    u = 0.9 * state["u"] + grads                                   # u = m u + g
    sent = state["v"] + u - new["v"]                               # v = v + u, then v -= sent
    np.testing.assert_allclose(out[0], sent.sum(0), atol=1e-5)
    was_sent = np.abs(sent) > 1e-5                                 # not float rounding
    assert was_sent.sum() == 4 * 16
    np.testing.assert_allclose(new["u"], np.where(was_sent, 0, u), atol=1e-6)
    assert np.all(new["v"][was_sent] == 0)


def test_dgc_clips_the_local_gradient_to_clip_norm_over_sqrt_n():
    # With momentum 0 and a zero state, sent + kept (new v) is the clipped gradient: each
    # worker's gradient scaled down to norm clip_norm / sqrt(n) = 2 / sqrt(4) = 1 if longer.
    comp = DGC(sparsity=0.5, momentum=0.0, clip_norm=2.0)
    for scale in (100.0, 0.01):
        grads = scale * normal((4, 4, 8))
        norms = np.linalg.norm(grads.reshape(4, -1), axis=1)[:, None, None]
        clipped = grads * np.minimum(1.0, 1.0 / norms)
        out, state = run(comp, grads)
        np.testing.assert_allclose(out[0] + state["v"].sum(0), clipped.sum(0), rtol=1e-5,
                                   atol=1e-7)


# --- sign methods ----------------------------------------------------------------------------


def test_signsgd_majority_vote_with_ties_to_the_chunk_owner():
    grads = normal((4, 8))
    out, _ = run(SignSGD(), grads)
    votes = np.where(grads >= 0, 1, -1).sum(0)
    owner = np.arange(8) // 2                                      # 8 entries, 4 chunks of 2
    majority = np.where(votes != 0, votes > 0, grads[owner, np.arange(8)] >= 0)
    scale = np.abs(grads).mean(1).sum()
    np.testing.assert_allclose(out[0], np.where(majority, scale, -scale), rtol=1e-6)
    assert np.any(votes == 0)                                      # the tie rule was exercised


# --- payloads on the wire ----------------------------------------------------------------


def hlo_collectives(fn, args):
    """(op, element types of its result) for every collective in the compiled HLO."""
    text = fn.lower(*args).compile().as_text()
    ops = re.findall(r"= (.*?) (all-reduce|all-gather|all-to-all|reduce-scatter)\(", text)
    return [(op, set(re.findall(r"\b([a-z]+\d+)\[", types))) for types, op in ops]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cast_moves_16_bit_payloads_in_the_compiled_hlo(dtype):
    fn, args = sharded_reduce(Cast(dtype), (64, 24))
    found = hlo_collectives(fn, args)
    wire = {"bf16": "u16", "fp16": "f16"}[dtype]                   # bf16 travels as its bits
    assert sorted(op for op, _ in found) == ["all-gather", "all-to-all"]
    assert all(types == {wire} for _, types in found), found


def test_cpu_widens_a_bf16_psum_which_is_why_cast_does_not_use_one():
    # An XLA CPU fact (jax 0.10.2): if it stops holding, Cast could use a plain psum.
    mesh = jax.make_mesh((8,), ("dp",))
    fn = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g, "dp"), mesh=mesh, in_specs=P("dp"),
                               out_specs=P()))
    x = jax.device_put(np.ones((8, 64), jnp.bfloat16), NamedSharding(mesh, P("dp")))
    assert hlo_collectives(fn, (x,)) == [("all-reduce", {"f32"})]


def test_sparse_and_onebit_payload_shapes_and_dtypes():
    def payload(comp):
        fn, args = sharded_reduce(comp, (16, 12))
        return sorted((name, a[0].shape, str(a[0].dtype))
                      for name, a in collectives(jax.make_jaxpr(fn)(*args)))

    assert payload(TopK(0.1)) == [("all_gather_invariant", (19,), "float32"),   # k = 19
                                  ("all_gather_invariant", (19,), "int32")]
    # 12 columns -> 2 per worker (8 workers, padded to 16); 16 rows -> 2 bytes of signs each.
    assert payload(OneBit()) == [("all_gather_invariant", (2, 2), "float32"),
                                 ("all_gather_invariant", (2, 2), "uint8"),
                                 ("all_to_all", (8, 2, 2), "float32"),
                                 ("all_to_all", (8, 2, 2), "uint8")]
    assert payload(TernGrad()) == [("pmax", (), "float32"), ("psum_invariant", (16, 12), "int8")]


# --- wire bytes ------------------------------------------------------------------------------


def collective_bytes(found, n):
    """Bytes one worker sends for the collectives found, with the ring/pairwise formulas."""
    total = 0.0
    for name, avals in found:
        nbytes = sum(a.size * a.dtype.itemsize for a in avals)
        if name.startswith("all_gather"):
            total += (n - 1) * nbytes
        elif name == "all_to_all":
            total += (n - 1) / n * nbytes
        else:                                                      # psum, pmax: ring all-reduce
            total += 2 * (n - 1) / n * nbytes
    return total


@pytest.mark.parametrize("comp", ALL, ids=ids(ALL))
def test_wire_bytes_match_the_collectives_reduce_uses(comp):
    """Traced under shard_map on 8 devices, which also checks that the result is replicated
    (out_specs=P() with check_vma), so `synchronous` holds by construction."""
    shape = (64, 24)
    fn, args = sharded_reduce(comp, shape)
    found = collectives(jax.make_jaxpr(fn)(*args))
    assert collective_bytes(found, 8) == pytest.approx(
        comp.wire_bytes(math.prod(shape), 4, 8, shape=shape))


def test_wire_bytes_hand_computed():
    n = 8
    assert Dense().wire_bytes(1000, 4, n) == 2 * 7 / 8 * 4000                 # ring all-reduce
    assert Cast().wire_bytes(1000, 4, n) == 2 * 7 * 125 * 2                   # 2-byte chunks
    assert TopK(0.01).wire_bytes(10_000, 4, n) == 7 * 100 * (4 + 4)          # values + indices
    assert RandomK(0.01).wire_bytes(10_000, 4, n) == 2 * 7 / 8 * 100 * 4     # k values, psum
    assert PowerSGD(4).wire_bytes(1024 * 512, 4, n, shape=(1024, 512)) == \
        2 * 7 / 8 * (1024 + 512) * 4 * 4                                    # P and Q, float32
    assert PowerSGD(4).wire_bytes(10, 4, n, shape=(10,)) == 2 * 7 / 8 * 40   # dense fallback
    # (64, 128): 128 columns, 16 per worker; each 64 sign bits (8 bytes) + 2 float32 scales.
    assert OneBit().wire_bytes(64 * 128, 4, n, shape=(64, 128)) == 2 * 7 * 16 * (8 + 8)
    assert SignSGD().wire_bytes(8000, 4, n) == 2 * 7 * 125 + 2 * 7 / 8 * 4   # bits + scale
    assert TernGrad().wire_bytes(1000, 4, n) == 2 * 7 / 8 * (1000 + 4)       # int8 + scale
    assert QSGD(8).wire_bytes(1000, 4, n) == 7 * (1000 + 4)                  # int8 + norm
    assert QSGD(8, bucket_size=512).wire_bytes(1000, 4, n) == 7 * (1024 + 8)
    assert all(c.wire_bytes(1000, 4, 1) == 0 for c in ALL)                   # one worker


def test_wire_bytes_growth_in_the_number_of_workers():
    shape = (1024, 512)
    numel = math.prod(shape)

    def growth(comp):
        return (comp.wire_bytes(numel, 4, 64, shape=shape)
                / comp.wire_bytes(numel, 4, 2, shape=shape))

    assert growth(TopK(0.01)) == pytest.approx(63)                  # all-gather: (n-1) * B
    assert growth(DGC()) == pytest.approx(63)
    assert growth(QSGD()) == pytest.approx(63)
    for flat in [Dense(), Cast(), RandomK(0.01), PowerSGD(4), OneBit(), SignSGD(), TernGrad()]:
        assert growth(flat) < 2.1, flat                              # 2 (n-1)/n: from 1 to 2


# --- parameters, names, state ----------------------------------------------------------------


@pytest.mark.parametrize("make,message", [
    (lambda: TopK(0.0), r"TopK: ratio must be in \(0, 1\], got 0.0"),
    (lambda: TopK(1.5), r"ratio must be in \(0, 1\]"),
    (lambda: RandomK(-0.1), r"RandomK: ratio"),
    (lambda: DGC(sparsity=1.0), r"DGC: sparsity must be in \(0, 1\), got 1.0"),
    (lambda: DGC(sparsity=0.0), r"sparsity must be in \(0, 1\)"),
    (lambda: DGC(momentum=1.0), r"momentum must be in \[0, 1\)"),
    (lambda: DGC(clip_norm=0.0), r"clip_norm must be > 0 or None"),
    (lambda: DGC(warmup_steps=-1), r"warmup_steps must be an int >= 0"),
    (lambda: DGC(sample_ratio=0.0), r"sample_ratio"),
    (lambda: DGC(warmup_steps=10, warmup_stages=()), r"at least one warm-up stage"),
    (lambda: DGC(min_compressed_numel=-1), r"min_compressed_numel must be an int >= 0 or None"),
    (lambda: PowerSGD(rank=0), r"PowerSGD: rank must be an int >= 1, got 0"),
    (lambda: QSGD(levels=0), r"QSGD: levels must be an int in \[1, 127\]"),
    (lambda: QSGD(levels=200), r"levels must be an int in \[1, 127\] \(int8 payload\), got 200"),
    (lambda: QSGD(bucket_size=0), r"bucket_size must be an int >= 1 or None"),
    (lambda: Cast("int8"), r"Cast: dtype must be one of \['bf16', 'fp16'\], got 'int8'"),
    (lambda: TernGrad(clip_sigma=-1.0), r"clip_sigma must be > 0 or None"),
])
def test_bad_parameters_raise_a_clear_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_by_name_builds_known_compressors_and_lists_them_otherwise():
    assert by_name("dgc", sparsity=0.99) == DGC(sparsity=0.99)
    assert by_name("powersgd").rank == 4
    known = "cast, dense, dgc, onebit, powersgd, qsgd, randomk, signsgd, terngrad, topk"
    with pytest.raises(ValueError, match=f"unknown compressor 'zip'; known: {known}"):
        by_name("zip")


def test_wrong_worker_count_is_a_value_error():
    with pytest.raises(ValueError, match="num_workers=3 but the axis 'dp' has size 4"):
        jax.vmap(lambda g: Dense().reduce(g, (), axis_name="dp", num_workers=3, phase=(),
                                          shared_key=KEY, worker_key=KEY), axis_name="dp")(
            jnp.ones((4, 2)))


# A bf16 matrix and a float32 vector: both dtypes, and both layouts of the matrix methods.
TREE = {"w": ((16, 12), jnp.bfloat16), "b": ((37,), jnp.float32)}


@functools.lru_cache(maxsize=None)
def vmapped_reduce_tree(comp, num_workers):
    """jit(vmap(reduce_tree)) of (stacked grad tree, stacked states, seed)."""
    def run_all(grads, states, seed):
        shared_key = jax.random.fold_in(KEY, seed)
        worker_keys = jax.random.split(jax.random.key(seed), num_workers)
        return jax.vmap(lambda g, s, worker_key: reduce_tree(
            comp, g, s, axis_name="dp", num_workers=num_workers, phase=(),
            shared_key=shared_key, worker_key=worker_key), axis_name="dp")(
                grads, states, worker_keys)
    return jax.jit(run_all)


def tree_run(comp, grads, seed=1):
    """reduce_tree on every worker from init_tree's states: (outputs, old states, new states)."""
    one_worker = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype), grads)
    states = jax.tree.map(lambda a: np.zeros((4, *a.shape), a.dtype), init_tree(comp, one_worker))
    out, new = jax.device_get(vmapped_reduce_tree(comp, 4)(grads, states, seed))
    return out, states, new


@pytest.mark.parametrize("comp", ALL, ids=ids(ALL))
def test_state_round_trips_and_zero_gradients_give_zero(comp):
    for shape, dtype in TREE.values():
        assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(comp.init_state(shape, dtype)))
    grads = {name: normal((4, *shape), dtype=dtype) for name, (shape, dtype) in TREE.items()}
    out, states, new = tree_run(comp, grads)
    for name, (shape, dtype) in TREE.items():
        assert out[name].shape == (4, *shape) and out[name].dtype == dtype
        assert np.all(out[name] == out[name][0])                  # synchronous
    assert jax.tree.structure(new) == jax.tree.structure(states)   # carried across jit calls
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(new)] == \
        [(a.shape, a.dtype) for a in jax.tree.leaves(states)]
    out, _, new = tree_run(comp, jax.tree.map(np.zeros_like, grads))  # no 0/0 anywhere
    assert all(np.all(a == 0) for a in jax.tree.leaves((out, new)))


def test_reduce_tree_folds_the_leaf_index_into_the_keys():
    comp = RandomK(0.25)
    grads = {"w": normal((4, 8)), "b": normal((4, 8), seed=1)}
    out, _, new = tree_run(comp, grads)
    for name in grads:                                             # each leaf conserves mass
        np.testing.assert_allclose(out[name][0] + new[name]["residual"].sum(0),
                                   grads[name].sum(0), atol=1e-5)
    # Same shape, same shared key before folding: the leaves still pick different positions.
    assert not np.array_equal(new["b"]["residual"][0] == 0, new["w"]["residual"][0] == 0)
