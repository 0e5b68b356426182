"""How requests enter and leave the native engine's cache rows: the prefill of admitted prompts (a prompt
admitted more than once, a group's samples, computed once and its rows copied), and the completions of
finished rows (their recorded routes brought to the host in one copy per kind)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from everyprompt.devices.placement import upload
from everyprompt.rollout.base import Completion
from everyprompt.rollout.native.cache import copy_rows
from everyprompt.rollout.native.call import Call
from everyprompt.rollout.native.rows import Admission, on_device
from everyprompt.rollout.native.sequences import ending
from everyprompt.rollout.native.site import Site


def prefill(call: Call, admitted: list[int], slots: list[int]) -> None:
    """Run the admitted requests' prompts (right-padded) into cache rows `slots`; their next-token logits
    become the rows' pending logits (and their routes go into the call's record, when it records). A prompt
    admitted more than once (a group's samples) is computed once and its cache rows copied."""
    engine, requests, params, record = call.engine, call.requests, call.params, call.record
    prompts = [requests[i].prompt_ids for i in admitted]
    lengths = [len(p) for p in prompts]
    forward_row: dict[tuple[int, ...], int] = {}  # each distinct prompt's row of the forward
    shared = [forward_row.setdefault(tuple(prompt), len(forward_row)) for prompt in prompts]
    unique = [shared.index(k) for k in range(len(forward_row))]  # the admitted row computing each
    tokens = torch.full((len(unique), max(lengths)), engine.pad_token_id, dtype=torch.long)
    for k, row in enumerate(unique):
        tokens[k, : lengths[row]] = torch.tensor(prompts[row])
    tokens = upload(tokens, engine.device)
    # the rows' slots, lengths, seeds and forward rows, the forward's slots and lengths: one copy
    seeds = [requests[i].seed for i in admitted]
    n = len(prompts)
    flat = on_device(
        [*slots, *lengths, *seeds, *shared, *[slots[r] for r in unique], *[lengths[r] for r in unique]],
        engine.device,
    )
    rows, lengths_, seeds, shared_ = flat[: 4 * n].view(4, n)
    computed, computed_lengths = flat[4 * n :].view(2, len(unique))
    positions = torch.arange(tokens.shape[1], device=engine.device)
    routes: list | None = [] if record is not None else None
    site = Site(computed, positions[-1:].expand(len(unique)), None)
    logits = engine.forward(
        call.layers,
        tokens,
        positions.expand_as(tokens),
        call.caches,
        site,
        last=computed_lengths - 1,
        routes=routes,
    )
    if len(unique) < len(prompts):  # copies of the computed prompts' rows for the repeated ones
        copy_rows(call.caches, computed[shared_], rows, tokens.shape[1])
        logits = logits[shared_]
        routes = None if routes is None else [tuple(t[shared_] for t in layer) for layer in routes]
    if record is not None:
        record.store(routes, rows, positions)
    limits = [
        min(params.max_new_tokens, requests[i].max_new_tokens or params.max_new_tokens) for i in admitted
    ]
    call.rows.admit(Admission(slots, admitted, lengths, limits, (rows, lengths_, seeds)), logits)


def finish(call: Call, finished: list[int], began: float, stops) -> Callable[[], list[Completion]]:
    """Free the `finished` slots; returns the function that makes their completions. Their tokens, log-probs
    and entropies are on the host already (each step's read brought them); recorded routes are taken from
    the device now and copied over in one copy per kind, which the function waits for (on a GPU, not for
    work sent after: the loop may call it a step later, devices/placement.py: `copy_later`)."""
    engine, requests, state, record = call.engine, call.requests, call.rows, call.record
    routes = None
    if record is not None:  # the last sampled token is not the model's input, so it has no route
        counts = [len(state.tokens[slot]) for slot in finished]
        fed = [len(requests[state.request[slot]].prompt_ids) + n - 1 for slot, n in zip(finished, counts)]
        routes = record.take(on_device(finished, engine.device), fed)
    made = []
    for slot in finished:
        request, token_ids = requests[state.request[slot]], state.tokens[slot]
        reason, mask = ending(token_ids, state.observed[slot], engine.stop_ids, stops)
        made.append(
            dict(
                request_id=request.request_id,
                prompt_ids=list(request.prompt_ids),
                token_ids=list(token_ids),
                logprobs=torch.tensor(state.token_logprobs[slot].tolist(), dtype=torch.float32),
                entropies=torch.tensor(state.token_entropies[slot].tolist(), dtype=torch.float32),
                completion_mask=mask,
                episode=request.episode,
                finish_reason=reason,
                timing={"finished_s": time.perf_counter() - began},
            )
        )
        state.free_row(slot)

    def completions() -> list[Completion]:
        recorded = routes() if routes is not None else [{}] * len(made)
        return [Completion(**fields, **extra) for fields, extra in zip(made, recorded)]

    return completions
