"""KL penalties against a reference model and train/rollout mismatch corrections (docs/algorithms.md).

KL estimators of KL(pi || pi_ref) per token, with d = logp - ref_logp (Schulman's k1/k2/k3):
  k1 = d,    k2 = d^2 / 2,    k3 = exp(-d) - 1 + d    (k3 >= 0 and unbiased).

Rollout corrections weight each token's loss by how far the trainer's old policy is from the engine
that sampled, rho = exp(old_logp - rollout_logp):
  tis:    w = min(rho, C)                      (truncated importance sampling)
  mis:    w = 1 if 1/C <= rho <= C else 0       (masked importance sampling; `band` [lo, hi] for
                                                 [1/C, C]: at the geometric level, the geometric-mean
                                                 ratio band of SkyRL and verl)
  icepop: w = rho if lo <= rho <= hi else 0     (IcePop, arXiv 2510.18855: the ratio inside a band, no
                                                 gradient outside it; band default [0.5, 5])
at token level (rho per token), sequence level (rho = exp(sum_t of the log-ratio), one per sequence) or
geometric level (rho = exp(mean_t of the log-ratio): the geometric mean of the token ratios, one per
sequence; the weight sequence-level losses such as GSPO and ESPO take).
The weights are detached; masked tokens keep their place in the aggregation's denominators.

With an asynchronous run (rl.max_staleness >= 1) the old policy is the learner's proximal policy and the
engine's log-probs are the behaviour policy's, several updates older: `tis` then makes the loss the
decoupled objective (docs/asynchrony.md).
"""

from __future__ import annotations

import math

import torch

from everyprompt.algorithms.options import CORRECTION_LEVELS, CORRECTIONS, ICEPOP_BAND, KL_ESTIMATORS


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] (differentiable in logp)."""
    d = logp - ref_logp.detach()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return (-d).clamp(max=20.0).exp() - 1.0 + d
    raise KeyError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def rollout_correction(
    old_logp: torch.Tensor,  # [B, T] trainer's log-probs of the sampled tokens before the update
    rollout_logp: torch.Tensor,  # [B, T] the engine's log-probs of the same tokens
    mask: torch.Tensor,  # [B, T]
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    band: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached per-token loss weights [B, T] and metrics (mean weight, share of tokens capped/masked)."""
    if mode not in CORRECTIONS:
        raise KeyError(f"unknown rollout correction {mode!r}; valid: {', '.join(CORRECTIONS)}")
    if level not in CORRECTION_LEVELS:
        raise KeyError(f"unknown rollout correction level {level!r}; valid: {', '.join(CORRECTION_LEVELS)}")
    if cap <= 1.0:
        raise ValueError(f"the rollout correction cap C must be > 1, got {cap}")
    if mode == "icepop" and band is None:
        band = ICEPOP_BAND
    if band is not None and not 0 <= band[0] < band[1]:
        raise ValueError(f"a rollout correction band must be 0 <= low < high, got {list(band)}")
    mask = mask.to(old_logp.dtype)
    with torch.no_grad():
        log_rho = (old_logp - rollout_logp) * mask
        if level == "sequence":
            log_rho = log_rho.sum(-1, keepdim=True).expand_as(mask)
        elif level == "geometric":
            log_rho = (log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(
                mask
            )
        log_cap = math.log(cap)
        if mode == "tis":
            weight = log_rho.clamp(max=log_cap).exp()
            affected = log_rho > log_cap
        else:
            low, high = (-log_cap, log_cap) if band is None else (_log(band[0]), math.log(band[1]))
            inside = (log_rho >= low) & (log_rho <= high)
            weight = inside.to(mask.dtype) * (log_rho.exp() if mode == "icepop" else 1.0)
            affected = ~inside
        weight = weight * mask
        tokens = mask.sum().clamp(min=1)
        metrics = {
            f"rollout_correction/{mode}_weight_mean": weight.sum() / tokens,
            f"rollout_correction/{mode}_affected_fraction": (affected * mask).sum() / tokens,
        }
    return weight, metrics


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def off_policy_sequence_mask(
    logp: torch.Tensor,  # [B, T] the policy being trained
    behaviour_logp: torch.Tensor,  # [B, T] the policy that sampled (the engine's log-probs)
    advantages: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    threshold: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556): a token of a sequence is dropped when
    its advantage is negative and the sequence's mean per-token KL from the behaviour policy to the current
    one, mean_t (behaviour_logp - logp) (k1 at the sampled tokens), exceeds `threshold`: a negative update
    learned from samples the policy has moved far from. Detached keep-mask [B, T] (masked tokens keep their
    place in the loss's denominators) and the shares of sequences and tokens masked."""
    if threshold <= 0:
        raise ValueError(f"the off-policy mask's threshold must be > 0, got {threshold}")
    mask = mask.to(logp.dtype)
    with torch.no_grad():
        drift = ((behaviour_logp - logp.detach()) * mask).sum(-1, keepdim=True) / mask.sum(
            -1, keepdim=True
        ).clamp(min=1)
        dropped = (advantages < 0) & (drift > threshold)
        keep = (~dropped).to(mask.dtype)
        rows = (mask.sum(-1) > 0).to(mask.dtype)
        sequences = ((dropped & (mask > 0)).any(-1).to(mask.dtype) * rows).sum() / rows.sum().clamp(min=1)
        metrics = {
            "off_policy_mask/masked_sequence_fraction": sequences,
            "off_policy_mask/masked_token_fraction": (dropped * mask).sum() / mask.sum().clamp(min=1),
            "off_policy_mask/kl_mean": (drift[:, 0] * rows).sum() / rows.sum().clamp(min=1),
        }
    return keep, metrics
