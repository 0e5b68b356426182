"""The two entry points of the RL math: `compute_advantages` and `policy_loss`, the functions registered
by name (registry.py) run with their options, corrections, KL penalty and aggregation."""

from __future__ import annotations

import torch

from everyprompt.algorithms.aggregation import aggregate
from everyprompt.algorithms.corrections import kl_penalty, off_policy_sequence_mask, rollout_correction
from everyprompt.algorithms.loss_batch import LossBatch, LossSettings
from everyprompt.algorithms.registry import advantage_function, policy_loss_spec

DEFAULT_SETTINGS = LossSettings()  # the loss's default aggregation, no correction, penalty or mask


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
    batch: LossBatch,
    settings: LossSettings = DEFAULT_SETTINGS,
    *,
    host_metrics: bool = True,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of `batch` under the loss registered as `name`, and its detached metrics: floats
    (`host_metrics`, read back in one go), or 0-dim tensors on the loss's device for a caller that sums
    them over micro-batches and reads them back once.

    The registered per-token objective, times the rollout-correction weights (`settings.correction`),
    times the off-policy sequence mask when `settings.off_policy_mask` gives its threshold (against
    `batch.rollout_logp`, else `batch.old_logp`), plus `settings.kl_coef` times the `settings.kl`
    estimator against `batch.ref_logp`, reduced by `settings.agg` (the loss's own default when None) over
    the batch's denominators (see :func:`aggregate`). `options` are the loss's own (its registered schema
    fills the unset ones).
    """
    spec = policy_loss_spec(name)
    if spec.needs_entropy and batch.entropy is None:
        raise ValueError(f"policy loss {name!r} needs per-token entropies (LossBatch.entropy)")
    options = spec.resolve_options(options)
    if spec.needs_vocab_size:
        options["vocab_size"] = settings.vocab_size
    token_loss, metrics = spec.fn(batch, **options)  # [B, T]
    correction = settings.correction
    if correction.mode is not None:
        if batch.rollout_logp is None:
            raise ValueError(
                f"rollout correction {correction.mode!r} needs the engine's log-probs (LossBatch.rollout_logp)"
            )
        weight, correction_metrics = rollout_correction(
            batch.old_logp,
            batch.rollout_logp,
            batch.mask,
            correction.mode,
            correction.level,
            correction.cap,
            correction.band,
        )
        token_loss = token_loss * weight
        metrics.update(correction_metrics)
    if settings.off_policy_mask is not None:
        behaviour = batch.rollout_logp if batch.rollout_logp is not None else batch.old_logp
        keep, mask_metrics = off_policy_sequence_mask(
            batch.logp, behaviour, batch.advantages, batch.mask, settings.off_policy_mask
        )
        token_loss = token_loss * keep
        metrics.update(mask_metrics)
    if settings.kl is not None:
        if batch.ref_logp is None:
            raise ValueError(
                f"KL estimator {settings.kl!r} needs the reference model's log-probs (LossBatch.ref_logp)"
            )
        penalty = kl_penalty(batch.logp, batch.ref_logp, settings.kl)
        token_loss = token_loss + settings.kl_coef * penalty
        with torch.no_grad():
            m = batch.mask.to(penalty.dtype)
            metrics["actor/kl_ref"] = (penalty * m).sum() / m.sum().clamp(min=1)
    loss = aggregate(
        token_loss,
        batch.mask,
        settings.agg or spec.default_agg,
        max_length=settings.max_length,
        num_tokens=batch.num_tokens,
        num_sequences=batch.num_sequences,
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
