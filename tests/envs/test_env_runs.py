"""`env.name` in a run: RL on episodes end to end (tiny chat model), and the settings it refuses."""

from __future__ import annotations

import json

import pytest

from everyprompt.cli import main
from everyprompt.config import ConfigError
from everyprompt.envs import StepResult, register_environment
from everyprompt.pipeline import train
from tests.conftest import TINY_OVERRIDES, tiny_config


@register_environment("test-answer-once")
class AnswerOnce:
    """Ends the model's first turn at a space (a random model writes one within a few tokens), answers it
    once with a tool message, and rewards the second turn by its length's parity (a signal that varies),
    scaled to 0.01: a value no 0/1 reward of the configured `rewards` could average to in a step of 8."""

    stop = (" ",)
    REWARD = 0.01

    def __init__(self, reply: str = "ok"):
        self.reply, self.turns = reply, 0

    def init(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "tool", "content": self.reply}])
        return StepResult([], reward=self.REWARD * (len(action) % 2), done=True)


EPISODES = (
    "model.preset=tiny-chat-moe",
    "env.name=test-answer-once",
    "sft.steps=0",
    "rollout.max_new_tokens=24",
)


def test_rl_on_episodes_trains_on_the_model_tokens_with_the_environments_reward(tmp_path, capsys):
    train(
        tiny_config(
            *EPISODES,
            "rl.steps=2",
            "rl.group_size=4",
            "env.options={reply: fine}",
            "rollout.max_new_tokens=40",
        ),
        run_dir=tmp_path,
    )
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "RL prompt 1 as the model sees it (env.name=test-answer-once):" in shown
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert any(line["rollout/environment_tokens"] > 0 for line in lines)  # observations were fed ...
    # ... each step's in a forward or a few (one for the rows whose environments answered together)
    fed = [line for line in lines if line["rollout/environment_tokens"] > 0]
    assert all(0 < line["rollout/extends"] <= line["rollout/environment_tokens"] for line in fed)
    assert all(line["rollout/extend_s"] > 0 for line in fed)
    assert all(line["rollout/environment_tokens"] < line["rollout/tokens"] for line in lines)
    # the environment's reward (0 or 0.01 an episode), not the math reward's 0 or 1
    assert all(0.0 <= line["reward/mean"] <= AnswerOnce.REWARD for line in lines)
    assert any(line["reward/mean"] > 0 for line in lines)
    assert all(line["reward/none_fraction"] == 0.0 for line in lines)


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("rollout.engine=hf", "native engine, not with rollout.engine=hf"),
        ("rollout.partial=true", "not with rollout.partial=true"),
        ("zve.filter.enabled=true", "not with zve.filter.enabled=true"),
        ("data.format=plain", "data.format=plain and data.system_prompt do not apply"),
    ],
)
def test_settings_episodes_cannot_run_with_are_config_errors(setting, says):
    with pytest.raises(ConfigError, match=says):
        tiny_config(*EPISODES, setting)


def test_an_unknown_environment_or_option_stops_the_run_with_exit_2(tmp_path, capsys):
    code = main(
        [
            "train",
            *TINY_OVERRIDES,
            *EPISODES[:1],
            "sft.steps=0",
            "env.name=nope",
            "--run-dir",
            str(tmp_path / "a"),
        ]
    )
    assert code == 2 and "unknown environment 'nope'" in capsys.readouterr().err
    bad = ["env.name=test-answer-once", "env.options={colour: red}"]
    code = main(
        ["train", *TINY_OVERRIDES, *EPISODES[:1], "sft.steps=0", *bad, "--run-dir", str(tmp_path / "b")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "env.options" in err and "colour" in err and "Traceback" not in err


@register_environment("test-raises")
class Raises(AnswerOnce):
    """Answers the first turn, then raises: every episode that reaches a second turn fails."""

    def step(self, action):
        if self.turns:
            raise ValueError("broken tool")
        return super().step(action)


def test_an_environment_that_raises_costs_its_episodes_reward_never_the_run(tmp_path, caplog):
    train(tiny_config(*EPISODES, "env.name=test-raises", "rl.steps=2", "rl.group_size=4"), run_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and sum(line.get("env/errors", 0) for line in lines) > 0
    assert any(line["reward/none_fraction"] > 0 for line in lines)
    assert (
        "ended by their environment raising, the first: Raises.step raised ValueError: broken tool"
        in caplog.text
    )


def test_held_out_evaluation_runs_the_episodes_and_takes_their_reward():
    from everyprompt.envs.episode import Episodes
    from everyprompt.evaluate import evaluate
    from everyprompt.models import load_model_and_tokenizer
    from everyprompt.rollout.native import NativeEngine

    config = tiny_config(*EPISODES)
    model, tokenizer = load_model_and_tokenizer(config.model, seed=0)
    engine = NativeEngine.from_model(model, tokenizer, 4)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)]
    kept: list = []

    def never_called(*_a, **_k):
        raise AssertionError("an episode's reward is its environment's")

    episodes = Episodes("test-answer-once", {"reply": "okay"}, tokenizer)
    results = evaluate(
        engine, tokenizer, rows, never_called, max_new_tokens=24, completions=kept, episodes=episodes
    )
    assert results["num_prompts"] == 6
    assert [r["prompt"] for r in kept] == [tokenizer.decode(episodes.start(row).prompt_ids) for row in rows]
    assert any("okay" in r["completion"] for r in kept)  # the tool's reply was fed
    assert all(r["reward"] in (0.0, AnswerOnce.REWARD) for r in kept)
    assert results["greedy_accuracy"] == 0.0  # a pass needs a reward of 1


def test_an_engine_that_cannot_run_episodes_is_refused_before_any_runs():
    """`rollout.engine=auto` picks hf for a model the native engine does not run: the episodes would be
    refused at the first generate call; they are refused when the run builds them."""
    from everyprompt.envs import EnvironmentSetupError
    from everyprompt.envs.episode import Episodes
    from everyprompt.models import load_model_and_tokenizer
    from everyprompt.rollout.hf import HFEngine
    from everyprompt.rollout.native import NativeEngine

    config = tiny_config(*EPISODES)
    model, tokenizer = load_model_and_tokenizer(config.model, seed=0)
    with pytest.raises(EnvironmentSetupError, match="needs a rollout engine that runs episodes.*HFEngine"):
        Episodes.from_config(config, tokenizer, HFEngine.from_model(model, tokenizer, 1))
    assert Episodes.from_config(config, tokenizer, NativeEngine.from_model(model, tokenizer, 1)).stop == (
        " ",
    )


@register_environment("test-sleeps")
class Sleeps(AnswerOnce):
    """Takes 3 s over every turn: past a time limit of 0.3 s."""

    def step(self, action):
        import time

        time.sleep(3)
        return super().step(action)


def test_an_environment_past_env_time_limit_s_costs_its_episode_never_the_run(tmp_path, caplog):
    train(
        tiny_config(
            *EPISODES, "env.name=test-sleeps", "env.time_limit_s=0.3", "rl.steps=1", "rl.group_size=4"
        ),
        run_dir=tmp_path,
    )
    (line,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["env/errors"] > 0 and line["reward/none_fraction"] > 0
    assert "the environment took longer than its time limit of 0.3 s" in caplog.text
