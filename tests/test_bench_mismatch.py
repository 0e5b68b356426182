"""The mismatch bench (bench/engine/mismatch.py) and its analysis of flipped tokens (bench/engine/mismatch_analysis.py)."""

import json

import pytest

from tests.test_bench import _load


def test_mismatch_bench_smoke(tmp_path, capsys):
    import torch

    bench = _load("engine.mismatch")
    assert bench.main(["--tiny", "--batches", "1", "--rl-steps", "1", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "mismatch.json").read_text())
    cells = {(c["precision"], c["replay"]): c for c in payload["cells"]}
    assert len(cells) == 6
    for precision in ("fp32", "bf16", "fp8"):
        assert cells[(precision, "r3")]["mismatch/routing_agreement"] == 1.0  # replay: by construction
    assert cells[("fp8", "off")]["mismatch/logp_abs_diff"] > cells[("fp32", "off")]["mismatch/logp_abs_diff"]
    assert cells[("fp8", "r3")]["rl"]["all_finite"]
    # below fp32 both cells keep their per-token data for further analysis
    for precision in ("bf16", "fp8"):
        for replay in ("off", "r3"):
            tokens = torch.load(tmp_path / "mismatch_runs" / f"{precision}_{replay}" / "tokens.pt")
            assert tokens["perturbation_layers"].shape == tokens["flipped_layers"].shape
            assert len(tokens["diff"]) == len(tokens["logprob"]) == len(tokens["entropy"])
    assert "mismatch per precision and replay mode" in capsys.readouterr().out


def test_flipped_token_analysis_matches_on_entropy():
    import torch

    bench = _load("engine.mismatch")
    # unflipped tokens: |dlogp| = entropy / 10; flipped: twice that. The raw means mix entropies (the
    # flipped sit at high entropy), the entropy-matched ratio recovers the factor 2 exactly.
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.9, 1.0])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[10:] = True
    diff = entropy / 10 * torch.where(mask, 2.0, 1.0)
    out = bench.flipped_token_analysis(diff, mask, entropy, neighbours=2, resamples=50)
    assert out["flipped_tokens"] == 2 and out["tokens"] == 12
    assert out["logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.19)
    assert out["logp_abs_diff_on_off_unflipped_tokens"] == pytest.approx(0.055)
    # the 2 nearest unflipped entropies of 0.9 are 0.8, 0.9 (mean diff 0.085); of 1.0: 0.9, 1.0 (0.095)
    assert out["logp_abs_diff_entropy_matched_unflipped"] == pytest.approx(0.09)
    assert out["flipped_over_matched_ratio"] == pytest.approx(0.19 / 0.09)
    # torch's median of an even count is the lower middle value
    assert out["median_logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.18)
    assert out["median_logp_abs_diff_on_off_unflipped_tokens"] == pytest.approx(0.05)
    low, high = out["flipped_over_matched_ratio_ci95"]
    assert low <= 0.19 / 0.09 <= high


def test_flipped_token_analysis_matches_on_router_perturbation():
    import torch

    bench = _load("engine.mismatch")
    # |dlogp| = perturbation / 10 for every token, flipped or not; the two flipped tokens sit at the two
    # largest perturbations. Raw means say flipped tokens are worse (0.095 vs 0.055); matched on the
    # perturbation (nearest neighbour: the unflipped token with the same one) they are not: ratio 1.
    perturbation = torch.cat([torch.arange(1, 11) / 10, torch.tensor([0.9, 1.0])])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[10:] = True
    entropy = torch.ones(12)
    out = bench.flipped_token_analysis(
        perturbation / 10, mask, entropy, perturbation, neighbours=1, resamples=50
    )
    assert out["logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.095)
    assert out["logp_abs_diff_on_off_unflipped_tokens"] == pytest.approx(0.055)
    assert out["router_perturbation_flipped"] == pytest.approx(0.95)
    assert out["router_perturbation_unflipped"] == pytest.approx(0.55)
    assert out["logp_abs_diff_perturbation_matched_unflipped"] == pytest.approx(0.095)
    assert out["flipped_over_perturbation_matched_ratio"] == pytest.approx(1.0)
    assert out["flipped_over_perturbation_matched_ratio_ci95"] == pytest.approx([1.0, 1.0])


def test_flipped_token_analysis_matches_on_the_sampled_log_prob_and_caps_outliers():
    import torch

    bench = _load("engine.mismatch")
    # |dlogp| = -logprob / 100 for every token (a rarer sample moves more under the same logit error);
    # the two flipped tokens are the two rarest samples. Entropy and perturbation are equal everywhere,
    # so only the log-prob separates them: matched on all three, the ratio is exactly 1.
    logprob = -torch.cat([torch.arange(1, 11).float(), torch.tensor([9.0, 10.0])])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[10:] = True
    same = torch.ones(12)
    out = bench.flipped_token_analysis(-logprob / 100, mask, same, same, logprob, neighbours=1, resamples=50)
    assert out["logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.095)
    assert out["logp_abs_diff_perturbation_matched_unflipped"] != pytest.approx(0.095)  # blind to log-prob
    assert out["logp_abs_diff_fully_matched_unflipped"] == pytest.approx(0.095)
    assert out["flipped_over_fully_matched_ratio"] == pytest.approx(1.0)
    assert out["flipped_over_fully_matched_ratio_ci95"] == pytest.approx([1.0, 1.0])
    # the rarest flipped sample made an outlier (|dlogp| 5 instead of 0.10): the mean ratio jumps to
    # (0.09 + 5) / (0.09 + 0.10); capped at the 10/11 quantile of the 12 values (0.10, the largest
    # ordinary one) it is 1 again
    diff = -logprob / 100
    diff[11] = 5.0
    out = bench.flipped_token_analysis(
        diff, mask, same, same, logprob, neighbours=1, resamples=50, cap_quantile=10 / 11
    )
    assert out["flipped_over_fully_matched_ratio"] == pytest.approx((0.09 + 5.0) / (0.09 + 0.10))
    assert out["logp_abs_diff_cap"] == pytest.approx(0.10)
    assert out["flipped_over_fully_matched_ratio_capped"] == pytest.approx(1.0)


def test_downstream_ratio_by_hand():
    import torch

    bench = _load("engine.mismatch")
    perturbation = torch.tensor(
        [
            [1.0, 1.0, 1.0],  # unflipped
            [1.0, 3.0, 1.0],  # unflipped: per-layer control means [1, 2, 1]
            [5.0, 4.0, 2.0],  # first flip at layer 0: layers 1, 2 count, 4 + 2 against 2 + 1
            [0.0, 0.0, 3.0],  # first flip at layer 1: layer 2 counts, 3 against 1
            [9.0, 9.0, 9.0],  # flips only at the last layer: nothing after it, left out
        ]
    )
    flipped = torch.tensor([[0, 0, 0], [0, 0, 0], [1, 0, 1], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert bench.downstream_ratio(perturbation, flipped) == pytest.approx((6 + 3) / (3 + 1))
    only_last = torch.zeros(5, 3, dtype=torch.bool)
    only_last[4, 2] = True
    assert bench.downstream_ratio(perturbation, only_last) != bench.downstream_ratio(perturbation, only_last)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_router_perturbation_is_the_engines_precision_error(tmp_path, precision):
    """The engine's router logits (recorded by the decode steps that sampled) against the trainer's under
    r3: equal for an fp32 engine (same network, same arithmetic up to kernel order), apart for fp8 weights."""
    import torch

    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    bench = _load("engine.mismatch")
    overrides = [*bench.TINY, "logging.progress=false", "logging.tensorboard=false", "sft.steps=0"]
    overrides += [f"rollout.precision={precision}", "rl.router_replay=r3", "rl.old_logprobs=recompute"]
    trainer = Run(load_config(None, overrides), tmp_path).trainer()
    engine_logits = bench.record_router_logits(trainer.engine)
    batch = trainer.rollout.next_batch(0)
    assert all((tuple(p), tuple(c)) in engine_logits for p, c in zip(batch.prompt_ids, batch.completion_ids))
    perturbation = bench.router_perturbation(trainer, batch, engine_logits)
    layers = trainer.model.config.num_hidden_layers
    assert perturbation.shape == (sum(len(c) for c in batch.completion_ids), layers)
    if precision == "fp32":
        assert float(perturbation.max()) < 1e-5
    else:
        assert float(perturbation.min()) > 1e-4
    assert bool(torch.isfinite(perturbation).all())
