import math

import pytest
import torch

from everyprompt.algorithms import compute_advantages, register_advantage, registered_advantages


def test_grpo_hand_computed():
    # group 0: rewards 1, 0, 0 -> mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.57735
    #   A = (1 - 1/3) / 0.57735 = 1.1547, (0 - 1/3) / 0.57735 = -0.57735
    # group 1: rewards 2, 2 -> std 0 -> A = 0 / (0 + eps) = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    advantages = compute_advantages("grpo", rewards, groups)
    torch.testing.assert_close(
        advantages, torch.tensor([1.1547, -0.57735, -0.57735, 0.0, 0.0]), atol=1e-4, rtol=0
    )


def test_none_rewards_are_left_out_and_get_zero():
    # group 0 valid rewards 1, 0 (NaN left out): mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.70711
    #   A = +-0.5 / 0.70711 = +-0.70711; the NaN row gets 0
    rewards = torch.tensor([1.0, math.nan, 0.0])
    advantages = compute_advantages("grpo", rewards, torch.tensor([0, 0, 0]))
    torch.testing.assert_close(advantages, torch.tensor([0.70711, 0.0, -0.70711]), atol=1e-4, rtol=0)


def test_dr_grpo_and_rloo_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    groups = torch.zeros(3, dtype=torch.long)
    # Dr.GRPO: mean 0.5 -> 0.5, -0.5, 0
    torch.testing.assert_close(compute_advantages("dr_grpo", rewards, groups), torch.tensor([0.5, -0.5, 0.0]))
    # RLOO: 1 - mean(0, .5) = 0.75; 0 - mean(1, .5) = -0.75; .5 - mean(1, 0) = 0
    torch.testing.assert_close(compute_advantages("rloo", rewards, groups), torch.tensor([0.75, -0.75, 0.0]))


def test_vectorised_grpo_equals_a_loop():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (60,), generator=generator).float()
    rewards[::7] = math.nan
    groups = torch.arange(12).repeat_interleave(5)
    fast = compute_advantages("grpo", rewards, groups)
    for g in range(12):
        values = rewards[groups == g]
        valid = values[~torch.isnan(values)]
        expected = (values - valid.mean()) / (valid.std() + 1e-6) if valid.numel() > 1 else values * 0
        expected = torch.nan_to_num(expected, nan=0.0)
        torch.testing.assert_close(fast[groups == g], expected, atol=1e-5, rtol=0)


def test_registry_errors_list_valid_names():
    with pytest.raises(KeyError, match="unknown advantage estimator 'gae'; valid: dr_grpo, gdpo, grpo, rloo"):
        compute_advantages("gae", torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r, g: r)
    assert {"grpo", "dr_grpo", "rloo"} <= set(registered_advantages())


def test_dead_zone_hand_computed():
    # one group of scalar-RM scores 0.52, 0.48, 0.50, 0.90: mean 0.60;
    # centred -0.08, -0.12, -0.10, +0.30; unbiased std sqrt((0.0064 + 0.0144 + 0.01 + 0.09) / 3) = 0.200666
    # delta 0.11: |-0.08| and |-0.10| fall inside -> 0; -0.12 / 0.200666 = -0.59801, 0.30 / 0.200666 = 1.49502
    rewards = torch.tensor([0.52, 0.48, 0.50, 0.90])
    groups = torch.zeros(4, dtype=torch.long)
    advantages = compute_advantages("grpo", rewards, groups, dead_zone=0.11)
    torch.testing.assert_close(advantages, torch.tensor([0.0, -0.59801, 0.0, 1.49502]), atol=1e-4, rtol=0)
    plain = compute_advantages("grpo", rewards, groups)
    assert plain[0] != 0 and plain[2] != 0  # without the dead zone the noise gets an advantage
    # Dr.GRPO: centred values themselves, the same two zeroed
    torch.testing.assert_close(
        compute_advantages("dr_grpo", rewards, groups, dead_zone=0.11),
        torch.tensor([0.0, -0.12, 0.0, 0.30]),
        atol=1e-6,
        rtol=0,
    )
