"""Group-relative advantage estimators (docs/algorithms.md).

All take rewards [N] (NaN where the reward is None) and group indices [N]; NaN rewards are left out of
their group's statistics and get advantage 0. Group statistics use scatter ops, no Python loop.
"""

from __future__ import annotations

import math

import torch


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-completion group count, mean and unbiased std over the valid (non-NaN) rewards of its group."""
    valid = ~torch.isnan(rewards)
    values = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, valid.double())
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, values)
    mean = total / count.clamp(min=1)
    squared = (values - mean[group_index]).pow(2) * valid
    sum_sq = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, squared)
    std = (sum_sq / (count - 1).clamp(min=1)).sqrt()
    return valid, count[group_index], mean[group_index], std[group_index], total[group_index]


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    eps: float = 1e-6,
    normalize_std: bool = True,
    dead_zone: float = 0.0,
) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps); std is the unbiased sample std of the group.

    `dead_zone` delta (for scalar reward models, docs/rewards.md): |R_i - mean_g R| < delta gives
    A_i = 0, so that scores scattered around the mean by the reward model's noise do not become
    advantages of magnitude ~1 and random sign. The group's mean and std are those of all its rewards.
    """
    valid, _, mean, std, _ = _group_stats(rewards, group_index)
    centred = rewards.double() - mean
    advantages = centred / (std + eps) if normalize_std else centred
    keep = valid & (centred.abs() >= dead_zone) if dead_zone > 0 else valid
    return torch.where(keep, advantages, torch.zeros_like(advantages)).to(rewards.dtype)


def dr_grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, dead_zone: float = 0.0
) -> torch.Tensor:
    """A_i = R_i - mean_g R (Dr.GRPO: no division by the group std); `dead_zone` as for grpo."""
    return grpo_advantages(rewards, group_index, normalize_std=False, dead_zone=dead_zone)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """A_i = R_i - mean_{j != i} R_j  (leave-one-out baseline; 0 for a group of one valid reward)."""
    valid, count, _, _, total = _group_stats(rewards, group_index)
    r = rewards.double()
    baseline = (total - torch.where(valid, r, torch.zeros_like(r))) / (count - 1).clamp(min=1)
    advantages = torch.where(valid & (count > 1), r - baseline, torch.zeros_like(r))
    return advantages.to(rewards.dtype)


def gdpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    components: torch.Tensor,
    weights: list[float] | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GDPO (arXiv 2601.05242): each reward component normalised within its group, then summed.

    A_k,i = (r_k,i - mean_g r_k) / (std_g r_k + eps) for each component k (`components` [N, K], NaN where
    the component is None: left out of its group's statistics, contributing 0), A_i = sum_k w_k A_k,i,
    then normalised over the batch's rows, (A_i - mean A) / (std A + eps) (per sequence, as TRL and
    NeMo-RL). Summing the rewards first and normalising once (GRPO) lets the component of the largest scale
    decide; here each has its own say. Rows whose total reward is None (`rewards` NaN) get 0, as in GRPO.
    """
    if components.dim() != 2 or components.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"gdpo needs components [N, K] for N = {rewards.shape[0]}, got {tuple(components.shape)}"
        )
    weights = [1.0] * components.shape[1] if weights is None else list(weights)
    if len(weights) != components.shape[1]:
        raise ValueError(f"gdpo: {len(weights)} weights for {components.shape[1]} reward components")
    total = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for k, weight in enumerate(weights):
        total += weight * grpo_advantages(components[:, k].double(), group_index, eps=eps).double()
    # the batch as one group, the rows without a reward left out
    batch = torch.where(torch.isnan(rewards), math.nan, total)
    return grpo_advantages(batch, torch.zeros_like(group_index), eps=eps).to(rewards.dtype)


def zvp_token_advantages(
    entropy: torch.Tensor,  # [B, T] token entropies under the current policy (detached)
    mask: torch.Tensor,  # [B, T] 1 on completion tokens
    sign: torch.Tensor,  # [B] +1: all-correct group, -1: all-wrong group, 0: not a zero-variance group
    alpha: float = 0.1,
) -> torch.Tensor:  # [B, T], 0 where sign == 0 or off the mask
    """RL-ZVP token advantages for zero-variance groups (arXiv 2509.21880; docs/zve.md).

    all-correct: A_t = alpha * H_t;  all-wrong: A_t = -alpha * (max_k H_k - H_t), the max over the
    sequence's own completion tokens. Confident tokens of a right answer are left nearly alone while
    its uncertain forks are reinforced; in a wrong answer the confident tokens are pushed down hardest.
    """
    entropy = entropy.detach()
    on = mask > 0
    row_max = torch.where(on, entropy, torch.full_like(entropy, -torch.inf)).amax(dim=-1, keepdim=True)
    positive = alpha * entropy
    negative = -alpha * (row_max - entropy)
    sign = sign.to(entropy.dtype)[:, None]
    advantages = torch.where(sign > 0, positive, torch.where(sign < 0, negative, torch.zeros_like(entropy)))
    return torch.where(on, advantages, torch.zeros_like(advantages))
