"""Prompt formats: chat rendering equals the tokenizer's own chat template, SFT trains on the
assistant's tokens only, `auto` picks chat for chat checkpoints."""

from __future__ import annotations

import pytest
import torch

from everyprompt.config import DataConfig
from everyprompt.data import DataError
from everyprompt.data.formatting import ChatFormat, PlainFormat, build_format
from everyprompt.models.tokenizer import build_char_tokenizer, build_chat_tokenizer
from everyprompt.trainer.sft import sft_batch

CORPUS = ["Tom has 3 apples and buys 4 more. How many apples does he have? 3+4=7 #### 7"] * 20


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_chat_tokenizer(CORPUS, vocab_size=300)


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_rendering_equals_apply_chat_template_with_a_system_prompt_and_a_thinking_switch(
    chat_tokenizer, thinking
):
    data = DataConfig(format="chat", system_prompt="Be brief.", template_kwargs={"enable_thinking": thinking})
    prompt_format = build_format(data, chat_tokenizer)
    row = {"prompt": "Tom has 3 apples and buys 4 more. How many?"}
    expected = chat_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}],
        add_generation_prompt=True,
        enable_thinking=thinking,
    )["input_ids"]
    assert prompt_format.prompt_ids(row) == expected
    text = prompt_format.text(row)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))


def test_a_messages_row_is_rendered_whole_and_keeps_its_own_system_turn(chat_tokenizer):
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2+2="},
    ]
    prompt_format = ChatFormat(chat_tokenizer, system_prompt="ignored: the row has its own")
    expected = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert prompt_format.prompt_ids({"messages": messages, "prompt": "and 2+2="}) == expected
    with pytest.raises(DataError, match="need data.format=chat"):
        PlainFormat(chat_tokenizer).prompt_ids({"messages": messages, "prompt": "and 2+2="})


def test_chat_sft_trains_on_the_assistant_tokens_only(chat_tokenizer):
    prompt_format = ChatFormat(chat_tokenizer, template_kwargs={"enable_thinking": False})
    rows = [
        {"prompt": "Tom has 3 apples and buys 4 more.", "solution": "3+4=7 #### 7"},
        {"prompt": "How many?", "solution": "7"},
    ]
    input_ids, mask, lengths = sft_batch(chat_tokenizer, rows, prompt_format)
    end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, row in enumerate(rows):
        prompt = prompt_format.prompt_ids(row)
        solution = chat_tokenizer(row["solution"], add_special_tokens=False).input_ids
        assert input_ids[i, : lengths[i]].tolist() == prompt + solution + [end]  # the template's turn end
        targets = input_ids[i, 1:][mask[i].bool()].tolist()  # mask[t] weighs the prediction of token t + 1
        assert targets == solution + [end]
        assert int(mask[i].sum()) == len(solution) + 1 and mask[i, : len(prompt) - 1].sum() == 0
    assert bool((input_ids[1, lengths[1] :] == chat_tokenizer.pad_token_id).all())  # padding untrained
    assert mask[1, lengths[1] - 1 :].sum() == 0


def test_plain_sft_is_prompt_solution_eos():
    tokenizer = build_char_tokenizer()
    input_ids, mask, lengths = sft_batch(tokenizer, [{"prompt": "1+1=", "solution": "2"}])
    assert input_ids[0].tolist() == tokenizer("1+1=").input_ids + tokenizer(
        "2", add_special_tokens=False
    ).input_ids + [tokenizer.eos_token_id]
    assert mask[0].tolist() == [0, 0, 0, 0, 1, 1]  # BOS 1 + 1 = -> predicts "2" and EOS only


def test_auto_is_chat_whenever_the_tokenizer_has_a_chat_template(chat_tokenizer):
    assert isinstance(build_format(DataConfig(), chat_tokenizer), ChatFormat)
    assert type(build_format(DataConfig(format="plain"), chat_tokenizer)) is PlainFormat
    assert type(build_format(DataConfig(), build_char_tokenizer())) is PlainFormat
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        build_format(DataConfig(format="chat"), build_char_tokenizer())
    with pytest.raises(DataError, match="resolved to plain"):
        build_format(DataConfig(system_prompt="hi"), build_char_tokenizer())


def test_completions_reach_the_reward_decoded_without_special_tokens(chat_tokenizer):
    from everyprompt.generation import sample_and_score
    from everyprompt.rewards.pool import RewardPool
    from everyprompt.rollout import Completion, GenerationRequest, SamplingParams

    class OneAnswer:  # an engine that answers "7" and ends the assistant's turn
        stats: dict = {}

        def generate(self, requests, params):
            for request in requests:
                ids = chat_tokenizer("7", add_special_tokens=False).input_ids + [chat_tokenizer.eos_token_id]
                yield Completion(request.request_id, request.prompt_ids, ids, torch.zeros(len(ids)), "eos")

    seen = []

    def reward(completions, **_):
        seen.extend(completions)
        return [1.0] * len(completions)

    with RewardPool(reward, workers=0) as pool:
        scored = sample_and_score(
            OneAnswer(), chat_tokenizer, [GenerationRequest(0, [1, 2])], SamplingParams(4), [{}], pool
        )
    assert seen == ["7"] and scored.texts == ["7"]
