"""Tracing: nested calls inlined, loops kept whole, FLOPs counted from shapes, gradient
leaves kept on their tensors."""

import dataclasses

import gpt
import jax
import jax.numpy as jnp
import optax
import pytest

import alpa_lite as al
from alpa_lite.ir.graph import Role
from alpa_lite.ir.op_rules import dim_labels, enumerate_assignments
from alpa_lite.ir.tracing import trace


def _graph(fn, *args):
    return trace(fn, args, batch_argnums=()).graph


def _prims(graph):
    return [n.primitive for n in graph.nodes]


def test_dot_general_flops_with_batch_dims():
    a = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)     # (batch, m, k)
    b = jax.ShapeDtypeStruct((4, 16, 32), jnp.float32)    # (batch, k, n)
    g = _graph(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), a, b)
    (dot,) = [n for n in g.nodes if n.primitive == "dot_general"]
    assert dot.flops == 2 * (4 * 8 * 32) * 16              # 2 x output size x contracted


def test_conv_flops():
    x = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)    # NHWC
    w = jax.ShapeDtypeStruct((3, 3, 3, 8), jnp.float32)      # HWIO

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    (c,) = _graph(conv, x, w).nodes
    assert c.flops == 2 * (2 * 16 * 16 * 8) * 3 * (3 * 3)    # 2 x out x in-features x window


def test_a_scan_kept_whole_is_one_node_costed_body_times_length():
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)

    def loop(x):     # element-wise work only: stays a loop
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.sin(c) * c, x)
    g = _graph(loop, x)
    scans = [n for n in g.nodes if n.primitive == "scan"]
    assert len(scans) == 1 and "sin" not in _prims(g)
    assert scans[0].flops >= 5 * 2 * 8 * 8


def test_a_scan_over_matrix_work_is_unrolled():
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)

    def loop(x):
        return jax.lax.fori_loop(0, 5, lambda i, c: c @ c, x)
    g = _graph(loop, x)
    assert "scan" not in _prims(g)
    assert sum(n.primitive == "dot_general" for n in g.nodes) == 5


def test_nested_calls_are_inlined():
    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2

    @jax.custom_vjp
    def custom(x):
        return x * 3
    custom.defvjp(lambda x: (x * 3, None), lambda _, g: (g * 3,))

    def f(x):
        return jax.checkpoint(lambda y: jnp.cos(y))(inner(x)) + custom(x) + jax.nn.relu(x)
    g = _graph(f, jax.ShapeDtypeStruct((4,), jnp.float32))
    prims = set(_prims(g))
    assert {"sin", "cos", "mul", "max"} <= prims
    assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2"}


def test_dead_code_is_dropped():
    def f(x):
        unused = jnp.exp(x) * 7    # noqa: F841  (traced, then unused)
        return x + 1
    g = _graph(f, jax.ShapeDtypeStruct((4,), jnp.float32))
    assert _prims(g) == ["add"]


def test_renumbering_carries_every_field():
    # Renumbering builds tensors and nodes by their constructors (for speed); a field
    # added to either must be carried, as dataclasses.replace would.
    def f(x, w):
        with jax.named_scope("block"):
            return jnp.sum(jax.nn.relu(x @ w))
    g = _graph(f, jax.ShapeDtypeStruct((4, 8), jnp.float32),
               jax.ShapeDtypeStruct((8, 2), jnp.float32))
    assert any(n.scope for n in g.nodes) and any(n.params for n in g.nodes)
    for t in g.tensors:
        assert t.renumbered(t.id + 7) == dataclasses.replace(t, id=t.id + 7)
    for n in g.nodes:
        assert n.renumbered(n.id + 7) == dataclasses.replace(n, id=n.id + 7)
        assert n.renumbered(3, (None, 1), (2,)) == \
            dataclasses.replace(n, id=3, inputs=(None, 1), outputs=(2,))


def test_fingerprint_is_stable_and_shape_sensitive():
    def f(x):
        return jnp.tanh(x) @ x.T
    a = trace(f, (jax.ShapeDtypeStruct((4, 4), jnp.float32),), ())
    b = trace(f, (jax.ShapeDtypeStruct((4, 4), jnp.float32),), ())
    c = trace(f, (jax.ShapeDtypeStruct((8, 4), jnp.float32),), ())
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_matmul_strategies_respect_divisibility():
    # (6 x 16) @ (16 x 4) on a 4-device axis: 6 and 4... only dims divisible by 4 split.
    labels = dim_labels("dot_general", {"dimension_numbers": (((1,), (0,)), ((), ()))},
                        [(6, 16), (16, 4)], [(6, 4)])
    assigns = enumerate_assignments(labels, [("y", 4)])
    sizes = sorted(labels.sizes[l] for a in assigns for l in a)
    assert sizes == [4, 16]        # split k (16) or n (4), never m (6); plus replicated
    assert {} in assigns


@pytest.mark.parametrize("src, dst, ok", [((8, 6), (2, 4, 6), True), ((4, 6), (24,), True)])
def test_reshape_labels_carry_the_major_split(src, dst, ok):
    labels = dim_labels("reshape", {"new_sizes": dst, "dimensions": None}, [src], [dst])
    assert (labels is not None) == ok
    shared = set(labels.operands[0]) & set(labels.outputs[0]) - labels.fixed
    assert labels.operands[0][0] in shared   # the leading dimension's split carries over


def test_gradient_leaves_name_the_gradients_after_dead_code_is_dropped():
    """`TracedStep.grad_leaves` holds tensor ids, which dead-code elimination renumbers:
    each leaf must still be its parameter's gradient (same shape, role GRAD), in the
    order the gradient pytree flattens. GPT's step leaves dead equations (a jvp's unused
    tangent seeds), so the ids do move."""
    cfg = gpt.CONFIGS["tiny"]
    tx = optax.adamw(1e-3)
    step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.DataParallel())
    args = gpt.abstract_args(cfg, 8, tx)
    traced = step.trace(*args)
    (leaves,) = traced.grad_leaves
    params = jax.tree.leaves(args[0])
    assert len(leaves) == len(params)
    for t, p in zip(leaves, params):
        tensor = traced.graph.tensors[t]
        assert tensor.role is Role.GRAD and tuple(tensor.shape) == tuple(p.shape)
    assert len(set(leaves)) == len(leaves) == len(traced.graph.tensors_with_role(Role.GRAD))
