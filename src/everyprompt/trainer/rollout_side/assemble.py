"""The RolloutBatch of a step's finished groups: every completion's tokens, log-probs, entropies, routes,
reward (and a composite reward's components), and the policy version of each token."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.rollout.base import Completion
from everyprompt.zve import Group


def assemble_batch(groups: list[Group], max_new_tokens: int, version: int) -> RolloutBatch:
    rows = list(_rows(groups))
    every = [r.completion for r in rows]
    stepwise = any(c.turns for g in groups for c, _ in g.completions)
    return RolloutBatch(
        prompt_ids=[c.prompt_ids for c in every],
        completion_ids=[c.token_ids for c in every],
        rollout_logprobs=[c.logprobs for c in every],
        rollout_entropies=[c.entropies for c in every]
        if all(c.entropies is not None for c in every)
        else None,
        routed_experts=[c.routed_experts for c in every]
        if every and all(c.routed_experts is not None for c in every)
        else None,
        finish_reason=[c.finish_reason for c in every],
        group_index=torch.tensor([r.group for r in rows], dtype=torch.long),
        prompt_index=[groups[r.group].prompt_index for r in rows],
        completion_text=[r.text for r in rows],
        rewards=torch.tensor([math.nan if r.reward is None else r.reward for r in rows], dtype=torch.float32),
        reward_components=reward_components([r.parts for r in rows]),
        max_new_tokens=max_new_tokens,
        completion_mask=[
            c.completion_mask
            if c.completion_mask is not None
            else torch.ones(len(c.token_ids), dtype=torch.bool)
            for c in every
        ]
        if any(c.completion_mask is not None for c in every)
        else None,
        versions=[
            c.versions
            if c.versions is not None
            else torch.full((len(c.token_ids),), version, dtype=torch.int32)
            for c in every
        ],
        episode_index=torch.tensor([r.episode for r in rows], dtype=torch.long) if stepwise else None,
    )


class _Row(NamedTuple):
    completion: Completion  # what the engine was given and sampled for this row
    text: str
    reward: float | None
    parts: dict | None  # a composite reward's components
    group: int  # its group's position in the batch
    episode: int  # the advantage unit it belongs to: its episode (or, with per-turn credit, itself)


def _rows(groups: list[Group]) -> Iterator[_Row]:
    """The batch's rows in order: a completion each, or a step-wise episode's turns (envs/stepwise.py), a
    row each with the tokens the engine had for it, the episode's reward (or with `env.turn_rewards=turn`
    the turn's own) and its components."""
    unit = 0
    for number, group in enumerate(groups):
        for (completion, text), reward, parts in zip(group.completions, group.rewards, group.components):
            if not completion.turns:
                yield _Row(completion, text, reward, parts, number, unit)
                unit += 1
                continue
            episode = completion.episode
            own = _own_rewards(completion, reward) if episode.per_turn else None
            for turn, (part, said) in enumerate(zip(completion.turns, episode.texts, strict=True)):
                yield _Row(part, said, reward if own is None else own[turn], parts, number, unit)
                if own is not None:  # per-turn credit: each turn an advantage of its own
                    unit += 1
            if own is None:  # the episode's rows share one advantage
                unit += 1


def reward_components(parts: list[dict | None]) -> dict[str, torch.Tensor]:
    """name -> [N] values of a composite reward's components (NaN where a row has none); {} for a reward
    that has no components."""
    names = sorted({name for row in parts if row for name in row})
    return {
        name: torch.tensor(
            [math.nan if not row or row.get(name) is None else float(row[name]) for row in parts],
            dtype=torch.float32,
        )
        for name in names
    }


def _own_rewards(completion: Completion, reward: float | None) -> list[float | None]:
    """A step-wise episode's reward for each turn, when it trains each turn on its own. A turn the
    environment never answered has no reward of its own: 0 where the cap cut it, None (left out, as the
    episode's reward is) where the environment failed."""
    given = list(completion.episode.turn_rewards)
    return given + [None if reward is None else 0.0] * (len(completion.turns) - len(given))
