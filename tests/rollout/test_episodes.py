"""Multi-turn episodes in the native engine (GenerationRequest.episode): at the end of a model turn the
engine asks the episode for an observation, feeds its tokens into the same sequence and lets the model go
on. What must hold: the model's tokens after an observation are what a from-scratch forward over the whole
sequence gives (the trainer's log-probs, greedy continuation from a fresh prefill, the routes of every fed
token); observation tokens are masked, with log-probs 0; other requests in the batch are untouched."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams, UnsupportedModelError
from everyprompt.rollout.hf import HFEngine
from everyprompt.rollout.native import NativeEngine
from everyprompt.trainer.learner_side.logprobs import token_logprobs
from tests.conftest import make_tiny_model

PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9="]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


class Scripted:
    """An episode that answers the model's turns with the given token lists, in order, then ends it."""

    def __init__(self, *observations: list[int]):
        self.observations, self.turns = list(observations), []
        self.reward, self.error, self.error_reason = None, None, None  # the Episode protocol's

    def turn_ended(self, token_ids: list[int]) -> list[int] | None:
        self.turns.append(list(token_ids))
        return self.observations.pop(0) if self.observations else None


def _stop_string(model, tokenizer, prompt: str) -> str:
    """The text of the second token greedy decoding writes after `prompt`: a stop string that ends the
    first turn at once (and later ones wherever the model writes it again)."""
    engine = NativeEngine.from_model(model, tokenizer, 1)
    (completion,) = engine.generate(
        [GenerationRequest(0, tokenizer(prompt).input_ids)], SamplingParams(4, greedy=True)
    )
    text = tokenizer.decode(completion.token_ids[1:2])
    assert text.strip(), text
    return text


def _observation(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def test_a_resumed_turn_is_what_a_forward_over_the_whole_sequence_gives(tiny):
    model, tokenizer = tiny
    prompt = tokenizer(PROMPTS[0]).input_ids
    stop = _stop_string(model, tokenizer, PROMPTS[0])
    observations = [_observation(tokenizer, "=85+"), _observation(tokenizer, "99")]
    episode = Scripted(*observations)
    engine = NativeEngine.from_model(model, tokenizer, 4)
    params = SamplingParams(40, stop=(stop,), record_routes=True)
    (done,) = engine.generate([GenerationRequest(0, prompt, seed=3, episode=episode)], params)
    tokens, mask = done.token_ids, done.completion_mask
    assert len(episode.turns) >= 2 and mask is not None and mask.shape == (len(tokens),)
    # the first observation follows the first turn, token for token, and is masked
    first_turn = len(episode.turns[0])
    fed = slice(first_turn, first_turn + len(observations[0]))
    assert tokens[fed] == observations[0] and not mask[fed].any() and mask[:first_turn].all()
    answered = observations[: min(len(episode.turns), len(observations))]  # the turns answered, in full
    if done.finish_reason != "length":
        assert int((~mask).sum()) == sum(len(o) for o in answered)
    assert torch.all(done.logprobs[~mask] == 0) and torch.all(done.entropies[~mask] == 0)
    # the model's tokens, the ones after each observation included: the trainer's log-probs over the whole
    # sequence, computed from scratch
    with torch.no_grad():
        expected, _ = token_logprobs(model, torch.tensor([prompt + tokens]))
    expected = expected[0, len(prompt) - 1 :]
    assert mask[first_turn + len(observations[0]) :].any()  # the model spoke after the observation
    torch.testing.assert_close(done.logprobs[mask], expected[mask], atol=1e-4, rtol=0)
    # every fed token (prompt, model and observation tokens; the last sampled one is never fed) has its
    # routes, equal to a fresh prefill's of the same sequence
    (fresh,) = NativeEngine.from_model(model, tokenizer, 1).generate(
        [GenerationRequest(0, prompt + tokens[:-1])], SamplingParams(1, record_routes=True)
    )
    assert done.routed_experts.shape[0] == len(prompt) + len(tokens) - 1
    assert torch.equal(done.routed_experts, fresh.routed_experts)


def test_greedy_after_an_observation_equals_greedy_from_a_fresh_prefill(tiny):
    model, tokenizer = tiny
    prompt = tokenizer(PROMPTS[1]).input_ids
    stop = _stop_string(model, tokenizer, PROMPTS[1])
    observation = _observation(tokenizer, "=3=")
    params = SamplingParams(24, greedy=True, stop=(stop,))
    engine = NativeEngine.from_model(model, tokenizer, 2)
    (done,) = engine.generate([GenerationRequest(0, prompt, episode=Scripted(observation))], params)
    turn = done.token_ids.index(observation[0])
    resumed = done.token_ids[turn + len(observation) :]
    assert resumed
    (fresh,) = engine.generate(
        [
            GenerationRequest(
                0, prompt + done.token_ids[: turn + len(observation)], max_new_tokens=len(resumed)
            )
        ],
        SamplingParams(24, greedy=True, stop=(stop,)),
    )
    assert fresh.token_ids == resumed


def test_episodes_share_the_batch_with_plain_requests_and_each_gets_what_it_would_alone(tiny):
    model, tokenizer = tiny
    stop = _stop_string(model, tokenizer, PROMPTS[2])
    params = SamplingParams(20, stop=(stop,))
    plain = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(PROMPTS)]
    alone = {c.request_id: c for c in NativeEngine.from_model(model, tokenizer, 8).generate(plain, params)}
    episodes = [
        GenerationRequest(
            10 + i, tokenizer(p).input_ids, seed=i, episode=Scripted(_observation(tokenizer, "+1"))
        )
        for i, p in enumerate(PROMPTS)
    ]
    # three slots for eight requests: rows are admitted while episodes are mid-observation
    mixed = list(NativeEngine.from_model(model, tokenizer, 3).generate([*episodes, *plain], params))
    assert len(mixed) == 8
    for completion in mixed:
        if completion.request_id < 10:
            expected = alone[completion.request_id]
            assert completion.token_ids == expected.token_ids and completion.completion_mask is None
            torch.testing.assert_close(completion.logprobs, expected.logprobs, atol=1e-5, rtol=0)
        else:  # up to its first observation (or whole, if it had none) the plain request's completion
            before, mask = alone[completion.request_id - 10].token_ids, completion.completion_mask
            turn = len(completion.token_ids) if mask is None else mask.tolist().index(False)
            assert turn > 0 and completion.token_ids[:turn] == before[:turn]


def test_the_cap_inside_an_observation_ends_the_completion_at_length(tiny):
    model, tokenizer = tiny
    prompt = tokenizer(PROMPTS[0]).input_ids
    stop = _stop_string(model, tokenizer, PROMPTS[0])
    long_observation = _observation(tokenizer, "1+2+3+4+5+6+7+8+9+10+11+12+13+14")
    engine = NativeEngine.from_model(model, tokenizer, 1)
    (done,) = engine.generate(
        [GenerationRequest(0, prompt, episode=Scripted(long_observation))],
        SamplingParams(8, greedy=True, stop=(stop,)),
    )
    assert len(done.token_ids) == 8 and done.finish_reason == "length"
    assert not done.completion_mask[-1] and done.completion_mask[0]


def test_an_episode_that_ends_at_once_changes_nothing(tiny):
    model, tokenizer = tiny
    stop = _stop_string(model, tokenizer, PROMPTS[3])
    params = SamplingParams(12, greedy=True, stop=(stop,))
    request = GenerationRequest(0, tokenizer(PROMPTS[3]).input_ids, seed=5)
    engine = NativeEngine.from_model(model, tokenizer, 1)
    (plain,) = engine.generate([request], params)
    episode = Scripted()
    (ended,) = engine.generate([GenerationRequest(0, request.prompt_ids, seed=5, episode=episode)], params)
    assert ended.token_ids == plain.token_ids and ended.completion_mask is None
    assert ended.finish_reason == plain.finish_reason == "stop" and episode.turns == [plain.token_ids]


def test_the_hf_engine_refuses_episodes(tiny):
    model, tokenizer = tiny
    engine = HFEngine.from_model(model, tokenizer, 1)
    request = GenerationRequest(0, tokenizer(PROMPTS[0]).input_ids, episode=Scripted())
    with pytest.raises(UnsupportedModelError, match="episodes need rollout.engine=native"):
        list(engine.generate([request], SamplingParams(4)))


def test_an_episode_on_fake_cuda_equals_the_cpu_one(tiny):
    """The observation's tokens go to the device in one copy per step and nothing else crosses."""
    from everyprompt.devices.fake_cuda import fake_cuda

    model, tokenizer = tiny
    stop = _stop_string(model, tokenizer, PROMPTS[0])
    params = SamplingParams(16, greedy=True, stop=(stop,), record_routes=True)

    def run(device):
        request = GenerationRequest(
            0, tokenizer(PROMPTS[0]).input_ids, episode=Scripted(_observation(tokenizer, "=85"))
        )
        engine = NativeEngine.from_model(model, tokenizer, 2, device=device)
        (done,) = engine.generate([request], params)
        return done

    expected = run("cpu")
    with fake_cuda():
        got = run("cuda:0")
    assert expected.completion_mask is not None and got.token_ids == expected.token_ids
    assert torch.equal(got.completion_mask, expected.completion_mask)
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    assert torch.equal(got.routed_experts, expected.routed_experts)


class Slow(Scripted):
    """Answers a turn once `release` is set (waiting at most `wait` seconds): an environment that takes
    its time. `time_limit`: the Episode protocol's."""

    def __init__(self, release, wait: float, *observations, time_limit: float | None = None):
        super().__init__(*observations)
        self.release, self.wait, self.time_limit = release, wait, time_limit
        self.released: bool | None = None

    def turn_ended(self, token_ids):
        self.released = self.release.wait(self.wait)
        return super().turn_ended(token_ids)


def test_an_environment_answers_while_the_other_rows_decode_and_tokens_stay_the_same(tiny):
    model, tokenizer = tiny
    stop = _stop_string(model, tokenizer, PROMPTS[0])
    params = SamplingParams(40, stop=(stop,))
    observation = _observation(tokenizer, "=85")
    engine = NativeEngine.from_model(model, tokenizer, 4)
    prompt, other = tokenizer(PROMPTS[0]).input_ids, tokenizer(PROMPTS[3]).input_ids
    release = threading.Event()
    slow = Slow(release, 30.0, observation)
    order = []
    for completion in engine.generate(
        [GenerationRequest(0, prompt, seed=3, episode=slow), GenerationRequest(1, other, seed=6)], params
    ):
        order.append(completion.request_id)
        if completion.request_id == 1:
            release.set()  # the environment answers only once the other row has finished decoding
        else:
            waited = completion
    assert slow.turns  # its first turn ended (at the stop string) and the environment was asked
    assert order == [1, 0] and slow.released is True  # the other row decoded while the environment ran
    (instant,) = engine.generate(
        [GenerationRequest(0, prompt, seed=3, episode=Scripted(observation))], params
    )
    assert waited.token_ids == instant.token_ids  # sitting out changes no token: noise follows positions
    assert torch.equal(waited.completion_mask, instant.completion_mask)


def test_an_environment_past_its_time_limit_or_raising_ends_its_episode_with_an_error(tiny):
    model, tokenizer = tiny
    stop = _stop_string(model, tokenizer, PROMPTS[0])
    params = SamplingParams(40, stop=(stop,))
    engine = NativeEngine.from_model(model, tokenizer, 4)
    prompt, other = tokenizer(PROMPTS[0]).input_ids, tokenizer(PROMPTS[3]).input_ids
    hung = Slow(threading.Event(), 10.0, _observation(tokenizer, "=85"), time_limit=0.2)

    class Broken(Scripted):
        def turn_ended(self, token_ids):
            raise RuntimeError("tool crashed")

    broken = Broken()
    began = time.monotonic()
    out = {
        c.request_id: c
        for c in engine.generate(
            [
                GenerationRequest(0, prompt, seed=3, episode=hung),
                GenerationRequest(1, prompt, seed=3, episode=broken),
                GenerationRequest(2, other, seed=6),
            ],
            params,
        )
    }
    assert time.monotonic() - began < 5  # the call did not wait for the hung environment
    assert hung.error == "the environment took longer than its time limit of 0.2 s"
    assert broken.error == "turn_ended raised RuntimeError: tool crashed"
    assert (hung.error_reason, broken.error_reason) == ("time_limit", "RuntimeError")  # env/errors/<reason>
    assert hung.released is None  # still waiting in its thread when the call ended
    for number in (0, 1):  # each ended at its first turn, no observation fed
        completion = out[number]
        assert completion.completion_mask is None and completion.finish_reason == "stop"
    (alone,) = engine.generate([GenerationRequest(2, other, seed=6)], params)
    assert out[2].token_ids == alone.token_ids
