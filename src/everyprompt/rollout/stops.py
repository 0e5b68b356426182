"""When a completion stops besides its length: the model's end-of-sequence ids and configured strings."""

from __future__ import annotations

from collections.abc import Sequence


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a completion: the tokenizer's EOS and each EOS id of the model's generation
    config (chat models often list several, e.g. an end-of-turn token beside end-of-text)."""
    ids: set[int] = set()
    for source in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if source is None:
            continue
        ids.update(int(i) for i in (source if isinstance(source, (list, tuple)) else [source]))
    if not ids:
        raise ValueError(
            "the model has no end-of-sequence token: neither its tokenizer nor its generation config names one"
        )
    return frozenset(ids)


class StopStrings:
    """Whether a completion's newest token completes one of the configured stop strings.

    The check decodes a tail of the completion long enough to hold the longest string (a token is at
    least one byte), so its cost does not grow with the completion; with no strings it is free.
    """

    def __init__(self, tokenizer, strings: Sequence[str]):
        if strings and tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer to decode completions")
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.tail = max((len(s.encode()) for s in self.strings), default=0) + 1

    def hit(self, token_ids: Sequence[int]) -> bool:
        """`token_ids`: the completion so far, or at least its last `self.tail` tokens."""
        if not self.strings:
            return False
        tail = list(token_ids[-self.tail :])
        now = self.tokenizer.decode(tail, skip_special_tokens=False)
        if not any(s in now for s in self.strings):
            return False
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        return any(s in now and now.count(s) > before.count(s) for s in self.strings)
