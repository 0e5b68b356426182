"""Log-probs of chosen positions without materialising [batch, length, vocab] logits.

A causal LM's forward ends in its LM head: hidden states [R, W, H] times the output embedding [H, V].
With a 49152-token vocabulary, full fp32 logits for 64 sequences of 256 tokens are 3.2 GB, and the
log-softmax and its gradient hold as much again. Only the targets the loss reads need a log-prob (a
completion's tokens; never the prompt's or the padding), so here the head runs on those positions only,
a chunk of `chunk` tokens at a time: per chunk the logits [chunk, V] are made, reduced to each target's
log-prob (and entropy), and dropped. Under autograd each chunk is checkpointed: its logits are made again
in the backward pass, so one chunk's logits are alive at any time, forward or backward.

For a plain bias-free linear head (most models) the chunks run in `LinearLogSoftmax`, one autograd
function: the weight is cast to the compute precision once for all chunks, each chunk's logits are
written into buffers made once a call (a fresh 100 MB tensor per step of the softmax costs as much in page
faults as the arithmetic), and the backward forms the logits' gradient in place, softmax minus the
target's one-hot, instead of replaying autograd's graph of the log-softmax. Other heads (a transform, a
bias, LoRA or sharded weights) take the checkpointed path of plain torch operations, which is also the
reference the fast one is tested against.

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

from everyprompt.models.emulated_bf16 import emulated_if, emulating, recompute_context

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
    if transform is None and fused_head_fits(head, hidden):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        chosen, entropy = LinearLogSoftmax.apply(
            hidden, head.weight, targets, temperature, chunk, with_entropy, dtype
        )
        return chosen, (entropy if with_entropy else None)

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
        if grad:
            parts.append(checkpoint(piece, h, t, use_reentrant=False, context_fn=recompute_context))
        else:
            parts.append(piece(h, t))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    chosen = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return chosen, entropy


def fused_head_fits(head, hidden: torch.Tensor) -> bool:
    """Whether `LinearLogSoftmax` computes this head: exactly a bias-free `nn.Linear` with a plain weight
    (not LoRA-wrapped, not a sharded DTensor) on the hidden states' device."""
    weight = getattr(head, "weight", None)
    return (
        type(head) is torch.nn.Linear
        and head.bias is None
        and type(weight) is torch.nn.Parameter
        and weight.device == hidden.device
        and not head._forward_hooks
        and not head._forward_pre_hooks
    )


class LinearLogSoftmax(torch.autograd.Function):
    """(log softmax(h W^T / T)[t], entropy) for hidden states h [N, H], a head weight W [V, H] and targets
    t [N], `chunk` rows at a time in `dtype` matmuls (fp32 softmax); the entropy is not differentiated.
    Saves h, W in `dtype` and each row's log-normaliser; the backward makes each chunk's logits again."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)  # one cast of the weight for every chunk
            n = h.shape[0]
            chosen = torch.empty(n, dtype=torch.float32, device=h.device)
            entropy = torch.empty_like(chosen) if with_entropy else chosen.new_zeros(0)
            lse = torch.empty_like(chosen)
            logits = _Logits(h, w, temperature, chunk)
            for rows, z in logits:
                top = z.amax(-1, keepdim=True)
                z.sub_(top)
                e = torch.exp(z, out=logits.spare(z))
                total = e.sum(-1)
                log_total = total.log()
                chosen[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - log_total
                lse[rows] = top.squeeze(-1) + log_total
                if with_entropy:  # -sum p log p = log(sum e) - sum(e z) / sum e, with z = logits - max
                    entropy[rows] = log_total - e.mul_(z).sum(-1) / total
        ctx.save_for_backward(h, w, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.emulating = emulating()  # bf16 products on float32 kernels (models/emulated_bf16.py): here too
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen, _grad_entropy):
        h, w, targets, lse = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if needs_hidden else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if needs_weight else None
        scale = grad_chosen.float() / ctx.temperature  # d logp_t / d z = (onehot(t) - softmax) / T
        with torch.autocast(h.device.type, enabled=False), emulated_if(ctx.emulating):
            logits = _Logits(h, w, ctx.temperature, ctx.chunk)
            for rows, z in logits:
                g = z.sub_(lse[rows, None]).exp_().mul_(-scale[rows, None])
                g[torch.arange(len(g), device=g.device), targets[rows]] += scale[rows]
                g = logits.low(g)
                if needs_hidden:
                    torch.mm(g, w, out=grad_h[rows])
                if needs_weight:
                    grad_w += g.T @ h[rows]
        return (
            None if grad_h is None else grad_h.to(hidden_dtype),
            None if grad_w is None else grad_w.to(weight_dtype),
            *([None] * 5),
        )


class _Logits:
    """Iterates (rows, logits / T) over `chunk`-row slices of h W^T in fp32, all in buffers made once: the
    product in `w`'s dtype, then its fp32 copy. `spare(z)` is a second fp32 buffer of z's shape;
    `low(t)` is `t` in the matmul dtype, in the product's buffer."""

    def __init__(self, h: torch.Tensor, w: torch.Tensor, temperature: float, chunk: int):
        self.h, self.w, self.temperature, self.chunk = h, w, temperature, chunk
        size = (min(chunk, h.shape[0]), w.shape[0])
        self.fp32 = torch.empty(size, dtype=torch.float32, device=h.device)
        self.product = (
            self.fp32 if w.dtype == torch.float32 else torch.empty(size, dtype=w.dtype, device=h.device)
        )
        self._spare: torch.Tensor | None = None

    def __iter__(self):
        for start in range(0, self.h.shape[0], self.chunk):
            rows = slice(start, start + self.chunk)
            count = self.h[rows].shape[0]
            product, z = self.product[:count], self.fp32[:count]
            torch.mm(self.h[rows], self.w.T, out=product)
            if product is not z:
                z.copy_(product)
            if self.temperature != 1.0:
                z.div_(self.temperature)
            yield rows, z

    def spare(self, z: torch.Tensor) -> torch.Tensor:
        if self._spare is None:
            self._spare = torch.empty_like(self.fp32)
        return self._spare[: z.shape[0]]

    def low(self, t: torch.Tensor) -> torch.Tensor:
        if self.product is self.fp32:
            return t
        return self.product[: t.shape[0]].copy_(t)


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
