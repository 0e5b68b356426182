"""ZVE stage 1 on a synthetic bandit: prompts with known pass rates, Bernoulli rewards."""

from __future__ import annotations

import random

import pytest
import torch

from everyprompt.zve import collect_groups, group_zero_variance, reshape_zero_variance, zvp_signs


class Bandit:
    """Prompt i succeeds with probability rates[i]; take_prompts walks the prompts in order."""

    def __init__(self, rates, seed=0):
        self.rates, self.rng, self.next = rates, random.Random(seed), 0
        self.sampled = 0

    def take(self, count):
        out = [(self.next + i) % len(self.rates) for i in range(count)]
        self.next += count
        return out

    def sample(self, specs):
        self.sampled += len(specs)
        return [
            (f"p{index}s{s}", float(self.rng.random() < self.rates[index]), None) for index, _, s in specs
        ]


def test_without_expansion_it_is_plain_group_sampling():
    bandit = Bandit([1.0, 0.0, 0.5, 0.5])
    result = collect_groups(bandit.take, bandit.sample, prompts_per_step=4, group_size=4)
    assert result.generated == bandit.sampled == 16 and result.rounds == 0
    assert [g.prompt_index for g in result.groups] == [0, 1, 2, 3]
    assert all(g.size == 4 for g in result.groups)
    assert result.zv_sampled >= 0.5  # prompts 0 and 1 are always zero-variance


def test_expansion_grows_zero_variance_groups_until_informative_or_capped():
    bandit = Bandit([1.0, 0.0, 0.9, 0.1] * 4, seed=1)
    result = collect_groups(
        bandit.take, bandit.sample, prompts_per_step=16, group_size=4, max_group_size=16, max_rollouts=10_000
    )
    for group in result.all_groups:
        if group.zero_variance:
            assert group.size == 16  # grew to N_max and stayed zero-variance
        else:
            assert group.size in (4, 8, 12, 16)  # stopped growing at the round that made it informative
    always = [g for g in result.all_groups if bandit.rates[g.prompt_index] in (0.0, 1.0)]
    assert all(g.zero_variance and g.size == 16 for g in always)
    assert result.zv_expanded < result.zv_sampled
    assert result.generated == sum(g.size for g in result.all_groups) == bandit.sampled


def test_the_rollout_budget_is_never_exceeded():
    bandit = Bandit([1.0] * 8)
    result = collect_groups(
        bandit.take,
        bandit.sample,
        prompts_per_step=8,
        group_size=4,
        max_group_size=64,
        max_rollouts=50,
        dynamic_sampling=True,
    )
    assert result.generated == bandit.sampled == 50  # 32 first draw + 18 expansion, then the budget stops it


def test_dynamic_sampling_fills_the_step_with_informative_groups():
    # every other prompt is hopeless; dynamic sampling replaces them with fresh prompts
    bandit = Bandit([0.0, 0.5] * 50, seed=2)
    result = collect_groups(
        bandit.take,
        bandit.sample,
        prompts_per_step=8,
        group_size=8,
        dynamic_sampling=True,
        max_rollouts=10_000,
    )
    assert len(result.groups) == 8 and not any(g.zero_variance for g in result.groups)
    assert result.sampled_groups > 8 and result.dropped_groups == result.sampled_groups - 8


def test_zero_variance_rate_matches_the_binomial_formula():
    """A prompt with pass rate p gives a zero-variance group of N with probability p^N + (1 - p)^N."""
    rates = [0.1, 0.5, 0.9]
    n, trials = 4, 3000
    bandit = Bandit(rates * trials, seed=3)
    result = collect_groups(bandit.take, bandit.sample, prompts_per_step=len(rates) * trials, group_size=n)
    for k, p in enumerate(rates):
        groups = result.all_groups[k :: len(rates)]
        measured = sum(g.zero_variance for g in groups) / len(groups)
        expected = p**n + (1 - p) ** n
        assert measured == pytest.approx(expected, abs=4 * (expected * (1 - expected) / len(groups)) ** 0.5)


def test_stages_two_and_three_on_a_hand_built_batch():
    # group 0 informative; group 1 all-correct with lengths 2 and 6; group 2 all-wrong, equal lengths
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    completions = [[5, 6], [5], [7, 8], [7, 8, 9, 10, 11, 12], [4, 4, 4], [3, 3, 3]]
    assert group_zero_variance(rewards, groups).tolist() == [False, True, True]
    advantages, informative = reshape_zero_variance(
        rewards, completions, groups, length_coef=0.1, repetition_coef=0.0, max_length=8, reward_gap=1.0
    )
    # group 1: lengths 2 and 6 (mean 4): -0.1 * (-2, +2) / 8 = +0.025, -0.025; groups 0 and 2 untouched
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.0, 0.025, -0.025, 0.0, 0.0]))
    assert informative.tolist() == [False, True, False]
    still = torch.tensor([False, False, True])
    assert zvp_signs(rewards, groups, still, correct_reward=1.0).tolist() == [0, 0, 0, 0, -1, -1]
    still = torch.tensor([False, True, True])
    assert zvp_signs(rewards, groups, still, correct_reward=1.0).tolist() == [0, 0, 1, 1, -1, -1]
