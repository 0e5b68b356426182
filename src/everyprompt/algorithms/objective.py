"""The two entry points of the RL math: `compute_advantages` and `policy_loss`, the functions registered
by name (registry.py) run with their options, corrections, KL penalty and aggregation."""

from __future__ import annotations

import torch

from everyprompt.algorithms.aggregation import aggregate
from everyprompt.algorithms.corrections import kl_penalty, off_policy_sequence_mask, rollout_correction
from everyprompt.algorithms.registry import advantage_function, policy_loss_spec


def compute_advantages(
    name: str,
    rewards: torch.Tensor,  # [N] float, NaN where the reward is None
    group_index: torch.Tensor,  # [N] long, the prompt group of each completion
    **options,
) -> torch.Tensor:  # [N]
    """Per-completion advantages from the estimator registered as `name`."""
    return advantage_function(name)(rewards, group_index, **options)


def policy_loss(
    name: str,
    logp: torch.Tensor,  # [B, T] log-probs under the policy being trained
    old_logp: torch.Tensor,  # [B, T] log-probs under the policy that sampled (detached)
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T] 1 on completion tokens
    *,
    entropy: torch.Tensor | None = None,  # [B, T] token entropies under the sampling policy
    agg: str | None = None,
    max_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    ref_logp: torch.Tensor | None = None,  # [B, T] reference-model log-probs (KL penalty)
    kl: str | None = None,
    kl_coef: float = 0.0,
    rollout_logp: torch.Tensor | None = None,  # [B, T] engine log-probs (mismatch correction)
    correction: str | None = None,
    correction_level: str = "token",
    correction_cap: float = 2.0,
    correction_band: tuple[float, float] | None = None,
    off_policy_mask: float | None = None,  # its KL threshold (None: off)
    vocab_size: int | None = None,
    host_metrics: bool = True,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss and detached metrics: floats (`host_metrics`, read back in one go), or 0-dim tensors on
    the loss's device for a caller that sums them over micro-batches and reads them back once.

    The registered per-token objective, times the rollout-correction weights when `correction` is
    "tis", "mis" or "icepop" (`correction_band`: MIS's or IcePop's ratio band), times the off-policy
    sequence mask when `off_policy_mask` gives its threshold (against `rollout_logp`, else `old_logp`),
    plus `kl_coef` times the `kl` estimator against `ref_logp`, reduced by `agg` (the
    loss's own default when None). `num_tokens` / `num_sequences` are the whole mini-batch's
    denominators when this call sees one micro-batch of it (see :func:`aggregate`). `options` are the
    loss's own (its registered schema fills the unset ones); `vocab_size` reaches losses that need it.
    """
    spec = policy_loss_spec(name)
    if spec.needs_entropy and entropy is None:
        raise ValueError(f"policy loss {name!r} needs per-token entropies (entropy=...)")
    options = spec.resolve_options(options)
    if spec.needs_vocab_size:
        options["vocab_size"] = vocab_size
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    token_loss, metrics = spec.fn(logp, old_logp, advantages, mask, entropy=entropy, **options)
    if correction is not None:
        if rollout_logp is None:
            raise ValueError(
                f"rollout correction {correction!r} needs the engine's log-probs (rollout_logp=...)"
            )
        weight, correction_metrics = rollout_correction(
            old_logp, rollout_logp, mask, correction, correction_level, correction_cap, correction_band
        )
        token_loss = token_loss * weight
        metrics.update(correction_metrics)
    if off_policy_mask is not None:
        behaviour = rollout_logp if rollout_logp is not None else old_logp
        keep, mask_metrics = off_policy_sequence_mask(logp, behaviour, advantages, mask, off_policy_mask)
        token_loss = token_loss * keep
        metrics.update(mask_metrics)
    if kl is not None:
        if ref_logp is None:
            raise ValueError(f"KL estimator {kl!r} needs the reference model's log-probs (ref_logp=...)")
        penalty = kl_penalty(logp, ref_logp, kl)
        token_loss = token_loss + kl_coef * penalty
        with torch.no_grad():
            m = mask.to(penalty.dtype)
            metrics["actor/kl_ref"] = (penalty * m).sum() / m.sum().clamp(min=1)
    loss = aggregate(
        token_loss,
        mask,
        agg or spec.default_agg,
        max_length=max_length,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
    return loss, (host_floats(metrics) if host_metrics else metrics)


def host_floats(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Metrics as floats: the tensors among them read back from their device in one copy."""
    tensors = {key: value for key, value in values.items() if isinstance(value, torch.Tensor)}
    out = {key: float(value) for key, value in values.items() if key not in tensors}
    if tensors:
        read = torch.stack([value.detach().double().reshape(()) for value in tensors.values()]).tolist()
        out.update(zip(tensors, read))
    return {key: out[key] for key in values}
