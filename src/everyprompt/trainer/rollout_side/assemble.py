"""The RolloutBatch of a step's finished groups: every completion's tokens, log-probs, entropies, routes,
reward (and a composite reward's components), and the policy version of each token."""

from __future__ import annotations

import math

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.zve import Group


def assemble_batch(groups: list[Group], max_new_tokens: int, version: int) -> RolloutBatch:
    if any(c.turns for g in groups for c, _ in g.completions):
        return _turn_rows(groups, max_new_tokens, version)
    completions = [pair for g in groups for pair in g.completions]  # (Completion, text)
    rewards = [r for g in groups for r in g.rewards]
    every = [c for c, _ in completions]
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
        group_index=torch.tensor([n for n, g in enumerate(groups) for _ in g.completions], dtype=torch.long),
        prompt_index=[g.prompt_index for g in groups for _ in g.completions],
        completion_text=[t for _, t in completions],
        rewards=torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32),
        reward_components=reward_components([part for g in groups for part in g.components]),
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
    )


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


def _turn_rows(groups: list[Group], max_new_tokens: int, version: int) -> RolloutBatch:
    """Step-wise episodes (envs/stepwise.py): a row per turn, its prompt and sampled tokens as the engine
    had them, the episode's reward and components on each; `episode_index` ties the rows of an episode."""
    flat: list[Group] = []  # one single-row group per turn, so that the common path lays the rows out
    owners: list[tuple[int, int]] = []  # (group, episode) of each row
    episode = 0
    for number, group in enumerate(groups):
        for (completion, text), reward, parts in zip(group.completions, group.rewards, group.components):
            turns = completion.turns or [completion]
            texts = completion.episode.texts if completion.turns else [text]  # each turn's decoded text
            own = _own_rewards(completion, reward)  # env.turn_rewards=turn: each row its turn's reward
            for number_in_episode, (turn, said) in enumerate(zip(turns, texts, strict=True)):
                value = reward if own is None else own[number_in_episode]
                flat.append(Group(group.prompt_index, number, [(turn, said)], [value], 1, [parts]))
                owners.append((number, episode))
                episode += own is not None  # per-turn credit: every row an advantage of its own
            episode += own is None
    batch = assemble_batch(flat, max_new_tokens, version)
    batch.group_index = torch.tensor([g for g, _ in owners], dtype=torch.long)
    batch.episode_index = torch.tensor([e for _, e in owners], dtype=torch.long)
    return batch


def _own_rewards(completion, reward: float | None) -> list[float | None] | None:
    """A step-wise episode's per-turn rewards when it trains each turn on its own (None: the episode's
    reward for every row). A turn the environment never answered has no reward of its own: 0 where the cap
    cut it, None (left out, as the episode's reward is) where the environment failed."""
    episode = completion.episode
    if not completion.turns or not getattr(episode, "per_turn", False):
        return None
    given = list(episode.turn_rewards)
    return given + [None if reward is None else 0.0] * (len(completion.turns) - len(given))
