"""The Plan: the single record the runtime executes, the CLI shows and the tests assert on.

A `Plan` is frozen and round-trips through JSON byte for byte (planning statistics such as
solver wall time are kept beside it in `stats`, which is not serialised, so the same inputs
always give the same JSON). `explanation` is serialised: the few alternatives the planner
weighed against its choice (for `alpa-lite explain`) and, from the CLI, how to rebuild the
step; it is absent (no JSON key) where there is nothing to record. Tensor ids in a stage
refer to the traced program whose fingerprint the plan carries; the runtime refuses a plan whose fingerprint, argument
signature or cluster differ from what it is given.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from alpa_lite.errors import PlanMismatchError
from alpa_lite.sharding import TensorSpec

PLAN_FORMAT = "alpa_lite.plan/3"


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """Collectives of one kind over one set of mesh axes with one per-device size."""
    kind: str               # HLO name: all-reduce, all-gather, all-to-all, ...
    axes: tuple[str, ...]
    nbytes: int             # per device, per op (see alpa_lite.sharding for the convention)
    count: int
    time_s: float           # all `count` ops together

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count


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

    def sharding_of(self, name: str) -> TensorSpec:
        for n, spec in self.shardings:
            if n == name:
                return spec
        raise KeyError(f"no tensor named {name!r} in the plan; known: "
                       f"{[n for n, _ in self.shardings][:20]}")


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
    step_time_s: float                  # simulated pipeline (sends, bubble) + apply_s
    bubble_fraction: float
    send_s: tuple[float, ...] = ()      # per stage boundary, one activation transfer
    apply_s: float = 0.0                # the optimizer update after the last backward


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """How a data-parallel plan exchanges its gradients (alpa_lite.compressed_runtime).

    Every device is a worker holding all parameters. With more than one node the exchange
    is hierarchical: full precision inside a node (`intra_axis`), `exchange` between nodes
    (`axis`); on one node `exchange` runs among its devices.
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one program on one cluster."""
    method: str
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

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s for s in self.stages)

    @property
    def comm_s(self) -> float:
        return sum(s.comm_s for s in self.stages)

    @property
    def step_time_s(self) -> float:
        """Estimated time of one training step."""
        if self.pipeline is not None:
            return self.pipeline.step_time_s
        if self.compression is not None:
            return self.compression.step_time_s
        return sum(s.total_s for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

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
        return tuple(c for s in self.stages for c in s.collectives)

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
        from alpa_lite.plan_text import plan_summary
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
    }


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
    )


def _pipeline_to_obj(p: PipelineSpec | None):
    if p is None:
        return None
    return {"num_micro_batches": p.num_micro_batches, "schedule": p.schedule,
            "layer_starts": list(p.layer_starts), "loss_scale": float(p.loss_scale),
            "forward_fingerprint": p.forward_fingerprint, "step_time_s": float(p.step_time_s),
            "bubble_fraction": float(p.bubble_fraction), "send_s": [float(x) for x in p.send_s],
            "apply_s": float(p.apply_s)}


def _pipeline_from_obj(o) -> PipelineSpec | None:
    if o is None:
        return None
    return PipelineSpec(
        num_micro_batches=int(o["num_micro_batches"]), schedule=str(o["schedule"]),
        layer_starts=tuple(int(x) for x in o["layer_starts"]), loss_scale=float(o["loss_scale"]),
        forward_fingerprint=str(o["forward_fingerprint"]), step_time_s=float(o["step_time_s"]),
        bubble_fraction=float(o["bubble_fraction"]), send_s=tuple(float(x) for x in o["send_s"]),
        apply_s=float(o["apply_s"]))


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
        "method": p.method,
        "cluster_name": p.cluster_name,
        "cluster_fingerprint": p.cluster_fingerprint,
        "program_fingerprint": p.program_fingerprint,
        "input_signature": [[list(s), d] for s, d in p.input_signature],
        "stages": [_stage_to_obj(s) for s in p.stages],
        "unsharded_primitives": list(p.unsharded_primitives),
        "pipeline": _pipeline_to_obj(p.pipeline),
        "compression": None if p.compression is None else
        dataclasses.asdict(p.compression) | {"candidates": [list(c) for c in
                                                             p.compression.candidates]},
    }
    # Written only when present, so plans without one keep the JSON they always had.
    if p.explanation is not None:
        obj["explanation"] = _explanation_to_obj(p.explanation)
    return obj


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
                "pipeline", "compression"}
    if set(o) - {"explanation"} != expected:
        raise ValueError(f"unexpected keys {sorted(set(o) - expected)}, missing "
                         f"{sorted(expected - set(o))}")
    return Plan(
        method=str(o["method"]), cluster_name=str(o["cluster_name"]),
        cluster_fingerprint=str(o["cluster_fingerprint"]),
        program_fingerprint=str(o["program_fingerprint"]),
        input_signature=tuple((tuple(int(d) for d in s), str(t)) for s, t in o["input_signature"]),
        stages=tuple(_stage_from_obj(s) for s in o["stages"]),
        unsharded_primitives=tuple(o["unsharded_primitives"]),
        pipeline=_pipeline_from_obj(o["pipeline"]),
        compression=_compression_from_obj(o["compression"]),
        explanation=_explanation_from_obj(o["explanation"]) if "explanation" in o else None)
