"""Trainer-side log-probabilities and entropies from the HF model's forward pass.

Training batches are right-padded: a batch of 64 arithmetic solutions averages ~39 real tokens in rows
padded to ~61. With `lengths` given, `token_logprobs` packs the sequences into shared rows instead
(first-fit decreasing, rows as wide as the longest sequence) and restarts `position_ids` at each
sequence; transformers' mask builder turns restarting positions into a block-diagonal causal mask, so
each token still sees only its own sequence. The padded-layout outputs equal the unpacked ones (float
rounding aside: tests/trainer/test_packing.py) while the model sees ~30% fewer tokens.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from everyprompt.models.attention import uses_sdpa
from everyprompt.trainer.learner_side.head import hidden_states_of, selected_logprobs


@dataclass(frozen=True)
class PackedLayout:
    """Where each of B sequences sits in R packed rows of width W."""

    row: torch.Tensor  # [B] long: packed row of each sequence
    offset: torch.Tensor  # [B] long: its first column in that row
    lengths: torch.Tensor  # [B] long: its token count
    num_rows: int
    width: int


def pack_layout(lengths: list[int], width: int) -> PackedLayout:
    """First-fit decreasing bin packing of sequence `lengths` into rows of `width` tokens."""
    if any(n > width for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a packed row of {width}")
    free: list[int] = []  # free columns left in each row
    row = [0] * len(lengths)
    offset = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, left in enumerate(free) if left >= lengths[i]), len(free))
        if r == len(free):
            free.append(width)
        row[i], offset[i] = r, width - free[r]
        free[r] -= lengths[i]
    return PackedLayout(torch.tensor(row), torch.tensor(offset), torch.tensor(lengths), len(free), width)


def _target_index(rows, offsets, lengths, first, width: int):
    """(sequence, target position, flat index) of every next-token target asked for, on the host: row
    i's targets `first[i]` (0 when `first` is None) to `lengths[i] - 2`, sequence i laid out in forward
    row `rows[i]` from column `offsets[i]`, flat indices into [R, width]."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    first = torch.zeros_like(lengths) if first is None else torch.as_tensor(first, dtype=torch.long)
    count = (lengths - 1 - first).clamp(min=0)
    sequence = torch.repeat_interleave(torch.arange(len(count)), count)
    starts = torch.cumsum(count, 0) - count
    position = first[sequence] + torch.arange(int(count.sum())) - torch.repeat_interleave(starts, count)
    flat = torch.as_tensor(rows)[sequence] * width + torch.as_tensor(offsets)[sequence] + position
    return sequence, position, flat


def _scatter(values: torch.Tensor | None, sequence, position, shape) -> torch.Tensor | None:
    """Per-target `values` into a zero [B, L - 1] tensor at (sequence, position)."""
    if values is None:
        return None
    out = values.new_zeros(shape)
    out[sequence, position] = values
    return out


def pack(
    input_ids: torch.Tensor, lengths: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, PackedLayout]:
    """Packed input_ids and position_ids [R, W] of right-padded `input_ids` [B, L] with true `lengths` (the
    position ids on the host: `packed_mask` reads them there, and the forward moves them)."""
    layout = pack_layout(lengths, input_ids.shape[1])
    # Unused tail columns count on from the row's last sequence; they form one more (ignored) segment.
    positions = torch.arange(layout.width).repeat(layout.num_rows, 1)
    # each packed token's place in input_ids, flat (-1: padding), made on the host and gathered on the
    # device in one go (a copy a sequence was 64 kernels for the recipe's 64)
    source = torch.full((layout.num_rows, layout.width), -1, dtype=torch.long)
    rows, offsets = layout.row.tolist(), layout.offset.tolist()  # the layout is made on the host
    for i, n in enumerate(lengths):
        positions[rows[i], offsets[i] : offsets[i] + n] = torch.arange(n)
        source[rows[i], offsets[i] : offsets[i] + n] = torch.arange(n) + i * input_ids.shape[1]
    source = source.to(input_ids.device, non_blocking=True)
    packed = input_ids.reshape(-1)[source.clamp(min=0)].masked_fill_(source < 0, pad_id)
    return packed, positions, layout


def packed_mask(model, positions: torch.Tensor, device) -> torch.Tensor | None:
    """The attention mask [R, 1, W, W] (True: attend) that transformers' SDPA attention builds for packed rows
    of host `positions`, built here on the host and copied over: a token sees the earlier tokens of its own
    segment (a segment: a run of positions rising by one). transformers finds the segments on the device and
    reads back whether any row holds two, a host sync in every forward; given a 4D mask it takes it as is.
    None (transformers decides) where no row holds two segments (it then attends causally without a mask,
    SDPA's fastest path), for an attention other than SDPA's, or a model with sliding-window layers (one
    mask would serve them all)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    sliding = getattr(config, "use_sliding_window", bool(getattr(config, "sliding_window", None)))
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not uses_sdpa(config) or layer_types != {"full_attention"} or sliding:
        return None
    start = torch.ones_like(positions, dtype=torch.bool)
    start[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    segment = start.cumsum(-1)
    if bool((segment[:, -1] == 1).all()):  # no row holds two: transformers' causal path (no mask at all)
        return None
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
    return (same & causal)[:, None].to(device, non_blocking=True)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    lengths: list[int] | None = None,
    pad_id: int = 0,
    router=None,
    routes: list[torch.Tensor] | None = None,
    recorded: list[torch.Tensor] | None = None,
    hold: list | None = None,
    chunk: int = 0,
    first_targets: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) of each next token: [B, L - 1]; and its entropy [B, L - 1] (detached).

    Sequences are right-padded, so causal attention never lets a real token see padding and no
    attention mask is needed; padded targets are dropped by the caller's mask. With `lengths` (each
    row's real token count) the rows are packed for the forward pass and the outputs scattered back;
    positions past a row's length are then 0.

    Router replay (`router`: a models.replay.RouterReplay): with `routes` (per row, [length - 1, L_moe, k]
    expert ids) the routers use them; with `recorded` (an empty list) it is filled with each row's own
    routes, the same shape. With `hold` (a list), the replay stays in force after the forward and a
    callable that ends it is appended to `hold`: a backward that recomputes the forward (gradient
    checkpointing) must replay the same routes, so the caller ends it after its backward.

    With `chunk` > 0 the LM head runs only on the targets asked for, `chunk` positions at a time
    (trainer/learner_side/head.py: no [B, L, V] logits): each row's targets from `first_targets[i]` (default 0) to its
    last; the other positions of the outputs are 0.
    """
    lengths_ = lengths if lengths is not None else [input_ids.shape[1]] * input_ids.shape[0]
    if lengths is None:
        forward_ids, positions = input_ids, None
        rows, offsets = torch.arange(input_ids.shape[0]), torch.zeros(input_ids.shape[0], dtype=torch.long)
    else:
        forward_ids, host_positions, layout = pack(input_ids, lengths, pad_id)
        positions = host_positions.to(forward_ids.device, non_blocking=True)
        rows, offsets = layout.row, layout.offset
    mask = None if positions is None else packed_mask(model, host_positions, forward_ids.device)
    inputs = {"input_ids": forward_ids, "position_ids": positions, "use_cache": False}
    if mask is not None:
        inputs["attention_mask"] = mask
    with _routing(
        router, routes, recorded, forward_ids.shape, rows=rows, offsets=offsets, lengths=lengths_, hold=hold
    ):
        if chunk:
            with hidden_states_of(model) as captured:
                model(**inputs)
        else:
            logits = model(**inputs).logits[:, :-1]
    shape = (input_ids.shape[0], input_ids.shape[1] - 1)
    if chunk:  # the hidden states [R, W, H] of the targets asked for, through the head in chunks
        hidden = captured[-1]
        width = forward_ids.shape[1]
        where = _target_index(rows, offsets, lengths_, first_targets, width)
        sequence, position, flat = (index.to(hidden.device, non_blocking=True) for index in where)
        states, targets = hidden.reshape(-1, hidden.shape[-1])[flat], forward_ids.reshape(-1)[flat + 1]
        logp, entropy = selected_logprobs(model, states, targets, temperature, with_entropy, chunk)
    else:
        logp, entropy = _logprobs_and_entropy(logits, forward_ids[:, 1:], temperature, with_entropy)
        if lengths is None:
            return logp, entropy
        # packed rows' [R, W - 1] targets back to their sequences
        where = _target_index(layout.row, layout.offset, layout.lengths, None, layout.width - 1)
        sequence, position, flat = (index.to(logp.device) for index in where)
        logp = logp.reshape(-1)[flat]
        entropy = None if entropy is None else entropy.reshape(-1)[flat]
    return _scatter(logp, sequence, position, shape), _scatter(entropy, sequence, position, shape)


@contextmanager
def _routing(router, routes, recorded, shape, *, rows, offsets, lengths, hold=None):
    """Replay `routes` / record into `recorded` for a forward over `shape` = [R, W] token rows (the
    replay ended by the callable put in `hold` instead, when given)."""
    if router is None or (routes is None and recorded is None):
        yield
        return
    num_rows, width = shape
    with ExitStack() as stack:
        if routes is not None:
            layers, top_k = routes[0].shape[1:]
            given = torch.full(
                (num_rows, width, layers, top_k), -1, dtype=torch.long, device=routes[0].device
            )
            for i, route in enumerate(routes):
                count = min(len(route), lengths[i])
                r, o = int(rows[i]), int(offsets[i])
                given[r, o : o + count] = route[:count].long()
            replaying = ExitStack()
            replaying.enter_context(router.replay(given.reshape(num_rows * width, layers, top_k)))
            if hold is None:
                stack.push(replaying)
            else:
                hold.append(replaying.close)
        seen = stack.enter_context(router.record()) if recorded is not None else None
        yield
    if seen is not None:
        used = torch.stack(seen, dim=1).view(num_rows, width, len(seen), -1)
        for i, n in enumerate(lengths):
            r, o = int(rows[i]), int(offsets[i])
            recorded.append(used[r, o : o + n - 1].to(torch.int16))


def _logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logprobs.gather(-1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logprobs.exp() * logprobs).sum(-1)
    return chosen, entropy


class PackingError(RuntimeError):
    """The model's attention ignores restarting position_ids, so packed rows would leak across sequences."""


@torch.no_grad()
def check_packing(model, tokens: list[list[int]], pad_id: int, tolerance: float = 1e-4) -> float:
    """Compare packed and one-by-one log-probs of `tokens` (two or more short sequences); raise if they differ.

    An architecture whose attention mask does not follow `position_ids` would let packed sequences
    attend to each other; this catches it before training rather than after.
    """
    width = sum(len(t) for t in tokens)
    input_ids = torch.full((len(tokens), width), pad_id, dtype=torch.long)
    for i, t in enumerate(tokens):
        input_ids[i, : len(t)] = torch.tensor(t)
    input_ids = input_ids.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        packed, _ = token_logprobs(model, input_ids, lengths=[len(t) for t in tokens], pad_id=pad_id)
        error = 0.0
        for i, t in enumerate(tokens):
            alone, _ = token_logprobs(model, input_ids[i : i + 1, : len(t)])
            error = max(error, float((packed[i, : len(t) - 1] - alone[0]).abs().max()))  # once a run
    finally:
        model.train(was_training)
    if error > tolerance:
        raise PackingError(
            f"{type(model).__name__}: packed sequences change log-probs by {error:.2e} (its attention does "
            "not restart at position_ids == 0); set model.pack_sequences=false"
        )
    return error
