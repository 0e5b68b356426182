"""Step-wise episodes: one trained sample per model turn, for chat templates that re-render history.

Where a template rewrites earlier turns as a conversation grows (a reasoning model's drops the thinking of
past turns), the tokens the model is given at turn t are not the tokens of turn t-1 plus an observation,
so an episode cannot be one growing sequence (envs/episode.py). Here every turn is a request of its own:
its prompt is the whole conversation so far rendered by the template (what the model would be given at
inference), its completion the tokens the model sampled. Each (prompt, sampled tokens) pair is kept as the
engine saw it, never re-tokenised, and becomes one row of the batch, every token of it the model's; the
rows of one episode share its reward and its advantage (computed once per episode, trainer side).
SkyRL, ROLL and prime-rl train multi-turn episodes this way.

`generate_stepwise` runs a call's episodes turn by turn and yields an episode's `Completion` (its `turns`
the per-turn completions) when it ends. On an engine that takes requests while a call runs (`offers(engine,
"live")`: the native engine) each episode goes at its own pace: its next turn joins the running call the
moment its environment answers (envs/turns.py), so no episode waits for another's turn or environment. On
another engine it goes round by round: each round sends every live episode's prompt to the engine, then
steps the environments of the turns that ended (concurrently, each within the episode's `time_limit`).
Either way turn t of a request is sampled with the same seed, so both give the same turns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch

from everyprompt.envs.base import Environment
from everyprompt.envs.template import EpisodeState, render
from everyprompt.envs.turns import generate_continuously
from everyprompt.rollout.base import (
    Completion,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    offers,
    past_time_limit,
)
from everyprompt.rollout.sampling import derive_seed


class StepwiseEpisode(EpisodeState):
    """One episode of `env` on data row `row`, each model turn prompted by the whole conversation as the
    chat template renders it. `prompt_ids`: the next turn's prompt; `turns`: the turns so far (each the
    engine's `Completion`: the prompt it was given and the tokens it sampled), `texts` theirs decoded;
    `turn_rewards` what each was given; the rest as in `EpisodeState`."""

    stepwise = True

    def __init__(self, env: Environment, tokenizer, row: dict, *args, schedule: str = "auto", **kwargs):
        """`schedule` (`env.stepwise_schedule`): auto, continuous or rounds (`generate_stepwise`)."""
        super().__init__(env, tokenizer, row, *args, **kwargs)
        self.schedule = schedule
        self.turn_rewards: list[float] = []  # the reward each turn was given (0 where none)
        self.prompt_ids = self._render()
        self.turns: list[Completion] = []
        self.texts: list[str] = []  # each turn's text, decoded without special tokens
        self.done = False

    def _render(self) -> list[int]:
        text = render(self.tokenizer, self.messages, self.options)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def take(self, turn: Completion) -> str | None:
        """Record a finished turn; the action for the environment, or None when the episode ends without
        one (the token cap cut the turn before it ended)."""
        self.turns.append(turn)
        said = turn.token_ids[:-1] if turn.finish_reason == "eos" else turn.token_ids  # without its end token
        # the turn as the model wrote it, markers such as <think> kept: the template decides what of it a
        # later rendering shows
        action = self.tokenizer.decode(said, skip_special_tokens=False)
        self.texts.append(self.tokenizer.decode(turn.token_ids, skip_special_tokens=True))
        self.messages.append({"role": "assistant", "content": action})
        if turn.finish_reason == "length":
            self.end()
            return None
        return action

    def answer(self, result) -> None:
        """The environment's `StepResult` for the last turn: the episode goes on or ends."""
        self.turn_rewards.append(0.0 if result.reward is None else float(result.reward))
        if self.answered(result, len(self.turns)):
            self.prompt_ids = self._render()  # the template's rendering now, earlier turns as it writes them

    def answer_later(self, action: str, lock, settled: Callable[[], None]) -> None:
        """The environment answers `action` in a thread of its own (a daemon: one that never answers cannot
        hold the process at exit), within the episode's time limit. Under `lock` the episode takes the
        answer, its failure or the limit's end, whichever comes first, and `settled()` is called, once; a
        late answer is dropped."""
        over, limit = threading.Event(), self.time_limit

        def settle(outcome: Callable[[], None]) -> None:
            with lock:
                if over.is_set():
                    return
                over.set()
                if timer is not None:
                    timer.cancel()
                outcome()
                settled()

        def answer() -> None:
            try:
                result = self.env.step(action)
            except BaseException as err:  # noqa: BLE001 (reported as the episode's error)
                settle(partial(self.failed, "step", err))
                return
            settle(partial(self.answer, result))

        def expire() -> None:
            settle(lambda: (past_time_limit(self, limit), self.end()))

        timer = None if limit is None else threading.Timer(limit, expire)
        threading.Thread(target=answer, name="everyprompt-env-step", daemon=True).start()
        if timer is not None:
            timer.daemon = True
            timer.start()

    def end(self) -> None:
        self.done = True
        super().end()

    def completion(self, request_id: int) -> Completion:
        """The episode as one completion: its first prompt, every turn's sampled tokens end to end (text
        and lengths), the last turn's finish reason, and `turns` for the batch."""
        turns = self.turns
        return Completion(
            request_id,
            turns[0].prompt_ids,
            [t for turn in turns for t in turn.token_ids],
            torch.cat([turn.logprobs for turn in turns]),
            turns[-1].finish_reason,
            episode=self,
            turns=list(turns),
        )


def _step_all(pending: list[tuple[StepwiseEpisode, str]]) -> None:
    """Each episode's environment answers its action, concurrently, each within its episode's time limit
    (`answer_later`); returns once every one has settled."""
    settled, left = threading.Condition(), [len(pending)]

    def one() -> None:  # under the condition's lock
        left[0] -= 1
        settled.notify_all()

    for episode, action in pending:
        episode.answer_later(action, settled, one)
    with settled:
        while left[0]:
            settled.wait()


def generate_stepwise(
    engine: RolloutEngine, requests: Sequence[GenerationRequest], params: SamplingParams
) -> Iterator[Completion]:
    """The completions of `requests`, each carrying a `StepwiseEpisode`, as their episodes end. Turn t of
    a request is sampled with the seed derive_seed(request seed, t), its cap the request's. Continuously
    where the engine takes live requests, unless the episodes' `schedule` says rounds."""
    if offers(engine, "live") and all(r.episode.schedule != "rounds" for r in requests):
        yield from generate_continuously(engine, requests, params)
        return
    live = {r.request_id: r for r in requests}
    while live:
        ids = list(live)
        calls = [
            replace(live[i], request_id=n, prompt_ids=live[i].episode.prompt_ids,
                    seed=derive_seed(live[i].seed, len(live[i].episode.turns)), episode=None)
            for n, i in enumerate(ids)
        ]  # fmt: skip
        pending = []
        for completion in engine.generate(calls, params):
            request = live[ids[completion.request_id]]
            action = request.episode.take(replace(completion, request_id=request.request_id))
            if action is not None:
                pending.append((request.episode, action))
        _step_all(pending)
        for i in ids:
            episode = live[i].episode
            if episode.done:
                del live[i]
                yield episode.completion(i)
