"""SAPO and DPPO (algorithms/gated.py) by hand: values and gradients per token, the gate inside and far
outside the trust region for both signs of the advantage, the divergence masks in both directions."""

from __future__ import annotations

import math

import pytest
import torch

from everyprompt.algorithms import LossBatch
from everyprompt.algorithms.gated import dppo_kl_loss, dppo_tv_loss, sapo_loss


def _per_token(loss_fn, log_ratios, advantages, old_logp=None, **options):
    """(loss values, d loss / d logp) of one row of tokens with the given log-ratios to the old policy."""
    old = torch.tensor([old_logp or [-1.0] * len(log_ratios)], dtype=torch.float64)
    logp = (old + torch.tensor([log_ratios], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([advantages], dtype=torch.float64)
    loss, metrics = loss_fn(LossBatch(logp, old, adv, torch.ones_like(adv)), **options)
    loss.sum().backward()
    return loss.detach()[0].tolist(), logp.grad[0].tolist(), metrics


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapos_gate_on_policy_inside_and_far_outside_for_both_signs():
    log_ratios = [0.0, 0.0, 0.5, 0.5, 3.0, -3.0]
    advantages = [1.0, -1.0, 2.0, -2.0, -1.0, 1.0]
    values, grads, metrics = _per_token(sapo_loss, log_ratios, advantages, tau_pos=1.0, tau_neg=1.05)
    for value, grad, x, a in zip(values, grads, log_ratios, advantages):
        tau = 1.0 if a > 0 else 1.05
        r = math.exp(x)
        s = _sigmoid(tau * (r - 1))
        assert value == pytest.approx(-s * 4 / tau * a, rel=1e-12)
        assert grad == pytest.approx(-a * 4 * s * (1 - s) * r, rel=1e-9, abs=1e-15)
    assert grads[0] == pytest.approx(-1.0) and grads[1] == pytest.approx(1.0)  # on-policy: -A, as PPO
    assert values[0] == pytest.approx(-2.0) and values[1] == pytest.approx(2 / 1.05)  # 2 / tau at r = 1
    # r = e^0.5, A > 0: s = sigmoid(0.6487) = 0.65672, gradient -2 * 4 * 0.65672 * 0.34328 * 1.64872
    assert grads[2] == pytest.approx(-2 * 4 * 0.656720 * 0.343280 * 1.648721, rel=1e-5)
    assert abs(grads[4]) < 1e-6  # r = e^3, A < 0: the gate has shut, softly (no clip boundary)
    # r = e^-3, A > 0: s = sigmoid(-0.9502) = 0.27889, gradient -4 * 0.27889 * 0.72111 * 0.049787
    assert grads[5] == pytest.approx(-4 * 0.278886 * 0.721114 * 0.049787, rel=1e-4)
    # a negative advantage fades faster than a positive one at the same ratio
    _, (neg,), _ = _per_token(sapo_loss, [0.5], [-1.0], tau_pos=1.0, tau_neg=3.0)
    _, (pos,), _ = _per_token(sapo_loss, [0.5], [1.0], tau_pos=1.0, tau_neg=3.0)
    assert abs(neg) < abs(pos)
    assert metrics["sapo/gradient_weight_mean"].item() == pytest.approx(
        sum(
            4
            * _sigmoid((1.0 if a > 0 else 1.05) * (math.exp(x) - 1))
            * (1 - _sigmoid((1.0 if a > 0 else 1.05) * (math.exp(x) - 1)))
            * math.exp(x)
            for x, a in zip(log_ratios, advantages)
        )
        / 6
    )


def test_dppo_tv_masks_a_move_past_the_band_in_the_advantages_direction_only():
    old = [math.log(0.5)] * 4
    p = [0.8, 0.8, 0.2, 0.2]  # moved up 0.3, up 0.3, down 0.3, down 0.3
    advantages = [1.0, -1.0, 1.0, -1.0]
    log_ratios = [math.log(x / 0.5) for x in p]
    values, grads, metrics = _per_token(
        dppo_tv_loss, log_ratios, advantages, old, delta_low=0.2, delta_high=0.2
    )
    kept = [
        False,
        True,
        True,
        False,
    ]  # up with A > 0: past the band; down with A < 0: past it; the rest return
    for value, grad, x, a, keep in zip(values, grads, log_ratios, advantages, kept):
        r = math.exp(x)
        assert value == pytest.approx(-a * r if keep else 0.0)
        assert grad == pytest.approx(-a * r if keep else 0.0)  # d(-A r)/d logp = -A r
    assert metrics["dppo/masked_fraction"].item() == 0.5 == metrics["actor/clip_fraction"].item()
    _, grads, _ = _per_token(dppo_tv_loss, log_ratios, advantages, old, delta_low=0.35, delta_high=0.35)
    assert all(g != 0 for g in grads)  # a wider band masks nothing


def test_dppo_kl_by_the_bernoulli_divergence():
    def kl(q, p):
        return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))

    assert kl(0.5, 0.8) == pytest.approx(0.223144, rel=1e-5) and kl(0.5, 0.52) == pytest.approx(
        0.000800, rel=1e-3
    )
    old = [math.log(0.5)] * 4
    p = [0.8, 0.52, 0.2, 0.8]
    advantages = [1.0, 1.0, -1.0, -1.0]
    log_ratios = [math.log(x / 0.5) for x in p]
    _, grads, metrics = _per_token(dppo_kl_loss, log_ratios, advantages, old, delta_low=0.05, delta_high=0.05)
    # 0.8 with A > 0: KL 0.223 > 0.05, masked; 0.52: KL 0.0008, kept; 0.2 with A < 0: KL(0.5||0.2) 0.223,
    # masked; 0.8 with A < 0: moving back, kept
    assert [g == 0 for g in grads] == [True, False, True, False]
    assert metrics["dppo/masked_fraction"].item() == 0.5


def test_on_policy_every_gated_loss_has_the_policy_gradient():
    for loss_fn, options in [
        (sapo_loss, {"tau_pos": 1.0, "tau_neg": 1.05}),
        (dppo_tv_loss, {"delta_low": 0.2, "delta_high": 0.2}),
        (dppo_kl_loss, {"delta_low": 0.05, "delta_high": 0.05}),
    ]:
        _, grads, _ = _per_token(loss_fn, [0.0, 0.0, 0.0], [1.5, -0.5, 0.0], **options)
        assert grads == pytest.approx([-1.5, 0.5, 0.0])
