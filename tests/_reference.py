"""The reference every execution test compares against: the undecorated step under jax.jit."""

import functools
import importlib

import jax
import optax

STEPS = 5


@functools.lru_cache(maxsize=None)
def reference_run(example: str):
    """The tiny config of `example`, trained STEPS SGD-momentum steps by plain jax.jit.

    Returns (step function, (params, opt_state, batch), losses, final params).
    """
    mod = importlib.import_module(example)
    cfg = mod.CONFIGS["tiny"]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    batch = mod.make_batch(cfg, cfg.batch_size, jax.random.PRNGKey(1))
    opt_state = tx.init(params)
    step = mod.make_train_step(cfg, tx)
    p, _, losses = run_steps(jax.jit(step), (params, opt_state, batch))
    return step, (params, opt_state, batch), losses, p


def run_steps(step, args, n: int = STEPS):
    """`n` calls of `step(params, opt_state, batch)`; returns (params, opt_state, losses)."""
    p, s, batch = args
    losses = []
    for _ in range(n):
        p, s, loss = step(p, s, batch)
        losses.append(float(loss))
    return p, s, losses
