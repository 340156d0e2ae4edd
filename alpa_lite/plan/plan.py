"""The Plan: the single record the runtime executes, the CLI shows and the tests assert on.

A `Plan` is frozen and round-trips through JSON byte for byte (planning statistics such as
solver wall time are kept beside it in `stats`, which is not serialised, so the same inputs
always give the same JSON). `explanation` is serialised: the few alternatives the planner
weighed against its choice (for `alpa-lite explain`) and, from the CLI, how to rebuild the
step; it is absent (no JSON key) where there is nothing to record. Tensor ids in a stage
refer to the traced program whose fingerprint the plan carries; the runtime refuses a
plan whose fingerprint, argument signature or cluster differ from what it is given.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from alpa_lite.errors import PlanMismatchError
from alpa_lite.plan.memory import MemoryEstimate
from alpa_lite.plan.methods import Method, method_from_json, method_to_json
from alpa_lite.plan.sharding import TensorSpec
from alpa_lite.plan.timing import StepTime, SyncBuckets, step_time_from_obj, step_time_to_obj

PLAN_FORMAT = "alpa_lite.plan/4"


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """Collectives of one kind over one set of mesh axes with one per-device size."""
    kind: str               # HLO name: all-reduce, all-gather, all-to-all, ...
    axes: tuple[str, ...]
    nbytes: int             # per device, per op (see alpa_lite.plan.sharding for the convention)
    count: int
    time_s: float           # all `count` ops together

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count


class Accumulation(enum.Enum):
    """How a gradient is combined over the micro-batches of one step."""
    SINGLE = "single"      # one micro-batch: the backward's gradient is the step's
    LOCAL = "local"        # summed unreduced on each device, reduced once after the last
    REDUCED = "reduced"    # reduced inside every micro-batch's backward, then summed


class SyncCollective(enum.Enum):
    """The collective that combines a gradient across the replicas that hold it."""
    NONE = "none"                      # nothing to reduce (one replica, or already reduced)
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"  # the optimizer state (and update) is split over the axes
    COMPRESSED = "compressed"          # the compressor's own exchange (`Plan.compression`,
                                       # or a stage's `StagePlan.exchange`)


@dataclasses.dataclass(frozen=True)
class GradientSync:
    """How one parameter's gradient gets from per-device partial sums to what the optimizer
    update reads: where it accumulates, over which mesh axes it is reduced, with which
    collective and compressor, and how often."""
    param: str
    stage: int                     # the stage whose backward makes it (and updates it)
    accumulation: Accumulation
    axes: tuple[str, ...]          # mesh axes of `stage` it is reduced over; () = none
    collective: SyncCollective
    compressor: str | None         # the compressor's description; None: full precision
    nbytes: int                    # per device, per reduction
    count: int                     # reductions per step
    time_s: float                  # all `count` reductions together


@dataclasses.dataclass(frozen=True)
class StageExchange:
    """A stage's once-per-step gradient exchange over its accumulation axes when it is
    compressed (hybrid plans: compressed data parallelism beside tensor or pipeline
    parallelism). Each device exchanges its own shard of each gradient with the devices
    that hold the same shard on the other replicas; error-feedback state lives on the
    device, so it is sharded like the parameter.

    Attributes:
      method: the compressor's config (`alpa_lite.compression.to_config`).
      compressed: per parameter gradient of the stage, in the stage program's order
        (`ir.step_parts.StageProgram.fb_param_grads`): True when it goes through `method`,
        False when it is all-reduced in full precision (a gradient so small that
        compressing it saves less than it costs).
      num_workers: the replicas exchanging (the accumulation axes' size).
      wire_bytes: per device per step, sent in the exchange.
      dense_wire_bytes: the same for an uncompressed all-reduce of every gradient.
      sync_s: the exchange's time per step (`cost_models.axis_exchange`).
      dense_sync_s: the uncompressed all-reduce's.
      state_bytes: per device, the compressor's state kept across steps.
    """
    method: dict
    compressed: tuple[bool, ...]
    num_workers: int
    wire_bytes: float
    dense_wire_bytes: float
    sync_s: float
    dense_sync_s: float
    state_bytes: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"compressed": list(self.compressed)}

    @staticmethod
    def from_json(o: dict[str, Any]) -> "StageExchange":
        return StageExchange(method=dict(o["method"]),
                             compressed=tuple(bool(c) for c in o["compressed"]),
                             num_workers=int(o["num_workers"]),
                             wire_bytes=float(o["wire_bytes"]),
                             dense_wire_bytes=float(o["dense_wire_bytes"]),
                             sync_s=float(o["sync_s"]), dense_sync_s=float(o["dense_sync_s"]),
                             state_bytes=float(o.get("state_bytes", 0.0)))


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One SPMD stage: a logical mesh over a set of devices, and every sharding on it."""
    devices: tuple[int, ...]                 # cluster device indices, row-major over the mesh
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    shardings: tuple[tuple[str, TensorSpec], ...]   # the readable table: name -> spec
    collectives: tuple[CollectiveSummary, ...]
    compute_s: float
    comm_s: float
    total_s: float
    peak_memory_bytes: float
    # What the runtime applies (tensor and node ids of the traced program):
    input_specs: tuple[TensorSpec, ...]              # per flattened argument leaf
    output_specs: tuple[TensorSpec, ...]             # per flattened result leaf
    tensor_specs: tuple[tuple[int, TensorSpec], ...]           # op results to constrain
    operand_specs: tuple[tuple[int, int, TensorSpec], ...]     # (node, operand, spec) reshards
    # Pipelined plans only (zero / empty otherwise): per micro-batch forward and backward
    # time, the layers this stage runs (first, last, inclusive) and whether it recomputes.
    forward_s: float = 0.0
    backward_s: float = 0.0
    layers: tuple[int, int] = (0, 0)
    remat: bool = False
    # Pipelined plans: the mesh axes over which the backward runs per device, each on its
    # slice of the micro-batch (`planning.gradient_sync` checked that this sums to the
    # plan's backward), so parameter gradients accumulate unreduced and are reduced once
    # per step (`Plan.gradient_sync`); () = the backward reduces them itself, and
    # `accumulate_note` says why. `local_loss_scale` turns the per-device loss into its
    # share of the micro-batch loss (1/replicas for a mean).
    accumulate_axes: tuple[str, ...] = ()
    local_loss_scale: float = 1.0
    accumulate_note: str = ""
    # (backward tensor id, batch dimension) of each value that enters the per-replica
    # backward with other size-1 dimensions than the stage's (JAX traces a replica's one
    # example so, `ir.one_example`): each replica takes its slice along that dimension and
    # reshapes it to its program's shape (the same elements, in the same order).
    accumulate_reshapes: tuple[tuple[int, int], ...] = ()
    # The whole-stage memory estimate per device (`planning.memory`); `peak_memory_bytes`
    # is its total. None: a plan made without one (read from an older JSON).
    memory: MemoryEstimate | None = None
    # The compressed exchange that replaces the once-per-step all-reduce over
    # `accumulate_axes`; None: a full-precision all-reduce.
    exchange: StageExchange | None = None

    def sharding_of(self, name: str) -> TensorSpec:
        for n, spec in self.shardings:
            if n == name:
                return spec
        raise KeyError(f"no tensor named {name!r} in the plan; known: "
                       f"{[n for n, _ in self.shardings][:20]}")


@dataclasses.dataclass(frozen=True)
class InputPlacement:
    """Where a pipelined step keeps one step input: the stage whose devices hold it, and its
    sharding on that stage's mesh (where a training loop hands it back each step)."""
    stage: int
    spec: TensorSpec


class Combine(enum.Enum):
    """How an aux output's values on the micro-batches of a step make the step's value
    (the values of `ir.batch.Combine`, which proves them)."""
    SAME = "same"          # every micro-batch computes the same value (a new key, a count)
    MEAN = "mean"          # a mean over examples: the mean of the micro-batch values
    SUM = "sum"            # a sum over examples: their sum
    CONCAT = "concat"      # one entry per example: concatenated along the batch dimension
    LAST = "last"          # a running value: each micro-batch reads the previous one's


@dataclasses.dataclass(frozen=True)
class AuxCombination:
    """How one aux output of the loss function is combined over the micro-batches."""
    combine: Combine
    axis: int = 0                       # the batch dimension, for Combine.CONCAT
    updates: int | None = None          # Combine.LAST: the loss operand it is the new value of

    def __str__(self) -> str:
        if self.combine is Combine.CONCAT:
            return f"{self.combine.value} along dim {self.axis}"
        if self.combine is Combine.LAST:
            return f"running value of loss operand {self.updates}"
        return self.combine.value


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """How a pipelined plan runs: the layers, the schedule and the estimate.

    Stage s of `Plan.stages` runs layers `stages[s].layers` of the loss function, layer k
    being its forward nodes `layer_starts[k]` up to the next start. Micro-batch losses and
    gradients are combined as `loss_scale` x their sum (1/m for a mean loss).
    """
    num_micro_batches: int
    schedule: str                       # "1f1b" or "gpipe"
    layer_starts: tuple[int, ...]
    loss_scale: float
    forward_fingerprint: str            # of the loss function's traced forward graph
    step_time_s: float                  # simulated pipeline (sends, bubble) + reduce_s + apply_s
    bubble_fraction: float
    send_s: tuple[float, ...] = ()      # per stage boundary, one activation transfer
    apply_s: float = 0.0                # the optimizer update after the last backward
    reduce_s: float = 0.0               # the slowest stage's once-per-step gradient reduction
    # The step outside the gradient call (the optimizer update), decided by the planner
    # (`planning.update_placement`): the stage each of its operators runs on, in the
    # traced step's node order, and where each step input (flattened) lives.
    update_stages: tuple[int, ...] = ()
    inputs: tuple[InputPlacement, ...] = ()
    # `value_and_grad(..., has_aux=True)`: per aux leaf, how its micro-batch values make the
    # step's (`ir.microbatch` proved the rule exact) and the batch dimension for CONCAT.
    aux: tuple[AuxCombination, ...] = ()
    # Random draws along the batch (dropout masks) that each micro-batch draws at its own
    # rows of the whole batch's draw (`ir.batch_draws`), so they equal jax.jit's; the
    # runtime feeds every micro-batch its row indices.
    batch_draws: int = 0


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """How a data-parallel plan exchanges its gradients (alpa_lite.runtime.compressed).

    Every device is a worker holding all parameters. With more than one node the exchange
    is hierarchical: full precision inside a node (axis "local"), `exchange` between nodes
    (`axis`); on one node `exchange` runs among its devices. A full-precision exchange
    with buckets in the plan (`Plan.sync_buckets`) runs one all-reduce per bucket over
    every worker instead (`hierarchical` False).
    """
    exchange: dict                  # the method's config (alpa_lite.compression.to_config)
    description: str
    axis: str                       # mesh axis the exchange runs over: "node" or "local"
    num_workers: int                # workers on that axis
    hierarchical: bool              # a full-precision reduce-scatter / all-gather inside nodes
    delay: int                      # delayed averaging's D; 0: synchronous
    loss_scale: float               # per-worker losses and gradients combine as scale x sum
    wire_bytes: float               # per worker per step, sent in the exchange
    dense_wire_bytes: float         # the same for an uncompressed all-reduce
    sync_s: float                   # the exchange (critical path share when delayed)
    dense_sync_s: float             # the uncompressed synchronous exchange
    compute_s: float                # the step without its gradient exchange
    step_time_s: float
    uncompressed_step_time_s: float
    candidates: tuple[tuple[str, float, bool], ...] = ()   # (method, step s, fits memory)

    @property
    def saved_s(self) -> float:
        """Estimated time per step saved against the uncompressed synchronous exchange."""
        return self.uncompressed_step_time_s - self.step_time_s


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One option the planner weighed against its choice (`alpa-lite explain` prints them).

    `kind` says what was compared and in which units `time_s` is:
      "mesh": a logical mesh planned whole (a single-stage plan's mesh, or stage `stage`'s
        mesh in the final re-plan of a pipeline); `time_s` is that stage's estimate (one
        micro-batch forward + backward, recomputation included).
      "option": an intra-op option (logical mesh, memory-lean or not, remat or not) of stage
        `stage`'s layers on its submesh, as the stage DP saw it (a sum over its layers);
        `time_s` is that stage's latency.
      "cut": the stage DP's pipeline with the boundary after stage `stage` moved one layer;
      "stages": the best pipeline of `label`'s equal stages on equal submeshes (layers split
        evenly);  for both, and for the "chosen" DP plan, `time_s` is the stage DP's
        pipeline latency: sum of stage latencies + (micro-batches - 1) x the slowest.
    """
    kind: str
    stage: int              # the stage it would replace; -1: the whole plan
    label: str
    time_s: float
    memory_bytes: float     # per device (0 where not known)
    fits: bool              # within the per-device memory budget
    chosen: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    """One decision of the plan that the method left open (or fixed: `by_user`), with the
    best other value the planner weighed for it.

    `what` names the decision: "pipeline", "micro-batches", "schedule", "remat",
    "logical mesh", "optimizer state". `time_s` is the plan's estimated step; `runner_up_s`
    the runner-up's whole-step estimate where it was planned (None: weighed without a whole
    plan, `note` says how), and `runner_up_fits` whether it fits the memory budget.
    """
    what: str
    value: str
    time_s: float
    runner_up: str = ""                 # "": nothing else was weighed
    runner_up_s: float | None = None
    runner_up_fits: bool = True
    by_user: bool = False
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `alpa-lite explain` needs from a plan without planning again."""
    alternatives: tuple[Alternative, ...] = ()
    # How the step was built, as the CLI wrote it (e.g. ("target", "gpt-2.6b"),
    # ("batch_size", "8")), so `explain --op` can rebuild the stage's intra-op problem.
    source: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class PlanningStats:
    """How the plan was found (not serialised: it varies run to run)."""
    trace_s: float = 0.0
    build_s: float = 0.0
    solve_s: float = 0.0
    nodes_before_merge: int = 0
    nodes_after_merge: int = 0
    ilp_nodes: int = 0              # after tying repeated layers
    ilp_variables: int = 0
    ilp_constraints: int = 0
    candidates: tuple[tuple[str, float], ...] = ()   # (mesh shape, estimated step s)
    # Pipelined plans: layers, stage-DP time and work, distinct layer ILPs solved.
    num_layers: int = 0
    dp_s: float = 0.0
    layer_ilps: int = 0
    dp_t_max_tried: int = 0
    dp_cost_queries: int = 0
    # Reuse: intra-op problems answered by an identical layer's solve, or read from the
    # disk cache (`planning.cache`); whether the whole plan came from that cache; whole
    # plans `Auto()` weighed (`planning.auto_search`).
    layer_ilps_reused: int = 0
    layer_cache_hits: int = 0
    plan_cache_hit: bool = False
    plans_weighed: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one program on one cluster."""
    method: Method                  # what the user asked for (compression: `compression`)
    cluster_name: str
    cluster_fingerprint: str
    program_fingerprint: str
    input_signature: tuple[tuple[tuple[int, ...], str], ...]
    stages: tuple[StagePlan, ...]
    unsharded_primitives: tuple[str, ...] = ()
    pipeline: PipelineSpec | None = None
    compression: CompressionSpec | None = None
    stats: PlanningStats = dataclasses.field(default_factory=PlanningStats, compare=False)
    explanation: Explanation | None = None
    gradient_sync: tuple[GradientSync, ...] = ()
    # Where the estimated step time goes (`planning.step_time`); its total is the estimate.
    step_time: StepTime | None = None
    # What tracing decided about the program that the plan rests on: loops unrolled or
    # kept whole, a `while` loop's assumed trip count (`TracedStep.notes`).
    notes: tuple[str, ...] = ()
    # What the planner chose where the method left it open (`Auto()`), and what it beat.
    choices: tuple[Choice, ...] = ()

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s for s in self.stages)

    @property
    def comm_s(self) -> float:
        return sum(s.comm_s for s in self.stages)

    @property
    def step_time_s(self) -> float:
        """Estimated time of one training step: `step_time`'s total where the planner
        broke it down, else the engine's own estimate."""
        if self.step_time is not None:
            return self.step_time.total_s
        if self.pipeline is not None:
            return self.pipeline.step_time_s
        if self.compression is not None:
            return self.compression.step_time_s
        return sum(s.total_s for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def sync_buckets(self) -> tuple[SyncBuckets, ...]:
        """How each stage's gradient reductions are bucketed and ordered, as the runtime
        issues them (kept with the estimate they were chosen for, `StepTime.sync_buckets`);
        () where none are (pipelined stages reduce once per step in a program of their
        own, combined by XLA; compressed exchanges but the full-precision one)."""
        return self.step_time.sync_buckets if self.step_time is not None else ()

    def sync_buckets_of(self, stage: int) -> SyncBuckets | None:
        """Stage `stage`'s buckets, or None."""
        return next((b for b in self.sync_buckets if b.stage == stage), None)

    @property
    def schedule(self) -> str:
        """The pipeline schedule and micro-batch count, e.g. "1f1b x 8 micro-batches"."""
        if self.pipeline is None:
            return "single stage, 1 micro-batch"
        p = self.pipeline
        return f"{p.schedule} x {p.num_micro_batches} micro-batch" + \
            ("es" if p.num_micro_batches > 1 else "")

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.peak_memory_bytes for s in self.stages)

    def collectives(self) -> tuple[CollectiveSummary, ...]:
        """The collectives one step runs by the plan's prediction, per stage program: a
        pipelined stage's per micro-batch collectives times the micro-batch count, then
        each gradient reduced once per step (`gradient_sync`) where it accumulates locally."""
        if self.pipeline is None:
            return tuple(c for s in self.stages for c in s.collectives)
        m = self.pipeline.num_micro_batches
        out = [dataclasses.replace(c, count=c.count * m, time_s=c.time_s * m)
               for s in self.stages for c in s.collectives]
        # A stage reduces all its accumulated gradients in one program, which XLA combines
        # into one collective per kind and axes.
        merged: dict[tuple, list] = {}
        for g in self.gradient_sync:
            if g.accumulation is Accumulation.LOCAL and g.collective is not SyncCollective.NONE:
                entry = merged.setdefault((g.stage, g.collective.value, g.axes), [0, 0.0])
                entry[0] += g.nbytes
                entry[1] += g.time_s
        out.extend(CollectiveSummary(k, a, n, 1, t)
                   for (_, k, a), (n, t) in sorted(merged.items()))
        return tuple(out)

    def check_matches(self, cluster_fingerprint: str, program_fingerprint: str,
                      input_signature) -> None:
        """Raises PlanMismatchError if this plan was made for something else."""
        if cluster_fingerprint != self.cluster_fingerprint:
            raise PlanMismatchError(
                f"this plan was made for cluster {self.cluster_name!r} (fingerprint "
                f"{self.cluster_fingerprint}) but the step runs on a cluster with fingerprint "
                f"{cluster_fingerprint}; plan again for this cluster")
        if tuple(input_signature) != self.input_signature:
            diffs = [f"arg leaf {i}: plan {a} vs now {b}" for i, (a, b) in
                     enumerate(zip(self.input_signature, input_signature)) if a != b]
            if len(input_signature) != len(self.input_signature):
                diffs.insert(0, f"plan has {len(self.input_signature)} argument leaves, "
                                f"the call has {len(input_signature)}")
            raise PlanMismatchError("this plan was made for other argument shapes: "
                                    + "; ".join(diffs[:5]) + ". Plan again for these arguments")
        if program_fingerprint != self.program_fingerprint:
            raise PlanMismatchError(
                f"this plan was made for a different program (fingerprint "
                f"{self.program_fingerprint}, now {program_fingerprint}); plan again")

    # ---- JSON ---------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(_plan_to_obj(self), sort_keys=True, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan JSON is malformed: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != PLAN_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"not an alpa_lite plan: expected format {PLAN_FORMAT!r}, got "
                             f"{got!r}; re-plan with this alpa_lite version")
        try:
            return _plan_from_obj(obj)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"plan JSON is malformed: {type(e).__name__}: {e}") from None

    # ---- text ---------------------------------------------------------------------------

    def summary(self, max_rows: int = 40) -> str:
        from alpa_lite.plan.text import plan_summary
        return plan_summary(self, max_rows=max_rows)


def _stage_to_obj(s: StagePlan) -> dict[str, Any]:
    return {
        "devices": list(s.devices),
        "mesh_shape": list(s.mesh_shape),
        "axis_names": list(s.axis_names),
        "shardings": [[n, spec.to_json()] for n, spec in s.shardings],
        "collectives": [dataclasses.asdict(c) | {"axes": list(c.axes), "time_s": float(c.time_s)}
                        for c in s.collectives],
        "compute_s": float(s.compute_s), "comm_s": float(s.comm_s),
        "total_s": float(s.total_s), "peak_memory_bytes": float(s.peak_memory_bytes),
        "input_specs": [x.to_json() for x in s.input_specs],
        "output_specs": [x.to_json() for x in s.output_specs],
        "tensor_specs": [[t, x.to_json()] for t, x in s.tensor_specs],
        "operand_specs": [[n, p, x.to_json()] for n, p, x in s.operand_specs],
        "forward_s": float(s.forward_s), "backward_s": float(s.backward_s),
        "layers": list(s.layers), "remat": bool(s.remat),
        "accumulate_axes": list(s.accumulate_axes),
        "local_loss_scale": float(s.local_loss_scale),
        "accumulate_note": s.accumulate_note,
        "accumulate_reshapes": [list(r) for r in s.accumulate_reshapes],
    } | ({} if s.memory is None else {"memory": s.memory.to_json()}) \
      | ({} if s.exchange is None else {"exchange": s.exchange.to_json()})


def _stage_from_obj(o: dict[str, Any]) -> StagePlan:
    spec = TensorSpec.from_json
    return StagePlan(
        devices=tuple(int(d) for d in o["devices"]),
        mesh_shape=tuple(int(d) for d in o["mesh_shape"]),
        axis_names=tuple(str(a) for a in o["axis_names"]),
        shardings=tuple((str(n), spec(x)) for n, x in o["shardings"]),
        collectives=tuple(CollectiveSummary(str(c["kind"]), tuple(c["axes"]), int(c["nbytes"]),
                                            int(c["count"]), float(c["time_s"]))
                          for c in o["collectives"]),
        compute_s=float(o["compute_s"]), comm_s=float(o["comm_s"]),
        total_s=float(o["total_s"]), peak_memory_bytes=float(o["peak_memory_bytes"]),
        input_specs=tuple(spec(x) for x in o["input_specs"]),
        output_specs=tuple(spec(x) for x in o["output_specs"]),
        tensor_specs=tuple((int(t), spec(x)) for t, x in o["tensor_specs"]),
        operand_specs=tuple((int(n), int(p), spec(x)) for n, p, x in o["operand_specs"]),
        forward_s=float(o["forward_s"]), backward_s=float(o["backward_s"]),
        layers=(int(o["layers"][0]), int(o["layers"][1])), remat=bool(o["remat"]),
        accumulate_axes=tuple(str(a) for a in o["accumulate_axes"]),
        local_loss_scale=float(o["local_loss_scale"]),
        accumulate_note=str(o["accumulate_note"]),
        accumulate_reshapes=tuple((int(t), int(d))
                                  for t, d in o.get("accumulate_reshapes", ())),
        memory=MemoryEstimate.from_json(o["memory"]) if o.get("memory") is not None else None,
        exchange=StageExchange.from_json(o["exchange"]) if o.get("exchange") is not None
        else None,
    )


def _sync_to_obj(g: GradientSync) -> dict[str, Any]:
    return {"param": g.param, "stage": g.stage, "accumulation": g.accumulation.value,
            "axes": list(g.axes), "collective": g.collective.value, "compressor": g.compressor,
            "nbytes": int(g.nbytes), "count": int(g.count), "time_s": float(g.time_s)}


def _sync_from_obj(o: dict[str, Any]) -> GradientSync:
    return GradientSync(param=str(o["param"]), stage=int(o["stage"]),
                        accumulation=Accumulation(o["accumulation"]),
                        axes=tuple(str(a) for a in o["axes"]),
                        collective=SyncCollective(o["collective"]),
                        compressor=None if o["compressor"] is None else str(o["compressor"]),
                        nbytes=int(o["nbytes"]), count=int(o["count"]),
                        time_s=float(o["time_s"]))


def _pipeline_to_obj(p: PipelineSpec | None):
    if p is None:
        return None
    return {"num_micro_batches": p.num_micro_batches, "schedule": p.schedule,
            "layer_starts": list(p.layer_starts), "loss_scale": float(p.loss_scale),
            "forward_fingerprint": p.forward_fingerprint, "step_time_s": float(p.step_time_s),
            "bubble_fraction": float(p.bubble_fraction), "send_s": [float(x) for x in p.send_s],
            "apply_s": float(p.apply_s), "reduce_s": float(p.reduce_s),
            "update_stages": list(p.update_stages),
            "inputs": [[i.stage, i.spec.to_json()] for i in p.inputs]} | (
        {"aux": [[a.combine.value, a.axis, a.updates] for a in p.aux]} if p.aux else {}) | (
        {"batch_draws": p.batch_draws} if p.batch_draws else {})


def _pipeline_from_obj(o) -> PipelineSpec | None:
    if o is None:
        return None
    return PipelineSpec(
        num_micro_batches=int(o["num_micro_batches"]), schedule=str(o["schedule"]),
        layer_starts=tuple(int(x) for x in o["layer_starts"]), loss_scale=float(o["loss_scale"]),
        forward_fingerprint=str(o["forward_fingerprint"]), step_time_s=float(o["step_time_s"]),
        bubble_fraction=float(o["bubble_fraction"]), send_s=tuple(float(x) for x in o["send_s"]),
        apply_s=float(o["apply_s"]), reduce_s=float(o["reduce_s"]),
        update_stages=tuple(int(s) for s in o["update_stages"]),
        inputs=tuple(InputPlacement(int(s), TensorSpec.from_json(x)) for s, x in o["inputs"]),
        aux=tuple(AuxCombination(Combine(c), int(a), None if u is None else int(u))
                  for c, a, u in o.get("aux", ())),
        batch_draws=int(o.get("batch_draws", 0)))


def _explanation_to_obj(e: Explanation) -> dict[str, Any]:
    return {"alternatives": [dataclasses.asdict(a) | {"time_s": float(a.time_s),
                                                      "memory_bytes": float(a.memory_bytes)}
                             for a in e.alternatives],
            "source": [[k, v] for k, v in e.source]}


def _explanation_from_obj(o) -> Explanation:
    fields = {f.name for f in dataclasses.fields(Alternative)}
    alts = []
    for a in o["alternatives"]:
        if set(a) != fields:
            raise ValueError(f"explanation: an alternative has keys {sorted(a)}, expected "
                             f"{sorted(fields)}")
        alts.append(Alternative(kind=str(a["kind"]), stage=int(a["stage"]),
                                label=str(a["label"]), time_s=float(a["time_s"]),
                                memory_bytes=float(a["memory_bytes"]), fits=bool(a["fits"]),
                                chosen=bool(a["chosen"])))
    return Explanation(alternatives=tuple(alts),
                       source=tuple((str(k), str(v)) for k, v in o["source"]))


def _plan_to_obj(p: Plan) -> dict[str, Any]:
    obj = {
        "format": PLAN_FORMAT,
        "method": method_to_json(p.method),
        "cluster_name": p.cluster_name,
        "cluster_fingerprint": p.cluster_fingerprint,
        "program_fingerprint": p.program_fingerprint,
        "input_signature": [[list(s), d] for s, d in p.input_signature],
        "stages": [_stage_to_obj(s) for s in p.stages],
        "unsharded_primitives": list(p.unsharded_primitives),
        "pipeline": _pipeline_to_obj(p.pipeline),
        "gradient_sync": [_sync_to_obj(g) for g in p.gradient_sync],
        "compression": None if p.compression is None else
        dataclasses.asdict(p.compression) | {"candidates": [list(c) for c in
                                                             p.compression.candidates]},
    }
    # Written only when present, so plans without one keep the JSON they always had.
    if p.explanation is not None:
        obj["explanation"] = _explanation_to_obj(p.explanation)
    if p.step_time is not None:
        obj["step_time"] = step_time_to_obj(p.step_time)
    if p.notes:
        obj["notes"] = list(p.notes)
    if p.choices:
        obj["choices"] = [dataclasses.asdict(c) | {"time_s": float(c.time_s),
                                                   "runner_up_s": None if c.runner_up_s is None
                                                   else float(c.runner_up_s)}
                          for c in p.choices]
    return obj


def _choice_from_obj(o) -> Choice:
    fields = {f.name for f in dataclasses.fields(Choice)}
    if set(o) != fields:
        raise ValueError(f"choices: a choice has keys {sorted(o)}, expected {sorted(fields)}")
    return Choice(what=str(o["what"]), value=str(o["value"]), time_s=float(o["time_s"]),
                  runner_up=str(o["runner_up"]),
                  runner_up_s=None if o["runner_up_s"] is None else float(o["runner_up_s"]),
                  runner_up_fits=bool(o["runner_up_fits"]), by_user=bool(o["by_user"]),
                  note=str(o["note"]))


def _compression_from_obj(o) -> CompressionSpec | None:
    if o is None:
        return None
    fields = {f.name for f in dataclasses.fields(CompressionSpec)}
    if set(o) != fields:
        raise ValueError(f"compression: unexpected keys {sorted(set(o) - fields)}, missing "
                         f"{sorted(fields - set(o))}")
    return CompressionSpec(**(o | {"candidates": tuple((str(a), float(b), bool(c))
                                                       for a, b, c in o["candidates"])}))


def _plan_from_obj(o: dict[str, Any]) -> Plan:
    expected = {"format", "method", "cluster_name", "cluster_fingerprint",
                "program_fingerprint", "input_signature", "stages", "unsharded_primitives",
                "pipeline", "compression", "gradient_sync"}
    if set(o) - {"explanation", "step_time", "notes", "choices"} != expected:
        raise ValueError(f"unexpected keys {sorted(set(o) - expected)}, missing "
                         f"{sorted(expected - set(o))}")
    return Plan(
        method=method_from_json(o["method"]), cluster_name=str(o["cluster_name"]),
        cluster_fingerprint=str(o["cluster_fingerprint"]),
        program_fingerprint=str(o["program_fingerprint"]),
        input_signature=tuple((tuple(int(d) for d in s), str(t)) for s, t in o["input_signature"]),
        stages=tuple(_stage_from_obj(s) for s in o["stages"]),
        unsharded_primitives=tuple(o["unsharded_primitives"]),
        pipeline=_pipeline_from_obj(o["pipeline"]),
        compression=_compression_from_obj(o["compression"]),
        gradient_sync=tuple(_sync_from_obj(g) for g in o["gradient_sync"]),
        explanation=_explanation_from_obj(o["explanation"]) if "explanation" in o else None,
        step_time=step_time_from_obj(o["step_time"]) if "step_time" in o else None,
        notes=tuple(str(n) for n in o.get("notes", ())),
        choices=tuple(_choice_from_obj(c) for c in o.get("choices", ())))
