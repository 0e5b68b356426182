"""`eval.reward`: the held-out answers judged by another reward than the training one."""

import json

import pytest

from everyprompt.evaluate import held_out_rewards
from everyprompt.pipeline import Run, train
from everyprompt.rewards import RewardError
from tests.conftest import tiny_config


def test_the_held_out_reward_replaces_the_training_one_and_its_components():
    config = tiny_config("eval.reward=math")  # trained on tests.trainer.flaky_reward:scattered
    assert held_out_rewards(config).function == "math" and held_out_rewards(config).components == []
    assert held_out_rewards(config).timeout_s == config.rewards.timeout_s  # the pool's settings stay
    plain = tiny_config()
    assert held_out_rewards(plain) is plain.rewards


def test_a_held_out_reward_that_does_not_resolve_stops_the_run_before_training(tmp_path):
    with pytest.raises(RewardError, match="nowhere"):
        Run(tiny_config("eval.reward=nowhere.at_all:reward"), tmp_path).trainer()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_trained_on_one_reward_is_evaluated_by_another(tmp_path):
    # trained on a reward that pays 1 for everything; judged by the math reward, which the random tiny
    # model never earns: the held-out accuracy says so
    config = tiny_config(
        "rl.steps=1", "eval.reward=math", "rewards.function=tests.trainer.flaky_reward:always"
    )
    train(config, run_dir=tmp_path)
    final = json.loads((tmp_path / "eval.json").read_text())
    assert final["greedy_accuracy"] == 0.0
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("reward/mean") == 1.0 for m in history)


def test_the_simulated_reward_models_misjudge_equally_often():
    from bench.evidence import rewards as sim

    assert sim.WRONG_CALL == pytest.approx(0.0478, abs=1e-4)  # P(N(0, 0.3^2) > 0.5), by hand
    texts = [f"the answer is {i % 2}" for i in range(4000)]
    answers = ["1"] * len(texts)  # every other completion right
    prompts = [f"q{i}" for i in range(len(texts))]
    scalar = sim.scalar_rm(texts, answer=answers, prompt=prompts)
    verdicts = sim.genrm(texts, answer=answers, prompt=prompts)
    right = [i % 2 == 1 for i in range(len(texts))]
    scalar_wrong = sum((s > 0.5) != r for s, r in zip(scalar, right)) / len(texts)
    genrm_wrong = sum((v > 0) != r for v, r in zip(verdicts, right)) / len(texts)
    assert abs(scalar_wrong - sim.WRONG_CALL) < 0.012 and abs(genrm_wrong - sim.WRONG_CALL) < 0.012
    assert set(verdicts) == {1.0, -1.0}
    # a fixed function of (question, response): the same response scores the same
    assert sim.scalar_rm(texts[:8], answer=answers[:8], prompt=prompts[:8]) == scalar[:8]
