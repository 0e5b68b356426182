"""Step-wise episodes (envs/stepwise.py): with a chat template that drops earlier thinking, every turn is a
sample of its own whose tokens are exactly what the engine was given and sampled, the loss covering only
the sampled ones; advantages once per episode; RL end to end; and `env.trajectory` deciding."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from everyprompt.batch import RolloutBatch
from everyprompt.config import load_config
from everyprompt.envs import EnvironmentSetupError, StepResult
from everyprompt.envs.episode import Episodes
from everyprompt.envs.stepwise import StepwiseEpisode, generate_stepwise
from everyprompt.models.tokenizer import DROPS_THINKING_TEMPLATE, build_chat_tokenizer
from everyprompt.pipeline import train
from everyprompt.rollout.base import Completion, GenerationRequest, SamplingParams
from everyprompt.trainer.learner_side.signal import batch_advantages
from everyprompt.trainer.rollout_side.assemble import assemble_batch
from everyprompt.zve import Group
from tests.conftest import tiny_config
from tests.envs.test_env_runs import EPISODES
from tests.envs.test_episode import _Graded

CORPUS = ["<think> so 6 times 7 </think> The answer is 42. Try again. user assistant"] * 20
DROPS_THINKING = DROPS_THINKING_TEMPLATE  # a past assistant turn written without its thinking


@pytest.fixture(scope="module")
def tokenizer():
    tok = copy.deepcopy(build_chat_tokenizer(CORPUS, vocab_size=300))
    tok.chat_template = DROPS_THINKING
    return tok


class TwoTries(_Graded):
    """Says 'Try again.' to a first turn, ends the episode at the second, rewarding it 1 if it says 42."""

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "user", "content": "Try again."}])
        return StepResult([], reward=float("42" in action), done=True)


class Scripted:
    """An engine that samples the given texts, turn after turn, and records what it was given."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.given, self.sampled = tokenizer, list(texts), [], []

    def generate(self, requests, params):
        for request in requests:
            tokens = self.tokenizer(self.texts.pop(0), add_special_tokens=False).input_ids
            tokens.append(self.tokenizer.eos_token_id)
            self.given.append(list(request.prompt_ids))
            self.sampled.append(tokens)
            logprobs = -torch.rand(len(tokens))
            yield Completion(request.request_id, list(request.prompt_ids), tokens, logprobs, "eos")


def test_a_template_that_drops_thinking_trains_each_turn_on_exactly_what_the_engine_saw(tokenizer):
    row = {"prompt": "What is 6 x 7?"}
    engine = Scripted(
        tokenizer, ["<think> so 6 times 7 </think> 41", "<think> 6 times 7 </think> The answer is 42."]
    )
    episode = StepwiseEpisode(TwoTries(), tokenizer, row)
    request = GenerationRequest(0, episode.prompt_ids, seed=3, episode=episode)
    (done,) = list(generate_stepwise(engine, [request], SamplingParams(32)))
    assert done.episode.reward == 1.0 and len(done.turns) == 2
    # the second prompt is the template's rendering of the whole conversation: the first turn's thinking
    # is gone from it, so it does not extend the first prompt plus the first turn's tokens
    second = tokenizer.decode(engine.given[1])
    assert "so 6 times 7" not in second and second.endswith(
        "<|im_start|>assistant\n41<|im_end|>\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        engine.given[1][: len(engine.given[0]) + len(engine.sampled[0])]
        != engine.given[0] + engine.sampled[0]
    )
    group = Group(0, 0, [(done, "41 The answer is 42.")], [done.episode.reward], 1)
    batch = assemble_batch([group], 32, version=0)
    assert len(batch) == 2 and batch.episode_index.tolist() == [0, 0]
    for r in range(2):  # token for token what the engine was given and sampled
        assert batch.prompt_ids[r] == engine.given[r] and batch.completion_ids[r] == engine.sampled[r]
    assert batch.completion_text == [tokenizer.decode(t, skip_special_tokens=True) for t in engine.sampled]
    assert batch.completion_mask is None and batch.rewards.tolist() == [1.0, 1.0]
    padded = batch.padded([0, 1], pad_id=0)
    for r in range(2):  # the loss's mask: exactly the sampled tokens' positions
        start = len(engine.given[r]) - 1
        expected = torch.zeros(padded["mask"].shape[1])
        expected[start : start + len(engine.sampled[r])] = 1
        assert torch.equal(padded["mask"][r].float(), expected)


def test_advantages_are_computed_once_per_episode_and_given_to_each_of_its_turns():
    # one group, two episodes: one of 3 turns with reward 1, one of 1 turn with reward 0
    batch = RolloutBatch(
        prompt_ids=[[1]] * 4, completion_ids=[[2]] * 4, rollout_logprobs=[torch.zeros(1)] * 4,
        finish_reason=["eos"] * 4, group_index=torch.zeros(4, dtype=torch.long), prompt_index=[0] * 4,
        rewards=torch.tensor([1.0, 1.0, 1.0, 0.0]), episode_index=torch.tensor([0, 0, 0, 1]),
    )  # fmt: skip
    config = load_config(None, ["rl.advantage=grpo"])
    batch_advantages(batch, config.rl, config.zve)
    # by hand: episode rewards (1, 0), mean 0.5, sample std 0.7071 -> +-0.7071 (per row it would be 0.5 / 0.5)
    assert torch.allclose(batch.advantages, torch.tensor([0.7071, 0.7071, 0.7071, -0.7071]), atol=1e-4)
    kept = batch.select([2, 3])
    assert kept.episode_index.tolist() == [0, 1]


def test_env_trajectory_decides_and_contiguous_is_refused_for_a_rewriting_template(tokenizer):
    from everyprompt.envs import register_environment

    register_environment("test-two-tries")(TwoTries)
    assert Episodes("test-two-tries", {}, tokenizer).stepwise  # auto: the template rewrites
    with pytest.raises(EnvironmentSetupError, match="env.trajectory=contiguous: the chat template renders"):
        Episodes("test-two-tries", {}, tokenizer, trajectory="contiguous")
    plain = build_chat_tokenizer(CORPUS, vocab_size=300)  # ChatML that extends: one growing sequence
    assert not Episodes("test-two-tries", {}, plain).stepwise
    assert Episodes("test-two-tries", {}, plain, trajectory="stepwise").stepwise


def test_rl_on_step_wise_episodes_end_to_end(tmp_path):
    train(
        tiny_config(
            *EPISODES,
            "env.trajectory=stepwise",
            "rl.steps=2",
            "rl.group_size=4",
            "rollout.max_new_tokens=16",
            "env.options={reply: fine}",
        ),  # fmt: skip
        run_dir=tmp_path,
    )
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all(line["rollout/environment_tokens"] == 0 for line in lines)  # each turn is its own sample
    assert any(line["reward/mean"] > 0 for line in lines) and all(
        line["reward/none_fraction"] == 0 for line in lines
    )
    assert any(line["actor/grad_norm"] > 0 and line["actor/no_signal_update"] == 0 for line in lines)


class Graded(TwoTries):
    """Rewards each turn: 0.5 for the first, then 1 if the second says 42."""

    def step(self, action):
        result = super().step(action)
        return StepResult(result.observations, 0.5 if self.turns == 1 else result.reward, result.done)


def test_per_turn_rewards_train_each_turn_on_its_own_reward(tokenizer):
    # turns are sampled a round at a time: the first turns of both episodes, then their second turns
    engine = Scripted(tokenizer, ["<think> a </think> 41", "no", "<think> b </think> 40", "42"])
    # two episodes of one prompt, each of two turns: rewards (0.5, 0) and (0.5, 1)
    episodes = [
        StepwiseEpisode(Graded(), tokenizer, {"prompt": "6 x 7?"}, turn_rewards="turn") for _ in range(2)
    ]
    requests = [GenerationRequest(i, e.prompt_ids, seed=i, episode=e) for i, e in enumerate(episodes)]
    done = sorted(generate_stepwise(engine, requests, SamplingParams(32)), key=lambda c: c.request_id)
    assert [c.episode.turn_rewards for c in done] == [[0.5, 0.0], [0.5, 1.0]]
    group = Group(0, 0, [(c, "") for c in done], [c.episode.reward for c in done], 2)
    batch = assemble_batch([group], 32, version=0)
    assert batch.rewards.tolist() == [0.5, 0.0, 0.5, 1.0] and batch.episode_index.tolist() == [0, 1, 2, 3]
    config = load_config(None, ["rl.advantage=grpo"])
    batch_advantages(batch, config.rl, config.zve)
    # by hand: GRPO over the four turns' rewards (mean 0.5, sample std 0.4082)
    assert torch.allclose(batch.advantages, torch.tensor([0.0, -1.2247, 0.0, 1.2247]), atol=1e-4)


def test_per_turn_rewards_need_step_wise_episodes():
    plain = build_chat_tokenizer(CORPUS, vocab_size=300)
    config = load_config(None, ["model.preset=tiny-chat-moe", "env.name=test-answer-once", "env.turn_rewards=turn",
                                "sft.steps=0"])  # fmt: skip

    class Native:
        offers = ("episodes",)

    with pytest.raises(EnvironmentSetupError, match="env.turn_rewards=turn .* set env.trajectory=stepwise"):
        Episodes.from_config(config, plain, Native())
