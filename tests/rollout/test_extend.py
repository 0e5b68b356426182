"""An episode's observation enters its row in one forward from the row's length (rollout/native/extend.py):
on every family the native engine runs (grouped-query and latent attention, dense and MoE), the model's
tokens after an observation have a transformers forward's log-probs over the whole sequence and a fresh
prefill's routes; rows answered together each take a forward of their own, and a call gives the same bits
whenever its environments answer; an observation costs one forward, not a decode step a token; and a row
whose observation reached its token cap stays inside the cache as an idle row beside rows that go on."""

from __future__ import annotations

import threading

import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.sequences import Turns
from tests.families import MOE_FAMILIES, family_model
from tests.rollout.test_episodes import PROMPTS, Scripted, Slow, _observation

NATIVE = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


def _turn_ending(model, tokenizer) -> tuple[list[int], str]:
    """A prompt of PROMPTS that greedy decoding answers with 12 tokens and no end, and the text of its
    second token: a stop string that ends the first turn at once, and later ones wherever the model writes
    it again (a random family model often writes its end of sequence first)."""
    engine = NativeEngine.from_model(model, tokenizer, 1)
    for prompt in PROMPTS + ["5*5=", "60-7=", "2+2+2=", "8/4="]:
        ids = tokenizer(prompt).input_ids
        (completion,) = engine.generate([GenerationRequest(0, ids)], SamplingParams(12, greedy=True))
        text = tokenizer.decode(completion.token_ids[1:2])
        if completion.finish_reason == "length" and text.strip():
            return ids, text
    raise AssertionError("no prompt of the list suits the test")


def _whole_sequence(model, completion) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy-temperature log-probs of a completion's tokens (fp32, one forward over the
    prompt and the completion) and its routes where it is a mixture of experts."""
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    start = len(completion.prompt_ids) - 1
    logprobs = torch.log_softmax(logits, -1)[start : start + len(completion.token_ids)]
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("name", NATIVE)
def test_every_family_continues_after_an_observation_as_a_whole_sequence_forward_does(name):
    model, tokenizer = family_model(name)
    prompt, stop = _turn_ending(model, tokenizer)
    observations = [_observation(tokenizer, "=85+17*3"), _observation(tokenizer, "99")]
    moe = name in MOE_FAMILIES
    params = SamplingParams(32, greedy=True, stop=(stop,), record_routes=moe)
    engine = NativeEngine.from_model(model, tokenizer, 2)
    episode = Scripted(*observations)
    (done,) = engine.generate([GenerationRequest(0, prompt, episode=episode)], params)
    mask = done.completion_mask
    first = len(episode.turns[0])
    assert done.token_ids[first : first + len(observations[0])] == observations[0]
    assert mask[first + len(observations[0]) :].any()  # the model spoke after the observation
    expected = _whole_sequence(model, done)
    torch.testing.assert_close(done.logprobs[mask], expected[mask], atol=1e-4, rtol=0)
    assert torch.all(done.logprobs[~mask] == 0)
    # greedy decoding from a fresh prefill of everything up to the observation's end goes on the same way
    upto = first + len(observations[0])
    (fresh,) = engine.generate(
        [GenerationRequest(0, prompt + done.token_ids[:upto], max_new_tokens=4)],
        SamplingParams(4, greedy=True, record_routes=moe),
    )
    after = done.token_ids[upto : upto + len(fresh.token_ids)]
    assert fresh.token_ids[: len(after)] == after
    if moe:  # every fed position's routes: a fresh prefill's of the same sequence
        (whole,) = engine.generate(
            [GenerationRequest(0, prompt + done.token_ids[:-1])], SamplingParams(1, record_routes=True)
        )
        assert torch.equal(done.routed_experts, whole.routed_experts)


@pytest.fixture(scope="module")
def qwen3_moe():
    return family_model("qwen3_moe")


def test_an_observation_costs_one_forward_where_it_cost_a_decode_step_a_token(qwen3_moe):
    model, tokenizer = qwen3_moe
    prompt, stop = _turn_ending(model, tokenizer)
    observation = _observation(tokenizer, "=3, and the tool says: 1+2+3+4+5+6+7+8+9 is 45")
    engine = NativeEngine.from_model(model, tokenizer, 1)
    params = SamplingParams(80, greedy=True, stop=(stop,))
    request = GenerationRequest(0, prompt, episode=Scripted(observation))
    (done,) = engine.generate([request], params)
    model_tokens = int(done.completion_mask.sum())
    assert len(done.token_ids) == model_tokens + len(observation)
    stats = engine.stats
    assert stats["extends"] == 1
    # one decode step for each of the model's tokens (but the last where the cap ended the completion: it
    # is never fed; a turn's last token is, before the environment ends the episode): none for the
    # observation's
    assert stats["decode_steps"] == model_tokens - (done.finish_reason == "length") and stats["extend_s"] > 0


def _answer_together(monkeypatch) -> None:
    """Environments' answers taken only once every waiting episode has answered: the rows are fed in one
    extend forward (an instant environment's thread may otherwise finish a step apart from another's)."""
    resolve = Turns.resolve

    def together(self, state, requests):
        if not all(future.done() for future, _, _ in self.pending.values()):
            return [], {}
        return resolve(self, state, requests)

    monkeypatch.setattr(Turns, "resolve", together)


def test_rows_answered_together_each_take_a_forward_of_their_own_and_get_what_they_get_alone(
    qwen3_moe, monkeypatch
):
    model, tokenizer = qwen3_moe
    prompt, stop = _turn_ending(model, tokenizer)
    params = SamplingParams(40, greedy=True, stop=(stop,), record_routes=True)
    texts = ["+1", "=1368, the sum of the three", "=7"]  # different lengths

    def requests():  # the same prompt: every turn ends at the same step
        return [
            GenerationRequest(i, prompt, seed=i, episode=Scripted(_observation(tokenizer, text)))
            for i, text in enumerate(texts)
        ]

    alone = {}
    for request in requests():
        (alone[request.request_id],) = NativeEngine.from_model(model, tokenizer, 1).generate(
            [request], params
        )
    _answer_together(monkeypatch)
    engine = NativeEngine.from_model(model, tokenizer, 3)
    together = {c.request_id: c for c in engine.generate(requests(), params)}
    assert engine.stats["extends"] == 3  # a forward a row: its bits never depend on who answered with it
    fed = [int((~together[i].completion_mask).sum()) for i in range(len(texts))]
    assert fed == [len(_observation(tokenizer, t)) for t in texts]  # every observation, whole
    for request_id, expected in alone.items():
        got = together[request_id]
        assert got.token_ids == expected.token_ids and torch.equal(
            got.completion_mask, expected.completion_mask
        )
        torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(got.routed_experts, expected.routed_experts)


def test_a_call_gives_the_same_bits_whenever_its_environments_answer(qwen3_moe, monkeypatch):
    """Environments answering at once (each as its thread finishes) or all together: which rows are fed by
    the same point of the loop changes, the completions' bits do not (a resumed run must equal one
    that ran through)."""
    model, tokenizer = qwen3_moe
    prompt, stop = _turn_ending(model, tokenizer)
    params = SamplingParams(40, stop=(stop,), record_routes=True)
    texts = ["+1", "=1368, the sum of the three", "=7", "=22 and more"]

    def run():
        requests = [GenerationRequest(i, prompt, seed=i, episode=Scripted(_observation(tokenizer, text)))
                    for i, text in enumerate(texts)]  # fmt: skip
        return {
            c.request_id: c for c in NativeEngine.from_model(model, tokenizer, 4).generate(requests, params)
        }

    at_once = run()
    _answer_together(monkeypatch)
    together = run()
    for request_id, expected in at_once.items():
        got = together[request_id]
        assert got.token_ids == expected.token_ids and torch.equal(got.logprobs, expected.logprobs)
        assert torch.equal(got.routed_experts, expected.routed_experts)


def test_a_row_whose_observation_reached_its_cap_idles_inside_the_cache_beside_rows_that_go_on(qwen3_moe):
    """The capped row has the call's longest prompt, so its cap is the cache's last position: fed up to
    it, the row (idle in the rows a later step reads: an episode waiting for its environment keeps the
    pool from shrinking to the running rows) would sit one past the cache's width."""
    model, tokenizer = qwen3_moe
    prompt = tokenizer(PROMPTS[2] * 2).input_ids
    params = SamplingParams(24, greedy=True)
    (plain,) = NativeEngine.from_model(model, tokenizer, 1).generate([GenerationRequest(0, prompt)], params)
    stop = tokenizer.decode(plain.token_ids[1:2])  # ends its first turn at its second token
    params = SamplingParams(24, greedy=True, stop=(stop,))
    long = _observation(tokenizer, "1+2+3+4+5+6+7+8+9+10+11+12+13+14+15+16")
    capped = GenerationRequest(0, prompt, episode=Scripted(long))
    other = GenerationRequest(1, tokenizer(PROMPTS[1]).input_ids)  # decoding on, row 1, short prompt
    (alone,) = NativeEngine.from_model(model, tokenizer, 1).generate([other], params)
    assert len(alone.token_ids) == 24  # it goes on after the capped row ends (its third step)
    release = threading.Event()  # the waiting episode's environment answers once row 1 has finished
    waiting = GenerationRequest(2, prompt, episode=Slow(release, 30.0))
    engine = NativeEngine.from_model(model, tokenizer, 3)  # the eager plain step: rows up to the last read
    out = {}
    for completion in engine.generate([capped, other, waiting], params):
        out[completion.request_id] = completion
        if completion.request_id == 1:
            assert 0 in out and 2 not in out  # the capped row idled while row 1 decoded
            release.set()
    done = out[0]
    assert len(done.token_ids) == 24 and done.finish_reason == "length"
    assert done.token_ids[2:] == long[:22] and not done.completion_mask[2:].any()
    assert out[1].token_ids == alone.token_ids


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_a_bf16_engine_feeds_an_observation_within_bf16s_precision(name):
    model, tokenizer = family_model(name)
    prompt, stop = _turn_ending(model, tokenizer)
    observation = _observation(tokenizer, "=85+17*3")
    engine = NativeEngine.from_model(model, tokenizer, 2, precision="bf16")
    request = GenerationRequest(0, prompt, episode=Scripted(observation))
    (done,) = engine.generate([request], SamplingParams(32, greedy=True, stop=(stop,)))
    mask = done.completion_mask
    assert mask is not None and mask[mask.tolist().index(False) + len(observation) :].any()
    # a wrong mask or position after the observation moves log-probs by far more than bf16's rounding
    torch.testing.assert_close(done.logprobs[mask], _whole_sequence(model, done)[mask], atol=0.05, rtol=0)


def test_on_fake_cuda_an_observation_is_fed_without_a_read_back_or_a_blocking_upload(qwen3_moe, monkeypatch):
    from everyprompt.devices.fake_cuda import fake_cuda
    from everyprompt.rollout.native import decode_loop

    model, tokenizer = qwen3_moe
    prompt, stop = _turn_ending(model, tokenizer)
    params = SamplingParams(32, greedy=True, stop=(stop,), record_routes=True)
    observation = _observation(tokenizer, "=85+17*3")
    expected_engine = NativeEngine.from_model(model, tokenizer, 2)
    (expected,) = expected_engine.generate(
        [GenerationRequest(0, prompt, episode=Scripted(observation))], params
    )
    crossed: list[tuple[int, int]] = []  # (syncs, blocking uploads) each extend made
    fed = decode_loop.extend

    with fake_cuda() as check:

        def watched(*args):
            before = (check.total_syncs, sum(check.uploads.values()))
            out = fed(*args)
            crossed.append((check.total_syncs - before[0], sum(check.uploads.values()) - before[1]))
            return out

        monkeypatch.setattr(decode_loop, "extend", watched)
        engine = NativeEngine.from_model(model, tokenizer, 2, device="cuda:0")  # the static step
        assert engine.static
        (done,) = engine.generate([GenerationRequest(0, prompt, episode=Scripted(observation))], params)
    assert crossed and crossed == [(0, 0)] * len(crossed), (check.syncs, check.uploads)
    assert done.token_ids == expected.token_ids and torch.equal(
        done.completion_mask, expected.completion_mask
    )
    torch.testing.assert_close(done.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    assert torch.equal(done.routed_experts, expected.routed_experts)


@pytest.mark.slow  # a compile of the decode step (~15 s)
def test_the_compiled_step_continues_after_an_observation_as_the_eager_one(qwen3_moe):
    model, tokenizer = qwen3_moe
    prompt, stop = _turn_ending(model, tokenizer)
    observation = _observation(tokenizer, "=85+17*3")
    params = SamplingParams(32, greedy=True, stop=(stop,), record_routes=True)
    done = {}
    for mode in ("off", "on"):  # the compiled step reads the call's whole cache width, masked
        engine = NativeEngine.from_model(model, tokenizer, 2, compile=mode)
        (done[mode],) = engine.generate([GenerationRequest(0, prompt, episode=Scripted(observation))], params)
        assert engine.stats["compiled"] == float(mode == "on") and engine.stats["extends"] == 1
    eager, compiled = done["off"], done["on"]
    assert compiled.token_ids == eager.token_ids and torch.equal(
        compiled.completion_mask, eager.completion_mask
    )
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    assert torch.equal(compiled.routed_experts, eager.routed_experts)
