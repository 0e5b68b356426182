"""ZVE stages 2 and 3 as pure functions: hand-computed examples and the correctness-order bound."""

from __future__ import annotations

import pytest
import torch

from everyprompt.algorithms import zvp_token_advantages
from everyprompt.rewards.shaping import repetition_rate, reshape_rewards, shaping_terms


def test_repetition_rate_hand_computed():
    # 3-grams of 1 2 3 1 2 3 1: (123) (231) (312) (123) (231): 3 distinct of 5 -> 1 - 3/5 = 0.4
    assert repetition_rate([1, 2, 3, 1, 2, 3, 1]) == pytest.approx(0.4)
    assert repetition_rate([1, 2, 3, 4]) == 0.0
    assert repetition_rate([1, 2]) == 0.0  # fewer than two 3-grams


def test_shaping_terms_hand_computed():
    # One group, lengths 10, 20, 30 (mean 20), L_max 40, lambda 0.1: length terms -0.1 * (-10, 0, 10) / 40
    # = +0.025, 0, -0.025. Repetition 0.0, 0.5, 0.1 (mean 0.2), mu 0.05: -0.05 * (-0.2, 0.3, -0.1)
    # = +0.010, -0.015, +0.005. Sum: 0.035, -0.015, -0.020 (centred: sums to 0).
    terms = shaping_terms(
        torch.tensor([10, 20, 30]),
        torch.tensor([0.0, 0.5, 0.1]),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3, dtype=torch.bool),
        length_coef=0.1,
        repetition_coef=0.05,
        max_length=40,
    )
    torch.testing.assert_close(terms, torch.tensor([0.035, -0.015, -0.020], dtype=torch.float64))


def test_reshaping_touches_only_the_chosen_groups_and_keeps_nan():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    apply = torch.tensor([True, True, False, False, True, True])
    shaped = reshape_rewards(
        rewards, torch.tensor([4, 8, 4, 8, 4, 8]), torch.zeros(6), groups, apply, 0.1, 0.0, max_length=8
    )
    # group 0: lengths 4, 8 (mean 6): -0.1 * (-2, 2) / 8 = +0.025, -0.025; group 2: only one valid reward
    torch.testing.assert_close(shaped[:2], torch.tensor([1.025, 0.975]))
    assert shaped[2:4].tolist() == [0.0, 1.0]
    assert torch.isnan(shaped[4]) and shaped[5] == 1.0


def test_reshaping_never_ranks_a_wrong_answer_above_a_right_one():
    """Randomised worst cases: mixed groups, extreme lengths and repetition, coefficients at the bound."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        n, groups = 64, 8
        group_index = torch.randint(0, groups, (n,), generator=generator)
        rewards = torch.randint(0, 2, (n,), generator=generator).float()
        lengths = torch.where(torch.rand(n, generator=generator) < 0.5, 1, 64)  # push the spread to the max
        repetition = torch.rand(n, generator=generator).round()  # 0 or 1
        lam = float(torch.rand(1, generator=generator)) * 0.99
        mu = 0.99 - lam  # lambda + mu = 0.99 < gap 1
        shaped = reshape_rewards(
            rewards, lengths, repetition, group_index, torch.ones(n, dtype=torch.bool), lam, mu, max_length=64
        )
        for g in range(groups):
            members = group_index == g
            right, wrong = shaped[members & (rewards == 1)], shaped[members & (rewards == 0)]
            if right.numel() and wrong.numel():
                assert float(right.min()) > float(wrong.max()), f"trial {trial}, group {g}"


def test_reshaping_rejects_coefficients_that_could_invert_the_order():
    with pytest.raises(ValueError, match="must be below the reward gap"):
        reshape_rewards(
            torch.ones(2),
            torch.tensor([1, 2]),
            torch.zeros(2),
            torch.zeros(2, dtype=torch.long),
            torch.ones(2, dtype=torch.bool),
            0.6,
            0.5,
            max_length=4,
        )


def test_zvp_token_advantages_hand_computed():
    entropy = torch.tensor(
        [
            [0.5, 1.0, 0.2, 9.9],  # all-correct group, last position is padding
            [0.5, 1.0, 0.2, 9.9],  # all-wrong group: max over the 3 real tokens is 1.0
            [0.5, 1.0, 0.2, 9.9],  # informative group: untouched (0)
        ]
    )
    mask = torch.tensor([[1.0, 1, 1, 0]] * 3)
    advantages = zvp_token_advantages(entropy, mask, torch.tensor([1, -1, 0]), alpha=0.1)
    # correct: 0.1 * H = 0.05, 0.10, 0.02; wrong: -0.1 * (1.0 - H) = -0.05, 0.0, -0.08
    expected = torch.tensor([[0.05, 0.10, 0.02, 0.0], [-0.05, 0.0, -0.08, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)
