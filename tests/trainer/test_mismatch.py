"""The train-inference mismatch through a run: router replay (R2, R3) in the trainer, the mismatch metrics
by hand and as logged, and fp8 rollouts, refused where their log-probs would stand for the old policy's."""

import json
import math

import pytest
import torch

from everyprompt.pipeline import Run, train
from tests.conftest import tiny_config


@pytest.mark.parametrize("pack", ["true", "false"])
def test_r3_replays_the_engines_routes_in_the_trainer(tmp_path, pack):
    """Engine routes ride in the batch; the replayed old-policy pass matches the engine and uses them."""
    config = tiny_config("rl.router_replay=r3", "rl.old_logprobs=recompute", f"model.pack_sequences={pack}")
    trainer = Run(config, tmp_path).trainer()
    batch = trainer.rollout.next_batch(0)
    layers, top_k = trainer.model.config.num_hidden_layers, trainer.model.config.num_experts_per_tok
    for prompt, completion, routes in zip(batch.prompt_ids, batch.completion_ids, batch.routed_experts):
        assert routes.shape == (len(prompt) + len(completion) - 1, layers, top_k)
    data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
    recorded = []
    with torch.no_grad():
        logp, _ = trainer.learner.forward(data, slice(None), False, recorded, "routes")
    engine = torch.cat([r for r in batch.rollout_logprobs])
    torch.testing.assert_close(
        torch.cat(batch.completion_values(list(range(len(batch))), logp)), engine, atol=1e-5, rtol=0
    )
    for used, given in zip(recorded, batch.routed_experts):
        n = len(given)
        assert torch.equal(used[:n].long().sort(-1).values, given.long().sort(-1).values)  # agreement 1.0


def test_r2_needs_the_old_policy_pass():
    from everyprompt.config import ConfigError

    with pytest.raises(ConfigError, match="set rl.old_logprobs=recompute or use r3"):
        tiny_config("rl.router_replay=r2", "rl.old_logprobs=rollout")


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_mismatch_metrics_are_logged_with_the_old_policy_pass(tmp_path, replay):
    config = tiny_config("rl.steps=1", "rl.old_logprobs=recompute", f"rl.router_replay={replay}")
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["mismatch/logp_abs_diff"] < 1e-4  # fp32 engine and trainer, same weights
    assert abs(line["mismatch/k3_kl"]) < 1e-6 and line["mismatch/ratio_above_2"] == 0
    assert line["mismatch/routing_agreement"] == 1.0 and line["mismatch/flipped_token_fraction"] == 0


def test_mismatch_metrics_hand_computed():
    from everyprompt.trainer.learner_side.mismatch import mismatch_metrics

    engine_routes = [torch.tensor([[[0, 1]], [[2, 3]], [[0, 2]]], dtype=torch.int16)]  # 3 fed tokens, 1 layer
    trainer_routes = [torch.tensor([[[1, 0]], [[2, 3]], [[0, 3]]], dtype=torch.int16)]  # last token flipped
    metrics = mismatch_metrics(
        [2],  # prompt of 2 tokens, completion of 2
        [torch.tensor([-1.0, -2.0 + math.log(3)])],  # trainer: second token's ratio is 3
        [torch.tensor([-1.0, -2.0])],
        trainer_routes,
        engine_routes,
    )
    # |dlogp| = (0 + ln 3) / 2; k3 = ((1 - 1 - 0) + (3 - 1 - ln 3)) / 2; ratio > 2 on 1 of 2 tokens
    assert metrics["mismatch/logp_abs_diff"] == pytest.approx(math.log(3) / 2)
    assert metrics["mismatch/k3_kl"] == pytest.approx((2 - math.log(3)) / 2)
    assert metrics["mismatch/ratio_above_2"] == 0.5
    # pairs: token 0 same set {0,1}, token 1 same, token 2 {0,2} vs {0,3} differs -> 2 of 3
    assert metrics["mismatch/routing_agreement"] == pytest.approx(2 / 3)
    # completion targets are predicted from fed tokens 1 and 2: token 2 flipped -> the second target
    assert metrics["mismatch/flipped_token_fraction"] == 0.5
    assert metrics["mismatch/logp_abs_diff_flipped"] == pytest.approx(math.log(3))
    assert metrics["mismatch/logp_abs_diff_unflipped"] == 0.0


def test_fp8_rollouts_with_rollout_logprobs_are_refused():
    from everyprompt.config import ConfigError

    with pytest.raises(ConfigError, match="with rollout.precision=fp8 set rl.old_logprobs=recompute"):
        tiny_config("rollout.precision=fp8")  # the demo config uses rl.old_logprobs=rollout


def test_fp8_rollouts_show_in_the_mismatch_metrics(tmp_path):
    config = tiny_config("rl.steps=1", "rl.old_logprobs=recompute", "rollout.precision=fp8")
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["mismatch/logp_abs_diff"] > 1e-4  # fp8 engine vs fp32 trainer: measured, not hidden
