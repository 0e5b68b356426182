"""The learning signal of a batch, before any forward pass: group-relative advantages, then zero-variance
elimination's stages 2 (reshaping) and 3 (RL-ZVP signs), and the groups left without any signal, which
`zve.drop_zero_variance` takes out of the update (docs/zve.md). Pure functions of the batch and the
config sections: every learner rank computes the same from the same batch."""

from __future__ import annotations

import torch

from everyprompt.algorithms import advantage_needs_components, compute_advantages
from everyprompt.batch import RolloutBatch
from everyprompt.errors import RunError
from everyprompt.zve import group_zero_variance, reshape_zero_variance, zvp_signs


def batch_advantages(
    batch: RolloutBatch, rl, zve, weights: dict[str, float] | None = None
) -> tuple[dict[str, float], torch.Tensor]:
    """Group-relative advantages, then ZVE stages 2 (reshaping) and 3 (RL-ZVP signs) when enabled;
    their metrics and the [G] groups still zero-variance after every enabled stage. An estimator that
    takes the reward's components (GDPO) gets them, each with its weight in `weights` (name -> weight)."""
    options = {"dead_zone": rl.dead_zone} if rl.dead_zone > 0 else {}
    if advantage_needs_components(rl.advantage):
        names = sorted(weights or {})
        if not names or any(name not in batch.reward_components for name in names):
            raise RunError(
                f"rl.advantage={rl.advantage} needs each reward component's value; the batch has "
                f"{sorted(batch.reward_components) or 'none'}, the config names {names or 'none'}"
            )
        options["components"] = torch.stack([batch.reward_components[name] for name in names], dim=1)
        options["weights"] = [weights[name] for name in names]
    if batch.episode_index is None:
        batch.advantages = compute_advantages(rl.advantage, batch.rewards, batch.group_index, **options)
    else:  # step-wise episodes: one advantage per episode, given to each of its turns' rows
        first = torch.tensor(batch.episode_rows(), dtype=torch.long)
        if "components" in options:
            options["components"] = options["components"][first]
        per_episode = compute_advantages(
            rl.advantage, batch.rewards[first], batch.group_index[first], **options
        )
        batch.advantages = per_episode[batch.episode_index]
    zero = group_zero_variance(batch.rewards, batch.group_index)
    stats = {"zve/zero_variance_rate_batch": float(zero.double().mean())}
    still = zero.clone()
    if zve.enabled and zve.reshape.enabled and bool(zero.any()):
        shape = zve.reshape
        shaped, informative = reshape_zero_variance(
            batch.rewards,
            batch.completion_ids,
            batch.group_index,
            shape.length_coef,
            shape.repetition_coef,
            batch.max_new_tokens,
            shape.reward_gap,
        )
        batch.advantages = torch.where(zero[batch.group_index], shaped, batch.advantages)
        still &= ~informative
        stats["zve/reshaped_groups"] = float(informative.sum())
    if zve.enabled:
        stats["zve/zero_variance_rate_reshaped"] = float(still.double().mean())
    if zve.enabled and zve.zvp.enabled and bool(still.any()):
        batch.zvp_sign = zvp_signs(batch.rewards, batch.group_index, still, zve.correct_reward)
        zvp_groups = torch.zeros_like(still).index_put_(
            (batch.group_index,), batch.zvp_sign != 0, accumulate=True
        )
        still &= ~zvp_groups
        stats["zve/zvp_groups"] = float(zvp_groups.sum())
    if zve.enabled:
        stats["zve/zero_variance_rate_final"] = float(still.double().mean())
    carries = _carrying(batch)
    # of all rollouts generated this step: those whose update carries a non-zero advantage
    generated = batch.stats.get("zve/generated_rollouts", float(len(batch)))
    stats["zve/informative_rollout_fraction"] = float(carries.sum()) / max(generated, 1.0)
    return stats, still


def _carrying(batch: RolloutBatch) -> torch.Tensor:
    """[N] whether each rollout's update carries a non-zero advantage (its own, or an RL-ZVP sign)."""
    carries = batch.advantages != 0
    if batch.zvp_sign is not None:
        carries |= batch.zvp_sign != 0
    return carries


def carries_signal(batch: RolloutBatch) -> bool:
    """Whether any rollout of `batch` (its advantages computed) gives the policy gradient something: when
    none does, an optimizer step would only replay Adam's momentum and the weight decay."""
    return bool(_carrying(batch).any())


def drop_zero_variance(batch: RolloutBatch, still: torch.Tensor, zve, metrics: dict) -> RolloutBatch:
    """`zve.drop_zero_variance`: the batch without the groups `still` zero-variance after every stage."""
    if not (zve.enabled and zve.drop_zero_variance):
        return batch
    metrics["zve/dropped_zero_variance_groups"] = float(still.sum())
    if not bool(still.any()):
        return batch
    kept = ~still[batch.group_index]
    return batch.select(kept.nonzero().flatten().tolist())
