"""How an environment's observation enters its episode's row (sequences.py): one forward of all its
tokens at the row's own length, an "extend", as a prefill continues a prompt, where it had been fed one
token a decode step (as many steps as the observation has tokens, the row's turn held up for each).

Rows whose environments answered together go in one forward, right-padded to the longest observation.
A real token writes its keys and values at its position of its row and attends to its row's cache up to
that position (`Extend.mask`); a padding token writes nothing, and what it computes is not read. The
row's next-token logits become its pending logits; its count of sampled tokens (the sampler's noise
counter) moves on by the observation's length, as feeding it a token a step did, so the model's later
tokens are drawn with the same noise. Observation tokens are not the model's: they carry log-prob and
entropy 0 and are masked out of the completion (`Slots.observed`). An observation longer than the room
left under the row's token cap is cut there, and the completion ends at "length".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from everyprompt.devices.sdpa import attention_kernels
from everyprompt.rollout.native.slots import on_device


@dataclass(frozen=True)
class Extend:
    """The layout of one extend forward over B rows of T (padded) new tokens: each real token's cache row
    and position and its index in the forward's flattened [B * T] tokens, and the mask [B, 1, T, width]
    (True where query t of row b may see a cache position: up to its own)."""

    token_rows: torch.Tensor  # [N] int64
    token_columns: torch.Tensor  # [N] int64
    real: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [B, 1, T, width] bool
    width: int  # the furthest position any row reaches, plus one

    def write(self, cache: torch.Tensor, values: torch.Tensor) -> None:
        """The real tokens' `values` [B, T, ...] into a layer's `cache` [rows, heads, positions, dim]."""
        per_token = values.flatten(0, 1)[self.real]
        cache[self.token_rows, :, self.token_columns] = per_token.reshape(-1, cache.shape[1], cache.shape[3])


def extend(
    engine, layers, answered: dict[int, list[int]], state, caches, record
) -> tuple[list[int], int, bool]:
    """Feed each answered slot's observation (`answered`: slot -> its tokens) into its row in one forward
    (module docstring); returns the slots whose token cap the observation reached (their completion ends),
    the observation tokens added to the completions, and whether a forward ran (not where every
    observation filled its row's last position alone)."""
    slots, fed, capped, added = [], [], [], 0
    for slot in sorted(answered):
        count = len(state.tokens[slot])
        tokens = answered[slot][: state.limit[slot] - count]  # a turn never ends at the cap: room >= 1
        state.observed[slot].extend(range(count, count + len(tokens)))
        state.tokens[slot].extend(tokens)
        state.token_logprobs[slot].extend([0.0] * len(tokens))
        state.token_entropies[slot].extend([0.0] * len(tokens))
        added += len(tokens)
        if len(state.tokens[slot]) >= state.limit[slot]:
            # the completion ends: its last token is not fed (as a sampled last token is not), so that
            # the row, idle from now, stays inside the cache's width
            capped.append(slot)
            tokens = tokens[:-1]
        if tokens:
            slots.append(slot)
            fed.append(tokens)
    if not slots:
        return capped, added, False
    starts = [state.host_length[slot] for slot in slots]
    counts = [len(tokens) for tokens in fed]
    batch, length = len(slots), max(counts)
    padded = [tokens + [engine.pad_token_id] * (length - len(tokens)) for tokens in fed]
    real = [(b, t) for b, count in enumerate(counts) for t in range(count)]
    # every index the forward needs, in one host-to-device copy
    flat = on_device(
        [token for tokens in padded for token in tokens]
        + [start + t for start in starts for t in range(length)]
        + [slots[b] for b, _ in real]
        + [starts[b] + t for b, t in real]
        + [b * length + t for b, t in real]
        + slots
        + [count - 1 for count in counts]
        + [start + count for start, count in zip(starts, counts)]
        + counts,
        engine.device,
    )
    cut = [batch * length] * 2 + [len(real)] * 3 + [batch] * 4
    tokens, positions, token_rows, token_columns, index, rows, last, ends, grown = flat.split(cut)
    tokens, positions = tokens.view(batch, length), positions.view(batch, length)
    width = max(start + count for start, count in zip(starts, counts))
    visible = torch.arange(width, device=positions.device)[None, None, :] <= positions[:, :, None]
    layout = Extend(token_rows, token_columns, index, visible[:, None], width)
    routes: list | None = [] if record is not None else None
    with attention_kernels(engine.device):  # as the prefill's: not cuDNN's (devices/sdpa.py)
        logits = engine.forward(layers, tokens, positions, caches, rows, None, last, routes, extend=layout)
    if record is not None:
        record.store_tokens(routes, layout)
    state.logits[rows] = logits
    state.length[rows] = ends
    state.step[rows] += grown
    for slot, count in zip(slots, counts):
        state.host_length[slot] += count
    return capped, added, True
