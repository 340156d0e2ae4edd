"""Finds momentum in the step's optimizer state, which DGC's momentum correction must not meet.

DGC (Lin et al. 2018) with `momentum` > 0 applies momentum SGD's momentum inside the
exchange: each worker accumulates the velocity u = m u + g and the exchange returns the
summed velocities. The step's optimizer must then be plain SGD. An optimizer with momentum
of its own would apply it a second time (each gradient would weigh 1 / (1 - m)^2 = 100
instead of 1 / (1 - m) = 10 at m = 0.9, with a longer lag), and nothing fails visibly: the
run just trains worse.

The traced step names its optimizer-state tensors (`Role.OPT_STATE`) by their pytree path,
e.g. "s/0/trace/w" for `optax.sgd(lr, momentum=0.9)` (optax `TraceState`) or "s/0/mu/w" for
`optax.adam` (`ScaleByAdamState`). `momentum_states` picks those whose path holds a field
of `MOMENTUM_FIELDS` and whose shape is a parameter's (a momentum buffer is shaped like its
parameter; step counts are not). The planner refuses DGC with momentum beside one of them
(`planning.compression.refuse_double_momentum`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from alpa_lite.compression.sparse import DGC

MOMENTUM_FIELDS: dict[str, str] = {
    "trace": "optax TraceState.trace: SGD momentum (optax.sgd(momentum=...), optax.trace)",
    "mu": "a first moment (optax ScaleByAdamState.mu: Adam, AdamW, AMSGrad; Lion, Novograd)",
    "ema": "optax EmaState.ema: an exponential moving average of the updates",
    "momentum": "a momentum buffer",
    "momentum_buffer": "a momentum buffer (PyTorch's name)",
    "exp_avg": "a first moment (PyTorch Adam's name)",
}
"""Optimizer-state field names that hold momentum, and what each is."""

_OTHER_FIELDS = frozenset({"nu", "nu_max", "sum_of_squares", "count"})
"""Optimizer-state fields without momentum (second moments, step counts). The first field
on a path decides: in "s/0/nu/mu" the parameter is named "mu", inside Adam's `nu`."""


@dataclasses.dataclass(frozen=True)
class MomentumState:
    """One optimizer-state tensor found to hold momentum."""
    name: str               # the tensor's name in the step, e.g. "s/0/trace/w"
    field: str              # the path component that matched, e.g. "trace"

    @property
    def kind(self) -> str:
        return MOMENTUM_FIELDS[self.field]


def momentum_states(opt_state: Iterable[tuple[str, tuple[int, ...]]],
                    param_shapes: Iterable[tuple[int, ...]]) -> tuple[MomentumState, ...]:
    """The optimizer-state tensors that hold momentum (module docstring).

    Args:
      opt_state: (name, shape) of each optimizer-state tensor of the step; a name is its
        pytree path with "/" or "." between the parts ("s/0/trace/w", "opt.mu.w").
      param_shapes: the shapes of the step's parameters.
    """
    shapes = {tuple(s) for s in param_shapes}
    found = []
    for name, shape in opt_state:
        if tuple(shape) not in shapes:
            continue
        parts = [p for p in re.split(r"[/.\[\]'\"]+", name) if p]
        field = next((p for p in parts if p in MOMENTUM_FIELDS or p in _OTHER_FIELDS), None)
        if field in MOMENTUM_FIELDS:
            found.append(MomentumState(name, field))
    return tuple(found)


def dgc_with_momentum(compression) -> tuple[DGC, ...]:
    """The DGC compressors with momentum > 0 that `compression` may run: itself, the one
    a wrapper holds (`compressor`: DelayedAveraging, LocalSGD) or those an
    `AutoCompression` may choose (`allow`)."""
    if isinstance(compression, DGC):
        return (compression,) if compression.momentum > 0 else ()
    found: tuple[DGC, ...] = ()
    for option in getattr(compression, "allow", ()):
        found += dgc_with_momentum(option)
    inner = getattr(compression, "compressor", None)
    return found + (dgc_with_momentum(inner) if inner is not None else ())
