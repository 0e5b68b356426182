"""The decoupled objective of asynchronous training (docs/asynchrony.md), by hand on three tokens."""

from __future__ import annotations

import math

import torch

from everyprompt.algorithms import LossBatch, LossSettings, RolloutCorrection, policy_loss
from everyprompt.algorithms.corrections import rollout_correction


def test_the_decoupled_ppo_loss_on_three_tokens_by_hand():
    # pi_theta (trained), pi_prox (the learner's recomputed old policy), mu (the engine, k versions older)
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.15]])).requires_grad_(True)
    prox = torch.log(torch.tensor([[0.4, 0.3, 0.25]]))
    behaviour = torch.log(torch.tensor([[0.1, 0.3, 0.5]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(
        "ppo_clip",
        LossBatch(logp, prox, advantages, mask, rollout_logp=behaviour),
        LossSettings(agg="token-mean", correction=RolloutCorrection(mode="tis", level="token", cap=2.0)),
        clip_low=0.2,
        clip_high=0.28,
    )
    # token 1: r = 0.6/0.4 = 1.5, clipped to 1.28 (A > 0): -1.28; w = min(0.4/0.1, 2) = 2   -> -2.56
    # token 2: r = 0.3/0.3 = 1:                        -1;    w = min(0.3/0.3, 2) = 1   -> -1
    # token 3: r = 0.15/0.25 = 0.6, A < 0, clipped to 0.8: +0.8; w = min(0.25/0.5, 2) = 0.5 -> 0.4
    # token-mean: (-2.56 - 1 + 0.4) / 3
    assert math.isclose(float(loss.detach()), (-2.56 - 1.0 + 0.4) / 3, rel_tol=1e-6)
    loss.backward()
    # clipped tokens carry no gradient; token 2: d/dlogp of -w r A / 3 = -1 * 1 * 1 / 3
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1 / 3, 0.0]]), atol=1e-6, rtol=0)
    assert math.isclose(metrics["rollout_correction/tis_weight_mean"], (2 + 1 + 0.5) / 3, rel_tol=1e-6)
    assert math.isclose(metrics["rollout_correction/tis_affected_fraction"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["actor/clip_fraction"], 2 / 3, rel_tol=1e-6)


def test_the_clip_is_taken_around_the_proximal_policy_not_the_behaviour_one():
    # the same tokens clipped around mu would clip token 2 (pi/mu = 1) differently from token 1
    # (0.6/0.1 = 6): with the proximal policy equal to pi_theta nothing is clipped and the loss is the
    # plain importance-weighted policy gradient, -w A per token
    logp = torch.log(torch.tensor([[0.6, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.1, 0.3]]))
    loss, metrics = policy_loss(
        "ppo_clip",
        LossBatch(logp, logp, torch.ones(1, 2), torch.ones(1, 2), rollout_logp=behaviour),
        LossSettings(agg="token-mean", correction=RolloutCorrection(mode="tis", cap=2.0)),
        clip_low=0.2,
        clip_high=0.28,
    )
    assert metrics["actor/clip_fraction"] == 0.0
    assert math.isclose(float(loss), (-2.0 - 1.0) / 2, rel_tol=1e-6)  # w = min(6, 2) = 2 and 1


def test_the_geometric_sequence_weight_by_hand():
    # log rho per token: log 4, 0, log 0.5; geometric mean of the ratios = exp((log 4 + log 0.5) / 3)
    # = 2 ** (1/3) ~ 1.26 on every token of the sequence; a second, one-token sequence has rho = 3 -> 2
    old = torch.log(torch.tensor([[0.4, 0.3, 0.25], [0.3, 0.9, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.1, 0.3, 0.5], [0.1, 0.9, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    weight, _ = rollout_correction(old, behaviour, mask, "tis", "geometric", 2.0)
    expected = torch.tensor([[2 ** (1 / 3)] * 3, [2.0, 0.0, 0.0]])
    torch.testing.assert_close(weight, expected, atol=1e-6, rtol=0)
