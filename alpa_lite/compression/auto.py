"""`compression="auto"`: the planner picks how gradients travel, from what the user allows.

Lossy methods change the optimisation, so the planner only chooses among the candidates the
user listed; the plain all-reduce (no compression) is always a candidate, and with no list
(`compression="auto"`) it is the only one. The plan names the choice and the estimated time
it saves (`Plan.compression`).
"""

from __future__ import annotations

import dataclasses

from alpa_lite.compression.base import Compressor
from alpa_lite.compression.delayed import DelayedAveraging
from alpa_lite.compression.local_sgd import LocalSGD
from alpa_lite.compression.dense import Cast
from alpa_lite.compression.onebit import OneBit
from alpa_lite.compression.powersgd import PowerSGD
from alpa_lite.compression.sparse import DGC


def common_lossy() -> tuple:
    """A starting set of lossy candidates, each with its paper's usual setting. DGC comes
    without its momentum correction (the planner cannot know whether the step's optimizer
    already has momentum; DGC's would add to it)."""
    dgc = DGC(sparsity=0.999, momentum=0.0)
    return (Cast("bf16"), PowerSGD(rank=4), dgc, OneBit(),
            DelayedAveraging(delay=4), DelayedAveraging(delay=4, compressor=dgc))


@dataclasses.dataclass(frozen=True)
class AutoCompression:
    """Let the planner choose per data-parallel axis among `allow` and no compression.

    A lossy method must make the estimated step at least `min_speedup` times faster than
    the exact all-reduce to be chosen: it costs accuracy (bench/compression_convergence.py),
    and where the exchange is a small part of the step (NVLink) a few percent is not worth
    it, nor within what the cost model can resolve.

    Args:
      allow: the compressors, delayed-averaging and local-SGD settings the planner may
        use, e.g. `common_lossy()` (which holds no LocalSGD: averaging parameters every H
        steps changes the optimisation more than a compressor, so only a user lists it);
        empty: only exact exchange.
      min_speedup: the least step-time ratio (exact / lossy) that justifies a lossy method.
    """

    allow: tuple = ()
    min_speedup: float = 1.2

    def __post_init__(self):
        object.__setattr__(self, "allow", tuple(self.allow))
        if not self.min_speedup >= 1.0:
            raise ValueError(f"AutoCompression: min_speedup must be >= 1, got "
                             f"{self.min_speedup!r}")
        for c in self.allow:
            if not isinstance(c, (Compressor, DelayedAveraging, LocalSGD)):
                raise ValueError(f"AutoCompression: {c!r} is not a compressor, a "
                                 "DelayedAveraging or a LocalSGD setting")
