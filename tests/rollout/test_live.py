"""The native engine over requests that arrive while it runs (`LiveRequests`, the server's continuous
batching): each request samples by its own settings exactly as a call of its own would, streams its
tokens as they are sampled, and a cancelled request frees its row at the next step."""

from __future__ import annotations

import threading

import pytest

from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.queue import LiveRequest, LiveRequests
from tests.conftest import make_tiny_model

PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "5*5=", "70-1="]
# (temperature, top_p, greedy) per request: a mixed batch
SETTINGS = [(1.0, 1.0, False), (0.7, 0.9, False), (1.0, 1.0, True), (1.3, 0.5, False), (0.5, 1.0, False)]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


def test_each_live_request_samples_as_a_call_of_its_own_with_its_settings(tiny):
    model, tokenizer = tiny
    engine = NativeEngine.from_model(model, tokenizer, 3)  # fewer rows than requests: some wait
    live = LiveRequests(max_prompt_tokens=32)
    streamed: dict[int, list[tuple[int, float]]] = {}
    for number, (prompt, (temperature, top_p, greedy)) in enumerate(zip(PROMPTS, SETTINGS)):
        seen = streamed.setdefault(number, [])
        request = GenerationRequest(
            0, tokenizer(prompt).input_ids, seed=100 + number, max_new_tokens=12 + number
        )
        live.submit(
            LiveRequest(request, temperature, top_p, greedy, on_token=lambda t, lp, s=seen: s.append((t, lp)))
        )
    live.close()  # the call ends once these are done
    got = {c.request_id: c for c in engine.generate(live, SamplingParams(max_new_tokens=20))}
    assert sorted(got) == list(range(len(SETTINGS)))
    for number, (prompt, (temperature, top_p, greedy)) in enumerate(zip(PROMPTS, SETTINGS)):
        request = GenerationRequest(
            7, tokenizer(prompt).input_ids, seed=100 + number, max_new_tokens=12 + number
        )
        params = SamplingParams(20, temperature=1.0 if greedy else temperature, top_p=top_p, greedy=greedy)
        (alone,) = engine.generate([request], params)
        assert got[number].token_ids == alone.token_ids, number
        assert got[number].logprobs.tolist() == pytest.approx(alone.logprobs.tolist(), abs=1e-5)
        # the stream heard every token, in order, with its log-prob, before the completion came out
        assert [t for t, _ in streamed[number]] == alone.token_ids
        assert [lp for _, lp in streamed[number]] == pytest.approx(alone.logprobs.tolist(), abs=1e-5)


def test_requests_arriving_mid_call_join_it_and_a_cancelled_one_frees_its_row(tiny):
    model, tokenizer = tiny
    engine = NativeEngine.from_model(model, tokenizer, 2)
    live = LiveRequests(max_prompt_tokens=32)
    params = SamplingParams(max_new_tokens=400)
    first_tokens = threading.Event()
    cancel_after = 3
    counts = {"long": 0}

    def on_long(_token, _logprob):
        counts["long"] += 1
        if counts["long"] == cancel_after:
            live.cancel(long_index)
            first_tokens.set()

    # greedy on this prompt never writes the end-of-sequence token within 400 tokens (checked below)
    prompt = tokenizer(PROMPTS[0]).input_ids
    (uncut,) = engine.generate([GenerationRequest(0, prompt)], SamplingParams(400, greedy=True))
    assert uncut.finish_reason == "length"
    long_index = live.submit(LiveRequest(GenerationRequest(0, prompt), 1.0, 1.0, True, on_token=on_long))
    done: list = []
    worker = threading.Thread(target=lambda: done.extend(engine.generate(live, params)))
    worker.start()
    assert first_tokens.wait(30)
    late = live.submit(
        LiveRequest(GenerationRequest(0, tokenizer(PROMPTS[1]).input_ids, max_new_tokens=5), 1.0, 1.0, True)
    )
    assert live.running() >= 1
    live.close()
    worker.join(30)
    assert not worker.is_alive()
    by_id = {c.request_id: c for c in done}
    # the cancelled sequence stopped within a step of the cancel, far short of its 400 tokens
    assert cancel_after <= len(by_id[long_index].token_ids) <= cancel_after + 1
    assert by_id[late].token_ids == uncut_of(engine, tokenizer, PROMPTS[1], 5)


def uncut_of(engine, tokenizer, prompt: str, cap: int) -> list[int]:
    (alone,) = engine.generate(
        [GenerationRequest(0, tokenizer(prompt).input_ids)], SamplingParams(cap, greedy=True)
    )
    return alone.token_ids


def test_a_prompt_longer_than_the_live_bound_or_a_submission_after_close_is_refused(tiny):
    live = LiveRequests(max_prompt_tokens=4)
    with pytest.raises(ValueError, match="a prompt of 5 tokens; at most 4"):
        live.submit(LiveRequest(GenerationRequest(0, [1, 2, 3, 4, 5]), 1.0, 1.0, False))
    with pytest.raises(ValueError, match="empty prompt"):
        live.submit(LiveRequest(GenerationRequest(0, []), 1.0, 1.0, False))
    live.close()
    with pytest.raises(RuntimeError, match="shutting down"):
        live.submit(LiveRequest(GenerationRequest(0, [1]), 1.0, 1.0, False))
