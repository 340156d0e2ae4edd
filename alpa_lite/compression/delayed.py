"""Delayed gradient averaging (Zhu et al. 2021): hide the all-reduce's latency behind D steps.

Worker j at step i applies

    w_j <- w_j - lr * (g_{i,j} - g_{i-D,j} + avg_{i-D})

its own fresh gradient, corrected by the average of step i-D's gradients, which had D steps
to arrive. Each worker's parameters drift from the others' by its last D local gradients
(the correction keeps the drift bounded; without it, applying stale averages alone loses
accuracy, as the paper's table shows). The exchange itself may be compressed.

This module holds the setting; the runtime (`alpa_lite.runtime.compressed`) keeps, per
worker, its parameters, the last D local gradients and the last D averages.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from alpa_lite.compression.base import Compressor, require_synchronous
from alpa_lite.compression.dense import Dense


@dataclasses.dataclass(frozen=True)
class DelayedAveraging:
    """Apply the average of step i's gradients at step i + `delay`, with the correction term.

    Args:
      delay: D >= 1 steps between sending a gradient and applying its average.
      compressor: how the averages travel (default `Dense()`: exact); a synchronous one.
    """

    delay: int = 4
    compressor: Compressor = Dense()

    name: ClassVar[str] = "delayed"
    lossy: ClassVar[bool] = True          # stale averages change the optimisation path

    def __post_init__(self):
        if not (isinstance(self.delay, int) and self.delay >= 1):
            raise ValueError(f"DelayedAveraging: delay must be an int >= 1, got {self.delay!r}")
        require_synchronous("DelayedAveraging", self.compressor, "the averages")

    def describe(self) -> str:
        return f"delayed averaging D={self.delay}, exchanged as {self.compressor.describe()}"
