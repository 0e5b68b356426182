"""Step-wise episodes (stepwise.py) without a barrier between rounds: every turn is a request of a running
generate call over a live source (the native engine's `LiveRequests`), and an episode's next turn joins it
the moment its environment answers. Round by round, every episode's turn t waits for the slowest turn t
of the call and for the slowest environment before any turn t + 1 starts; here none waits for another.

Turn t of a request is sampled with the seed derive_seed(request seed, t), as round by round, and a
request's tokens do not depend on what decodes beside it, so both give the same turns (tested).

A call's cache is as wide as its longest prompt could grow to: the longest prompt waiting when it starts
plus `GROWTH` times `max_new_tokens`, plus the call's own `max_new_tokens`. A next turn whose prompt has
grown past that waits for a wider call: the running one is closed as soon as none of its turns is left to
sample (environments may still be answering: their episodes' next turns join the next call), and the next
starts at once. Each environment answers in a thread of its own, within its episode's `time_limit` (past
it the episode ends with the error `TIME_LIMIT`, as round by round, and a late answer is dropped).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace

from everyprompt.rollout.base import Completion, GenerationRequest, SamplingParams
from everyprompt.rollout.native.queue import LiveRequest, LiveRequests
from everyprompt.rollout.sampling import derive_seed

# how far, in `max_new_tokens`, a call's prompts may grow beyond its longest first one (a cache that wide:
# the static decode step attends over its whole width, so wider costs every step)
GROWTH = 2


def generate_continuously(
    engine, requests: Sequence[GenerationRequest], params: SamplingParams
) -> Iterator[Completion]:
    """The completions of `requests` (each with a `StepwiseEpisode`) as their episodes end."""
    yield from Turns(engine, params, requests).run()


class Turns:
    """The episodes of one `generate_stepwise` call, through as many live generate calls as their prompts'
    growth needs (module docstring). All state is guarded by `changed`'s lock: the environments' threads
    submit the next turns, the caller's thread reads the completions."""

    def __init__(self, engine, params: SamplingParams, requests: Sequence[GenerationRequest]):
        self.engine, self.params = engine, params
        self.changed = threading.Condition()
        self.waiting: list[GenerationRequest] = list(requests)  # next turns that wait for a (wider) call
        self.answering = 0  # environments answering
        self.live: LiveRequests | None = None  # the running call's source
        self.running = 0  # turns submitted to it and not yet sampled
        self.requests: dict[int, GenerationRequest] = {}  # its index -> the episode's request
        self.ended: list[GenerationRequest] = []  # episodes over, to be yielded by the caller's thread
        self.left = len(requests)  # episodes not over

    def run(self) -> Iterator[Completion]:
        while True:
            with self.changed:
                while not self.waiting and self.answering:  # every episode left waits for its environment
                    self.changed.wait()
                ended, self.ended = self.ended, []
                if not self.waiting and not self.answering:
                    break
                longest = max(len(request.episode.prompt_ids) for request in self.waiting)
                # as many rows as episodes are left: at most one turn of each runs at a time
                self.live = LiveRequests(longest + GROWTH * self.params.max_new_tokens, rows=self.left)
                self.running = 0
                waiting, self.waiting = self.waiting, []
                for request in waiting:
                    self._submit(request)  # each fits: the call is as wide as the longest
            yield from self._completions(ended)
            yield from self._call()
        yield from self._completions(ended)

    def _call(self) -> Iterator[Completion]:
        """One live generate call: each sampled turn taken by its episode, whose environment then answers."""
        live = self.live
        for completion in self.engine.generate(live, self.params):
            live.done(completion.request_id)
            with self.changed:
                request = self.requests.pop(completion.request_id)
                self.running -= 1
            episode = request.episode
            action = episode.take(replace(completion, request_id=request.request_id))
            with self.changed:
                if action is None:  # the cap cut the turn: the episode is over
                    self.ended.append(request)
                else:
                    self._answer(request, action)
                self._close_if_idle()
                ended, self.ended = self.ended, []
            yield from self._completions(ended)

    def _completions(self, ended: list[GenerationRequest]) -> Iterator[Completion]:
        for request in ended:
            with self.changed:
                self.left -= 1
            yield request.episode.completion(request.request_id)

    def _submit(self, request: GenerationRequest) -> None:
        """The episode's next turn into the running call, or waiting for the next where the call has closed
        or is too narrow for its prompt (under the lock)."""
        prompt, live = request.episode.prompt_ids, self.live
        if live is None or live.closed or len(prompt) > live.max_prompt_tokens:
            self.waiting.append(request)
            return
        seed = derive_seed(request.seed, len(request.episode.turns))  # turn t: as round by round
        params = self.params
        turn = LiveRequest(GenerationRequest(0, prompt, seed, request.max_new_tokens),
                           params.temperature, params.top_p, params.greedy)  # fmt: skip
        self.requests[live.submit(turn)] = request
        self.running += 1

    def _close_if_idle(self) -> None:
        """Close the running call once none of its turns is left to sample and either a turn waits for a
        wider call or no environment is still answering (under the lock)."""
        if self.live is not None and not self.running and (self.waiting or not self.answering):
            self.live.close()

    def _settled(self, request: GenerationRequest) -> None:
        """An environment's answer, error or time limit (under the lock): the episode's next turn, or the
        episode yielded where it is over."""
        self.answering -= 1
        if request.episode.done:
            self.ended.append(request)
        else:
            self._submit(request)
        self._close_if_idle()
        self.changed.notify_all()

    def _answer(self, request: GenerationRequest, action: str) -> None:
        """The episode's environment answers `action` in a thread of its own, within the time limit (under
        the lock; stepwise.py: `answer_later`)."""
        self.answering += 1
        request.episode.answer_later(action, self.changed, lambda: self._settled(request))
