"""The OpenAI-compatible request bodies `everyprompt serve` accepts (pydantic models: a body that does not
fit is an HTTP 400 naming the field), and the response bodies it writes.

Beyond OpenAI's fields, as vLLM's server does: `return_token_ids` (the prompt's ids as
`prompt_token_ids`, each choice's as `token_ids`) and `seed` (a request's samples depend only on its seed,
never on the batch it decodes in)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Limits(BaseModel):
    """What one request may ask of the server (a request above a bound is a 400 naming it)."""

    max_tokens: int = 512  # new tokens a choice may ask for
    max_prompt_tokens: int = 1024
    max_n: int = 8  # choices a request may ask for
    max_body_bytes: int = 1 << 20


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: passed to the chat template

    role: str
    content: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="ignore")  # OpenAI fields the server does not use (user, ...)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None  # 0 only: the sampled token's log-prob (no top-k alternatives)
    chat_template_kwargs: dict | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _sampled_only(cls, value: int | None) -> int | None:
        return _sampled_logprob_only(value)

    def cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None  # 0: the sampled token's log-prob (no top-k alternatives)
    echo: Literal[False] = False

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, value: int | None) -> int | None:
        return _sampled_logprob_only(value)

    def cap(self) -> int | None:
        return self.max_tokens


def _sampled_logprob_only(value: int | None) -> int | None:
    if value is not None and value != 0:
        raise ValueError(
            f"{value} top alternatives asked; the server returns the sampled token's log-prob only (0)"
        )
    return value


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine -> OpenAI finish reasons


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(pieces: list[str], logprobs: list[float]) -> dict:
    return {
        "content": [
            {"token": piece, "logprob": value, "bytes": list(piece.encode()), "top_logprobs": []}
            for piece, value in zip(pieces, logprobs)
        ]
    }


def completion_logprobs(pieces: list[str], logprobs: list[float]) -> dict:
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": logprobs,
        "top_logprobs": [{} for _ in pieces],
        "text_offset": offsets,
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
