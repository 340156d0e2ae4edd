"""Solvers: the intra-op sharding ILP and the inter-op DPs; plain data in and out, no JAX."""

from alpa_lite.solvers.layer_clustering import Clustering as Clustering
from alpa_lite.solvers.layer_clustering import ClusteringError as ClusteringError
from alpa_lite.solvers.layer_clustering import ClusteringProblem as ClusteringProblem
from alpa_lite.solvers.layer_clustering import choose_num_layers as choose_num_layers
from alpa_lite.solvers.layer_clustering import cluster_layers as cluster_layers
from alpa_lite.solvers.layer_clustering import cut_costs as cut_costs
from alpa_lite.solvers.sharding_ilp import EdgeFormulation as EdgeFormulation
from alpa_lite.solvers.sharding_ilp import ILPEdge as ILPEdge
from alpa_lite.solvers.sharding_ilp import ILPNode as ILPNode
from alpa_lite.solvers.sharding_ilp import InfeasibleMemoryError as InfeasibleMemoryError
from alpa_lite.solvers.sharding_ilp import ShardingProblem as ShardingProblem
from alpa_lite.solvers.sharding_ilp import ShardingSolution as ShardingSolution
from alpa_lite.solvers.sharding_ilp import Solver as Solver
from alpa_lite.solvers.sharding_ilp import SolverUnavailableError as SolverUnavailableError
from alpa_lite.solvers.sharding_ilp import solve_sharding_ilp as solve_sharding_ilp
from alpa_lite.solvers.stage_dp import NoFeasiblePipelineError as NoFeasiblePipelineError
from alpa_lite.solvers.stage_dp import PipelinePlan as PipelinePlan
from alpa_lite.solvers.stage_dp import StageAssignment as StageAssignment
from alpa_lite.solvers.stage_dp import StageCostFn as StageCostFn
from alpa_lite.solvers.stage_dp import StageDPStats as StageDPStats
from alpa_lite.solvers.stage_dp import StageOption as StageOption
from alpa_lite.solvers.stage_dp import SubmeshShape as SubmeshShape
from alpa_lite.solvers.stage_dp import brute_force_stage_plan as brute_force_stage_plan
from alpa_lite.solvers.stage_dp import solve_stage_dp as solve_stage_dp
from alpa_lite.solvers.stage_dp import submesh_shapes as submesh_shapes
