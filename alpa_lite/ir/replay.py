"""The one replay loop: runs traced graph nodes on values, optionally pinning shardings.

The single-stage runtime replays a whole step with it, the pipeline runtime each stage's
forward and backward, and `step_parts` each stage program's `jax.vjp` when tracing it.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from alpa_lite.ir.tracing import TracedStep


def replay(traced: TracedStep, node_ids: Sequence[int], env: dict[int, Any],
           tensor_sharding: dict | None = None, operand_sharding: dict | None = None) -> None:
    """Runs graph nodes in order, reading and writing `env` (tensor id -> value); with
    shardings, pins results and resharded operands with `with_sharding_constraint`."""
    wsc = jax.lax.with_sharding_constraint
    g = traced.graph
    for i in node_ids:
        node, prim = g.nodes[i], traced.primitives[i]
        with jax.named_scope(node.name):
            args = []
            for pos, t in enumerate(node.inputs):
                if t is None:
                    x = traced.literals[(node.id, pos)]
                elif t in env:
                    x = env[t]
                else:
                    x = traced.consts[t]
                s = operand_sharding.get((node.id, pos)) if operand_sharding else None
                args.append(x if s is None else wsc(x, s))
            outs = prim.bind(*args, **prim.get_bind_params(dict(node.params)))
            if not prim.multiple_results:
                outs = [outs]
            for t, o in zip(node.outputs, outs):
                s = tensor_sharding.get(t) if tensor_sharding else None
                env[t] = o if s is None else wsc(o, s)
