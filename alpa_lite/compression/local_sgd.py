"""Local SGD (periodic parameter averaging), optionally post-local, with a compressed exchange.

Each worker takes its own optimizer steps on the gradient of its own share of the batch, with
no gradient exchange; every H (`every`) steps the workers average their PARAMETERS (Stich
2019, "Local SGD converges fast and communicates little"; Lin et al. 2020, "Don't use large
mini-batches, use local SGD"). Post-local SGD (Lin et al. 2020, section 3) runs the first
`warmup_steps` steps as plain synchronous SGD (exact all-reduce of the gradients) and only
then switches to local steps: the early phase, where the loss drops fast and the
generalisation gap is decided later, gets the large-batch gradient.

Worker j at step t (counted from 0 by the executable) applies its optimizer to

    g_j = n * loss_scale * (gradient of its own loss on its share)

(for a mean loss, loss_scale = 1/n: its own mean gradient), so that the mean of the workers'
gradients is the synchronous gradient. After the local step of every step t with
(t - warmup_steps + 1) % H == 0, the parameters are averaged:

    Dense():       w_j <- (1/n) sum_k w_k
    a lossy one:   d_j = w_j - a  (a: the last average, the same on every worker)
                   a <- a + (1/n) C(sum_k d_k),   w_j <- a

where C is the compressor's exchange (with error feedback where it has it: what a worker's
delta did not send is kept in its residual and sent with the next delta). With Dense the
two lines are the same average; the runtime computes the first (no copy of `a` is kept).

Optimizer state is NOT averaged: each worker keeps its own (momentum, Adam moments), as in
the papers. So with an optimizer whose update is linear in its state and gradient (SGD,
with or without momentum), H = 1 with Dense gives exactly the synchronous run; with Adam it
does not.

This module holds the setting and its schedule; the runtime (`alpa_lite.runtime.compressed`)
keeps the workers' parameters and optimizer states (stacked over workers), and, for a
lossy exchange, the last average `a` and the compressor's residuals.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from alpa_lite.compression.base import Compressor, require_synchronous
from alpa_lite.compression.dense import Dense


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Average the workers' parameters every `every` steps; local optimizer steps between.

    What a call of the parallelized step returns (it is precise because the workers'
    models differ between averages):

    * the parameters and everything else the step carries from call to call (optimizer
      state, batch-norm statistics): worker 0's copy. Right after an averaging step (and
      after every warm-up step) worker 0's parameters ARE the average every worker holds;
      after a local step they are worker 0's own model. Evaluate after an averaging step.
      Passing back what the step returned lets every worker go on from its own copy;
      passing anything else restarts every worker from that value (and makes it the last
      average).
    * the loss: on warm-up and averaging steps the global loss (as without compression);
      on a local step worker 0's loss on its share of the batch, scaled like the global one
      (n x loss_scale x its own: for a mean loss, its own mean), since reporting the mean
      would move bytes between workers on a step meant to move none.

    Args:
      every: H >= 1, steps between parameter averages (H = 1: every step).
      warmup_steps: steps of synchronous SGD first (post-local SGD); 0: local from the start.
      compressor: how the parameter deltas travel (default `Dense()`: an exact all-reduce of
        the parameters); a synchronous compressor. Compressors built for gradients apply to
        the delta as is; DGC's momentum correction treats its input as a gradient and is
        refused (use `DGC(..., momentum=0.0)`).

    Example:
        al.parallelize(step, method=al.DataParallel(),
                       compression=LocalSGD(every=8, warmup_steps=100,
                                            compressor=PowerSGD(rank=2)))
    """

    every: int
    warmup_steps: int = 0
    compressor: Compressor = Dense()

    name: ClassVar[str] = "local_sgd"
    lossy: ClassVar[bool] = True      # local steps change the optimisation path

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"LocalSGD: every must be an int >= 1 (steps between parameter "
                             f"averages), got {self.every!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ValueError(f"LocalSGD: warmup_steps must be an int >= 0 (synchronous steps "
                             f"before local ones), got {self.warmup_steps!r}")
        require_synchronous("LocalSGD", self.compressor, "the average")
        if getattr(self.compressor, "momentum", 0.0):
            raise ValueError(f"LocalSGD: {self.compressor.name}'s momentum correction treats "
                             f"what it sends as a gradient, but local SGD sends parameter "
                             f"deltas; pass it with momentum=0.0")

    def is_warmup(self, step: int) -> bool:
        """Whether step `step` (from 0) is a synchronous warm-up step."""
        return step < self.warmup_steps

    def averages_at(self, step: int) -> bool:
        """Whether step `step` (from 0) ends by averaging the parameters (never a warm-up
        step: those all-reduce the gradients instead)."""
        return step >= self.warmup_steps and (step - self.warmup_steps + 1) % self.every == 0

    def describe(self) -> str:
        warm = f" after {self.warmup_steps} synchronous steps" if self.warmup_steps else ""
        how = ("an exact all-reduce of the parameters" if self.compressor == Dense()
               else f"deltas since the last average as {self.compressor.describe()}")
        period = "every step" if self.every == 1 else f"every {self.every} steps"
        return f"local SGD H={self.every}{warm}: parameters averaged {period}, {how}"
