"""Batch-invariant sampling: counter-based noise, so a row's sample depends only on its own seed.

Each row's Gumbel noise is a hash of (request seed, decode position, vocabulary index); sampling is
Gumbel-max over the (temperature-scaled, nucleus-filtered) log-probabilities. The result is the same
whether a request is decoded alone or in any batch, which continuous batching and resume rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

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


def _splitmix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of each element, in place (callers pass a tensor of their own)."""
    x.add_(_GOLDEN)
    x.bitwise_xor_(_shift_right(x, 30)).mul_(_MIX1)
    x.bitwise_xor_(_shift_right(x, 27)).mul_(_MIX2)
    return x.bitwise_xor_(_shift_right(x, 31))


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) from the top 24 bits of each hash."""
    return _shift_right(bits, 40).to(torch.float64).add_(0.5).div_(float(1 << 24))


def vocab_hashes(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each vocabulary index's hash [1, V] (int64), the half of the noise that no row changes. A caller
    that samples every step makes it once and passes it to `sample_tokens` (the native engine does): then
    the sampler neither recomputes it nor, compiled, holds an index sequence plus 64-bit constants, which
    Inductor's Triton code cannot express (measured on an H200 with torch 2.11: "Scalar
    -7046029254386353131 is out of range for type int32", the compiled step given up)."""
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _splitmix64_(vocab[None, :])


def _hashes(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, vocab: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's key [B, 1] and each vocabulary index's hash [1, V] (`vocab`, else made here): a (row,
    token) noise is the hash of their xor."""
    if vocab is None:
        vocab = vocab_hashes(vocab_size, seeds.device)
    return _splitmix64_(seeds[:, None] * _STEP + positions[:, None]), vocab


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from int64 seeds [B] and positions [B]."""
    key, vocab = _hashes(seeds, positions, vocab_size)
    return _uniform(_splitmix64_(key ^ vocab))


# columns per block of the CPU's noise: a [64, 2048] int64 block (1 MiB) stays in cache through the
# hash's dozen passes, where a [64, 49152] one would go to memory and back each time
_CPU_BLOCK = 2048


def gumbel_argmax(
    logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, vocab: torch.Tensor | None = None
) -> torch.Tensor:
    """argmax(logprobs + Gumbel noise) [B] with the noise of `uniform_noise` (bit for bit the same
    tokens), made block by block of the vocabulary on the CPU, keeping only each row's best so far; in
    one block on other devices. `vocab`: `vocab_hashes` of the vocabulary, if the caller keeps them."""
    vocab_size = logprobs.shape[-1]
    block = _CPU_BLOCK if logprobs.device.type == "cpu" else vocab_size
    key, vocab = _hashes(seeds, positions, vocab_size, vocab)
    best_value = best_index = None
    for start in range(0, vocab_size, block):
        noise = _uniform(_splitmix64_(key ^ vocab[:, start : start + block]))
        noise = noise.log_().neg_().log_().neg_()  # Gumbel: -log(-log(u))
        value, index = noise.add_(logprobs[:, start : start + block]).max(dim=-1)  # added in float64
        if best_value is None:
            best_value, best_index = value, index
        else:  # ties keep the earlier index, as one argmax over the whole row would
            better = value > best_value
            best_value = torch.where(better, value, best_value)
            best_index = torch.where(better, index + start, best_index)
    return best_index


def nucleus_filter(logprobs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Set to -inf the tokens outside the smallest set whose probability reaches `top_p` (a float, or
    one per row [B, 1])."""
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
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
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    greedy: bool | torch.Tensor,
    vocab: torch.Tensor | None = None,  # [1, V] vocab_hashes(V), made once by a caller that keeps them
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled token ids [B], their log-probs [B] and the entropy [B] of softmax(logits / temperature).

    Log-probs and entropy are of the untruncated distribution (as the trainer sees it), from one
    log-softmax. The settings are the call's, or each row's (`temperature`, `top_p` [B, 1], `greedy` [B]:
    a server's requests each ask their own).
    """
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if isinstance(greedy, torch.Tensor):
        sampled = gumbel_argmax(nucleus_filter(logprobs, top_p), seeds, positions, vocab)
        tokens = torch.where(greedy, logprobs.argmax(dim=-1), sampled)
    elif greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        tokens = gumbel_argmax(nucleus_filter(logprobs, top_p), seeds, positions, vocab)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), entropy


def sampler(vocab_size: int, device: torch.device | str) -> Callable:
    """`sample_tokens` with the vocabulary's hashes (`vocab_hashes`) made once, for a caller that samples
    every step (the native engine)."""
    return partial(sample_tokens, vocab=vocab_hashes(vocab_size, device))
