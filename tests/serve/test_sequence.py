"""A served choice's text as its tokens come one by one (serve/engine.py's `Sequence`): the same text as
decoding the whole completion, characters split across tokens held until whole, stop strings cut."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi", reason="the server is the optional extra everyprompt[serve]")

from everyprompt.models.tokenizer import build_chat_tokenizer  # noqa: E402
from everyprompt.serve.engine import Sequence  # noqa: E402

TEXT = "Naïve café: 3×4 = 12 ✓, then 12 − 5 = 7 🎉 done."


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(["plain ascii words and 0123456789"] * 20, vocab_size=300)


def feed(tokenizer, stops: list[str], stream: bool):
    async def run():
        sequence = Sequence(0, asyncio.Queue(), tokenizer, stops)
        sent = []
        for token in tokenizer(TEXT, add_special_tokens=False).input_ids:
            ended = sequence.apply((token, -1.0))
            if stream:
                sent.append(sequence.delta()[0])
            if ended:
                break
        else:
            sequence.apply("length")
            if stream:
                sent.append(sequence.delta()[0])
        return sequence, sent

    return asyncio.run(run())


def test_text_grows_to_the_whole_decoding_and_never_streams_half_a_character(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > len(TEXT.encode()) // 2  # bytes split over tokens: the case that matters
    sequence, sent = feed(tokenizer, [], stream=True)
    assert sequence.text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert "".join(sent) == TEXT and not any("\ufffd" in piece for piece in sent)


def test_a_stop_string_cuts_the_text_and_no_part_of_it_is_streamed(tokenizer):
    sequence, sent = feed(tokenizer, ["12 −"], stream=True)
    assert sequence.finish == "stop"
    assert sequence.text == "Naïve café: 3×4 = 12 ✓, then " == "".join(sent)
