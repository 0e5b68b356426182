"""On-policy distillation's per-token advantage (algorithms/distill.py) by hand: its values on rows with
and without a teacher, its figures from the micro-batches' sums, and the policy gradient it gives through
PPO-clip (on-policy: -A per token, the gradient of the reverse KL's sampled estimate)."""

from __future__ import annotations

import pytest
import torch

from everyprompt.algorithms import (
    LossBatch,
    LossSettings,
    distillation_advantages,
    distillation_metrics,
    distillation_sums,
    policy_loss,
)


def test_the_advantage_is_minus_coef_times_the_log_ratio_on_taught_rows_only():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-4.0, -0.1, -9.0]])
    covered = torch.tensor([True, False])
    advantages = distillation_advantages(student, teacher, covered, coef=2.0)
    # row 0: -2 * (s - q) = -2 * [-0.5, 1.0, 0.0]; row 1 has no teacher
    assert advantages.tolist() == [[1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
    same = distillation_advantages(student, student, torch.tensor([True, True]), coef=5.0)
    assert same.abs().sum() == 0  # teacher = student: no term


def test_the_advantage_is_a_constant_of_the_update():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    advantages = distillation_advantages(student, torch.tensor([[-1.5, -1.0]]), torch.tensor([True]), 1.0)
    assert not advantages.requires_grad


def test_the_figures_from_the_sums():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-4.0, -0.1, -9.0]])
    covered = torch.tensor([True, False])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 0's last token is not trained
    distilled = distillation_advantages(student, teacher, covered, coef=1.0)  # [[0.5, -1, 0], [0, 0, 0]]
    estimated = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    sums = {
        k: float(v)
        for k, v in distillation_sums(student, teacher, covered, mask, distilled, estimated).items()
    }
    # taught tokens: row 0's first two; KL estimates s - q: -0.5 and +1.0
    assert sums == {
        "distill/kl_sum": 0.5,
        "distill/tokens_sum": 2.0,
        "distill/abs_sum": 1.5,  # |0.5| + |-1|
        "distill/estimator_abs_sum": 2.0 + 1.5,  # row 0's two trained tokens, row 1's three
    }
    figures = distillation_metrics(dict(sums, other=7.0), trained_tokens=5.0)
    assert figures == {
        "distill/reverse_kl": 0.25,
        "distill/token_share": 0.4,
        "distill/advantage_share": pytest.approx(1.5 / 5.0),
    }
    # several teachers: each one's figures beside the whole's (row 0 is teacher a's, row 1 teacher b's,
    # whose teacher log-probs are here only to be summed)
    each = {"a": torch.tensor([True, False]), "b": torch.tensor([False, True])}
    both = torch.tensor([True, True])
    split = distillation_sums(student, teacher, both, mask, distilled, estimated, each)
    figures = distillation_metrics({k: float(v) for k, v in split.items()}, trained_tokens=5.0)
    # a: s - q over row 0's two trained tokens = -0.5 + 1.0; b: row 1's three = 3.0 - 0.9 + 8.0
    assert figures["distill/a/reverse_kl"] == pytest.approx(0.25)
    assert figures["distill/b/reverse_kl"] == pytest.approx(10.1 / 3)
    assert figures["distill/a/token_share"] == pytest.approx(0.4) and figures["distill/b/token_share"] == 0.6
    assert figures["distill/reverse_kl"] == pytest.approx((0.5 + 10.1) / 5)
    untaught = dict.fromkeys(sums, 0.0)
    assert distillation_metrics(untaught, 5.0) == {
        "distill/reverse_kl": 0.0,
        "distill/token_share": 0.0,
        "distill/advantage_share": 0.0,
    }


def test_through_ppo_clip_on_policy_the_gradient_is_minus_the_advantage_per_token():
    """Alone (pure distillation), token-mean over 3 tokens: d loss / d logp_t = -A_t / 3 = coef (s_t - q_t) / 3."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    teacher = torch.tensor([[-0.5, -3.0, -0.5]], dtype=torch.float64)
    logp = old.clone().requires_grad_()
    advantages = distillation_advantages(old, teacher, torch.tensor([True]), coef=2.0)  # [1, -2, 0]
    loss, _ = policy_loss(
        "ppo_clip", LossBatch(logp, old, advantages, torch.ones_like(old)), LossSettings(agg="token-mean")
    )
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-1 / 3, 2 / 3, 0.0])]
    # lowering the log-prob of a token the teacher finds less likely lowers the loss: descent moves the
    # student towards the teacher on each token (token 1: s = -2 > q = -3)
    assert logp.grad[0, 1] > 0 and logp.grad[0, 0] < 0
