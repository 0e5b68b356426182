"""Generate, decode, score: the one loop shared by the rollout side, evaluation and the offline filter.

Each finished completion is decoded and handed to the reward pool the moment the engine yields it, so
with worker processes scoring overlaps with generation (docs/rollout.md); an inline pool
(`workers=0`) scores the whole call in one reward call when it is waited on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from everyprompt.envs.stepwise import generate_stepwise
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout.base import Completion, GenerationRequest, RolloutEngine, SamplingParams


@dataclass
class ScoredSamples:
    """One generate call's results, in request-id order (request ids are 0..n-1)."""

    completions: list[Completion]
    texts: list[str]  # decoded without special tokens
    rewards: list[float | None]
    components: list[dict | None]  # composite rewards: each component's value per row (else None)
    generate_s: float = 0.0  # until the engine yielded its last completion
    reward_wait_s: float = 0.0  # then waiting for the last rewards
    engine_stats: dict[str, float] = field(default_factory=dict)  # the engine's figures of this call
    scored: int = 0  # completions sent to the reward (all but unfinished partial rollouts)
    # (reason, error) of each episode its environment ended early (Episode.error_reason, Episode.error)
    environment_errors: list[tuple[str, str]] = field(default_factory=list)


def sample_and_score(
    engine: RolloutEngine,
    tokenizer,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    rows: Sequence[dict],
    rewards: RewardPool,
    call: object = 0,
    prefixes: Sequence[list[int]] | None = None,
    finished: Callable[[Completion], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ScoredSamples:
    """Generate `requests` (ids 0..n-1, admitted in the order given), score each completion against the
    reward columns `rows[request_id]`. `call` keeps this call's keys apart in a pool shared by calls.

    Partial rollouts: `prefixes[request_id]`, the tokens a request's completion continues (decoded and
    scored together with it); a completion for which `finished` is false is neither decoded nor scored
    (its text is "" and its reward None). `progress(1)` is called as each completion comes out."""
    ids = sorted(r.request_id for r in requests)
    if ids != list(range(len(requests))):
        raise ValueError(f"request ids must be 0..{len(requests) - 1}, got {ids[:5]}...")
    done: dict[int, tuple[Completion, str]] = {}
    scored: list[int] = []
    judged: dict[int, float] = {}  # episodes: their environment's reward, not the pool's
    errors: list[tuple[str, str]] = []  # episodes whose environment ended them early
    began = time.perf_counter()
    # step-wise episodes: a request a turn (envs/stepwise.py)
    stepwise = any(getattr(r.episode, "stepwise", False) for r in requests)
    stream = generate_stepwise(engine, requests, params) if stepwise else engine.generate(requests, params)
    for completion in stream:
        number = completion.request_id
        if progress is not None:
            progress(1)
        if finished is not None and not finished(completion):
            done[number] = (completion, "")
            continue
        tokens = completion.token_ids if prefixes is None else [*prefixes[number], *completion.token_ids]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        done[number] = (completion, text)
        if completion.episode is not None:  # its environment's reward; 0 if the cap cut it before judging
            episode = completion.episode
            if episode.error:  # an environment that failed: no reward, as a failed reward
                errors.append((episode.error_reason or "other", episode.error))
            else:
                judged[number] = 0.0 if episode.reward is None else episode.reward
            continue
        rewards.submit((call, number), text, rows[number])
        scored.append(number)
    generated = time.perf_counter()
    scored.sort()
    values = dict(zip(scored, rewards.wait([(call, i) for i in scored])))
    values.update(judged)
    components = dict(zip(scored, rewards.last_components))
    return ScoredSamples(
        completions=[done[i][0] for i in range(len(requests))],
        texts=[done[i][1] for i in range(len(requests))],
        rewards=[values.get(i) for i in range(len(requests))],
        components=[components.get(i) for i in range(len(requests))],
        generate_s=generated - began,
        reward_wait_s=time.perf_counter() - generated,
        engine_stats=dict(engine.stats),
        scored=len(scored) + len(judged),
        environment_errors=errors,
    )
