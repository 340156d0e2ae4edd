"""Gradient compressors for the data-parallel all-reduce, and helpers to apply them to a pytree.

Each compressor (see `base.Compressor`) turns one worker's gradient leaf into a compressed
exchange over a named axis and returns the sum over workers. `reduce_tree` and `init_tree`
apply one compressor to every leaf of a gradient pytree; `by_name` builds one from its id.

Example, 4 workers simulated with vmap:

    comp = TopK(ratio=0.1)
    states = jax.vmap(lambda g: init_tree(comp, g))(grads)       # grads stacked on dim 0
    step = lambda g, s, k: reduce_tree(comp, g, s, axis_name="dp", num_workers=4, phase=(),
                                       shared_key=key, worker_key=k)
    summed, states = jax.vmap(step, axis_name="dp")(grads, states, jax.random.split(key, 4))
"""

from __future__ import annotations

import dataclasses

import jax

from alpa_lite.compression.auto import AutoCompression, common_lossy
from alpa_lite.compression.base import Compressor
from alpa_lite.compression.delayed import DelayedAveraging
from alpa_lite.compression.dense import Cast, Dense
from alpa_lite.compression.local_sgd import LocalSGD
from alpa_lite.compression.onebit import OneBit, SignSGD
from alpa_lite.compression.powersgd import PowerSGD
from alpa_lite.compression.sparse import DGC, RandomK, TopK
from alpa_lite.compression.stochastic import QSGD, TernGrad

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (Dense, Cast, TopK, RandomK, DGC, PowerSGD, OneBit, SignSGD, TernGrad, QSGD)
}
"""Every compressor class by its `name`."""


def by_name(name: str, **kwargs) -> Compressor:
    """The compressor `name` (e.g. "dgc") built with `kwargs` as its parameters."""
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(sorted(COMPRESSORS))}")
    return COMPRESSORS[name](**kwargs)


def to_config(method) -> dict:
    """A JSON-able description of a compressor, a DelayedAveraging or a LocalSGD setting."""
    if isinstance(method, DelayedAveraging):
        return {"name": DelayedAveraging.name, "delay": method.delay,
                "compressor": to_config(method.compressor)}
    if isinstance(method, LocalSGD):
        return {"name": LocalSGD.name, "every": method.every,
                "warmup_steps": method.warmup_steps, "compressor": to_config(method.compressor)}
    if not isinstance(method, Compressor):
        raise TypeError(f"not a compression method: {method!r}")
    params = {}
    for f in dataclasses.fields(method):
        v = getattr(method, f.name)
        params[f.name] = list(v) if isinstance(v, tuple) else v
    return {"name": method.name, "params": params}


def from_config(config: dict):
    """The method `to_config` described."""
    if config.get("name") == DelayedAveraging.name:
        return DelayedAveraging(delay=int(config["delay"]),
                                compressor=from_config(config["compressor"]))
    if config.get("name") == LocalSGD.name:
        return LocalSGD(every=int(config["every"]), warmup_steps=int(config["warmup_steps"]),
                        compressor=from_config(config["compressor"]))
    params = {k: tuple(v) if isinstance(v, list) else v
              for k, v in config.get("params", {}).items()}
    return by_name(str(config.get("name")), **params)


def init_tree(compressor: Compressor, grads_like):
    """Per-leaf states for a gradient pytree (arrays or `jax.ShapeDtypeStruct`s)."""
    return jax.tree.map(lambda g: compressor.init_state(tuple(g.shape), g.dtype), grads_like)


def reduce_tree(compressor: Compressor, grads, states, *, axis_name: str, num_workers: int,
                phase, shared_key, worker_key):
    """`compressor.reduce` on every leaf; returns (summed grads, new states).

    `states` is what `init_tree` returned for `grads`. Leaf i gets both keys folded with i,
    so leaves draw independent random numbers.
    """
    leaves, treedef = jax.tree.flatten(grads)
    leaf_states = treedef.flatten_up_to(states)
    summed, new_states = [], []
    for i, (grad, state) in enumerate(zip(leaves, leaf_states)):
        total, state = compressor.reduce(
            grad, state, axis_name=axis_name, num_workers=num_workers, phase=phase,
            shared_key=jax.random.fold_in(shared_key, i),
            worker_key=jax.random.fold_in(worker_key, i))
        summed.append(total)
        new_states.append(state)
    return treedef.unflatten(summed), treedef.unflatten(new_states)


__all__ = [
    "AutoCompression",
    "COMPRESSORS",
    "DelayedAveraging",
    "common_lossy",
    "Cast",
    "Compressor",
    "DGC",
    "Dense",
    "LocalSGD",
    "OneBit",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "SignSGD",
    "TernGrad",
    "TopK",
    "by_name",
    "from_config",
    "to_config",
    "init_tree",
    "reduce_tree",
]
