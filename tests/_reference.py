"""The reference every execution test compares against: the undecorated step under jax.jit."""

import functools
import importlib

import jax
import optax

import alpa_lite as al

STEPS = 5


def example_step(example: str):
    """The plain train step of `example`'s tiny config with SGD momentum, and its first
    arguments: (step function, (params, opt_state, batch))."""
    mod = importlib.import_module(example)
    cfg = mod.CONFIGS["tiny"]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    batch = mod.make_batch(cfg, cfg.batch_size, jax.random.PRNGKey(1))
    return mod.make_train_step(cfg, tx), (params, tx.init(params), batch)


def step_of(loss_fn, tx):
    """The plain train step `(params, opt_state, batch) -> (params, opt_state, loss)` of
    `loss_fn(params, batch)` under the optax transformation `tx`."""
    # The argument names name the plan's tensors (params/..., opt_state/..., batch/...).
    def step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


@functools.lru_cache(maxsize=None)
def reference_run(example: str):
    """`example_step(example)` trained STEPS steps by plain jax.jit.

    Returns (step function, (params, opt_state, batch), losses, final params).
    """
    step, args = example_step(example)
    p, _, losses = run_steps(jax.jit(step), args)
    return step, args, losses, p


def run_steps(step, args, n: int = STEPS):
    """`n` calls of `step(params, opt_state, batch)`; returns (params, opt_state, losses)."""
    p, s, batch = args
    losses = []
    for _ in range(n):
        p, s, loss = step(p, s, batch)
        losses.append(float(loss))
    return p, s, losses
