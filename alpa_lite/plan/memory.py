"""The whole-stage memory estimate a plan carries: per device, bytes, by what holds them.

`alpa_lite.planning.memory` computes it from the traced program and the chosen shardings;
`StagePlan.memory` records it and `StagePlan.peak_memory_bytes` is its `total`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device of a stage holds at the stage's peak, split by what they are.

    Attributes:
      params: parameter buffers (and, where the runtime does not donate them, the updated
        copies the step returns), each divided over the mesh axes that split it.
      grads: parameter gradients live at the peak (pipelines: the per-step accumulators).
      optimizer_state: optimizer state (and its updated copy when not donated), sharded as
        the plan places it (ZeRO: split over dp).
      activations: batch leaves, intermediate values and step results live at the peak
        (pipelines: the stashed inputs, and without remat the residuals, of every
        micro-batch the schedule holds at once).
      workspace: transient buffers: a resharded operand's copy (an all-gathered weight)
        at the operator that reads it; pipelines: what one micro-batch's forward and
        backward need beyond the stash.
      compression_state: a compressed gradient exchange's state kept across steps
        (error-feedback residuals, warm starts; `StagePlan.exchange`).
      micro_batches_held: micro-batches whose activations a pipelined stage holds at once
        (1F1B: min(stages - stage index, m); GPipe: m); 1 for a single-stage plan.
    """
    params: float = 0.0
    grads: float = 0.0
    optimizer_state: float = 0.0
    activations: float = 0.0
    workspace: float = 0.0
    micro_batches_held: int = 1
    compression_state: float = 0.0

    @property
    def total(self) -> float:
        """Per-device peak bytes: the sum of the parts."""
        return self.params + self.grads + self.optimizer_state + self.activations + \
            self.workspace + self.compression_state

    def to_json(self) -> dict[str, Any]:
        return {"params": float(self.params), "grads": float(self.grads),
                "optimizer_state": float(self.optimizer_state),
                "activations": float(self.activations), "workspace": float(self.workspace),
                "micro_batches_held": int(self.micro_batches_held),
                "compression_state": float(self.compression_state),
                "total": float(self.total)}

    @staticmethod
    def from_json(o: dict[str, Any]) -> MemoryEstimate:
        return MemoryEstimate(params=float(o["params"]), grads=float(o["grads"]),
                              optimizer_state=float(o["optimizer_state"]),
                              activations=float(o["activations"]),
                              workspace=float(o["workspace"]),
                              micro_batches_held=int(o.get("micro_batches_held", 1)),
                              compression_state=float(o.get("compression_state", 0.0)))

    def describe(self) -> str:
        """One line: "1.200 GiB = params 0.400 + grads 0.400 + ... GiB"."""
        unit, scale = _unit(self.total)
        return (f"{self.total / scale:.3f} {unit} = params {self.params / scale:.3f} + grads "
                f"{self.grads / scale:.3f} + optimizer state {self.optimizer_state / scale:.3f}"
                f" + activations {self.activations / scale:.3f} + workspace "
                f"{self.workspace / scale:.3f}"
                + (f" + compression state {self.compression_state / scale:.3f}"
                   if self.compression_state else "") + f" {unit}")


def _unit(nbytes: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return unit, scale
    return "KiB", 2**10


def format_bytes(nbytes: float) -> str:
    """"1.500 GiB", "12.000 MiB" or "3.000 KiB"."""
    unit, scale = _unit(nbytes)
    return f"{nbytes / scale:.3f} {unit}"
