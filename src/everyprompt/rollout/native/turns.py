"""What a decode step's sampled tokens do to each sequence, on the host: append, stop, or, for a multi-turn
episode (rollout.base.Episode), end the model's turn and queue the environment's observation, whose tokens
then replace the samples one a step (fed like any token, so the cache, the routes and the positions stay
those of one sequence) and are masked out of the completion."""

from __future__ import annotations

import torch

from everyprompt.rollout.native.state import Slots, on_device


def take_tokens(tokens: list[int], active: list[int], state: Slots, requests, stop_ids, stops):
    """Append the step's tokens `tokens` (of the `active` slots, in order) to their sequences; returns the
    slots that finished and the (position among the active rows, token) pairs fed in place of a sample."""
    finished, forced = [], []
    for position, (slot, token) in enumerate(zip(active, tokens)):
        observing = bool(state.observation[slot])
        if observing:  # an environment's observation: its next token replaces the sample
            token = state.observation[slot].pop(0)
            forced.append((position, token))
            state.observed[slot].append(len(state.tokens[slot]))
        state.tokens[slot].append(token)
        if len(state.tokens[slot]) >= state.limit[slot]:
            finished.append(slot)
        elif not observing and (token in stop_ids or stops.hit(state.tokens[slot])):
            if not _next_turn(requests[state.request[slot]], state, slot):
                finished.append(slot)
    return finished, forced


def _next_turn(request, state: Slots, slot: int) -> bool:
    """A model turn of `slot` ended: whether its episode goes on (its observation queued to be fed)."""
    if request.episode is None:
        return False
    observation = request.episode.turn_ended(list(state.tokens[slot]))
    if not observation:
        return False
    state.observation[slot] = list(observation)
    return True


def force(sampled: torch.Tensor, forced: list[tuple[int, int]], index, step, state: Slots) -> torch.Tensor:
    """The step's tokens with the fed observation tokens in place of the samples at their positions (of
    the active rows `index`); their log-prob and entropy entries zeroed (they are not the model's)."""
    where, tokens = on_device(forced, sampled.device).T  # one host-to-device copy
    sampled[where] = tokens
    state.logprobs[index[where], step[where]] = 0.0
    state.entropies[index[where], step[where]] = 0.0
    return sampled


def ending(token_ids: list[int], observed: list[int], stop_ids, stops) -> tuple[str, torch.Tensor | None]:
    """A finished sequence's finish reason and completion mask (None when every token is the model's)."""
    count = len(token_ids)
    if observed and observed[-1] == count - 1:  # the cap fell inside an observation
        reason = "length"
    else:
        reason = "eos" if token_ids[-1] in stop_ids else "stop" if stops.hit(token_ids) else "length"
    if not observed:
        return reason, None
    mask = torch.ones(count, dtype=torch.bool)
    mask[observed] = False
    return reason, mask
