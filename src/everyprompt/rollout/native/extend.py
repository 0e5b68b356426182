"""How an environment's observation enters its episode's row (sequences.py): one forward of all its
tokens at the row's own length, an "extend", as a prefill continues a prompt, where it had been fed one
token a decode step (as many steps as the observation has tokens, the row's turn held up for each).

Each row's observation goes in a forward of its own, even where several environments answered by the
same point of the loop: which rows those are depends on when the environments' threads ran, and a
forward's shape can change its rows' last bits (a matmul's blocking follows its rows), so a row's
observation is computed the same whichever rows answered with it. Its tokens write their keys and values at their positions of the
row and attend to the row's cache up to their own (`Extend.mask`). The row's next-token logits become
its pending logits; its count of sampled tokens (the sampler's noise counter) moves on by the
observation's length, as feeding it a token a step did, so the model's later tokens are drawn with the
same noise. Observation tokens are not the model's: they carry log-prob and entropy 0 and are masked out
of the completion (`Rows.observed`). An observation longer than the room left under the row's token cap
is cut there, and the completion ends at "length" (its last token not fed, as a sampled last one is not).
"""

from __future__ import annotations

import torch

from everyprompt.devices.sdpa import attention_kernels
from everyprompt.rollout.native.call import Call
from everyprompt.rollout.native.rows import on_device
from everyprompt.rollout.native.site import Extend, Site


def extend(call: Call, answered: dict[int, list[int]]) -> tuple[list[int], int]:
    """Feed each answered slot's observation (`answered`: slot -> its tokens) into its row, a forward a row
    (module docstring); returns the slots whose token cap the observation reached (their completion ends)
    and the forwards run (none for a row whose observation filled its last position alone)."""
    capped, forwards, state = [], 0, call.rows
    for slot in sorted(answered):  # in slot order: each row's forward is its own (module docstring)
        count = len(state.tokens[slot])
        tokens = answered[slot][: state.limit[slot] - count]  # a turn never ends at the cap: room >= 1
        state.observe(slot, tokens)
        if len(state.tokens[slot]) >= state.limit[slot]:
            # the completion ends: its last token is not fed (as a sampled last token is not), so that
            # the row, idle from now, stays inside the cache's width
            capped.append(slot)
            tokens = tokens[:-1]
        if tokens:
            _feed(call, slot, tokens)
            forwards += 1
    return capped, forwards


def _feed(call: Call, slot: int, tokens: list[int]) -> None:
    """`tokens` through the model from row `slot`'s length; its pending logits and lengths moved on."""
    engine, record = call.engine, call.record
    start, length, device = call.rows.host_length[slot], len(tokens), engine.device
    row, fed = on_device([slot, *tokens], device).split([1, length])  # one host-to-device copy
    positions = torch.arange(start, start + length, device=device)
    layout = Extend(slot, start, torch.arange(start + length, device=device)[None, :] <= positions[:, None])
    routes: list | None = [] if record is not None else None
    with attention_kernels(device):  # as the prefill's: not cuDNN's (devices/sdpa.py)
        site = Site(row, positions[-1:], None, layout)
        logits = engine.forward(call.layers, fed[None], positions[None], call.caches, site, routes=routes)
    if record is not None:  # every fed position's routes, as a prefill's
        record.store(routes, row, positions)
    call.rows.extended(slot, length, logits[0])
