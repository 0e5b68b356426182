"""Batch-invariant sampling: counter-based noise, so a row's sample depends only on its own seed.

Each row's Gumbel noise is a hash of (request seed, decode position, vocabulary index); sampling is
Gumbel-max over the (temperature-scaled, nucleus-filtered) log-probabilities. The result is the same
whether a request is decoded alone or in any batch, which continuous batching and resume rely on.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """A 63-bit request seed from integers (run seed, step, slot, sample ...): stable across runs and
    processes, so a request's sample depends only on where it stands in the run."""
    value = 0x2545F4914F6CDD1D
    for part in parts:
        value = (value * 6364136223846793005 + part + 1442695040888963407) % (1 << 63)
    return value


def _to_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_MIX1 = _to_signed(0xBF58476D1CE4E5B9)
_MIX2 = _to_signed(0x94D049BB133111EB)
_STEP = _to_signed(0xD6E8FEB86659FD93)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from int64 seeds [B] and positions [B]."""
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    key = _splitmix64(seeds[:, None] * _STEP + positions[:, None])
    bits = _splitmix64(key ^ _splitmix64(vocab[None, :]))
    return (_shift_right(bits, 40).to(torch.float64) + 0.5) / float(1 << 24)


def nucleus_filter(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf the tokens outside the smallest set whose probability reaches `top_p`."""
    if top_p >= 1.0:
        return logprobs
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logprobs.masked_fill(drop, float("-inf"))


def sample_tokens(
    logits: torch.Tensor,  # [B, V]
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, index of the token being sampled within its completion
    temperature: float,
    top_p: float,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled token ids [B], their log-probs [B] and the entropy [B] of softmax(logits / temperature).

    Log-probs and entropy are of the untruncated distribution (as the trainer sees it), from one
    log-softmax.
    """
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, logits.shape[-1])))
        tokens = (nucleus_filter(logprobs, top_p).double() + gumbel).argmax(dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), entropy
