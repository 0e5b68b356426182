"""Generate, decode, score: the one loop shared by the rollout side, evaluation and the offline filter.

Each finished completion is decoded and handed to the reward pool the moment the engine yields it, so
with worker processes scoring overlaps with generation (docs/rollout.md); an inline pool
(`workers=0`) scores the whole call in one reward call when it is waited on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def sample_and_score(
    engine: RolloutEngine,
    tokenizer,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    rows: Sequence[dict],
    rewards: RewardPool,
    call: object = 0,
) -> ScoredSamples:
    """Generate `requests` (ids 0..n-1, admitted in the order given), score each completion against the
    reward columns `rows[request_id]`. `call` keeps this call's keys apart in a pool shared by calls."""
    ids = sorted(r.request_id for r in requests)
    if ids != list(range(len(requests))):
        raise ValueError(f"request ids must be 0..{len(requests) - 1}, got {ids[:5]}...")
    done: dict[int, tuple[Completion, str]] = {}
    began = time.perf_counter()
    for completion in engine.generate(requests, params):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        done[completion.request_id] = (completion, text)
        rewards.submit((call, completion.request_id), text, rows[completion.request_id])
    generated = time.perf_counter()
    values = rewards.wait([(call, i) for i in range(len(requests))])
    return ScoredSamples(
        completions=[done[i][0] for i in range(len(requests))],
        texts=[done[i][1] for i in range(len(requests))],
        rewards=values,
        components=list(rewards.last_components),
        generate_s=generated - began,
        reward_wait_s=time.perf_counter() - generated,
        engine_stats=dict(engine.stats),
    )
