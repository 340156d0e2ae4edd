"""How a step is parallelized: the planner's search space, as frozen records.

`Auto` lets the planner choose the logical mesh and every sharding, and with
`num_micro_batches` also the pipeline stages. `Manual` fixes a Megatron-style
dp x tp x pp layout; `DataParallel` is `Manual(dp=all devices, tp=1)`. All three go through
the same planner, which pins what the user fixed and optimises the rest, so the plans are
compared on equal terms.
"""

from __future__ import annotations

import dataclasses
import enum


class SolverChoice(enum.Enum):
    CBC = "cbc"
    HIGHS = "highs"


SCHEDULES = ("gpipe", "1f1b")


def _check_pipeline_args(owner: str, num_micro_batches, schedule) -> None:
    if num_micro_batches is not None and (not isinstance(num_micro_batches, int)
                                          or isinstance(num_micro_batches, bool)
                                          or num_micro_batches < 1):
        raise ValueError(f"{owner}(num_micro_batches={num_micro_batches!r}): must be a "
                         "positive integer")
    if schedule not in SCHEDULES and not (owner == "Auto" and schedule is None):
        raise ValueError(f"{owner}(schedule={schedule!r}): unknown pipeline schedule; "
                         f"use one of {SCHEDULES}")


@dataclasses.dataclass(frozen=True)
class Auto:
    """Let the planner choose: with nothing set, whether to pipeline, the micro-batches,
    the schedule, the stages (layers, submeshes, logical meshes, remat each) or the single
    stage's mesh, and every sharding, optimizer state included, by the cost model within
    the memory budget. Each attribute set narrows that search; `Plan.choices` says what was
    chosen, whether the user fixed it, and the runner-up it beat.

    Attributes:
      memory_budget_bytes: per-device memory limit; None means the cluster device's memory.
      solver: the ILP solver.
      time_limit_s: per ILP solve.
      mesh_shapes: logical mesh shapes to try; None means every 2-D factorisation.
        Single-stage plans only.
      num_micro_batches: the batch is split into this many micro-batches and the stage DP
        chooses 1..N pipeline stages, their layers, their submeshes and logical meshes,
        and whether each stage recomputes its activations. None: chosen among the divisors
        of the batch (`planning.auto_search`).
      schedule: the pipeline schedule, "1f1b" or "gpipe"; None: 1F1B is planned and GPipe
        weighed on the same stages (`Plan.choices` gives its simulated time and peak
        memory; it holds every micro-batch's activations on every stage).
      num_layers: layers the loss function is clustered into for the stage DP (None:
        chosen automatically, or the `al.mark_layer_boundary` calls when present).
      max_stages: at most this many pipeline stages (None: no limit beyond layers and
        devices).
      pipeline: None lets the planner weigh one SPMD stage over all devices against
        pipelines; False plans the single stage only (intra-op only); True pipelines only.
      exhaustive: plan every micro-batch count, and every layer on every mesh on its own
        (no reuse of identical layers, nothing pruned). Slow; for checking that the fast
        search loses nothing.
    """
    memory_budget_bytes: float | None = None
    solver: SolverChoice = SolverChoice.HIGHS
    time_limit_s: float = 60.0
    mesh_shapes: tuple[tuple[int, int], ...] | None = None
    num_micro_batches: int | None = None
    schedule: str | None = None
    num_layers: int | None = None
    max_stages: int | None = None
    pipeline: bool | None = None
    exhaustive: bool = False

    def __post_init__(self):
        _check_pipeline_args("Auto", self.num_micro_batches, self.schedule)
        for name in ("num_layers", "max_stages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"Auto({name}={v!r}): must be a positive integer or None")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise ValueError(f"Auto(memory_budget_bytes={self.memory_budget_bytes}): "
                             "the budget must be a positive number of bytes, or None")
        if not self.time_limit_s > 0:
            raise ValueError(f"Auto(time_limit_s={self.time_limit_s}) must be positive")
        if not isinstance(self.solver, SolverChoice):
            raise TypeError(f"Auto(solver={self.solver!r}): use alpa_lite.plan.methods.SolverChoice")
        if self.pipeline not in (None, True, False):
            raise ValueError(f"Auto(pipeline={self.pipeline!r}): use None (the planner "
                             "chooses), True or False")
        if self.pipeline is False and (self.num_micro_batches is not None
                                       or self.max_stages is not None
                                       or self.schedule is not None):
            raise ValueError(f"{describe(self)}: pipeline=False plans one SPMD stage; drop "
                             "num_micro_batches, schedule and max_stages, or the pipeline flag")
        if self.mesh_shapes is not None and self.fixed_pipeline:
            raise ValueError(f"{describe(self)}: mesh_shapes is for single-stage plans (a "
                             "pipeline's stages choose their own meshes); drop one of them")

    @property
    def searches_pipelines(self) -> bool:
        """Whether pipelined plans are weighed at all (mesh_shapes asks for one stage)."""
        return self.pipeline is not False and (self.mesh_shapes is None or self.fixed_pipeline)

    @property
    def fixed_pipeline(self) -> bool:
        """Whether only pipelined plans are weighed (the user asked for one)."""
        return self.pipeline is True or self.num_micro_batches is not None


@dataclasses.dataclass(frozen=True)
class Manual:
    """A Megatron-style plan: batch split dp ways, weights split tp ways, layers cut into pp
    pipeline stages.

    Linear layers alternate column and row splits along the forward pass (attention: heads
    split, then the output projection row-split), weights are replicated over dp and their
    gradients all-reduced over dp. With `shard_optimizer_state` the optimizer state is split
    over dp (ZeRO stage 1; single-stage plans only).

    With pp > 1, num_micro_batches > 1 or remat the step is pipelined: stage s runs on devices
    s*dp*tp ... (s+1)*dp*tp - 1, the batch is split into `num_micro_batches` micro-batches
    run with `schedule` ("1f1b" or "gpipe"), and `remat=True` recomputes each stage's
    forward in its backward. The loss function's layers (its `al.mark_layer_boundary` calls,
    else an automatic clustering) are split evenly over the stages, or as `layer_ranges`
    says: one (first, last) layer pair per stage, inclusive, covering every layer once.
    """
    dp: int = 1
    tp: int = 1
    pp: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    remat: bool = False
    layer_ranges: tuple[tuple[int, int], ...] | None = None
    shard_optimizer_state: bool = False
    solver: SolverChoice = SolverChoice.HIGHS
    time_limit_s: float = 60.0

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Manual({name}={v!r}): must be a positive integer")
        _check_pipeline_args("Manual", self.num_micro_batches, self.schedule)
        if not isinstance(self.remat, bool):
            raise ValueError(f"Manual(remat={self.remat!r}): must be True or False")
        if self.layer_ranges is not None:
            ranges = tuple(tuple(r) for r in self.layer_ranges)
            if len(ranges) != self.pp or any(len(r) != 2 for r in ranges):
                raise ValueError(f"Manual(layer_ranges={self.layer_ranges!r}): give one "
                                 f"(first, last) layer pair per stage, {self.pp} in all")
            expected = 0
            for s, (a, b) in enumerate(ranges):
                if a != expected or b < a:
                    raise ValueError(
                        f"Manual(layer_ranges={self.layer_ranges!r}): stage {s} is layers "
                        f"{a}..{b}, but it must start at layer {expected} and not be empty; "
                        "the stages must cover the layers in order, each exactly once")
                expected = b + 1
            object.__setattr__(self, "layer_ranges", ranges)
        if self.shard_optimizer_state and self.pipelined:
            raise ValueError("Manual(shard_optimizer_state=True) is for single-stage plans; "
                             "use pp=1 and num_micro_batches=1")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def pipelined(self) -> bool:
        """Runs as stages (`runtime.pipeline`): more than one stage or micro-batch, or
        recomputation, which only the staged runtime does (one stage then)."""
        return self.pp > 1 or self.num_micro_batches > 1 or self.remat


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Data parallelism over every device (optionally ZeRO-style optimizer sharding)."""
    shard_optimizer_state: bool = False


Method = Auto | Manual | DataParallel


def megatron_grid(num_devices: int, devices_per_node: int):
    """(dp, tp, pp) with dp*tp*pp = devices and tp dividing a node's devices: the
    Megatron-style layouts of a cluster."""
    for pp in range(1, num_devices + 1):
        for tp in range(1, devices_per_node + 1):
            if num_devices % (pp * tp) == 0 and devices_per_node % tp == 0:
                yield num_devices // (pp * tp), tp, pp


METHOD_KINDS = {"Auto": Auto, "Manual": Manual, "DataParallel": DataParallel}


def describe(method: Method) -> str:
    """The method as a user would write it, without its default arguments:
    "Auto(num_micro_batches=4)", "Manual(dp=2, tp=4)"."""
    kept = []
    for f in dataclasses.fields(method):
        v = getattr(method, f.name)
        if v != f.default:
            kept.append(f"{f.name}={v.value if isinstance(v, enum.Enum) else v!r}")
    return f"{type(method).__name__}({', '.join(kept)})"


def method_to_json(method: Method) -> dict:
    """The method as a JSON object: its kind and every field (enums by value, tuples as
    lists)."""
    def plain(v):
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v
    return {"kind": type(method).__name__} | {f.name: plain(getattr(method, f.name))
                                              for f in dataclasses.fields(method)}


def method_from_json(obj: dict) -> Method:
    """The inverse of `method_to_json`; raises ValueError on an unknown kind or field."""
    if not isinstance(obj, dict) or obj.get("kind") not in METHOD_KINDS:
        raise ValueError(f"a method must be an object with kind in {sorted(METHOD_KINDS)}, "
                         f"got {obj!r}")
    cls = METHOD_KINDS[obj["kind"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    extra = set(obj) - fields - {"kind"}
    if extra:
        raise ValueError(f"method {obj['kind']}: unknown fields {sorted(extra)}")

    def nested(v):
        return tuple(nested(x) for x in v) if isinstance(v, list) else v
    kw = {k: nested(v) for k, v in obj.items() if k != "kind"}
    if "solver" in kw:
        kw["solver"] = SolverChoice(kw["solver"])
    return cls(**kw)
