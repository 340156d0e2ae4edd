"""The Plan: the frozen record the runtime executes, the CLI shows and the tests assert on.

Holds the Plan and its parts (`plan`), sharding specs (`sharding`), the user's methods
(`methods`) and the text rendering (`text`).

May import: `alpa_lite.errors`, `alpa_lite.cost_models`. Never ir, planning or runtime.
"""

from alpa_lite.plan.plan import (
                                 PLAN_FORMAT,
                                 Accumulation,
                                 Alternative,
                                 Choice,
                                 CollectiveSummary,
                                 CompressionSpec,
                                 Explanation,
                                 GradientSync,
                                 InputPlacement,
                                 PipelineSpec,
                                 Plan,
                                 PlanningStats,
                                 StageExchange,
                                 StagePlan,
                                 SyncCollective,
)
from alpa_lite.plan.timing import BucketIssue, SyncBucket, SyncBuckets

__all__ = ["PLAN_FORMAT", "Accumulation", "Alternative", "BucketIssue", "Choice",
           "CollectiveSummary", "CompressionSpec", "Explanation", "GradientSync",
           "InputPlacement", "PipelineSpec", "Plan", "PlanningStats", "StageExchange",
           "StagePlan", "SyncBucket", "SyncBuckets", "SyncCollective"]
