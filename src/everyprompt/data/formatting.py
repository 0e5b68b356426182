"""Prompt formats: how a data row becomes the token ids the model sees, and an SFT example.

`plain` tokenises the prompt text as it is (the tokenizer's own special tokens added, e.g. BOS). `chat`
renders the row's `messages` (or its prompt as one user message), after an optional system message,
with the tokenizer's chat template and the generation prompt, passing template switches through
(`enable_thinking` for Qwen3, ...). Completions are decoded without special tokens either way.

An SFT example is the prompt exactly as RL renders it, then the worked solution, then the end of the
assistant's turn; the loss covers the solution and the turn's end only. For `chat` the end of the turn is
what the template writes after an assistant message, up to and including its first stop token (Qwen's
`<|im_end|>`); decided so (rather than rendering the whole conversation through the template) because
templates may render a finished assistant turn differently from the generation prompt (Qwen3 drops the
empty thinking block), and SFT should teach the model to continue exactly the prompt RL will give it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from everyprompt.data.datasets import DataError

FORMATS: dict[str, type] = {}


def register_format(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        FORMATS[name], cls.name = cls, name
        return cls

    return add


@register_format("plain")
class PlainFormat:
    """The prompt text, tokenised as it is."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, row: dict) -> str:
        if row.get("messages") is not None:
            raise DataError("rows with a `messages` column need data.format=chat (or auto with a chat model)")
        return row["prompt"]

    def prompt_ids(self, row: dict) -> list[int]:
        return self.tokenizer(self.text(row)).input_ids

    def turn_end_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def sft_example(self, row: dict) -> tuple[list[int], int]:
        """Token ids of prompt + solution + turn end, and the index where the trained tokens start."""
        prompt = self.prompt_ids(row)
        solution = self.tokenizer(row["solution"], add_special_tokens=False).input_ids
        return prompt + solution + self.turn_end_ids(), len(prompt)


@register_format("chat")
class ChatFormat(PlainFormat):
    """The tokenizer's chat template over [system?] + the row's messages (or its prompt as a user turn),
    with the generation prompt."""

    _PROBE = "\x00everyprompt\x00"  # an assistant message whose rendering marks where the turn's end starts

    def __init__(
        self,
        tokenizer,
        stop_ids: Iterable[int] = (),
        system_prompt: str | None = None,
        template_kwargs: dict | None = None,
    ):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.format=chat needs a tokenizer with a chat template; this one has none")
        self.system_prompt, self.template_kwargs = system_prompt, dict(template_kwargs or {})
        self.stop_ids = set(stop_ids) | {tokenizer.eos_token_id}
        self._turn_end: list[int] | None = None

    def messages(self, row: dict) -> list[dict]:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def text(self, row: dict) -> str:
        return self._render(self.messages(row), generation_prompt=True)

    def prompt_ids(self, row: dict) -> list[int]:
        return self.tokenizer(self.text(row), add_special_tokens=False).input_ids

    def turn_end_ids(self) -> list[int]:
        """What the template writes after an assistant message's content, cut after its first stop token
        (with the tokenizer's EOS appended when it writes none)."""
        if self._turn_end is None:
            rendered = self._render(
                [{"role": "user", "content": "1"}, {"role": "assistant", "content": self._PROBE}], False
            )
            tail = rendered.split(self._PROBE, 1)[1] if self._PROBE in rendered else ""
            ids = self.tokenizer(tail, add_special_tokens=False).input_ids
            stop = next((i for i, token in enumerate(ids) if token in self.stop_ids), None)
            self._turn_end = ids[: stop + 1] if stop is not None else ids + [self.tokenizer.eos_token_id]
        return self._turn_end


def resolve_format(name: str, tokenizer) -> str:
    """`auto`: chat when the tokenizer has a chat template (a chat model is spoken to in its turns: raw
    text makes an instruct model answer worse or not at all), else plain."""
    if name != "auto":
        return name
    return "chat" if getattr(tokenizer, "chat_template", None) else "plain"


def build_format(data, tokenizer, stop_ids: Iterable[int] = ()) -> PlainFormat:
    """The prompt format of a `data` config section (config.DataConfig) for this tokenizer; `stop_ids`: the
    model's stop tokens (rollout.stops.stop_token_ids)."""
    name = resolve_format(data.format, tokenizer)
    if name == "plain":
        if data.system_prompt is not None or data.template_kwargs:
            raise DataError(
                "data.system_prompt / data.template_kwargs need the chat format, and data.format=auto "
                "resolved to plain (the tokenizer has no chat template)"
            )
        return PlainFormat(tokenizer)
    return ChatFormat(tokenizer, stop_ids, data.system_prompt, data.template_kwargs)


def prompt_format_of(config, tokenizer, stop_ids: Iterable[int] = ()) -> PlainFormat:
    """The prompt format of a run's config (config.Config) for this tokenizer."""
    return build_format(config.data, tokenizer, stop_ids)
