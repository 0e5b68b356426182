"""Policy losses that replace PPO's hard ratio clip (docs/algorithms.md): SAPO's soft gate and DPPO's
divergence mask. Same signature as the losses of losses.py: a `LossBatch` (log-probs under the policy being
trained and under the old policy, advantages and the completion mask, all [B, T]) and the loss's options;
(per-token loss, detached metrics).

SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347): with r = exp(logp - old_logp),
    f(r) = sigmoid(tau (r - 1)) * 4 / tau,  loss_t = -f(r_t) A_t,  tau = tau_pos if A > 0 else tau_neg.
Its gradient is -A * 4 s (1 - s) r grad logp (s the sigmoid): -A grad logp on-policy, fading smoothly as r
leaves 1 instead of stopping at a clip boundary; a larger tau (tau_neg) fades negative-advantage tokens
faster.

DPPO (Divergence PPO, arXiv:2602.04879): the ratio is not clipped; a token whose probability has moved
from the anchor (the old policy: the engine's under rl.old_logprobs=rollout, as the paper prescribes)
further than a trust region, in the direction its advantage pushes, is masked out:
    p = exp(logp), q = exp(old_logp)
    binary TV:  masked when A > 0 and p - q > delta_high, or A <= 0 and p - q < -delta_low
    binary KL:  D = q log(q / p) + (1 - q) log((1 - q) / (1 - p)); masked when A > 0, p > q and
                D > delta_high, or A <= 0, p < q and D > delta_low
    loss_t = -M_t A_t r_t   (M = 1 - masked, detached; r untruncated)
A move back toward the anchor is never masked.
"""

from __future__ import annotations

import torch

from everyprompt.algorithms.loss_batch import LossBatch
from everyprompt.algorithms.losses import masked_mean, ratio_metrics

LOG_RATIO_BOUND = 20.0  # log-ratios clamped to +-20 before exp, as the other losses do
PROBABILITY_FLOOR = 1e-8  # 1 - p and 1 - q in the binary KL


def sapo_loss(
    batch: LossBatch, *, tau_pos: float, tau_neg: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO per token: -sigmoid(tau (r - 1)) * 4 / tau * A (module docstring)."""
    logp, old_logp, advantages = batch.logp, batch.old_logp, batch.advantages  # [B, T] each
    mask = batch.mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    tau = torch.full_like(logp, tau_neg).masked_fill(advantages > 0, tau_pos).detach()
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -gate * (4.0 / tau) * advantages.detach()
    with torch.no_grad():
        weight = 4.0 * gate * (1.0 - gate) * ratio  # the gradient's factor on -A grad logp: 1 on-policy
        metrics = {
            **ratio_metrics(ratio, log_ratio, mask),
            "sapo/gradient_weight_mean": masked_mean(weight, mask),
        }
    return loss, metrics


def _dppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    masked: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-M A r per token, M = 1 where `masked` is False; the share masked as the clip fraction."""
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    keep = (~masked).to(logp.dtype).detach()
    loss = -keep * advantages.detach() * ratio
    with torch.no_grad():
        share = masked_mean(masked.to(logp.dtype), mask)
        metrics = {
            "actor/clip_fraction": share,
            "dppo/masked_fraction": share,
            **ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def _binary_tv(logp, old_logp, advantages, delta_low, delta_high) -> torch.Tensor:
    """Masked where p - q passes delta_high in the direction A > 0 pushes, or -delta_low for A <= 0."""
    moved = logp.exp() - old_logp.exp()
    return torch.where(advantages > 0, moved > delta_high, moved < -delta_low)


def _binary_kl(logp, old_logp, advantages, delta_low, delta_high) -> torch.Tensor:
    """Masked where KL(Bern(q) || Bern(p)) passes the delta of the direction A pushes p away from q."""
    p, q = logp.exp(), old_logp.exp()
    rest_p, rest_q = (1.0 - p).clamp(min=PROBABILITY_FLOOR), (1.0 - q).clamp(min=PROBABILITY_FLOOR)
    divergence = q * (old_logp - logp) + rest_q * (rest_q.log() - rest_p.log())
    return torch.where(
        advantages > 0, (p > q) & (divergence > delta_high), (p < q) & (divergence > delta_low)
    )


def _dppo_loss(divergence_mask):
    """A DPPO loss with the trust-region mask `divergence_mask` (the registered signature)."""

    def loss(batch: LossBatch, *, delta_low: float, delta_high: float):
        logp, old_logp, advantages = batch.logp, batch.old_logp, batch.advantages  # [B, T] each
        with torch.no_grad():
            masked = divergence_mask(logp, old_logp, advantages, delta_low, delta_high)
        return _dppo(logp, old_logp, advantages, batch.mask, masked)

    loss.__doc__ = f"DPPO with the mask of `{divergence_mask.__name__}` (module docstring)."
    return loss


dppo_tv_loss = _dppo_loss(_binary_tv)
dppo_kl_loss = _dppo_loss(_binary_kl)
