"""Reward reshaping for zero-variance groups (ZVE stage 2, docs/zve.md).

R'_i = R_i - lambda * (L_i - mean_g L) / L_max - mu * (rep_i - mean_g rep)

Both terms are centred on the group, so a group's mean reward is unchanged, and bounded: a length term
lies in (-lambda, lambda) and two completions' repetition terms differ by at most mu (rep in [0, 1]).
Two completions of one group therefore move apart by less than lambda + mu; with lambda + mu below the
gap between reward levels, a right answer keeps outranking a wrong one.
"""

from __future__ import annotations

import torch


def repetition_rate(token_ids: list[int], n: int = 3) -> float:
    """Share of a sequence's n-grams that repeat an earlier one: 0 (none) to 1 - 1/#n-grams."""
    count = len(token_ids) - n + 1
    if count <= 1:
        return 0.0
    grams = {tuple(token_ids[i : i + n]) for i in range(count)}
    return 1.0 - len(grams) / count


def _group_mean(values: torch.Tensor, valid: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    groups = int(group_index.max()) + 1
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, valid.double())
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, values.double() * valid)
    return (total / count.clamp(min=1))[group_index]


def shaping_terms(
    lengths: torch.Tensor,  # [N] completion lengths (tokens)
    repetition: torch.Tensor,  # [N] repetition rates in [0, 1]
    group_index: torch.Tensor,  # [N] long
    valid: torch.Tensor,  # [N] bool: rewards that exist (None-scored completions get 0)
    length_coef: float,
    repetition_coef: float,
    max_length: int,
) -> torch.Tensor:  # [N] float64, group-centred
    """-lambda * (L - mean L) / L_max - mu * (rep - mean rep), 0 where not valid."""
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    lengths, repetition = lengths.double(), repetition.double()
    terms = -length_coef * (lengths - _group_mean(lengths, valid, group_index)) / max_length
    terms = terms - repetition_coef * (repetition - _group_mean(repetition, valid, group_index))
    return torch.where(valid, terms, torch.zeros_like(terms))


def reshape_rewards(
    rewards: torch.Tensor,  # [N], NaN where None
    lengths: torch.Tensor,  # [N]
    repetition: torch.Tensor,  # [N]
    group_index: torch.Tensor,  # [N] long
    apply: torch.Tensor,  # [N] bool: completions whose group is reshaped
    length_coef: float,
    repetition_coef: float,
    max_length: int,
    reward_gap: float = 1.0,
) -> torch.Tensor:  # [N]
    """Rewards with the shaping terms added where `apply`; NaN rewards stay NaN."""
    if length_coef < 0 or repetition_coef < 0:
        raise ValueError("shaping coefficients must be non-negative")
    if length_coef + repetition_coef >= reward_gap:
        raise ValueError(
            f"length_coef + repetition_coef = {length_coef + repetition_coef:g} must be below the reward gap "
            f"{reward_gap:g}, or a wrong answer could outrank a right one"
        )
    valid = ~torch.isnan(rewards)
    terms = shaping_terms(lengths, repetition, group_index, valid, length_coef, repetition_coef, max_length)
    shaped = rewards.double() + torch.where(apply, terms, torch.zeros_like(terms))
    return shaped.to(rewards.dtype)
