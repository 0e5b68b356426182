"""Invariants every registered policy loss must keep, and ESPO against a plain-loop reference."""

import math

import pytest
import torch

from everyprompt.algorithms import (
    LossBatch,
    LossSettings,
    policy_loss,
    registered_policy_losses,
)

VOCAB = 100


def _inputs(seed: int, rows: int = 6, width: int = 7):
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=generator) * 3
    old = logp + 0.3 * torch.randn(rows, width, generator=generator)
    advantages = torch.randn(rows, generator=generator)
    mask = (torch.rand(rows, width, generator=generator) > 0.25).float()
    mask[:, 0] = 1
    entropy = torch.rand(rows, width, generator=generator) * math.log(VOCAB)
    return logp, old, advantages, mask, entropy


def _options(name: str) -> dict:
    # wide clip ranges so that both branches of every clip occur on these inputs
    return {
        "ppo_clip": {"clip_low": 0.2, "clip_high": 0.28},
        "gspo": {"clip_low": 0.05, "clip_high": 0.05},
        "gspo_token": {"clip_low": 0.05, "clip_high": 0.05},
        "cispo": {"clip_high": 0.28},
        "espo": {"alpha": 0.5},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
        "dppo_tv": {"delta_low": 0.05, "delta_high": 0.05},  # narrow bands: masked and kept tokens both occur
        "dppo_kl": {"delta_low": 0.01, "delta_high": 0.01},
    }[name]


LOSSES = ["ppo_clip", "gspo", "gspo_token", "cispo", "espo", "sapo", "dppo_tv", "dppo_kl"]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_all_registered_losses_are_covered():
    assert sorted(LOSSES) == registered_policy_losses()


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", LOSSES)
def test_masked_positions_change_nothing(name, agg):
    logp, old, advantages, mask, entropy = _inputs(1)
    settings = LossSettings(agg=agg, max_length=7, vocab_size=VOCAB)
    base, _ = policy_loss(
        name, LossBatch(logp, old, advantages, mask, entropy=entropy), settings, **_options(name)
    )
    off = ~mask.bool()
    noisy = torch.where(off, torch.full_like(entropy, 50.0), entropy)
    shifted, _ = policy_loss(
        name,
        LossBatch(
            torch.where(off, torch.full_like(logp, 5.0), logp),
            torch.where(off, torch.full_like(old, -40.0), old),
            advantages,
            mask,
            entropy=noisy,
        ),
        settings,
        **_options(name),
    )
    torch.testing.assert_close(base, shifted)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_give_the_mini_batch_gradient(name, agg):
    logp, old, advantages, mask, entropy = _inputs(2)
    settings = LossSettings(agg=agg, max_length=7, vocab_size=VOCAB)
    whole = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        name, LossBatch(whole, old, advantages, mask, entropy=entropy), settings, **_options(name)
    )
    loss.backward()
    split = logp.clone().requires_grad_(True)
    for part in (slice(0, 2), slice(2, 3), slice(3, 6)):
        micro, _ = policy_loss(
            name,
            LossBatch(
                split[part],
                old[part],
                advantages[part],
                mask[part],
                entropy=entropy[part],
                num_tokens=float(mask.sum()),
                num_sequences=6,
            ),
            settings,
            **_options(name),
        )
        micro.backward()
    assert whole.grad.abs().sum() > 0
    torch.testing.assert_close(split.grad, whole.grad)


def test_espo_with_one_group_and_a_fixed_epsilon_is_gspo():
    # entropy = log|V| everywhere makes eps = alpha: one group of ESPO is GSPO(-token) with clip alpha
    logp, old, advantages, mask, _ = _inputs(3)
    entropy = torch.full_like(logp, math.log(VOCAB))
    for eps in (0.01, 0.1):
        a = logp.clone().requires_grad_(True)
        espo, _ = policy_loss(
            "espo",
            LossBatch(a, old, advantages, mask, entropy=entropy),
            LossSettings(vocab_size=VOCAB),
            alpha=eps,
            num_groups=1,
        )
        espo.backward()
        b = logp.clone().requires_grad_(True)
        gspo, _ = policy_loss("gspo", LossBatch(b, old, advantages, mask), clip_low=eps, clip_high=eps)
        gspo.backward()
        torch.testing.assert_close(espo, gspo)
        torch.testing.assert_close(a.grad, b.grad)


def _espo_loop(logp, old, advantages, mask, entropy, alpha, num_groups, high_frac):
    """ESPO written plainly: per sequence, sort its tokens by entropy, form groups, average."""
    total = 0.0
    for i in range(logp.shape[0]):
        positions = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        ranked = sorted(positions, key=lambda t: (-float(entropy[i, t]), t))
        n = len(ranked)
        if num_groups == 2:
            high = max(1, math.ceil(n * high_frac))
            groups = [ranked[:high], ranked[high:]]
        else:
            groups = [
                [t for r, t in enumerate(ranked) if r * num_groups // n == k] for k in range(num_groups)
            ]
        group_losses = []
        for group in groups:
            if not group:
                continue
            s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in group) / len(group))
            eps = alpha * sum(float(entropy[i, t]) for t in group) / len(group) / math.log(VOCAB)
            a = float(advantages[i])
            group_losses.append(-min(s * a, min(max(s, 1 - eps), 1 + eps) * a))
        total += sum(group_losses) / len(group_losses)
    return total / logp.shape[0]


@pytest.mark.parametrize(("num_groups", "high_frac"), [(2, 0.2), (2, 0.5), (3, 0.2), (4, 0.2)])
def test_vectorised_espo_equals_a_plain_loop(num_groups, high_frac):
    logp, old, advantages, mask, entropy = _inputs(4, rows=9, width=11)
    loss, _ = policy_loss(
        "espo",
        LossBatch(logp, old, advantages, mask, entropy=entropy),
        LossSettings(vocab_size=VOCAB),
        alpha=0.5,
        num_groups=num_groups,
        high_frac=high_frac,
    )
    expected = _espo_loop(logp, old, advantages, mask, entropy, 0.5, num_groups, high_frac)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_gspo_equals_a_plain_loop():
    logp, old, advantages, mask, _ = _inputs(5)
    loss, _ = policy_loss("gspo", LossBatch(logp, old, advantages, mask), clip_low=0.05, clip_high=0.05)
    expected = 0.0
    for i in range(logp.shape[0]):
        tokens = [float(logp[i, t] - old[i, t]) for t in range(logp.shape[1]) if mask[i, t] > 0]
        s = math.exp(sum(tokens) / len(tokens))
        a = float(advantages[i])
        expected += -min(s * a, min(max(s, 0.95), 1.05) * a)
    assert loss.item() == pytest.approx(expected / logp.shape[0], abs=1e-6)
