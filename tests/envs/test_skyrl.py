"""skyrl-gym's environments in process (`env.name=skyrl:ID`): the adapter, skyrl-gym's data layout, and RL
on its gsm8k environments for a few steps on a tiny chat model."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("skyrl_gym", reason="skyrl-gym is the optional extra everyprompt[envs]")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from everyprompt.data.datasets import load_prompt_file  # noqa: E402
from everyprompt.envs import EnvironmentSetupError, make_environment  # noqa: E402
from everyprompt.envs.episode import Episodes  # noqa: E402
from everyprompt.pipeline import train  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def skyrl_rows(count: int) -> list[dict]:
    """Rows as skyrl-gym's gsm8k datasets are laid out: the prompt a conversation, the answer inside the
    reward spec."""
    return [
        {
            "data_source": "test",
            "prompt": [{"role": "user", "content": f"What is {n} + {n}?"}],
            "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": str(2 * n)},
            "extra_info": {"index": n},
        }
        for n in range(count)
    ]


def test_gsm8k_rewards_a_turn_by_skyrl_gyms_own_rule():
    env = make_environment("skyrl:gsm8k")
    row = skyrl_rows(4)[3]
    assert env.init(row) == [{"role": "user", "content": "What is 3 + 3?"}]
    result = env.step("3 and 3 make six, so #### 6")
    assert (result.reward, result.done, result.observations) == (1.0, True, [])
    env = make_environment("skyrl:gsm8k")
    env.init(row)
    assert env.step("The answer is 6").reward == 0.0  # no '#### ' line: skyrl-gym's strict rule


def test_gsm8k_multi_turn_answers_with_observations_until_right_or_out_of_turns():
    env = make_environment("skyrl:gsm8k_multi_turn", max_turns=3)
    env.init({"prompt": "What is 2 + 2?", "answer": "4"})  # an everyprompt row: the answer is the truth
    first = env.step("#### 5")
    # wrong but well formatted: skyrl-gym's format score, 0.2 over the turns; asked again as the user
    assert first.reward == pytest.approx(0.2 / 3) and not first.done
    assert [m["role"] for m in first.observations] == ["user"]
    assert "####" in first.observations[0]["content"]
    last = env.step("#### 4")
    assert (last.reward, last.done, last.observations) == (1.0, True, [])


def test_unknown_ids_bad_rows_and_a_missing_install_are_clear_setup_errors(monkeypatch):
    with pytest.raises(EnvironmentSetupError, match=r"no environment 'gsm9k' \(registered: aime, gsm8k"):
        make_environment("skyrl:gsm9k")
    env = make_environment("skyrl:gsm8k")
    with pytest.raises(EnvironmentSetupError, match=r"needs a `reward_spec` or an `answer`.*\['prompt'\]"):
        env.init({"prompt": "What is 1 + 1?"})
    with pytest.raises(EnvironmentSetupError, match=r"env.options \{'colour': 'red'\}.*colour"):
        Episodes("skyrl:gsm8k", {"colour": "red"}, tokenizer=None)
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # as if the extra were not installed
    with pytest.raises(EnvironmentSetupError, match=r"pip install 'everyprompt\[envs\]'"):
        make_environment("skyrl:gsm8k")


def test_a_skyrl_gym_parquet_file_loads_with_its_conversation_and_reward_spec(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(skyrl_rows(3)), path)
    rows = load_prompt_file(path, require=())
    assert rows[2]["messages"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert rows[2]["prompt"] == "What is 2 + 2?"  # the last user message, for logs and reports
    assert rows[2]["reward_spec"] == {"method": "rule", "ground_truth": "4"}
    env = make_environment("skyrl:gsm8k")
    assert env.init(rows[2]) == rows[2]["messages"]
    assert env.step("#### 4").reward == 1.0


def test_rl_on_skyrl_gyms_gsm8k_multi_turn_feeds_its_observations_and_takes_its_reward(tmp_path, monkeypatch):
    """A few RL steps on a tiny chat model, data in skyrl-gym's layout. A random model never writes
    '#### N', so skyrl-gym's scorer is replaced by one that gives 0.03 to every turn: the episodes then run
    to `max_turns` (observations fed between turns) and every judged episode's reward is 0.03."""
    from skyrl_gym.envs.gsm8k import multi_turn_env

    monkeypatch.setattr(multi_turn_env.utils, "compute_score", lambda **_: 0.03)
    train_file = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(skyrl_rows(16)), train_file)
    config = tiny_config(
        "model.preset=tiny-chat-moe",
        "sft.steps=0",
        "env.name=skyrl:gsm8k_multi_turn",
        "env.options={max_turns: 2}",
        f"data.train_file={train_file}",
        f"data.eval_file={train_file}",
        "rl.steps=2",
        "rl.group_size=4",
        "rollout.max_new_tokens=48",
    )
    train(config, run_dir=tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert any(line["rollout/environment_tokens"] > 0 for line in lines)  # skyrl-gym's next-turn asks
    assert all(0.0 <= line["reward/mean"] <= 0.03 + 1e-9 for line in lines)
    assert any(line["reward/mean"] > 0 for line in lines)
    assert all(line["reward/none_fraction"] == 0.0 for line in lines)
