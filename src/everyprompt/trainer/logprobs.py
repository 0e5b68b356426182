"""Trainer-side log-probabilities and entropies from the HF model's forward pass."""

from __future__ import annotations

import torch


def token_logprobs(
    model, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) of each next token: [B, L - 1]; and its entropy [B, L - 1] (detached).

    Sequences are right-padded, so causal attention never lets a real token see padding and no
    attention mask is needed; padded targets are dropped by the caller's mask.
    """
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, 1:, None]
    chosen = logprobs.gather(-1, targets).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logprobs.exp() * logprobs).sum(-1)
    return chosen, entropy
