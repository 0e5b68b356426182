"""The 2026 off-policy masks by hand (algorithms/corrections.py): off-policy sequence masking, IcePop's
token band and the geometric-mean ratio band, and each composed with the loss through `policy_loss`."""

from __future__ import annotations

import math
import re

import pytest
import torch

from everyprompt.algorithms import LossBatch, LossSettings, RolloutCorrection, policy_loss
from everyprompt.algorithms.corrections import off_policy_sequence_mask, rollout_correction


def test_a_negative_sequence_past_the_threshold_is_masked_and_a_positive_one_kept():
    current = torch.zeros(4, 3)
    # the behaviour policy's log-probs above the current ones by 0.3 a token (k1 KL 0.3), or by 0.05
    behaviour = torch.tensor([[0.3, 0.3, 0.3], [0.3, 0.3, 0.3], [0.05, 0.05, 0.05], [0.3, 0.9, 0.0]])
    advantages = torch.tensor([-1.0, 1.0, -1.0, -0.5])[:, None].expand(4, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    keep, metrics = off_policy_sequence_mask(current, behaviour, advantages, mask, threshold=0.1)
    # row 3's KL is over its one completion token: 0.3 (the 0.9 off the mask does not count)
    assert keep[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert metrics["off_policy_mask/masked_sequence_fraction"].item() == pytest.approx(0.5)
    assert metrics["off_policy_mask/masked_token_fraction"].item() == pytest.approx(4 / 10)
    assert metrics["off_policy_mask/kl_mean"].item() == pytest.approx((0.3 + 0.3 + 0.05 + 0.3) / 4)
    zero = torch.zeros(4, 3)  # an advantage of 0 is never masked
    assert off_policy_sequence_mask(current, behaviour, zero, mask, 0.1)[0].all()
    with pytest.raises(ValueError, match="threshold must be > 0"):
        off_policy_sequence_mask(current, behaviour, advantages, mask, 0.0)


def test_icepop_keeps_the_ratio_inside_its_band_and_nothing_outside():
    rho = torch.tensor([[0.4, 0.5, 1.2, 5.0, 6.0]])
    old, rollout = rho.log(), torch.zeros_like(rho)
    weight, metrics = rollout_correction(old, rollout, torch.ones_like(rho), "icepop")
    assert weight[0].tolist() == pytest.approx([0.0, 0.5, 1.2, 5.0, 0.0])  # both bounds inclusive
    assert metrics["rollout_correction/icepop_affected_fraction"].item() == pytest.approx(2 / 5)
    narrow, _ = rollout_correction(old, rollout, torch.ones_like(rho), "icepop", band=(1.0, 2.0))
    assert narrow[0].tolist() == pytest.approx([0.0, 0.0, 1.2, 0.0, 0.0])


def test_the_geometric_mean_ratio_band_masks_whole_sequences():
    # per-token log-ratios whose means are 0.05 and 0.2: geometric means e^0.05 = 1.051 and e^0.2 = 1.221
    old = torch.tensor([[0.1, 0.0, 0.05], [0.4, 0.0, 0.2]])
    weight, _ = rollout_correction(
        old, torch.zeros(2, 3), torch.ones(2, 3), "mis", "geometric", band=(0.9, 1.1)
    )
    assert weight.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    wide, _ = rollout_correction(old, torch.zeros(2, 3), torch.ones(2, 3), "mis", "geometric")  # [1/2, 2]
    assert wide.sum().item() == 6


def test_the_masks_compose_with_the_loss_and_tis():
    logp = torch.zeros(2, 2, requires_grad=True)
    old = torch.zeros(2, 2)
    rollout = torch.tensor([[0.5, 0.5], [0.5, 0.5]])  # the engine drifted 0.5 a token from both rows
    advantages = torch.tensor([-1.0, 1.0])
    settings = LossSettings(
        agg="token-mean", correction=RolloutCorrection(mode="tis", cap=2.0), off_policy_mask=0.1
    )
    loss, metrics = policy_loss(
        "ppo_clip", LossBatch(logp, old, advantages, torch.ones(2, 2), rollout_logp=rollout), settings
    )
    loss.backward()
    # tis weight min(e^-0.5, 2) = 0.6065 on every token; the negative row masked: gradient only on row 2
    w = math.exp(-0.5)
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -w / 4, -w / 4])
    assert loss.item() == pytest.approx(-w / 2)  # row 2's two tokens, -A r w each, over 4 tokens
    assert metrics["off_policy_mask/masked_sequence_fraction"] == pytest.approx(0.5)


def test_bad_bands_and_thresholds_are_config_errors():
    from everyprompt.config import ConfigError, load_config

    for override, expected in [
        ("rl.rollout_correction.band=[2.0, 1.0]", "expected [low, high] with 0 <= low < high"),
        ("rl.off_policy_mask=0", "greater than 0"),
        ("rl.off_policy_mask=-1", "greater than 0"),
    ]:
        with pytest.raises(ConfigError, match=re_escape(expected)):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="band applies to mode mis or icepop, not mode=tis"):
        load_config(None, ["rl.rollout_correction.band=[0.5, 2.0]"])  # the demo's correction is tis
    config = load_config(None, ["rl.rollout_correction.mode=icepop", "rl.off_policy_mask=0.5"])
    assert config.rl.rollout_correction.band is None and config.rl.off_policy_mask == 0.5


def re_escape(text: str) -> str:
    return re.escape(text)
