"""Reward functions: the plain-callable protocol, the registry, and the built-in verifiers.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``; the columns are the
prompt rows' fields (``answer``, ``level``, ...) aligned with the completions. None means "could not be
scored": the row is left out of its group's statistics.
"""

from everyprompt.rewards import math as _math  # noqa: F401  (registers "math")
from everyprompt.rewards.base import (
    RewardError,
    RewardFunction,
    get_reward,
    register_reward,
    registered_rewards,
    score_completions,
)
from everyprompt.rewards.math import extract_answer, math_reward

__all__ = [
    "RewardError",
    "RewardFunction",
    "extract_answer",
    "get_reward",
    "math_reward",
    "register_reward",
    "registered_rewards",
    "score_completions",
]
