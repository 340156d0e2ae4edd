"""alpa_lite: Alpa-style automatic parallelization of JAX train steps on stock JAX.

    import alpa_lite as al

    @al.parallelize(method=al.Auto())                      # or Auto(num_micro_batches=8),
    def train_step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        ...
"""

from alpa_lite.api import ParallelizedStep as ParallelizedStep
from alpa_lite.api import parallelize as parallelize
from alpa_lite.cost_models.cluster import Cluster as Cluster
from alpa_lite.errors import CheckpointMismatchError as CheckpointMismatchError
from alpa_lite.errors import MemoryBudgetError as MemoryBudgetError
from alpa_lite.errors import NonFiniteGradientError as NonFiniteGradientError
from alpa_lite.errors import PlanMismatchError as PlanMismatchError
from alpa_lite.errors import PlanningError as PlanningError
from alpa_lite.ir.markers import grad as grad
from alpa_lite.ir.markers import mark_layer_boundary as mark_layer_boundary
from alpa_lite.ir.markers import value_and_grad as value_and_grad
from alpa_lite.plan import Plan as Plan
from alpa_lite.plan.methods import Auto as Auto
from alpa_lite.plan.methods import DataParallel as DataParallel
from alpa_lite.plan.methods import Manual as Manual
from alpa_lite.runtime import distributed as distributed
from alpa_lite.tools import checkpoint as checkpoint
from alpa_lite.tools.compare import CompareRow as CompareRow
from alpa_lite.tools.compare import compare as compare

__all__ = [
    "Auto", "CheckpointMismatchError", "Cluster", "CompareRow", "DataParallel", "Manual",
    "MemoryBudgetError",
    "NonFiniteGradientError", "ParallelizedStep", "Plan", "PlanMismatchError", "PlanningError",
    "checkpoint", "compare", "distributed", "grad", "mark_layer_boundary", "parallelize",
    "value_and_grad",
]
