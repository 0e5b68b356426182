"""Where a generate call's requests come from: a list known when the call starts (`Queue`, RL and eval), or
requests that arrive while it runs (`LiveRequests`, the server: continuous batching across clients).

The engine's loop asks its source for new requests whenever a cache row is free, for the sampling
settings of its rows, and what to do when nothing runs (stop, or wait for the next arrival); a live source
also hears each sampled token as it is sampled (streaming) and names the rows its clients gave up on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from everyprompt.rollout.base import GenerationRequest, SamplingParams


def check_prompt(request: GenerationRequest) -> None:
    if not request.prompt_ids:
        raise ValueError(f"generation request {request.request_id} has an empty prompt")


class Queue:
    """A fixed list of requests, admitted in the order given; the call ends when they are all done."""

    live = False

    def __init__(self, requests: list[GenerationRequest]):
        for request in requests:
            check_prompt(request)
        self.requests = requests
        self._pending = deque(range(len(requests)))

    def pool(self, batch_size: int) -> int:
        return min(batch_size, len(self.requests))

    def width(self, params: SamplingParams) -> int:
        return max(len(r.prompt_ids) for r in self.requests) + params.max_new_tokens

    def take(self, count: int) -> list[int]:
        """Up to `count` requests (their indices into `requests`) to admit now."""
        return [self._pending.popleft() for _ in range(min(count, len(self._pending)))]

    @property
    def drained(self) -> bool:
        """Nothing more will be admitted (the running rows may be compacted)."""
        return not self._pending

    def wait(self) -> bool:
        """Nothing runs and nothing is queued: whether to go on (a live source waits for work)."""
        return False

    def sampling(self, active: list[int], state, params: SamplingParams):
        """The sampling settings of the `active` rows: the call's."""
        return params.temperature, params.top_p, params.greedy

    def sampled(self, active: list[int], tokens: list[int], logprobs: list[float], state) -> list[int]:
        """The step's tokens were sampled (with their log-probs, on the host): the slots to finish now
        besides those that stopped."""
        return []


@dataclass
class LiveRequest:
    """A request of a live source and what its client asked: `on_token(token_id, logprob)` is called from
    the engine's thread as each token is sampled; `on_finish(reason)` by whoever reads the completions."""

    request: GenerationRequest
    temperature: float
    top_p: float
    greedy: bool
    on_token: Callable[[int, float], None] | None = None
    on_finish: Callable[[str], None] | None = None
    cancelled: bool = False


class LiveRequests:
    """Requests submitted from other threads while a generate call runs (`engine.generate(live, params)`
    with `params.max_new_tokens` the largest any request may ask). Each request has its own temperature,
    top-p and greedy setting and cap; `cancel` frees its row at the next step; `close` ends the call once
    the running requests finish. `max_prompt_tokens` bounds the prompts (the cache's width); `rows`, where
    the caller knows how many requests can run at once, bounds the call's cache rows (else the engine's
    batch size)."""

    live = True

    def __init__(self, max_prompt_tokens: int, rows: int | None = None):
        self.max_prompt_tokens, self.rows = max_prompt_tokens, rows
        self.requests: list[GenerationRequest] = []
        self.entries: list[LiveRequest] = []
        self._arrived: deque[int] = deque()
        self._running: set[int] = set()  # admitted, their completion not yet read (`done`)
        self._settings: tuple[tuple, tuple] = ((), ())  # (the rows' request indices, their settings)
        self.sampled_tokens = 0  # every token sampled for any request so far
        self._changed = threading.Condition()
        self.closed = False

    # ------------------------------------------------------------ clients (any thread)
    def submit(self, entry: LiveRequest) -> int:
        """Queue `entry` (its request's id is set to its index); returns the index."""
        check_prompt(entry.request)
        if len(entry.request.prompt_ids) > self.max_prompt_tokens:
            raise ValueError(
                f"a prompt of {len(entry.request.prompt_ids)} tokens; at most {self.max_prompt_tokens}"
            )
        with self._changed:
            if self.closed:
                raise RuntimeError("the engine is shutting down")
            index = len(self.entries)
            request = entry.request
            entry.request = GenerationRequest(index, request.prompt_ids, request.seed, request.max_new_tokens)
            self.entries.append(entry)
            self.requests.append(entry.request)
            self._arrived.append(index)
            self._changed.notify_all()
        return index

    def cancel(self, index: int) -> None:
        """The client is gone: its sequence stops at the next step (or is never admitted)."""
        self.entries[index].cancelled = True
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def waiting(self) -> int:
        with self._changed:
            return sum(not self.entries[i].cancelled for i in self._arrived)

    def running(self) -> int:
        with self._changed:
            return len(self._running)

    def done(self, index: int) -> None:
        """The completion of request `index` was read: its row is free."""
        with self._changed:
            self._running.discard(index)

    # ------------------------------------------------------------ the engine's loop
    def pool(self, batch_size: int) -> int:
        return batch_size if self.rows is None else min(batch_size, self.rows)

    def width(self, params: SamplingParams) -> int:
        return self.max_prompt_tokens + params.max_new_tokens

    def take(self, count: int) -> list[int]:
        taken = []
        with self._changed:
            while self._arrived and len(taken) < count:
                index = self._arrived.popleft()
                if not self.entries[index].cancelled:
                    taken.append(index)
            self._running.update(taken)
        return taken

    @property
    def drained(self) -> bool:
        return False  # more may arrive: the pool keeps its rows

    def wait(self) -> bool:
        with self._changed:
            while not self._arrived and not self.closed:
                self._changed.wait()
            return bool(self._arrived) or not self.closed

    def sampling(self, active: list[int], state, params: SamplingParams):
        """The `active` rows' own settings, read off their requests on the host: one value for all where
        they agree (the sampler's common path: no vocabulary sort without a top-p below 1), else one per
        row (`temperature`, `top_p` [B, 1], `greedy` [B]). Rebuilt only when the rows' requests change."""
        key = tuple(state.request[slot] for slot in active)
        if key != self._settings[0]:
            entries = [self.entries[index] for index in key]
            # a greedy row's log-probs are of the model's own distribution (temperature 1)
            rows = [
                (1.0 if e.greedy else float(e.temperature), float(e.top_p), bool(e.greedy)) for e in entries
            ]
            if len(set(rows)) == 1:
                settings = rows[0]
            else:
                device = state.logits.device
                temperature, top_p, greedy = zip(*rows)
                settings = (
                    torch.tensor(temperature, device=device)[:, None],
                    torch.tensor(top_p, device=device)[:, None],
                    torch.tensor(greedy, device=device),
                )
            self._settings = (key, settings)
        return self._settings[1]

    def sampled(self, active: list[int], tokens: list[int], logprobs: list[float], state) -> list[int]:
        self.sampled_tokens += len(tokens)
        stop = []
        for slot, token, value in zip(active, tokens, logprobs):
            entry = self.entries[state.request[slot]]
            if entry.cancelled:
                stop.append(slot)
            elif entry.on_token is not None:
                entry.on_token(token, value)
        return stop
