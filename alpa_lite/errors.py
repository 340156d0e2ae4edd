"""The errors alpa_lite raises for problems a user can fix."""

import copy
from typing import TypeVar

ErrorT = TypeVar("ErrorT", bound=BaseException)
AnswerT = TypeVar("AnswerT")


class PlanningError(ValueError):
    """No plan satisfies the request (memory budget, mesh shape, divisibility)."""


class MemoryBudgetError(PlanningError):
    """No plan fits the per-device memory budget; `peak_bytes` is the smallest peak the
    planner reached (per device), so a caller can say how far off the request is."""

    def __init__(self, message: str, peak_bytes: float):
        super().__init__(message)
        self.peak_bytes = peak_bytes

    def __reduce__(self):
        # Planning workers send their errors back pickled (`planning.workers`).
        return type(self), (str(self), self.peak_bytes)


class PlanMismatchError(ValueError):
    """A plan was used with a different cluster, program or argument shapes."""


class CheckpointMismatchError(ValueError):
    """A checkpoint holds another model's state, or compressor state this step cannot take."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; the step changed nothing (see `on_nonfinite`)."""


def detached(error: ErrorT) -> ErrorT:
    """A copy of `error` to keep in a memo, or to raise from one: the same type and message,
    without the traceback and the exception it was raised while handling. A raised
    exception holds every frame it passed through, and they their locals (a whole stage's
    intra-op problem, a search's tables): kept in a memo, or raised again from one (which
    hands it this raise's frames), it would keep them alive as long as the memo."""
    return copy.copy(error)


def kept_answer(answer: "AnswerT | PlanningError") -> AnswerT:
    """A memo's answer: the value it holds, or the error it holds (kept `detached`) raised
    as a fresh copy."""
    if isinstance(answer, PlanningError):
        raise detached(answer)
    return answer
