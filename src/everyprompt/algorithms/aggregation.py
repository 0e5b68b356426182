"""Reductions of a per-token loss matrix to a scalar (kept apart from the objective, as in verl)."""

from __future__ import annotations

import torch

from everyprompt.algorithms.options import AGGREGATIONS


def aggregate(
    token_loss: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    mode: str,
    max_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss.

    token-mean:               sum_{i,t} l m / sum_{i,t} m                     (DAPO)
    seq-mean-token-mean:      mean_i [ sum_t l m / sum_t m ]                  (GRPO paper)
    seq-mean-token-sum-norm:  mean_i [ sum_t l m / max_length ]               (Dr.GRPO)

    `num_tokens` / `num_sequences` override the denominators, so that micro-batches of one mini-batch
    can each be divided by the mini-batch's totals and their gradients summed exactly.
    """
    mask = mask.to(token_loss.dtype)
    masked = token_loss * mask
    if mode == "token-mean":
        denominator = num_tokens if num_tokens is not None else mask.sum().clamp(min=1.0)
        return masked.sum() / denominator
    sequences = num_sequences if num_sequences is not None else token_loss.shape[0]
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        if not max_length:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs max_length")
        per_sequence = masked.sum(-1) / max_length
    else:
        raise KeyError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return per_sequence.sum() / sequences
