"""Train-inference mismatch: how far the trainer's old policy is from the engine that sampled.

The two implementations' disagreement is measured, not hidden; docs/metrics.md
explains each `mismatch/*` metric, docs/algorithms.md what router replay and the rollout corrections do
about it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from everyprompt.algorithms.objective import host_floats
from everyprompt.batch import RolloutBatch
from everyprompt.models.replay import same_expert_sets


def mismatch_metrics(*args, **kwargs) -> dict[str, float]:
    """`mismatch_values`' figures as metrics (`read_mismatch`)."""
    return read_mismatch(mismatch_values(*args, **kwargs))


def read_mismatch(values: dict) -> dict[str, float]:
    """`mismatch_values`' figures read back in one copy and finished on the host (`finish_mismatch`)."""
    return finish_mismatch(host_floats(values)) if values else {}


def mismatch_values(
    prompt_lengths: Sequence[int],
    trainer_logprobs: Sequence[torch.Tensor],  # N x [completion]: the trainer's old-policy log-probs
    engine_logprobs: Sequence[torch.Tensor],  # N x [completion]: the engine's
    trainer_routes: Sequence[torch.Tensor] | None = None,  # N x [fed tokens, L_moe, k]: routes it used
    engine_routes: Sequence[torch.Tensor] | None = None,  # N x [fed tokens, L_moe, k]: the engine's
    masks: Sequence[torch.Tensor] | None = None,  # N x [completion] bool: the model's own tokens
) -> dict[str, torch.Tensor | float]:
    """Over completion tokens: mean |logp_trainer - logp_engine|, the k3 estimate of KL(engine || trainer),
    the share of tokens whose ratio pi_trainer / pi_engine exceeds 2; with both sides' routes: the share
    of (token, MoE layer) pairs routed to the same expert set, and |dlogp| on tokens whose input token
    was routed differently in some layer ("flipped") and on the rest. With `masks`, over the model's own
    completion tokens only (an episode's environment tokens have no engine log-prob). The figures stay
    tensors on the device (a caller reads them back with its own, then `finish_mismatch`)."""
    if not trainer_logprobs:
        return {}
    old = torch.cat(list(trainer_logprobs))
    if not old.numel():
        return {}
    device = old.device
    log_ratio = (old - torch.cat(list(engine_logprobs)).to(device, non_blocking=True)).double()
    kept = None if masks is None else torch.cat(list(masks)).to(device, non_blocking=True)
    if kept is not None:
        log_ratio = log_ratio[kept]
        if not log_ratio.numel():
            return {}
    # every figure stays a tensor on the device until one read back at the end
    values = {
        "mismatch/logp_abs_diff": log_ratio.abs().mean(),
        "mismatch/k3_kl": (log_ratio.exp() - 1 - log_ratio).mean(),
        "mismatch/ratio_above_2": (log_ratio > math.log(2)).double().mean(),
    }
    if trainer_routes is not None and engine_routes is not None:
        same_pairs, pairs, flipped = [], 0, []
        for prompt_length, trainer, engine_route in zip(prompt_lengths, trainer_routes, engine_routes):
            n = min(len(trainer), len(engine_route))
            same = same_expert_sets(trainer[:n], engine_route[:n].to(device))  # [n, L]
            same_pairs.append(same.sum())
            pairs += same.numel()
            # completion target j is predicted from input token prompt_length - 1 + j
            flipped.append(~same[prompt_length - 1 :].all(-1))
        flipped_tokens = torch.cat(flipped)
        flipped_tokens = (flipped_tokens if kept is None else flipped_tokens[kept]).double()
        diff = log_ratio.abs()[: flipped_tokens.numel()]
        values["mismatch/routing_agreement"] = torch.stack(same_pairs).sum().double() / max(pairs, 1)
        values["mismatch/flipped_token_fraction"] = flipped_tokens.mean()
        values["mismatch:flipped"] = flipped_tokens.sum()
        values["mismatch:tokens"] = float(flipped_tokens.numel())  # known on the host
        values["mismatch:flipped_diff"] = (diff * flipped_tokens).sum()
        values["mismatch:unflipped_diff"] = (diff * (1 - flipped_tokens)).sum()
    return values


def finish_mismatch(read: dict[str, float]) -> dict[str, float]:
    """The `mismatch/*` metrics from `mismatch_values`' figures read back as floats (among others, which
    are left out): the flipped and unflipped tokens' mean |dlogp| where there are any."""
    metrics = {key: value for key, value in read.items() if key.startswith("mismatch/")}
    if "mismatch:flipped" in read:
        count, total = read["mismatch:flipped"], read["mismatch:tokens"]
        if count > 0:
            metrics["mismatch/logp_abs_diff_flipped"] = read["mismatch:flipped_diff"] / count
        if count < total:
            metrics["mismatch/logp_abs_diff_unflipped"] = read["mismatch:unflipped_diff"] / (total - count)
    return metrics


def fed_tokens(batch: RolloutBatch, rows: list[int], routes: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Recorded routes of `rows` cut to each row's fed tokens (prompt + completion - 1; an unpacked
    forward records its padding too)."""
    return [
        r[: len(batch.prompt_ids[i]) + len(batch.completion_ids[i]) - 1] for i, r in zip(rows, routes or [])
    ]


def batch_mismatch(
    batch: RolloutBatch, rows: list[int], trainer_logprobs, trainer_routes
) -> dict[str, float]:
    """`mismatch_metrics` of `rows` of `batch`: the trainer's values given, the engine's from the batch."""
    return read_mismatch(batch_mismatch_values(batch, rows, trainer_logprobs, trainer_routes))


def batch_mismatch_values(
    batch: RolloutBatch, rows: list[int], trainer_logprobs, trainer_routes
) -> dict[str, torch.Tensor | float]:
    """`mismatch_values` of `rows` of `batch` (on the device): the trainer's given, the engine's from it."""
    engine_routes = batch.routed_experts
    return mismatch_values(
        [len(batch.prompt_ids[r]) for r in rows],
        trainer_logprobs,
        [batch.rollout_logprobs[r] for r in rows],
        trainer_routes,
        [engine_routes[r] for r in rows] if engine_routes is not None else None,
        None if batch.completion_mask is None else [batch.completion_mask[r] for r in rows],
    )
