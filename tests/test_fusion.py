"""alpa_lite.planning.fusion: XLA-style fusion groups, their memory traffic and kernel counts.

Each test traces a tiny function (float32 unless said: 4 bytes per element) and checks the
groups, the bytes each group moves (reads of tensors made outside it + results that leave
it) and the element-wise kernels, with the arithmetic written out.
"""

import jax
import jax.numpy as jnp
import numpy as np

from alpa_lite.ir.tracing import trace
from alpa_lite.planning.fusion import fuse


def _graph(fn, *args):
    """The traced graph (bytes per equation: all operands + results) and its fusion."""
    g = trace(fn, args, batch_argnums=(0,)).graph
    return g, fuse(g)


def _prims(g):
    return [n.primitive for n in g.nodes]


def _group_bytes(g, r):
    """Bytes per group; duplicates (broadcasts, free) are groups of one with 0 bytes and
    are left out."""
    out = {}
    for n in g.nodes:
        out[r.group[n.id]] = out.get(r.group[n.id], 0.0) + r.bytes_accessed[n.id]
    return {k: v for k, v in out.items() if v > 0}


def test_elementwise_chain_is_one_kernel():
    # exp(x * 2 + 1) over x (4, 8): three equations, one loop fusion.
    g, r = _graph(lambda x: jnp.exp(x * 2.0 + 1.0), np.ones((4, 8), np.float32))
    assert _prims(g) == ["mul", "add", "exp"]
    assert r.group == (0, 0, 0)
    # Reads x once (32 * 4 = 128 B), writes the result once (128 B); the intermediates
    # stay in registers. Unfused, each equation paid 256 B: 768 B in all.
    assert sum(r.bytes_accessed) == 128 + 128
    assert r.kernels == (1, 0, 0)


def test_reduction_ends_the_fusion():
    # x - sum(x, axis=1): the subtraction needs the finished sum, so it is a second kernel.
    g, r = _graph(lambda x: x - x.sum(axis=1, keepdims=True), np.ones((4, 8), np.float32))
    assert _prims(g) == ["reduce_sum", "broadcast_in_dim", "sub"]
    red, bcast, sub = g.nodes
    assert r.group[sub.id] != r.group[red.id]
    # Kernel 1 reads x (128 B), writes the sums (4 * 4 = 16 B). The broadcast is re-done
    # inside kernel 2 (free), which reads x (128 B) and the sums (16 B), writes 128 B.
    assert r.bytes_accessed[red.id] == 128 + 16
    assert r.bytes_accessed[bcast.id] == 0
    assert r.bytes_accessed[sub.id] == 128 + 16 + 128
    assert r.num_kernels == 2


def test_matmul_is_its_own_kernel_and_bias_broadcast_is_free():
    # tanh(x @ w + b), x (4, 8), w (8, 16), b (16,).
    x, w, b = (np.ones((4, 8), np.float32), np.ones((8, 16), np.float32),
               np.ones((16,), np.float32))
    g, r = _graph(lambda x, w, b: jnp.tanh(x @ w + b), x, w, b)
    assert _prims(g) == ["dot_general", "broadcast_in_dim", "add", "tanh"]
    dot, bcast, add, tanh = g.nodes
    # The matmul keeps its traced bytes: x 128 + w 512 + result 256 = 896 B.
    assert r.bytes_accessed[dot.id] == 128 + 512 + 256
    assert r.group[add.id] == r.group[tanh.id] != r.group[dot.id]
    # The add+tanh kernel reads the matmul result (256 B) and b (16 * 4 = 64 B), not the
    # broadcast (4 x 16) array; writes the result (256 B).
    assert _group_bytes(g, r)[r.group[add.id]] == 256 + 64 + 256
    assert r.bytes_accessed[bcast.id] == 0
    # One element-wise kernel (matmuls are not counted: they pay op_overhead_s).
    assert r.kernels == (0, 0, 1, 0)


def test_cheap_upcast_is_recomputed_not_written():
    # A softmax-like pattern in bf16 (2 bytes per element): y = f32(x); m = max(y);
    # exp(y - m). The upcast is cheap (XLA duplicates it into both fusions), so the f32 y
    # (4 * 8 * 4 = 128 B) is never written: both kernels read the bf16 x (64 B).
    x = np.ones((4, 8), jnp.bfloat16)

    def f(x):
        y = x.astype(jnp.float32)
        return jnp.exp(y - y.max(axis=1, keepdims=True))

    g, r = _graph(f, x)
    assert _prims(g)[:2] == ["convert_element_type", "reduce_max"]
    groups = _group_bytes(g, r)
    assert len(groups) == 2
    first, second = sorted(groups)
    assert groups[first] == 64 + 16            # read x (bf16), write max (4 floats)
    assert groups[second] == 64 + 16 + 128     # read x and max, write the f32 result
    assert r.num_kernels == 2


def test_no_fusion_that_would_make_a_cycle():
    # neg(x) + neg(x) @ w: the add reads neg(x) (group 0) and the matmul's result, which
    # itself depends on group 0; joining group 0 would make group 0 -> matmul -> group 0,
    # so the add is a kernel of its own.
    x = np.ones((4, 4), np.float32)
    g, r = _graph(lambda x, w: -x + (-x) @ w, x, x)
    prims = _prims(g)
    assert prims[-1] == "add" and "dot_general" in prims
    add = g.nodes[-1]
    dot = next(n for n in g.nodes if n.primitive == "dot_general")
    assert r.group[add.id] == add.id
    for n in g.nodes:   # every edge between groups runs forward (no cycles)
        for t in n.inputs:
            p = g.producer(t) if t is not None else None
            if p is not None and r.group[p] != r.group[n.id]:
                assert r.group[p] < r.group[n.id]
    # The add reads -x (64 B) and the matmul result (64 B) and writes 64 B.
    assert r.bytes_accessed[add.id] == 64 + 64 + 64
    assert r.bytes_accessed[dot.id] == 3 * 64


def test_fusion_never_charges_more_than_per_equation():
    # A layer norm + gelu MLP: the fused traffic is at most the per-equation traffic, both
    # in all and per group (a group reads and writes a subset of what its equations do).
    x = np.ones((2, 8, 16), np.float32)
    w = np.ones((16, 64), np.float32)

    def f(x, w):
        m = x.mean(-1, keepdims=True)
        y = (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)
        return jax.nn.gelu(y @ w, approximate=True)

    g, r = _graph(f, x, w)
    assert sum(r.bytes_accessed) < sum(n.bytes_accessed for n in g.nodes)
    per_eq = {}
    for n in g.nodes:
        per_eq[r.group[n.id]] = per_eq.get(r.group[n.id], 0.0) + n.bytes_accessed
    for gid, b in _group_bytes(g, r).items():
        assert b <= per_eq[gid]
    # Kernels: the matmul is not counted; the two reductions each end a fusion, so at
    # least three element-wise kernels (mean, variance, normalise + gelu side).
    assert 3 <= r.num_kernels < len(g.nodes) - 1


def test_a_call_kept_for_its_derivative_rule_fuses_as_its_body():
    # A pipeline's pieces keep jax.nn.relu's custom_jvp call whole (for its derivative at
    # 0); XLA compiles its body, max(x, 0), inlined: one fusion with its neighbours, the
    # same traffic and kernels as the inlined trace. A custom_jvp around a reduction
    # (logsumexp's kind of body) stays its own kernel.
    from alpa_lite.ir.graph import Role
    from alpa_lite.ir.tracing import trace_flat

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)

    def flat(fn):
        g = trace_flat(lambda v: (fn(v),), [x], [Role.BATCH], ["x"]).graph
        return g, fuse(g)

    def fn(v):
        return jax.nn.relu(v * 2.0 + 1.0) * 3.0

    kept, r_kept = flat(fn)
    assert "custom_jvp_call" in _prims(kept)
    inlined, r_inlined = _graph(fn, np.ones((4, 8), np.float32))
    assert "custom_jvp_call" not in _prims(inlined)
    assert len(set(r_kept.group)) == 1
    assert r_kept.num_kernels == r_inlined.num_kernels == 1
    assert sum(r_kept.bytes_accessed) == sum(r_inlined.bytes_accessed) == 2 * 32 * 4

    @jax.custom_jvp
    def total(v):
        return jnp.sum(v, axis=-1, keepdims=True)

    total.defjvp(lambda p, t: (total(p[0]), total(t[0])))
    summed, r_summed = flat(lambda v: total(v * 2.0) + 1.0)
    call = next(n for n in summed.nodes if n.primitive == "custom_jvp_call")
    assert r_summed.group[call.id] == call.id
