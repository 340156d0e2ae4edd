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

A layout whose activations do not fit at that count is not given up: as Megatron-LM users
do, it is planned again with more micro-batches (gradient accumulation where pp = 1) and
then with recomputation, the first variant that fits standing for the layout
(`layout_variants`). A variant whose memory floor (the least peak any of its plans can
have, without an ILP) is over the budget is not planned.
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


def splits(batch: int, dp: int, m: int) -> bool:
    """Whether `batch` splits evenly into m micro-batches over dp replicas, each replica's
    share of a micro-batch at least `MIN_EXAMPLES_PER_REPLICA` examples."""
    return batch % (m * dp) == 0 and batch // (m * dp) >= MIN_EXAMPLES_PER_REPLICA


def micro_batch_count(batch: int, dp: int, pp: int) -> int | None:
    """The micro-batch count of a dp x pp layout (module docstring); None: none works."""
    if pp == 1:
        return 1 if splits(batch, dp, 1) else None
    valid = [m for m in range(pp, batch + 1) if splits(batch, dp, m)]
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


def layout_variants(layout: Manual, batch: int) -> list[Manual]:
    """`layout` at its own micro-batch count and then at every larger one that splits the
    batch evenly over dp with at least two examples per replica, each without and then with
    recomputation: in the order `best_hybrid` tries them (each more micro-batches or
    recomputation holds fewer activations)."""
    counts = [m for m in range(layout.num_micro_batches, batch + 1)
              if splits(batch, layout.dp, m)]
    return [dataclasses.replace(layout, num_micro_batches=m, remat=remat)
            for m in counts for remat in (False, True)]


def best_hybrid(layouts: list[Manual], plan_layout: Callable[[Manual], Plan],
                budget_bytes: float, batch: int,
                floor: Callable[[Manual], float] | None = None
                ) -> tuple[Plan | None, tuple[HybridOutcome, ...]]:
    """The fastest plan among `layouts` (planned by `plan_layout`) that fits
    `budget_bytes` per device, and what each layout gave: its first variant that fits
    (`layout_variants`), or the last one tried. `floor` gives a variant's least possible
    peak memory per device; a variant over budget by it is skipped unplanned."""
    best, outcomes = None, []
    for layout in layouts:
        outcome = None
        for variant in layout_variants(layout, batch):
            try:
                if floor is not None and floor(variant) > budget_bytes:
                    outcome = outcome or HybridOutcome(
                        variant, None, "needs more than the memory budget whatever its "
                        "shardings")
                    continue
                plan = plan_layout(variant)
            except (PlanningError, ValueError) as e:
                # (ValueError: the model refuses this micro-batch size while traced.)
                outcome = HybridOutcome(variant, None, " ".join(str(e).split())[:200])
                break
            fits = plan.peak_memory_bytes <= budget_bytes
            outcome = HybridOutcome(variant, plan, "" if fits else "over the memory budget")
            if fits:
                if best is None or plan.step_time_s < best.step_time_s:
                    best = plan
                break
        if outcome is not None:
            outcomes.append(outcome)
    return best, tuple(outcomes)
