"""Per-token policy objectives (ALGORITHMS.md section 1). Each returns (loss [B, T], detached metrics)."""

from __future__ import annotations

import torch

from everyprompt.algorithms.registry import register_policy_loss


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip per token: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - old_logp).

    With `dual_clip` = c > 1, a negative-advantage token's loss is further capped at -c A (dual-clip PPO).
    clip_high > clip_low is DAPO's clip-higher.
    """
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    with torch.no_grad():
        metrics = {
            "actor/clip_fraction": _masked_mean((clipped > unclipped).to(logp.dtype), mask),
            "actor/ratio_mean": _masked_mean(ratio, mask),
            "actor/approx_kl": _masked_mean(0.5 * log_ratio.pow(2), mask),
        }
    return loss, metrics
