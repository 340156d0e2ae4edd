"""The errors alpa_lite raises for problems a user can fix."""


class PlanningError(ValueError):
    """No plan satisfies the request (memory budget, mesh shape, divisibility)."""


class PlanMismatchError(ValueError):
    """A plan was used with a different cluster, program or argument shapes."""


class CheckpointMismatchError(ValueError):
    """A checkpoint holds another model's state, or compressor state this step cannot take."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; the step changed nothing (see `on_nonfinite`)."""
