"""The step as a program: tracing, the operator graph, and how it is cut.

Holds the traced step (`tracing`), its graph (`graph`), the markers a user's loss calls
(`markers`), every primitive's dimension labels (`op_rules`), the proof that micro-batching
keeps the step's math (`microbatch`), the step split around its gradient call and cut into
stage programs (`step_parts`), and the one replay loop that runs graph nodes (`replay`).

May import: `alpa_lite.errors`, `alpa_lite.solvers`, JAX. Never planning, plan or runtime.
"""
