"""What users run around a step: the `alpa-lite` CLI, compare, explain, reports and pictures,
calibration, built-in targets, the local launcher and checkpoints.

May import anything below it: api, runtime, planning, plan, ir, cost_models, solvers.
"""
