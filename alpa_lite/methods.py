"""How a step is parallelized: the planner's search space, as frozen records.

`Auto` lets the planner choose the logical mesh and every sharding. `Manual` fixes a
Megatron-style dp x tp layout; `DataParallel` is `Manual(dp=all devices, tp=1)`. All three go
through the same planner, which pins what the user fixed and optimises the rest, so the
plans are compared on equal terms.
"""

from __future__ import annotations

import dataclasses
import enum


class SolverChoice(enum.Enum):
    CBC = "cbc"
    HIGHS = "highs"


@dataclasses.dataclass(frozen=True)
class Auto:
    """Search logical mesh shapes and per-operator shardings.

    Attributes:
      memory_budget_bytes: per-device memory limit; None means the cluster device's memory.
      solver: the ILP solver.
      time_limit_s: per ILP solve.
      mesh_shapes: logical mesh shapes to try; None means every 2-D factorisation.
    """
    memory_budget_bytes: float | None = None
    solver: SolverChoice = SolverChoice.HIGHS
    time_limit_s: float = 60.0
    mesh_shapes: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise ValueError(f"Auto(memory_budget_bytes={self.memory_budget_bytes}): "
                             "the budget must be a positive number of bytes, or None")
        if not self.time_limit_s > 0:
            raise ValueError(f"Auto(time_limit_s={self.time_limit_s}) must be positive")
        if not isinstance(self.solver, SolverChoice):
            raise TypeError(f"Auto(solver={self.solver!r}): use alpa_lite.methods.SolverChoice")


@dataclasses.dataclass(frozen=True)
class Manual:
    """A Megatron-style plan: batch split dp ways, weights split tp ways.

    Linear layers alternate column and row splits along the forward pass (attention: heads
    split, then the output projection row-split), weights are replicated over dp and their
    gradients all-reduced over dp. With `shard_optimizer_state` the optimizer state is split
    over dp (ZeRO stage 1).
    """
    dp: int = 1
    tp: int = 1
    shard_optimizer_state: bool = False
    solver: SolverChoice = SolverChoice.HIGHS
    time_limit_s: float = 60.0

    def __post_init__(self):
        for name in ("dp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Manual({name}={v!r}): must be a positive integer")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Data parallelism over every device (optionally ZeRO-style optimizer sharding)."""
    shard_optimizer_state: bool = False


Method = Auto | Manual | DataParallel
