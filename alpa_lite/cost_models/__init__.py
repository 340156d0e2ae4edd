"""Cost models: device and cluster specs, collective and compute costs, pipeline schedules,
calibration fits (``calibration.py``), stragglers (``stragglers.py``) (no PuLP here)."""

from alpa_lite.cost_models.cluster import CLUSTER_JSON_FORMAT as CLUSTER_JSON_FORMAT
from alpa_lite.cost_models.cluster import Cluster as Cluster
from alpa_lite.cost_models.cluster import LinkSpec as LinkSpec
from alpa_lite.cost_models.cluster import MeasuredCollective as MeasuredCollective
from alpa_lite.cost_models.collectives import AllReduceAlgorithm as AllReduceAlgorithm
from alpa_lite.cost_models.collectives import AxisTopology as AxisTopology
from alpa_lite.cost_models.collectives import CollectiveKind as CollectiveKind
from alpa_lite.cost_models.collectives import all_gather_time as all_gather_time
from alpa_lite.cost_models.collectives import all_reduce_time as all_reduce_time
from alpa_lite.cost_models.collectives import all_to_all_time as all_to_all_time
from alpa_lite.cost_models.collectives import collective_time as collective_time
from alpa_lite.cost_models.collectives import mesh_axis_topology as mesh_axis_topology
from alpa_lite.cost_models.collectives import reduce_scatter_time as reduce_scatter_time
from alpa_lite.cost_models.collectives import send_recv_time as send_recv_time
from alpa_lite.cost_models.compute import compute_time as compute_time
from alpa_lite.cost_models.devices import DEVICES as DEVICES
from alpa_lite.cost_models.devices import DeviceSpec as DeviceSpec
from alpa_lite.cost_models.pipeline_schedule import Schedule as Schedule
from alpa_lite.cost_models.pipeline_schedule import ScheduleResult as ScheduleResult
from alpa_lite.cost_models.pipeline_schedule import StageTiming as StageTiming
from alpa_lite.cost_models.pipeline_schedule import Task as Task
from alpa_lite.cost_models.pipeline_schedule import TaskKind as TaskKind
from alpa_lite.cost_models.pipeline_schedule import schedule_from_name as schedule_from_name
from alpa_lite.cost_models.pipeline_schedule import simulate as simulate_pipeline
from alpa_lite.cost_models.stragglers import EmpiricalDelays as EmpiricalDelays
from alpa_lite.cost_models.stragglers import ShiftedExponential as ShiftedExponential
from alpa_lite.cost_models.stragglers import StragglerEstimate as StragglerEstimate
from alpa_lite.cost_models.stragglers import StragglerPolicy as StragglerPolicy
from alpa_lite.cost_models.stragglers import StragglerScheme as StragglerScheme
from alpa_lite.cost_models.stragglers import expected_step_times as expected_step_times
from alpa_lite.cost_models.stragglers import parse_delay_model as parse_delay_model

__all__ = [
    "CLUSTER_JSON_FORMAT",
    "DEVICES",
    "AllReduceAlgorithm",
    "AxisTopology",
    "Cluster",
    "CollectiveKind",
    "DeviceSpec",
    "EmpiricalDelays",
    "LinkSpec",
    "MeasuredCollective",
    "Schedule",
    "ScheduleResult",
    "ShiftedExponential",
    "StageTiming",
    "StragglerEstimate",
    "StragglerPolicy",
    "StragglerScheme",
    "Task",
    "TaskKind",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "collective_time",
    "compute_time",
    "expected_step_times",
    "mesh_axis_topology",
    "parse_delay_model",
    "reduce_scatter_time",
    "schedule_from_name",
    "send_recv_time",
    "simulate_pipeline",
]
