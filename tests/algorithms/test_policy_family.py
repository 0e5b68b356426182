"""Hand-computed values for GSPO, GSPO-token, CISPO, ESPO, the KL estimators and rollout corrections."""

import math

import pytest
import torch

from everyprompt.algorithms import (
    LossBatch,
    LossSettings,
    RolloutCorrection,
    entropy_groups,
    kl_penalty,
    policy_loss,
    policy_loss_spec,
    register_policy_loss,
    rollout_correction,
)


def test_gspo_hand_computed():
    # sequence log-ratios: mean(0.2, 0.4) = 0.3 -> s1 = e^0.3 = 1.34986; mean(0.0, -0.3) = -0.15 -> s2 = 0.86071
    # clip range [0.8, 1.2]: seq 1, A = +1: -min(1.34986, 1.2) = -1.2 (clipped)
    #                        seq 2, A = -1: -min(-0.86071, -0.86071) = 0.86071 (inside)
    # seq-mean-token-mean: (-1.2 + 0.86071) / 2 = -0.16965
    logp = torch.tensor([[0.2, 0.4], [0.0, -0.3]])
    loss, metrics = policy_loss(
        "gspo",
        LossBatch(logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2)),
        clip_low=0.2,
        clip_high=0.2,
    )
    assert loss.item() == pytest.approx((-1.2 + math.exp(-0.15)) / 2, abs=1e-6)
    assert metrics["actor/clip_fraction"] == pytest.approx(0.5)
    assert policy_loss_spec("gspo").default_agg == "seq-mean-token-mean"


def test_gspo_default_clip_is_the_papers_tight_range():
    # e^0.3 with A = +1 is clipped at 1 + 4e-4; e^-0.15 with A = -1 at 1 - 3e-4: (-1.0004 + 0.9997) / 2
    logp = torch.tensor([[0.2, 0.4], [0.0, -0.3]])
    loss, _ = policy_loss(
        "gspo", LossBatch(logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    )
    assert loss.item() == pytest.approx((-1.0004 + 0.9997) / 2, abs=1e-7)


def test_gspo_token_equals_gspo_in_value_and_gradient():
    generator = torch.Generator().manual_seed(3)
    base = 0.05 * torch.randn(4, 6, generator=generator)
    old = torch.zeros(4, 6)
    advantages = torch.randn(4, generator=generator)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    grads, values = [], []
    for name in ("gspo", "gspo_token"):
        logp = base.clone().requires_grad_(True)
        loss, _ = policy_loss(name, LossBatch(logp, old, advantages, mask), clip_low=0.2, clip_high=0.2)
        loss.backward()
        grads.append(logp.grad)
        values.append(loss.detach())
    torch.testing.assert_close(values[0], values[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_cispo_hand_computed():
    # r = e^0.5 = 1.6487, e^-0.5 = 0.6065, e^0.1 = 1.1052; weight = sg[clip(r, 0, 1.28)] = 1.28, 0.6065, 1.1052
    # token loss -w A logp: -1.28*1*0.5 = -0.64; -0.6065*(-1)*(-0.5) = -0.30327; -1.1052*2*0.1 = -0.22103
    logp = torch.tensor([[0.5, -0.5, 0.1]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    loss, metrics = policy_loss("cispo", LossBatch(logp, torch.zeros(1, 3), advantages, torch.ones(1, 3)))
    expected = (-1.28 * 0.5 - math.exp(-0.5) * 0.5 - math.exp(0.1) * 0.2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d/dlogp = -w A / 3: the clipped token keeps a gradient (unlike PPO-clip)
    expected_grad = torch.tensor([[-1.28, math.exp(-0.5), -2 * math.exp(0.1)]]) / 3
    torch.testing.assert_close(logp.grad, expected_grad)
    assert metrics["actor/clip_fraction"] == pytest.approx(1 / 3)


def test_entropy_groups():
    entropy = torch.tensor([[0.1, 0.9, 0.3, 0.2, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    # K = 2, high_frac 0.2: ceil(5 * 0.2) = 1 token (0.9) high; masked position -1
    assert entropy_groups(entropy, mask, 2, 0.2).tolist() == [[1, 0, 1, 1, 1, -1]]
    # high_frac 0.5: ceil(2.5) = 3 tokens: 0.9, 0.5, 0.3
    assert entropy_groups(entropy, mask, 2, 0.5).tolist() == [[1, 0, 0, 1, 0, -1]]
    # K = 3 equal-count bins over ranks 0..4 (0.9, 0.5, 0.3, 0.2, 0.1): floor(3 rank / 5) = 0, 0, 1, 1, 2
    assert entropy_groups(entropy, mask, 3, 0.2).tolist() == [[2, 0, 1, 1, 0, -1]]


def _espo_inputs():
    # two copies of one 5-token sequence (+1 masked column of garbage), advantages +1 and -1
    log_ratio = torch.tensor([0.1, 0.2, -0.1, 0.0, 0.2, 9.0])
    entropy = torch.tensor([0.1, 0.9, 0.3, 0.2, 0.5, 9.0])
    mask = torch.tensor([1.0, 1, 1, 1, 1, 0])
    return log_ratio.repeat(2, 1), entropy.repeat(2, 1), mask.repeat(2, 1), torch.tensor([1.0, -1.0])


def test_espo_hand_computed():
    # high group {t1} (H 0.9): s_h = e^0.2 = 1.22140, eps_h = 0.02 * 0.9 / ln 100 = 0.0039087
    # low group {t0,t2,t3,t4}: mean lr = 0.2/4 = 0.05, s_l = e^0.05 = 1.05127,
    #                         eps_l = 0.02 * mean(0.1, 0.3, 0.2, 0.5) / ln 100 = 0.0011943
    # A = +1: both groups clipped: (-(1 + eps_h) - (1 + eps_l)) / 2 = -1.0025515
    # A = -1: pessimistic side is unclipped: (1.22140 + 1.05127) / 2 = 1.1363370
    # mean over sequences: (-1.0025515 + 1.1363370) / 2 = 0.0668928
    log_ratio, entropy, mask, advantages = _espo_inputs()
    logp = log_ratio.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        "espo",
        LossBatch(logp, torch.zeros(2, 6), advantages, mask, entropy=entropy),
        LossSettings(vocab_size=100),
    )
    eps_h = 0.02 * 0.9 / math.log(100)
    eps_l = 0.02 * 0.275 / math.log(100)
    seq1 = (-(1 + eps_h) - (1 + eps_l)) / 2
    seq2 = (math.exp(0.2) + math.exp(0.05)) / 2
    assert loss.item() == pytest.approx((seq1 + seq2) / 2, abs=1e-6)
    assert metrics["espo/clip_fraction_high"] == pytest.approx(0.5)
    assert metrics["espo/clip_fraction_low"] == pytest.approx(0.5)
    assert metrics["espo/epsilon_high"] == pytest.approx(eps_h)
    assert metrics["espo/epsilon_low"] == pytest.approx(eps_l)
    assert metrics["espo/group_size_high"] == pytest.approx(1.0)
    assert metrics["espo/group_size_low"] == pytest.approx(4.0)
    # gradient (GSPO-token form, sg[pi] denominator): d/dlogp_t = -A s_tau * (1 / (|tau| K)) / sequences
    # seq 1 clipped -> 0; seq 2: high 1.22140 * 1/2 / 2 = 0.30535, low 1.05127 * 1/8 / 2 = 0.06570
    loss.backward()
    expected = torch.zeros(2, 6)
    expected[1, :5] = math.exp(0.05) / 16
    expected[1, 1] = math.exp(0.2) / 4
    torch.testing.assert_close(logp.grad, expected)


def test_espo_old_denominator_multiplies_the_token_ratio():
    # ratio_denominator "old": token ratio = s_tau * exp(logp - old); A = -1, loss = max(r, clip(r)):
    # high: 1.22140 * e^0.2 = 1.49182
    # low (s_l = 1.05127): e^0.1 -> 1.16183; e^-0.1 -> 0.95123, below 1 - eps_l so 0.99881; e^0 -> 1.05127;
    #                      e^0.2 -> 1.28403; mean 1.12399.  Sequence: (1.49182 + 1.12399) / 2 = 1.30790
    log_ratio, entropy, mask, _ = _espo_inputs()
    loss, _ = policy_loss(
        "espo",
        LossBatch(log_ratio[:1], torch.zeros(1, 6), torch.tensor([-1.0]), mask[:1], entropy=entropy[:1]),
        LossSettings(vocab_size=100),
        ratio_denominator="old",
    )
    eps_l = 0.02 * 0.275 / math.log(100)
    low = sum(max(math.exp(0.05 + x), 1 - eps_l) for x in (0.1, -0.1, 0.0, 0.2)) / 4
    assert loss.item() == pytest.approx((math.exp(0.4) + low) / 2, abs=1e-6)


def test_espo_without_entropy_is_a_clear_error():
    log_ratio, _, mask, advantages = _espo_inputs()
    with pytest.raises(ValueError, match="needs per-token entropies"):
        policy_loss(
            "espo", LossBatch(log_ratio, torch.zeros(2, 6), advantages, mask), LossSettings(vocab_size=100)
        )


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([[0.5, -0.5]]), torch.zeros(1, 2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -0.5]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.125, 0.125]]))
    # k3 = e^{-d} - 1 + d: e^-0.5 - 0.5 = 0.106531; e^0.5 - 1.5 = 0.148721
    k3 = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(k3, torch.tensor([[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]]))
    with pytest.raises(KeyError, match="valid: k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_term_is_added_to_the_loss():
    # zero advantages: the loss is kl_coef * mean k2 = 0.1 * 0.125
    logp = torch.tensor([[0.5, -0.5]])
    loss, metrics = policy_loss(
        "ppo_clip",
        LossBatch(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=torch.zeros(1, 2)),
        LossSettings(kl="k2", kl_coef=0.1),
    )
    assert loss.item() == pytest.approx(0.0125)
    assert metrics["actor/kl_ref"] == pytest.approx(0.125)


def test_rollout_corrections_hand_computed():
    # old - rollout = 0, 1, -1 -> rho = 1, e = 2.718, 1/e = 0.368; C = 2
    old = torch.tensor([[0.0, 0.0, -1.0]])
    rollout = torch.tensor([[0.0, -1.0, 0.0]])
    mask = torch.ones(1, 3)
    tis, metrics = rollout_correction(old, rollout, mask, "tis", "token", 2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, math.exp(-1.0)]]))
    assert metrics["rollout_correction/tis_affected_fraction"] == pytest.approx(1 / 3)
    mis, _ = rollout_correction(old, rollout, mask, "mis", "token", 2.0)
    torch.testing.assert_close(mis, torch.tensor([[1.0, 0.0, 0.0]]))
    # sequence level: sum of log-ratios = 0 -> rho = 1 for every token
    seq, _ = rollout_correction(old, rollout, mask, "tis", "sequence", 2.0)
    torch.testing.assert_close(seq, torch.ones(1, 3))
    with pytest.raises(KeyError, match="valid: tis, mis"):
        rollout_correction(old, rollout, mask, "is", "token", 2.0)


def test_correction_weights_scale_the_token_loss():
    # ppo_clip with r = 1 and A = 1: token loss -1 each; MIS drops the middle token: (-1 + 0 - 1) / 3
    logp = torch.zeros(1, 3)
    loss, _ = policy_loss(
        "ppo_clip",
        LossBatch(logp, logp, torch.ones(1), torch.ones(1, 3), rollout_logp=torch.tensor([[0.0, -1.0, 0.0]])),
        LossSettings(correction=RolloutCorrection(mode="mis")),
    )
    assert loss.item() == pytest.approx(-2 / 3)


def test_registry_rejects_duplicates_and_names_the_valid_losses():
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("espo")(lambda *a, **k: None)
    with pytest.raises(
        KeyError, match="valid: cispo, dppo_kl, dppo_tv, espo, gspo, gspo_token, ppo_clip, sapo"
    ):
        policy_loss("nope", LossBatch(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1)))


def test_gspo_takes_the_mean_of_token_advantages_as_the_sequence_advantage():
    """RL-ZVP gives token advantages; GSPO's one ratio per sequence then weighs their mean (docs/algorithms.md).
    ratio 1 everywhere: loss = -mean over sequences of A_seq = -((0.1 + 0.3) / 2 + (-0.2)) / 2 = 0.0;
    with only the first token's advantage it would be -(0.1 - 0.2) / 2 = 0.05."""
    logp = torch.zeros(2, 3)
    advantages = torch.tensor([[0.1, 0.3, 9.0], [-0.2, -0.2, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the 9.0 sits off the mask
    loss, _ = policy_loss("gspo", LossBatch(logp, logp, advantages, mask))
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    constant, _ = policy_loss("gspo", LossBatch(logp, logp, torch.tensor([0.4, -0.2]), mask))
    assert constant.item() == pytest.approx(-(0.4 - 0.2) / 2)


def test_loss_options_are_checked_against_the_losss_schema():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"loss option 'clip_lo'.*options of this loss: clip_low, clip_high"):
        policy_loss("ppo_clip", LossBatch(logp, logp, torch.ones(1), torch.ones(1, 2)), clip_lo=0.1)
    with pytest.raises(ValueError, match="loss option 'alpha'"):
        policy_loss(
            "espo",
            LossBatch(logp, logp, torch.ones(1), torch.ones(1, 2), entropy=logp),
            LossSettings(vocab_size=10),
            alpha=-1,
        )


def test_a_user_loss_gets_its_options_from_loss_options_through_its_schema():
    from pydantic import Field

    from everyprompt.algorithms import registry
    from everyprompt.algorithms.registry import LossOptions
    from everyprompt.config import ConfigError
    from tests.conftest import tiny_config

    class ScaleOptions(LossOptions):
        scale: float = Field(2.0, gt=0, description="Multiplies the advantage.")

    @register_policy_loss("test_scaled", options=ScaleOptions)
    def scaled(batch, *, scale):
        return -scale * batch.advantages * batch.logp, {}

    try:
        assert tiny_config("rl.loss=test_scaled").rl.loss_kwargs() == {"scale": 2.0}
        assert tiny_config("rl.loss=test_scaled", "rl.loss_options={scale: 3}").rl.loss_kwargs() == {
            "scale": 3.0
        }
        with pytest.raises(ConfigError, match="loss option 'scale'"):
            tiny_config("rl.loss=test_scaled", "rl.loss_options={scale: -1}")
        with pytest.raises(ConfigError, match=r"takes its options from rl.ppo.\*, not rl.loss_options"):
            tiny_config("rl.loss=ppo_clip", "rl.loss_options={clip_low: 0.1}")
        # ppo_clip's options come from rl.ppo, ESPO's from rl.espo, each with the schema's defaults
        assert tiny_config("rl.ppo.clip_high=0.3").rl.loss_kwargs() == {
            "clip_low": 0.2,
            "clip_high": 0.3,
            "dual_clip": None,
        }
        assert tiny_config("rl.loss=espo").rl.loss_kwargs()["alpha"] == 0.02
    finally:
        registry._POLICY_LOSSES.pop("test_scaled")
