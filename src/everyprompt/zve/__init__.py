"""Multi-stage zero-variance elimination (docs/zve.md): no rollout wasted on a group that teaches nothing.

A group whose valid rewards are all equal has zero advantage everywhere. ZVE removes such groups at
every stage of a step:

  stage 0  offline filter        (`offline`: pass rates before RL, or `everyprompt filter`)
  stage 1  adaptive expansion    (`expansion.collect_groups`; the rollout side runs it)
  stage 2  reward reshaping      (`stages.reshape_zero_variance`; the learner runs stages 2 and 3)
  stage 3  RL-ZVP                (`stages.zvp_signs`, token advantages in the learner's forward)
  stage 4  online retirement     (`data.passrate.PassRateStore.record`; the rollout side records)
"""

from everyprompt.zve.expansion import Collection, Group, collect_groups
from everyprompt.zve.offline import (
    FilterResult,
    PassRateEstimate,
    estimate_pass_rates,
    filter_by_pass_rate,
    seeded_sample,
)
from everyprompt.zve.stages import group_zero_variance, reshape_zero_variance, zero_variance_rate, zvp_signs

__all__ = [
    "Collection",
    "FilterResult",
    "Group",
    "PassRateEstimate",
    "collect_groups",
    "estimate_pass_rates",
    "filter_by_pass_rate",
    "group_zero_variance",
    "reshape_zero_variance",
    "seeded_sample",
    "zero_variance_rate",
    "zvp_signs",
]
