"""Reward functions: the plain-callable protocol, the registry, and the built-in verifiers.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``; the columns are the
prompt rows' fields (``answer``, ``level``, ...) aligned with the completions. None means "could not be
scored": the row is left out of its group's statistics.
"""

from everyprompt.rewards import gym as _gym  # noqa: F401  (registers "reasoning_gym")
from everyprompt.rewards import math as _math  # noqa: F401  (registers "math")
from everyprompt.rewards.base import (
    RewardError,
    RewardFunction,
    get_reward,
    register_reward,
    registered_rewards,
    score_completions,
)
from everyprompt.rewards.compose import CompositeReward
from everyprompt.rewards.genrm import GenRMJudge, parse_verdict
from everyprompt.rewards.math import extract_answer, math_reward
from everyprompt.rewards.scalar_rm import ScalarRM


def build_reward(config, run_dir=None) -> RewardFunction:
    """The reward function a `RewardsConfig` describes: a weighted composite of `components` when given,
    else `function` (`genrm`: the judge model; `scalar_rm`: a sequence-classification model; otherwise the registry's or a user function)."""

    def one(function: str) -> RewardFunction:
        if function == "genrm":
            return GenRMJudge.from_config(config.genrm, run_dir)
        if function == "scalar_rm":
            return ScalarRM.from_config(config.scalar_rm)
        return get_reward(function)

    if config.components:
        parts = [(c.name, one(c.function), c.weight) for c in config.components]
        return CompositeReward(parts, config.missing)
    return one(config.function)


__all__ = [
    "CompositeReward",
    "GenRMJudge",
    "RewardError",
    "RewardFunction",
    "ScalarRM",
    "extract_answer",
    "build_reward",
    "get_reward",
    "math_reward",
    "parse_verdict",
    "register_reward",
    "registered_rewards",
    "score_completions",
]
