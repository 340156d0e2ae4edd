"""Solvers: the intra-op sharding ILP and the inter-op DPs; plain data in and out, no JAX."""

from alpa_lite.solvers.sharding_ilp import EdgeFormulation as EdgeFormulation
from alpa_lite.solvers.sharding_ilp import ILPEdge as ILPEdge
from alpa_lite.solvers.sharding_ilp import ILPNode as ILPNode
from alpa_lite.solvers.sharding_ilp import InfeasibleMemoryError as InfeasibleMemoryError
from alpa_lite.solvers.sharding_ilp import ShardingProblem as ShardingProblem
from alpa_lite.solvers.sharding_ilp import ShardingSolution as ShardingSolution
from alpa_lite.solvers.sharding_ilp import Solver as Solver
from alpa_lite.solvers.sharding_ilp import SolverUnavailableError as SolverUnavailableError
from alpa_lite.solvers.sharding_ilp import solve_sharding_ilp as solve_sharding_ilp
from alpa_lite.solvers.layer_clustering import Clustering as Clustering
from alpa_lite.solvers.layer_clustering import ClusteringError as ClusteringError
from alpa_lite.solvers.layer_clustering import ClusteringProblem as ClusteringProblem
from alpa_lite.solvers.layer_clustering import choose_num_layers as choose_num_layers
from alpa_lite.solvers.layer_clustering import cluster_layers as cluster_layers
from alpa_lite.solvers.layer_clustering import cut_costs as cut_costs
