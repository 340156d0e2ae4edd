"""`Auto()` with nothing set: one SPMD stage or a pipeline, and how many micro-batches.

`search_auto(method, batch, space)` weighs the single-stage plan (`planning.spmd`) against
the stage DP's pipelines (`planning.pipeline`) over the micro-batch counts that divide the
batch, and the Megatron dp x tp x pp layouts of the best count (`_textbook`), and returns
the fastest plan on the whole-step estimate that fits the memory budget, with
`Plan.choices` saying what was chosen and the runner-up it beat. Inside each candidate the
planners choose the rest (stages, meshes, remat, shardings). The module knows nothing of
JAX: `SearchSpace` holds the planners as callbacks.

Which micro-batch counts are planned. A pipelined plan costs a trace at the micro-batch
size and a stage search, so the counts are not all planned. Memory only falls as m grows
(each micro-batch holds fewer activations), and the estimated step first falls (a smaller
bubble) then rises (smaller, less efficient kernels, more per-micro-batch overheads). The
search therefore starts at the middle divisor (for a power of two, the middle on a log
scale), bisects the larger counts for one that fits if it does not, and then walks to a
neighbour that is faster while one is. The likelier side is tried first, and where it is
faster the walk moves on without planning the other: a count is certified a local optimum
by its two neighbours only where the walk stops. From a pipeline of several stages that
is the larger count (the bubble falls as m grows; GPT-39B on 64 V100s: 256, 512 and 1024
planned, not 128 as well); from one stage the smaller (no bubble, and larger
micro-batches run more efficiently; the counts below a one-stage optimum are all planned
anyway, see below). The step is not unimodal in m where memory forces
recomputation: a count that fits only with remat can lose to a larger one whose smaller
micro-batches fit without it (GPT-6.7B on 16 V100s: 57.08 s at m=128 with remat, 56.23 s
at m=512 without, 256 between them slower than both). So while the fastest plan found
recomputes somewhere, the walk goes on to the next larger count, until a plan recomputes
nowhere or the counts end. Nor is it unimodal in kernel efficiency, which depends on how
the micro-batch divides over the devices (Wide-ResNet-2B on 8 V100s: 6.67 s at m=24,
8.42 s at 32, 7.53 s at 48): so the counts with fewer, larger micro-batches than the
optimum's are all planned where the optimum is one stage (no bubble to grow), down to
the first over the budget (memory only grows as m falls; a count refused for memory
costs a trace and the floor DP, no ILP). A count the model refuses (a group norm whose
groups do not divide the micro-batch) is stepped over, not a wall. Every count planned is
in the plan's explanation (kind "plan"), so a user sees what was weighed;
`Auto(num_micro_batches=m)` plans exactly m. Each count's planning work (its traces,
stage programs and layer solutions) is let go of (`SearchSpace.forget`) once the count is
planned and not the fastest so far: only the fastest count is planned again (its Megatron
layouts), and memory holds two counts' work instead of every count's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from alpa_lite.errors import MemoryBudgetError, PlanningError
from alpa_lite.plan import Alternative, Choice, Explanation, Plan, PlanningStats
from alpa_lite.plan.methods import Auto, Manual, megatron_grid
from alpa_lite.progress import SEARCH, Progress, report


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One whole plan weighed: its label, the plan (None: none was made) and, where none
    was, why (the planner's error)."""
    label: str
    pipelined: bool
    plan: Plan | None
    error: str = ""
    memory: bool = False          # the error was the memory budget
    peak_bytes: float = math.inf  # with it, the smallest peak the planner reached
    micro_batches: int = 0        # the stage DP's pipelines: their count (0: other kinds)

    @property
    def time_s(self) -> float:
        return self.plan.step_time_s if self.plan is not None else math.inf


def micro_batch_counts(batch: int) -> tuple[int, ...]:
    """The micro-batch counts a pipeline may split `batch` into: its divisors (1 included:
    stages in sequence, which can still beat one stage where layers are small)."""
    return tuple(m for m in range(1, batch + 1) if batch % m == 0)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """How `search_auto` plans each kind of candidate, and what it may weigh: the
    callbacks raise PlanningError (MemoryBudgetError where the budget is the reason) or
    ValueError (the step cannot run at that micro-batch size) when no plan is made."""
    plan_single: Callable[[], Plan]
    plan_pipelined: Callable[[int], Plan]          # the stage DP's pipeline of m micro-batches
    plan_textbook: Callable[[Manual], Plan]        # a Megatron-style layout, as given
    # The least peak memory per device any plan of a Megatron-style layout can have
    # (cheap: no ILP), so that layouts that cannot fit are not planned.
    textbook_floor: Callable[[Manual], float]
    num_devices: int
    devices_per_node: int
    budget_bytes: float
    # Drops what planning m micro-batches kept for later candidates of that count (its
    # traces, stage programs and layer solutions), once the search no longer needs it:
    # memory then holds two counts' work, not every count's.
    forget: Callable[[int], None] = lambda m: None


def search_auto(method: Auto, batch: int | None, space: SearchSpace,
                progress: Progress | None = None) -> Plan:
    """The fastest plan that fits among one SPMD stage and pipelines (module docstring).

    Args:
      method: the user's `Auto`; its `pipeline` and `num_micro_batches` narrow the search.
      batch: the step's batch size (None: no batch, nothing to split into micro-batches).
      space: the planners of each candidate, the cluster's size and the memory budget.

    Raises:
      MemoryBudgetError: nothing weighed fits; the message names each candidate's reason
        and the smallest peak reached.
      PlanningError: the step can be planned neither way.
    """
    weighed: list[Candidate] = []
    done = 0

    def tick():
        nonlocal done
        done += 1
        report(progress, SEARCH, done, 0)

    if method.pipeline is not True and method.num_micro_batches is None:
        try:
            weighed.append(Candidate("one SPMD stage", False, space.plan_single()))
        except PlanningError as e:
            weighed.append(Candidate("one SPMD stage", False, None, str(e),
                                     isinstance(e, MemoryBudgetError),
                                     getattr(e, "peak_bytes", math.inf)))
        tick()
    pipelined: dict[int, Candidate] = {}
    held: int | None = None    # the fastest count so far, whose planning work is kept

    def pipeline(m: int) -> float:
        nonlocal held
        if m not in pipelined:
            label = f"pipeline, {m} micro-batches"
            try:
                pipelined[m] = Candidate(label, True, space.plan_pipelined(m), micro_batches=m)
            except (PlanningError, ValueError) as e:
                # ValueError: the model itself refuses this micro-batch size while it is
                # traced (e.g. a group norm whose groups do not divide it).
                pipelined[m] = Candidate(label, True, None, str(e),
                                         isinstance(e, MemoryBudgetError),
                                         getattr(e, "peak_bytes", math.inf), micro_batches=m)
            tick()
            # Only the fastest count so far may be planned again (its Megatron layouts).
            best = min((c for c in pipelined.values() if c.plan is not None),
                       key=lambda c: c.time_s, default=None)
            fastest = best.micro_batches if best is not None else None
            for done in sorted({held, m} - {None, fastest}):
                space.forget(done)
            held = fastest
        return pipelined[m].time_s

    refusal = ""
    if method.num_micro_batches is not None:
        pipeline(method.num_micro_batches)
    elif method.searches_pipelines and batch is not None:
        counts = micro_batch_counts(batch)
        if method.exhaustive:
            for m in counts:
                pipeline(m)
        else:
            refusal = _walk(counts, pipeline, pipelined)
    weighed.extend(pipelined[m] for m in sorted(pipelined))
    best_pipe = min((c for c in pipelined.values() if c.plan is not None),
                    key=lambda c: c.time_s, default=None)
    if best_pipe is not None and batch:
        weighed.extend(_textbook(best_pipe.plan, batch, space, method.schedule or "1f1b",
                                 tick))
    # Both planners return only plans whose whole-stage estimates fit the budget.
    made = [c for c in weighed if c.plan is not None]
    if not made:
        raise _nothing_fits(weighed)
    best = min(made, key=lambda c: (c.time_s, c.plan.pipeline is not None,
                                         c.plan.pipeline.num_micro_batches
                                         if c.plan.pipeline else 0))
    return _with_choices(best, weighed, method, refusal)


def _textbook(dp_plan: Plan, batch: int, space: SearchSpace, schedule: str,
              tick) -> list[Candidate]:
    """The Megatron-style pipelines (dp x tp x pp, layers split evenly) of the stage DP's
    best micro-batch count, with at least its number of stages, planned beside it.

    The DP is exact on what it weighs (per-micro-batch stage latencies, and an even split
    on Megatron's meshes is in its space), so a textbook layout can only win on what it
    does not: the optimizer update, which each stage runs on its share of the parameters,
    and the once-per-step gradient reductions, which both shrink as stages are added. As
    single-stage `Auto` weighs the textbook meshes for the same reason. Each with remat
    only where it does not fit without; a layout whose memory floor (`textbook_floor`, the
    least peak any of its plans can have) is over budget is listed, not planned."""
    m = dp_plan.pipeline.num_micro_batches
    out = []
    for dp, tp, pp in megatron_grid(space.num_devices, space.devices_per_node):
        if pp == 1 or pp < len(dp_plan.stages) or (batch // m) % dp:
            continue
        for remat in (False, True):
            label = f"Megatron dp={dp} tp={tp} pp={pp}, {m} micro-batches" + \
                (", remat" if remat else "")
            layout = Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=m, schedule=schedule,
                            remat=remat)
            try:
                floor = space.textbook_floor(layout)
                if floor > space.budget_bytes:
                    out.append(Candidate(label, True, None,
                                         f"needs at least {floor / 2**30:.2f} GiB per device "
                                         "whatever its shardings (not planned)", True, floor))
                    tick()
                    continue
                plan = space.plan_textbook(layout)
            except (PlanningError, ValueError) as e:
                out.append(Candidate(label, True, None, str(e),
                                     isinstance(e, MemoryBudgetError),
                                     getattr(e, "peak_bytes", math.inf)))
                tick()
                break
            tick()
            if plan.peak_memory_bytes <= space.budget_bytes:
                out.append(Candidate(label, True, plan))
                break
            out.append(Candidate(label, True, None, "does not fit the memory budget", True,
                                 plan.peak_memory_bytes))
    return out


def _walk(counts: tuple[int, ...], pipeline: Callable[[int], float],
          pipelined: dict[int, Candidate]) -> str:
    """Plans the micro-batch counts the search visits (module docstring). Returns why
    pipelines were given up ("" where they were not): a step the pipeline planner refuses
    at the first count (no `al.value_and_grad`, batch statistics) is refused at all."""
    if not counts:
        return ""
    n = len(counts)

    def accepted(j: int) -> bool:
        """Plans counts[j]; False where the model itself refuses it (a group norm whose
        groups do not divide the micro-batch, say): such a count is not a point of the
        curve, and the search steps over it. Over the budget is accepted (and inf)."""
        pipeline(counts[j])
        c = pipelined[counts[j]]
        return c.plan is not None or c.memory

    def neighbour(j: int, step: int) -> int | None:
        """The next count from j in direction step that the model accepts, planned."""
        j += step
        while 0 <= j < n and not accepted(j):
            j += step
        return j if 0 <= j < n else None

    i = n // 2
    if not accepted(i):
        # The whole batch as one micro-batch says whether the step pipelines at all (a
        # model may refuse some micro-batch sizes only).
        if not accepted(0):
            return pipelined[counts[0]].error
        i = 0
    if math.isinf(pipeline(counts[i])):
        # Over the budget: a count that fits (memory falls as m grows), by bisection over
        # the larger counts the model accepts; the walk starts from the first one found.
        lo, hi, found = i + 1, n - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            k = mid                        # the first count from mid on the model accepts
            while k <= hi and not accepted(k):
                k += 1
            if k > hi:
                hi = mid - 1
            elif math.isinf(pipeline(counts[k])):
                lo = k + 1
            else:
                found = k
                break
        if found is None:
            return ""
        i = found

    while True:
        while True:            # to a faster neighbour, while there is one
            here = pipeline(counts[i])
            # The likelier side first; where it is faster, the walk moves on without
            # planning the other (module docstring).
            one_stage = len(pipelined[counts[i]].plan.stages) == 1
            for step in ((-1, 1) if one_stage else (1, -1)):
                j = neighbour(i, step)
                if j is not None and pipeline(counts[j]) < here:
                    i = j
                    break
            else:
                break
        # Past a local optimum that recomputes, more micro-batches may fit without remat
        # (module docstring): plan the next larger count not planned yet, and walk on from
        # it if it is faster.
        best = min((c for c in pipelined.values() if c.plan is not None),
                   key=lambda c: c.time_s)
        largest = pipelined[max(pipelined)]
        done = largest.plan is not None and not _recomputes(largest.plan) or \
            largest.plan is None and not largest.memory
        larger = [j for j in range(i + 1, n) if counts[j] not in pipelined]
        if not _recomputes(best.plan) or done or not larger:
            break
        j = larger[0]
        if pipeline(counts[j]) < here:
            i = j
    # Where the optimum is one stage (gradient accumulation: no bubble), fewer, larger
    # micro-batches change the step only through kernel efficiency and per-micro-batch
    # overheads, and efficiency is not monotone in the micro-batch size (a per-device
    # batch of 6 runs a V100's fp16 tensor cores worse than 4 or 8): a local optimum can
    # hide a faster count behind a slower one (Wide-ResNet-2B on 8 V100s: 7.53 s at
    # m=48, 8.42 s at 32, 6.67 s at 24). So every count with larger micro-batches is
    # planned, down to the first over the budget (memory only grows as m falls). With
    # several stages each micro-batch fewer adds bubble, and the walk's optimum stands
    # (planning every such count cost Wide-ResNet-4B on 16 V100s 3.5x its time).
    if len(best.plan.stages) == 1:       # the loop's best: nothing was planned since
        j = neighbour(counts.index(best.micro_batches), -1)
        while j is not None and pipelined[counts[j]].plan is not None:
            j = neighbour(j, -1)
    return ""


def _recomputes(plan: Plan) -> bool:
    return any(st.remat for st in plan.stages)


def _nothing_fits(weighed: list[Candidate]) -> PlanningError:
    reasons = " | ".join(f"{c.label}: {c.error}" for c in weighed)
    if weighed and all(c.memory for c in weighed):
        return MemoryBudgetError(f"no plan fits the memory budget: {reasons}",
                                 min(c.peak_bytes for c in weighed))
    return PlanningError(f"no plan could be made: {reasons}")


def _with_choices(best: Candidate, weighed: list[Candidate], method: Auto,
                  refusal: str) -> Plan:
    """`best.plan` with the user's method, the search's choices in front of the planner's
    own, and every candidate in its explanation (kind "plan")."""
    plan = best.plan
    def runner_up(pred) -> Candidate | None:
        others = [c for c in weighed if c is not best and pred(c)]
        return min(others, key=lambda c: (c.plan is None, c.time_s), default=None)

    def choice(what: str, value: str, other: Candidate | None, by_user: bool,
               note: str = "") -> Choice:
        if other is None:
            return Choice(what, value, plan.step_time_s, by_user=by_user, note=note)
        return Choice(what, value, plan.step_time_s, runner_up=other.label,
                      runner_up_s=other.time_s if other.plan is not None else None,
                      runner_up_fits=other.plan is not None,
                      by_user=by_user, note=note or other.error[:200])

    piped = plan.pipeline is not None
    pipe_note = refusal and f"pipelines refused: {refusal[:300]}"
    choices = [choice("pipeline",
                      f"{len(plan.stages)} stage(s)" if piped else "no (one SPMD stage)",
                      runner_up(lambda c: c.pipelined != piped),
                      by_user=method.pipeline is not None or method.num_micro_batches is not None,
                      note=pipe_note)]
    if piped:
        textbook = best.label.startswith("Megatron")
        choices.append(choice(
            "stages", best.label if textbook else "stage DP",
            runner_up(lambda c: c.pipelined and c.label.startswith("Megatron") != textbook),
            by_user=False))
        m = plan.pipeline.num_micro_batches
        tried = sorted(c.micro_batches for c in weighed if c.micro_batches)
        choices.append(choice("micro-batches", str(m),
                              runner_up(lambda c: c.micro_batches not in (0, m)),
                              by_user=method.num_micro_batches is not None,
                              note=f"planned m = {', '.join(map(str, tried))}"
                              if len(tried) > 1 else ""))
    alts = tuple(Alternative("plan", -1, c.label, c.time_s if c.plan is not None else 0.0,
                             c.plan.peak_memory_bytes if c.plan is not None else 0.0,
                             c.plan is not None, chosen=c is best) for c in weighed)
    old = plan.explanation or Explanation()
    # A Megatron layout's own choices were the search's, not the user's.
    own = tuple(dataclasses.replace(c, by_user=c.what == "schedule" and method.schedule
                                    is not None) for c in plan.choices)
    return dataclasses.replace(
        plan, method=method, choices=tuple(choices) + own,
        explanation=dataclasses.replace(old, alternatives=alts + old.alternatives),
        stats=_search_stats(plan.stats, [c.plan.stats for c in weighed if c.plan is not None],
                            len(weighed)))


def _search_stats(chosen: PlanningStats, made: list[PlanningStats],
                  weighed: int) -> PlanningStats:
    """The chosen plan's statistics with the work of every plan weighed added up (the
    search is how the plan was found): ILP build and solve time, layer problems solved,
    reused and read from the cache, stage-DP time."""
    def total(name):
        return sum(getattr(s, name) for s in made)
    return dataclasses.replace(
        chosen, build_s=total("build_s"), solve_s=total("solve_s"), dp_s=total("dp_s"),
        layer_ilps=total("layer_ilps"), layer_ilps_reused=total("layer_ilps_reused"),
        layer_cache_hits=total("layer_cache_hits"), plans_weighed=weighed)
