"""ZVE stages 2 and 3 as pure tensor functions (docs/zve.md), and the zero-variance test they share.

  stage 2  reward reshaping  (`reshape_zero_variance`: group-centred length / repetition terms)
  stage 3  RL-ZVP            (`zvp_signs` here; the token advantages, `algorithms.zvp_token_advantages`,
                              are computed in the learner's forward from the current policy's entropies)

Decisions where the papers are silent:
- A reshaped group's advantages are its centred shaping terms, not std-normalised: the terms are a
  tie-breaker of size ~lambda, and dividing by the group std would make a one-token length difference
  weigh as much as a right-vs-wrong difference.
- A completion is "correct" when its reward reaches `zve.correct_reward` (1 for verifiable rewards);
  pass rates, retirement and RL-ZVP's sign all use that test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from everyprompt.rewards.shaping import repetition_rate, reshape_rewards


def group_zero_variance(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[G] bool: groups whose valid rewards are all equal (or that have none)."""
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    valid = ~torch.isnan(rewards)
    values, index = rewards[valid].double(), group_index[valid]
    low = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amin")
    high = torch.full((groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amax")
    return high <= low


def reshape_zero_variance(
    rewards: torch.Tensor,  # [N], NaN where None
    completion_ids: Sequence[Sequence[int]],
    group_index: torch.Tensor,  # [N] long
    length_coef: float,
    repetition_coef: float,
    max_length: int,
    reward_gap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ZVE stage 2: (advantages [N] of the reshaped groups, 0 elsewhere; [G] bool groups now informative).

    Only zero-variance groups are reshaped; a reshaped group's advantage is its shaped reward minus the
    group mean (the shaping term itself, since the group's rewards were equal).
    """
    zero_variance = group_zero_variance(rewards, group_index)
    apply = zero_variance[group_index]
    lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float64)
    repetition = torch.tensor([repetition_rate(list(ids)) for ids in completion_ids], dtype=torch.float64)
    shaped = reshape_rewards(
        rewards.double(),
        lengths,
        repetition,
        group_index,
        apply,
        length_coef,
        repetition_coef,
        max_length,
        reward_gap,
    )
    advantages = torch.where(
        apply & ~torch.isnan(rewards), shaped - rewards.double(), torch.zeros_like(shaped)
    )
    # advantages equal the (centred) terms: informative where any member's term is non-zero
    groups = zero_variance.numel()
    moved = torch.zeros(groups, dtype=torch.bool).index_put_(
        (group_index,), advantages.abs() > 1e-12, accumulate=True
    )
    return advantages.to(rewards.dtype), zero_variance & moved


def zvp_signs(
    rewards: torch.Tensor, group_index: torch.Tensor, still_zero: torch.Tensor, correct_reward: float
) -> torch.Tensor:
    """[N] RL-ZVP sign per completion: +1 in an all-correct group, -1 in an all-wrong one, 0 elsewhere."""
    valid = ~torch.isnan(rewards)
    correct = torch.where(
        valid, (rewards >= correct_reward).double(), torch.zeros_like(rewards, dtype=torch.float64)
    )
    groups = still_zero.numel()
    any_correct = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, correct) > 0
    has_valid = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, valid.double()) > 0
    sign = torch.where(any_correct, 1, -1) * (still_zero & has_valid)
    return sign[group_index].to(torch.long)


def zero_variance_rate(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """Share of groups whose valid rewards are all equal (their advantages are all zero)."""
    return float(group_zero_variance(rewards, group_index).double().mean())
