"""Cost models: device and cluster specs, collective and compute costs (no PuLP here)."""

from alpa_lite.cost_models.cluster import CLUSTER_JSON_FORMAT as CLUSTER_JSON_FORMAT
from alpa_lite.cost_models.cluster import Cluster as Cluster
from alpa_lite.cost_models.cluster import LinkSpec as LinkSpec
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

__all__ = [
    "CLUSTER_JSON_FORMAT",
    "DEVICES",
    "AllReduceAlgorithm",
    "AxisTopology",
    "Cluster",
    "CollectiveKind",
    "DeviceSpec",
    "LinkSpec",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "collective_time",
    "compute_time",
    "mesh_axis_topology",
    "reduce_scatter_time",
    "send_recv_time",
]
