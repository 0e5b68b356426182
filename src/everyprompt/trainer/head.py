"""Log-probs of chosen positions without materialising [batch, length, vocab] logits.

A causal LM's forward ends in its LM head: hidden states [R, W, H] times the output embedding [H, V].
With a 49152-token vocabulary, full fp32 logits for 64 sequences of 256 tokens are 3.2 GB, and the
log-softmax and its gradient hold as much again. Only the targets the loss reads need a log-prob (a
completion's tokens; never the prompt's or the padding), so here the head runs on those positions only,
a chunk of `chunk` tokens at a time: per chunk the logits [chunk, V] are made, reduced to each target's
log-prob (and entropy), and dropped. Under autograd each chunk is checkpointed: its logits are made again
in the backward pass, so one chunk's logits are alive at any time, forward or backward.

`hidden_states_of(model)` gets the hidden states the head would read: a forward pre-hook on the model's
output embedding keeps its input and hands the head one position per row instead (so the model's own
logits are [R, 1, V]). Models that transform their logits after the head (soft-capping, scaling) are
handled by the transforms in `HEAD_TRANSFORMS`, read from the model's config; `check_head` compares the
result with the model's own full logits once a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

# config attribute -> what the model does to its logits after the head when that attribute is set
HEAD_TRANSFORMS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "final_logit_softcapping": lambda logits, cap: torch.tanh(logits / cap) * cap,  # Gemma 2 and 3
    "logit_scale": lambda logits, scale: logits * scale,  # Cohere
    "logits_scaling": lambda logits, scale: logits / scale,  # Granite
}


class HeadError(RuntimeError):
    """The chunked head's log-probs differ from the model's own (a logit transform it does not know)."""


@contextmanager
def hidden_states_of(model) -> Iterator[list[torch.Tensor]]:
    """Within it, a forward of `model` computes logits of one position per row; the hidden states its
    head would have read ([R, W, H]) are appended to the yielded list."""
    captured: list[torch.Tensor] = []

    def keep(_module, args):
        hidden = args[0]
        captured.append(hidden)
        return (hidden[..., :1, :], *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def head_transform(model) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What `model` does to its logits after the head (None: nothing)."""
    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    for attribute, transform in HEAD_TRANSFORMS.items():
        value = getattr(config, attribute, None)
        if not value or (value == 1.0 and attribute != "final_logit_softcapping"):
            continue  # unset, or a no-op (a cap of 0 or None is no cap)
        return lambda logits, transform=transform, value=value: transform(logits, value)
    return None


def selected_logprobs(
    model,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / T)[target] for hidden [N, H] and targets [N] (and each position's
    entropy, detached), `chunk` positions at a time (see the module docstring)."""
    head = model.get_output_embeddings()
    transform = head_transform(model)

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h).float()
        if transform is not None:
            logits = transform(logits)
        if temperature != 1.0:  # in place: the head's product saves its inputs, not its output
            logits = logits.div_(temperature)
        norm = torch.logsumexp(logits, dim=-1)
        chosen = logits.gather(-1, t[:, None]).squeeze(-1) - norm
        if not with_entropy:
            return chosen, norm.new_zeros(0)
        with torch.no_grad():
            entropy = norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return chosen, entropy

    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, len(targets), chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        parts.append(checkpoint(piece, h, t, use_reentrant=False) if grad else piece(h, t))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    chosen = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return chosen, entropy


@torch.no_grad()
def check_head(model, tokens: list[int], chunk: int, tolerance: float = 1e-4) -> float:
    """The chunked head's log-probs of `tokens` against the model's own full logits (eval mode, once a
    run); HeadError if they differ by more than `tolerance`. Returns the largest difference."""
    input_ids = torch.tensor([tokens], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).reshape(-1)
        with hidden_states_of(model) as captured:
            model(input_ids=input_ids, use_cache=False)
        hidden = captured[-1][0, :-1]
        got, _ = selected_logprobs(model, hidden, input_ids[0, 1:], 1.0, False, chunk)
    finally:
        model.train(was_training)
    error = float((got - expected).abs().max())  # once a run
    if error > tolerance:
        raise HeadError(
            f"{type(model).__name__}: log-probs from its LM head over chosen positions differ from its own "
            f"logits by {error:.2e} (a logit transform after the head this project does not know); set "
            "model.logprob_chunk=0 to compute full logits"
        )
    return error
