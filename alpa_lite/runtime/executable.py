"""One road to run a plan: `compile_plan(plan, step, devices)` returns an executable with
one interface whatever the plan.

Every executable is called with the step's positional arguments and returns what the step
returns; `input_shardings(*args)` says where the plan wants each argument leaf; and
`collectives(*args)` lists what one call of the step executes, read from the compiled
programs (`runtime.hlo.CompiledCollective`: program, kind, bytes, count per step), so a
test compares it with `Plan.collectives()`. Behind it, the engine is chosen from what the
Plan says and nothing else: pipelined plans (`plan.pipeline`) run stage programs on
submeshes, compressed ones (`plan.compression`) run per worker with the compressor's
exchange, the rest as one SPMD program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

from alpa_lite.ir.step_parts import StepParts
from alpa_lite.ir.tracing import TracedStep
from alpa_lite.plan import Plan
from alpa_lite.runtime.compressed import CompressedExecutable
from alpa_lite.runtime.hlo import CompiledCollective
from alpa_lite.runtime.pipeline import PipelineExecutable
from alpa_lite.runtime.spmd import SpmdExecutable


class Executable(Protocol):
    """What every compiled plan offers."""
    plan: Plan

    def __call__(self, *args) -> Any: ...

    def input_shardings(self, *args) -> Any: ...

    def collectives(self, *args) -> tuple[CompiledCollective, ...]: ...


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What the runtime needs of the user's step besides the plan: the function, its trace
    (whole, or split around its gradient call for pipelines) and how compressed runs treat
    it. `parts` is given for pipelined plans, `traced` for the others."""
    fn: Callable
    batch_argnums: tuple[int, ...]
    traced: TracedStep | None = None
    parts: StepParts | None = None
    on_nonfinite: str = "raise"
    compression_seed: int = 0


def compile_plan(plan: Plan, step: StepProgram, devices: Sequence[Any]) -> Executable:
    """The executable of `plan` for `step` on `devices` (cluster device order)."""
    if plan.pipeline is not None:
        if step.parts is None:
            raise ValueError("a pipelined plan needs the step split around its gradient call "
                             "(StepProgram.parts)")
        return PipelineExecutable(step.parts, plan, devices, step.compression_seed)
    if step.traced is None:
        raise ValueError("a single-stage plan needs the traced step (StepProgram.traced)")
    if plan.compression is not None:
        return CompressedExecutable(step.fn, step.traced, plan, devices, step.batch_argnums,
                                    step.on_nonfinite, step.compression_seed)
    return SpmdExecutable(step.traced, plan, devices)
