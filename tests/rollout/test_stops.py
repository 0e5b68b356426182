"""Generation stops on every end-of-sequence id of the model and on configured stop strings, on both
engines, and the finish reason says which."""

from __future__ import annotations

import pytest

from everyprompt.rollout import GenerationRequest, SamplingParams, make_engine
from tests.families import family_model

PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "60-7="]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return family_model("qwen3_moe", seed=1)


def _run(engine, tokenizer, params):
    requests = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(PROMPTS)]
    return {c.request_id: c for c in engine.generate(requests, params)}


@pytest.mark.parametrize("name", ["native", "hf"])
def test_every_eos_id_of_the_generation_config_stops(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    free = _run(make_engine(name, model, tokenizer, 4), tokenizer, SamplingParams(16))
    longest = max(free.values(), key=lambda c: len(c.token_ids))
    assert len(longest.token_ids) >= 6
    second_eos = longest.token_ids[4]  # a token this completion samples mid-way
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, second_eos]
    try:
        stopped = _run(make_engine(name, model, tokenizer, 4), tokenizer, SamplingParams(16))
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    for request_id, before in free.items():
        after = stopped[request_id]
        if second_eos in before.token_ids:
            cut = before.token_ids.index(second_eos) + 1
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "eos"
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
    assert stopped[longest.request_id].token_ids[-1] == second_eos


@pytest.mark.parametrize("name", ["native", "hf"])
def test_a_stop_string_ends_the_completion_on_the_token_that_completes_it(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    engine = make_engine(name, model, tokenizer, 4)
    free = _run(engine, tokenizer, SamplingParams(16))
    longest = max(free.values(), key=lambda c: len(c.token_ids))
    text = tokenizer.decode(longest.token_ids[3:5])  # spans two tokens (one character each)
    assert len(text) == 2
    stopped = _run(engine, tokenizer, SamplingParams(16, stop=(text,)))
    for request_id, before in free.items():
        after, decoded = stopped[request_id], tokenizer.decode(before.token_ids, skip_special_tokens=False)
        if text in decoded:
            end = decoded.index(text) + len(text)  # one token per character: token index == char index
            assert after.token_ids == before.token_ids[:end] and after.finish_reason == "stop"
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
    assert stopped[longest.request_id].finish_reason == "stop"


def test_stop_strings_must_be_non_empty():
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(8, stop=("",))
