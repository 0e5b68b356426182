import math

import pytest
import torch

from everyprompt.algorithms import LossBatch, LossSettings, aggregate, policy_loss


def test_ppo_clip_hand_computed():
    # ratios r = exp(logp - old): e^0.5 = 1.6487, e^-0.5 = 0.6065, e^0.1 = 1.1052; clip range [0.8, 1.28]
    #   tok 1, A = +1: -min(1.6487, 1.28) = -1.28        (clipped)
    #   tok 2, A = -1: -min(-0.6065, -0.8) = 0.8          (clipped: the pessimistic side)
    #   tok 3, A = +2: -min(2.2103, 2.2103) = -2.2103     (inside the range)
    logp = torch.tensor([[0.5, -0.5, 0.1]])
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(
        "ppo_clip", LossBatch(logp, old, advantages, mask), clip_low=0.2, clip_high=0.28
    )
    # token-mean: (-1.28 + 0.8 - 2.2103) / 3 = -0.89678
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2 * math.exp(0.1)) / 3, abs=1e-5)
    assert metrics["actor/clip_fraction"] == pytest.approx(2 / 3)


def test_dual_clip_caps_negative_advantage_loss():
    # r = e^2 = 7.389, A = -1: PPO loss = max(7.389, clip 1.28) = 7.389; dual clip c = 3 caps it at 3
    logp, old = torch.tensor([[2.0]]), torch.zeros(1, 1)
    loss, _ = policy_loss(
        "ppo_clip", LossBatch(logp, old, torch.tensor([[-1.0]]), torch.ones(1, 1)), dual_clip=3.0
    )
    assert loss.item() == pytest.approx(3.0)


def test_aggregations_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: (6/3 + 4/1) / 2 = 3
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum-norm, max_length 4: (6/4 + 4/4) / 2 = 1.25
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", max_length=4).item() == pytest.approx(1.25)
    with pytest.raises(KeyError, match="valid: token-mean"):
        aggregate(loss, mask, "sum")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_masked_positions_change_nothing(agg):
    generator = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 6, generator=generator)
    old = logp + 0.1 * torch.randn(4, 6, generator=generator)
    advantages = torch.randn(4, generator=generator)
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    mask[:, 0] = 1
    base, _ = policy_loss(
        "ppo_clip", LossBatch(logp, old, advantages, mask), LossSettings(agg=agg, max_length=6)
    )
    noisy_logp = torch.where(mask.bool(), logp, torch.full_like(logp, 55.0))
    noisy_old = torch.where(mask.bool(), old, torch.full_like(old, -40.0))
    shifted, _ = policy_loss(
        "ppo_clip", LossBatch(noisy_logp, noisy_old, advantages, mask), LossSettings(agg=agg, max_length=6)
    )
    torch.testing.assert_close(base, shifted)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_mini_batch_gradient(agg):
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(6, 5, generator=generator)
    old = base + 0.2 * torch.randn(6, 5, generator=generator)
    advantages = torch.randn(6, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.25).float()

    whole = base.clone().requires_grad_(True)
    loss, _ = policy_loss(
        "ppo_clip", LossBatch(whole, old, advantages, mask), LossSettings(agg=agg, max_length=5)
    )
    loss.backward()

    split = base.clone().requires_grad_(True)
    tokens = float(mask.sum())
    for part in (slice(0, 2), slice(2, 3), slice(3, 6)):
        micro, _ = policy_loss(
            "ppo_clip",
            LossBatch(
                split[part], old[part], advantages[part], mask[part], num_tokens=tokens, num_sequences=6
            ),
            LossSettings(agg=agg, max_length=5),
        )
        micro.backward()
    torch.testing.assert_close(split.grad, whole.grad)


def test_unknown_loss_lists_valid_names():
    with pytest.raises(KeyError, match="unknown policy loss 'ppo'; valid: .*ppo_clip"):
        policy_loss("ppo", LossBatch(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1)))
