"""Planning: from a traced step and a cluster to a Plan.

Holds the one planner (`planner`) and its parts: sharding strategies per operator
(`strategies`, `grouping`), the intra-op ILP of one stage (`intra_op`), single-stage planning
over logical meshes (`spmd`), layers and the inter-op stage search (`layers`, `pipeline`),
gradient sync and its compression (`compression`), and fused-kernel analysis (`fusion`).

May import: ir, plan, `alpa_lite.cost_models`, `alpa_lite.solvers`, errors, progress.
Never runtime: a plan is found without running anything.
"""
