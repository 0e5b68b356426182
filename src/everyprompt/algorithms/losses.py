"""Per-token policy objectives (docs/algorithms.md).

Each loss takes a `LossBatch` (loss_batch.py: log-probs under the policy being trained and under the policy
that sampled, advantages and the completion mask, all [B, T], and the sampling policy's entropies) and its
own options, and returns (per-token loss [B, T], detached metrics); `policy_loss` then aggregates. A loss whose objective is a mean over sequences (GSPO, ESPO) returns per-token values
that `seq-mean-token-mean` reduces to exactly that objective, and declares it as its default aggregation.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from everyprompt.algorithms.loss_batch import LossBatch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A metric: the mean of `values` where `mask` is 1, a detached 0-dim tensor on their device (read
    back with the step's other metrics, not one by one)."""
    return ((values * mask).sum() / mask.sum().clamp(min=1)).detach()


def ratio_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What every ratio-based loss reports: the mean importance ratio and 0.5 (log ratio)^2 over `mask`."""
    return {
        "actor/ratio_mean": masked_mean(ratio, mask),
        "actor/approx_kl": masked_mean(0.5 * log_ratio.pow(2), mask),
    }


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(r A, clip(r, low, high) A) and where the clipped branch was taken."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, low, high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_t (logp - old_logp) over each sequence's completion tokens: [B]."""
    return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def ppo_clip_loss(
    batch: LossBatch, *, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per token: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - old_logp).

    With `dual_clip` = c > 1, a negative-advantage token's loss is further capped at -c A (dual-clip PPO).
    clip_high > clip_low is DAPO's clip-higher.
    """
    logp, old_logp, advantages = batch.logp, batch.old_logp, batch.advantages  # [B, T] each
    mask = batch.mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    loss, was_clipped = _clipped_objective(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    with torch.no_grad():
        metrics = {
            "actor/clip_fraction": masked_mean(was_clipped.to(logp.dtype), mask),
            **ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def gspo_loss(
    batch: LossBatch, *, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: one ratio per sequence, s_i = exp(mean_t (logp - old_logp)), clipped to [1 - lo, 1 + hi].

    The sequence loss -min(s A_i, clip(s) A_i) is written on every completion token of the sequence, so
    `seq-mean-token-mean` gives the paper's mean over sequences. A_i is the sequence's advantage: the
    mean of its completion tokens' advantages (the advantage itself when it is one per sequence; with
    RL-ZVP's token advantages, their mean: docs/algorithms.md). Computed as GSPO-token with that
    advantage on every token: same values, same gradient, and a clip fraction over tokens that is
    comparable with the token-level losses'.
    """
    mask = batch.mask.to(batch.logp.dtype)
    sequence_advantage = (batch.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return gspo_token_loss(
        replace(batch, advantages=sequence_advantage), clip_low=clip_low, clip_high=clip_high
    )


def _gspo_token_ratio(logp: torch.Tensor, group_log_ratio: torch.Tensor) -> torch.Tensor:
    """sg[s] * exp(logp - sg[logp]): forward value s, gradient s * d logp (GSPO-token form)."""
    return group_log_ratio.detach().exp() * (logp - logp.detach()).exp()


def gspo_token_loss(
    batch: LossBatch, *, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token: s_{i,t} = sg[s_i] exp(logp - sg[logp]); per token -min(s A_{i,t}, clip(s) A_{i,t}).

    Same forward values as GSPO and, with one advantage per sequence, the same gradient; it also
    accepts per-token advantages.
    """
    logp, old_logp, advantages = batch.logp, batch.old_logp, batch.advantages  # [B, T] each
    mask = batch.mask.to(logp.dtype)
    log_ratio = ((logp - old_logp) * mask).clamp(-20.0, 20.0)
    sequence_log_ratio = _sequence_log_ratio(log_ratio, mask)[:, None]
    ratio = _gspo_token_ratio(logp, sequence_log_ratio.expand_as(logp))
    loss, was_clipped = _clipped_objective(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        metrics = {
            "actor/clip_fraction": masked_mean(was_clipped.to(logp.dtype), mask),
            **ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def cispo_loss(
    batch: LossBatch, *, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1): -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logp per token.

    The importance weight is clipped and detached instead of the update being dropped, so every token
    keeps a gradient. clip_low = 1 leaves the weight unbounded below (the paper's setting).
    """
    logp, old_logp, advantages = batch.logp, batch.old_logp, batch.advantages  # [B, T] each
    mask = batch.mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max(0.0, 1.0 - clip_low), 1.0 + clip_high)
    loss = -weight * advantages * logp
    with torch.no_grad():
        clipped = (ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low)
        metrics = {
            "actor/clip_fraction": masked_mean(clipped.to(logp.dtype), mask),
            **ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def entropy_groups(
    entropy: torch.Tensor, mask: torch.Tensor, num_groups: int, high_frac: float
) -> torch.Tensor:
    """Per-token entropy group id [B, T] (long; 0 = highest entropy; -1 off the mask).

    Groups are per sequence. K = 2: the ceil(high_frac * n) highest-entropy completion tokens of a
    sequence of n tokens form group 0, the rest group 1. K > 2: equal-count entropy quantile bins,
    group k holding ranks [k n / K, (k + 1) n / K). Ties are broken by position.
    """
    if num_groups < 1:
        raise ValueError(f"ESPO num_groups must be >= 1, got {num_groups}")
    if not 0.0 < high_frac < 1.0:
        raise ValueError(f"ESPO high_frac must be in (0, 1), got {high_frac}")
    valid = mask > 0
    keyed = torch.where(
        valid, entropy.detach().double(), torch.full_like(entropy, -math.inf, dtype=torch.float64)
    )
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(entropy.shape[-1], device=entropy.device).expand_as(order)
    )
    counts = valid.sum(-1, keepdim=True)
    if num_groups == 1:
        group = torch.zeros_like(rank)
    elif num_groups == 2:
        high = torch.ceil(counts.double() * high_frac).long().clamp(min=1)
        group = (rank >= high).long()
    else:
        group = torch.div(rank * num_groups, counts.clamp(min=1), rounding_mode="floor")
    return torch.where(valid, group, torch.full_like(group, -1))


def espo_loss(
    batch: LossBatch,
    *,
    vocab_size: int | None,
    alpha: float,
    num_groups: int,
    high_frac: float,
    ratio_denominator: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ESPO (docs/algorithms.md): entropy-grouped sequence ratios with entropy-adaptive clipping.

    Per sequence i and entropy group tau (see :func:`entropy_groups`; entropies of the sampling policy):
      s_tau   = exp(mean_{t in tau} (logp - old_logp))
      eps_tau = alpha * mean_{t in tau} H / log |V|                        (detached)
      token t in tau: ratio = sg[s_tau] * exp(logp - sg[logp])             ratio_denominator="current"
                      ratio = sg[s_tau] * exp(logp - old_logp)             ratio_denominator="old"
      loss_t = -min(ratio A, clip(ratio, 1 - eps_tau, 1 + eps_tau) A)
    and the objective is the mean over tokens of a group, then over the sequence's non-empty groups,
    then over sequences. Returned per-token values are loss_t * n_i / (|tau| * K_i), so that
    `seq-mean-token-mean` (sum_t / n_i, then mean over sequences) is exactly that three-level mean.
    """
    logp, old_logp, advantages, entropy = batch.logp, batch.old_logp, batch.advantages, batch.entropy
    if entropy is None:
        raise ValueError("the ESPO loss needs per-token entropies of the sampling policy (LossBatch.entropy)")
    if not vocab_size or vocab_size < 2:
        raise ValueError(f"the ESPO loss needs the vocabulary size (vocab_size >= 2), got {vocab_size}")
    if ratio_denominator not in ("current", "old"):
        raise ValueError(f"ESPO ratio_denominator must be 'current' or 'old', got {ratio_denominator!r}")
    mask = batch.mask.to(logp.dtype)
    entropy = entropy.detach().to(logp.dtype)
    group = entropy_groups(entropy, mask, num_groups, high_frac)
    # a comparison, not F.one_hot: on a GPU one_hot checks its input's range, a device sync
    groups = torch.arange(num_groups, device=group.device)
    one_hot = (group.clamp(min=0)[..., None] == groups).to(logp.dtype) * mask[..., None]
    size = one_hot.sum(1)  # [B, K] tokens per group
    log_ratio = ((logp - old_logp) * mask).clamp(-20.0, 20.0)
    group_log_ratio = torch.einsum("bt,btk->bk", log_ratio, one_hot) / size.clamp(min=1)
    group_entropy = torch.einsum("bt,btk->bk", entropy * mask, one_hot) / size.clamp(min=1)
    epsilon = alpha * group_entropy / math.log(vocab_size)  # [B, K]
    token_group_log_ratio = torch.einsum("bk,btk->bt", group_log_ratio, one_hot)
    token_epsilon = torch.einsum("bk,btk->bt", epsilon, one_hot)
    if ratio_denominator == "current":
        ratio = _gspo_token_ratio(logp, token_group_log_ratio)
    else:
        ratio = token_group_log_ratio.detach().exp() * (logp - old_logp).clamp(-20.0, 20.0).exp()
    loss, was_clipped = _clipped_objective(ratio, advantages, 1.0 - token_epsilon, 1.0 + token_epsilon)
    groups_present = (size > 0).sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    token_size = torch.einsum("bk,btk->bt", size, one_hot).clamp(min=1)
    weight = mask.sum(-1, keepdim=True) / (token_size * groups_present)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k in range(num_groups):
            name = ("high", "low")[k] if num_groups == 2 else str(k)
            in_group = one_hot[..., k]
            present = size[:, k] > 0
            metrics[f"espo/clip_fraction_{name}"] = masked_mean(was_clipped.to(logp.dtype), in_group)
            metrics[f"espo/group_size_{name}"] = size[:, k].mean()
            metrics[f"espo/entropy_{name}"] = masked_mean(entropy, in_group)
            metrics[f"espo/epsilon_{name}"] = masked_mean(epsilon[:, k], present.to(epsilon.dtype))  # 0: none
        metrics["actor/clip_fraction"] = masked_mean(was_clipped.to(logp.dtype), mask)
        metrics.update(ratio_metrics(ratio, log_ratio, mask))
        metrics["espo/epsilon_mean"] = masked_mean(token_epsilon, mask)
    return loss * weight, metrics
