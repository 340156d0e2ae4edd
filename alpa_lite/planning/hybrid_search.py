"""`Auto()` with `AutoCompression`: hybrid layouts with compressed data parallelism.

Across slow links (sites joined by a WAN, nodes by 25 Gbit/s Ethernet) the sane plan for a
large model is fast parallelism inside a site or node (tensor or pipeline parallelism)
and data parallelism across, with its once-per-step gradient exchange compressed. The
pure data-parallel compressed plan (`planning.compression`) holds the whole model on
every device, and the uncompressed search never compresses, so neither finds it.

`hybrid_layouts` lists the Megatron dp x tp x pp layouts with dp > 1 and tensor or
pipeline parallelism, each with a micro-batch count (one for pp = 1; for pipelines the
smallest count of at least 4 x pp, Megatron-LM's rule of thumb for a bubble under 20%,
that leaves every replica at least two examples per micro-batch). `best_hybrid` plans
each with the compression asked for (the planner picks the compressor per stage and per
gradient, `planning.stage_exchange`) and keeps the fastest that fits.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from alpa_lite.errors import PlanningError
from alpa_lite.plan import Plan
from alpa_lite.plan.methods import Manual, megatron_grid

MIN_EXAMPLES_PER_REPLICA = 2    # JAX treats size-1 dimensions specially (`ir.step_parts`)
MICRO_BATCHES_PER_STAGE = 4     # Megatron-LM (Narayanan et al. 2021): m >= 4 pp


@dataclasses.dataclass(frozen=True)
class HybridOutcome:
    """One layout weighed: its plan, or why it has none."""
    layout: Manual
    plan: Plan | None
    note: str = ""

    @property
    def step_time_s(self) -> float | None:
        return None if self.plan is None else self.plan.step_time_s


def micro_batch_count(batch: int, dp: int, pp: int) -> int | None:
    """The micro-batch count of a dp x pp layout (module docstring); None: none works."""
    if pp == 1:
        return 1 if batch % dp == 0 and batch // dp >= MIN_EXAMPLES_PER_REPLICA else None
    valid = [m for m in range(pp, batch + 1)
             if batch % (m * dp) == 0 and batch // (m * dp) >= MIN_EXAMPLES_PER_REPLICA]
    if not valid:
        return None
    enough = [m for m in valid if m >= MICRO_BATCHES_PER_STAGE * pp]
    return min(enough) if enough else max(valid)


def hybrid_layouts(num_devices: int, devices_per_node: int, batch: int) -> list[Manual]:
    """The dp x tp x pp layouts with dp > 1 beside tensor or pipeline parallelism."""
    out = []
    for dp, tp, pp in megatron_grid(num_devices, devices_per_node):
        if dp < 2 or (tp == 1 and pp == 1):
            continue
        m = micro_batch_count(batch, dp, pp)
        if m is not None:
            out.append(Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=m))
    return out


def best_hybrid(layouts: list[Manual], plan_layout: Callable[[Manual], Plan],
                budget_bytes: float) -> tuple[Plan | None, tuple[HybridOutcome, ...]]:
    """The fastest plan among `layouts` (planned by `plan_layout`) that fits
    `budget_bytes` per device, and what each layout gave."""
    best, outcomes = None, []
    for layout in layouts:
        try:
            plan = plan_layout(layout)
        except PlanningError as e:
            outcomes.append(HybridOutcome(layout, None, " ".join(str(e).split())[:200]))
            continue
        fits = plan.peak_memory_bytes <= budget_bytes
        outcomes.append(HybridOutcome(layout, plan, "" if fits else "over the memory budget"))
        if fits and (best is None or plan.step_time_s < best.step_time_s):
            best = plan
    return best, tuple(outcomes)
