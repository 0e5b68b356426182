"""Step-wise episodes on the native engine go at their own pace (envs/turns.py): each turn joins one running
call as its environment answers. The turns are the ones round-by-round decoding gives (same prompts, same
tokens, log-probs within float32 rounding, same routes); an episode whose environment is slow holds no
other up; a turn whose prompt outgrew the call waits for the next; time limits and failures end only
their episode."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from everyprompt.envs import StepResult
from everyprompt.envs import turns as continuous
from everyprompt.envs.stepwise import StepwiseEpisode, generate_stepwise
from everyprompt.models.tokenizer import build_chat_tokenizer
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.base import TIME_LIMIT
from everyprompt.rollout.native import NativeEngine
from tests.envs.test_episode import _Graded
from tests.envs.test_stepwise import CORPUS, DROPS_THINKING
from tests.families import family_config

PARAMS = SamplingParams(24, stop=("e",), record_routes=True)  # turns of a few tokens, some cut at the cap


@pytest.fixture(scope="module")
def chat_model():
    """A tiny random Qwen3-MoE over a chat tokenizer whose template drops earlier thinking."""
    tokenizer = copy.deepcopy(build_chat_tokenizer(CORPUS, vocab_size=300))
    tokenizer.chat_template = DROPS_THINKING
    config = family_config("qwen3_moe", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=None, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.dim() >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return model, tokenizer


class Replies(_Graded):
    """Answers every turn with 'Try again.' until its `turns`-th, which ends the episode (reward 1)."""

    def __init__(self, turns: int = 3, wait: threading.Event | None = None, raises: bool = False):
        super().__init__()
        self.limit, self.wait, self.raises = turns, wait, raises

    def step(self, action):
        self.turns += 1
        if self.wait is not None:
            self.wait.wait(30)
        if self.raises:
            raise RuntimeError("tool crashed")
        if self.turns >= self.limit:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "Try again."}])


def _episodes(tokenizer, envs, time_limit=None, schedule="auto"):
    """Step-wise episodes of `envs`; `schedule` rounds: round by round on the native engine too."""
    episodes = [StepwiseEpisode(env, tokenizer, {"prompt": f"What is {i} x 7?"}, time_limit=time_limit,
                                max_turns=8, schedule=schedule) for i, env in enumerate(envs)]  # fmt: skip
    return [GenerationRequest(i, e.prompt_ids, seed=10 + i, episode=e) for i, e in enumerate(episodes)]


def _run(engine, requests, params=PARAMS):
    return {c.request_id: c for c in generate_stepwise(engine, requests, params)}


def _assert_same_turns(got, expected):
    assert got.keys() == expected.keys()
    for request_id, reference in expected.items():
        mine = got[request_id]
        assert len(mine.turns) == len(reference.turns) and mine.finish_reason == reference.finish_reason
        for turn, other in zip(mine.turns, reference.turns):
            assert turn.prompt_ids == other.prompt_ids and turn.token_ids == other.token_ids
            torch.testing.assert_close(turn.logprobs, other.logprobs, atol=1e-5, rtol=0)
            assert torch.equal(turn.routed_experts, other.routed_experts)
        assert (
            mine.episode.reward == reference.episode.reward and mine.episode.error == reference.episode.error
        )


def test_turns_in_one_running_call_are_the_turns_round_by_round_gives(chat_model, monkeypatch):
    model, tokenizer = chat_model
    monkeypatch.setattr(continuous, "GROWTH", 8)  # room for three turns of 24 tokens and their replies
    engine = NativeEngine.from_model(model, tokenizer, 4)  # four rows for six episodes: turns queue
    expected = _run(engine, _episodes(tokenizer, [Replies(3) for _ in range(6)], schedule="rounds"))
    assert any(len(c.turns) > 1 for c in expected.values())  # episodes went past their first turn
    calls = []
    generate = engine.generate
    engine.generate = lambda source, params: (calls.append(source), generate(source, params))[1]
    got = _run(engine, _episodes(tokenizer, [Replies(3) for _ in range(6)]))
    assert len(calls) == 1  # every turn of every episode in one call
    _assert_same_turns(got, expected)


def test_a_turn_whose_prompt_outgrew_the_call_waits_for_the_next_and_nothing_changes(chat_model, monkeypatch):
    model, tokenizer = chat_model
    engine = NativeEngine.from_model(model, tokenizer, 4)
    expected = _run(engine, _episodes(tokenizer, [Replies(3) for _ in range(3)], schedule="rounds"))
    monkeypatch.setattr(continuous, "GROWTH", 0)  # a call only as wide as its longest first prompt
    calls = []
    generate = engine.generate
    engine.generate = lambda source, params: (calls.append(source), generate(source, params))[1]
    got = _run(engine, _episodes(tokenizer, [Replies(3) for _ in range(3)]))
    assert len(calls) > 1  # later turns were deferred to calls of their own
    _assert_same_turns(got, expected)


def test_a_call_holds_as_many_cache_rows_as_episodes_are_left(chat_model, monkeypatch):
    model, tokenizer = chat_model
    monkeypatch.setattr(continuous, "GROWTH", 8)  # one call
    engine = NativeEngine.from_model(model, tokenizer, 64)  # a server's pool would be all 64 rows
    _run(engine, _episodes(tokenizer, [Replies(2) for _ in range(3)]))
    assert engine.stats["slots"] == 3


@pytest.mark.parametrize("growth", [8, 0], ids=["one-call", "a-call-a-turn"])
def test_a_slow_environment_holds_no_other_episode_up(chat_model, monkeypatch, growth):
    """Episode 0's environment answers only once episode 1 has ended: episode 1 goes through its three
    turns meanwhile, in one running call or (its prompts outgrowing each call) in a call a turn, started
    while episode 0's environment is still answering; round by round its second turn would wait for
    episode 0's answer, which waits for it, until the time limit ended episode 0."""
    model, tokenizer = chat_model
    monkeypatch.setattr(continuous, "GROWTH", growth)
    engine = NativeEngine.from_model(model, tokenizer, 4)
    params = SamplingParams(24, stop=("e",), greedy=True)  # greedy: each turn ends at the stop, not the cap

    def run(schedule, time_limit):
        release = threading.Event()
        envs = [Replies(2, wait=release), Replies(3)]
        requests = _episodes(tokenizer, envs, time_limit=time_limit, schedule=schedule)
        order = []
        for completion in generate_stepwise(engine, requests, params):
            order.append(completion)
            if completion.request_id == 1:
                release.set()
        return order

    order = run("auto", time_limit=30.0)
    assert [c.request_id for c in order] == [1, 0]
    assert [len(c.turns) for c in order] == [3, 2] and not any(c.episode.error for c in order)
    began = time.monotonic()
    rounds = {c.request_id: c for c in run("rounds", time_limit=0.5)}
    assert rounds[0].episode.error_reason == TIME_LIMIT and time.monotonic() - began >= 0.5
    assert len(rounds[1].turns) == 3


def test_a_late_or_failing_environment_ends_only_its_episode(chat_model):
    model, tokenizer = chat_model
    engine = NativeEngine.from_model(model, tokenizer, 4)
    params = SamplingParams(24, stop=("e",), greedy=True)
    hung = Replies(2, wait=threading.Event())  # never released: answers after 30 s
    requests = _episodes(tokenizer, [hung, Replies(2, raises=True), Replies(2)], time_limit=0.3)
    began = time.monotonic()
    done = _run(engine, requests, params)
    assert time.monotonic() - began < 10  # the call did not wait for the hung environment
    assert done[0].episode.error_reason == TIME_LIMIT
    assert done[0].episode.error == "the environment took longer than its time limit of 0.3 s"
    assert done[1].episode.error == "Replies.step raised RuntimeError: tool crashed"
    assert all(len(done[i].turns) == 1 for i in (0, 1))
    assert done[2].episode.error is None  # its own turns went on as they would alone
    alone = _run(engine, _episodes(tokenizer, [Replies(2) for _ in range(3)])[2:], params)
    assert [t.token_ids for t in done[2].turns] == [t.token_ids for t in alone[2].turns]


def test_a_continuous_schedule_on_an_engine_without_live_requests_is_refused():
    from everyprompt.config import load_config
    from everyprompt.envs import EnvironmentSetupError
    from everyprompt.envs.episode import Episodes
    from tests.envs import test_env_runs  # noqa: F401 (registers test-answer-once)

    config = load_config(None, ["model.preset=tiny-chat-moe", "env.name=test-answer-once", "sft.steps=0",
                                "env.trajectory=stepwise", "env.stepwise_schedule=continuous"])  # fmt: skip

    class Episodic:  # an engine that runs episodes and takes no live requests (the Ray engine's offers)
        offers = ("episodes",)

    with pytest.raises(
        EnvironmentSetupError, match="env.stepwise_schedule=continuous needs a rollout engine"
    ):
        Episodes.from_config(config, build_chat_tokenizer(CORPUS, vocab_size=300), Episodic())
