"""Runtime: executes a Plan on JAX devices, reading the Plan and nothing else.

Holds the one compile entry (`executable`), the engines behind it (`spmd` for one SPMD stage,
`pipeline` for stages on submeshes, `compressed` for compressed data-parallel exchange),
several processes (`distributed`) and reading collectives back from compiled HLO (`hlo`).

May import: ir, plan, `alpa_lite.cost_models` (the pipeline schedule's task order),
`alpa_lite.compression`, errors. Never planning: the runtime knows nothing of how a plan was
found.
"""
