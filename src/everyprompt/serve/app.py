"""The HTTP routes of `everyprompt serve` (FastAPI): `/v1/chat/completions`, `/v1/completions` (both with
streaming, log-probs and token ids), `/v1/models` and `/health`; the API key, the bounds on a request,
and OpenAI-shaped errors (a 4xx with a message; the server goes on serving)."""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from everyprompt.rollout.sampling import derive_seed
from everyprompt.serve.engine import Sequence, ServingEngine
from everyprompt.serve.intake import Rollouts
from everyprompt.serve.protocol import (
    FINISH,
    ChatRequest,
    CompletionRequest,
    Limits,
    chat_logprobs,
    completion_logprobs,
    error_body,
    now,
    usage,
)

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request looks for its client having gone


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def create_app(
    server: ServingEngine, model_name: str, limits: Limits, api_key: str | None = None, intake=None
) -> FastAPI:
    """The app over `server`, whose engine thread it starts and, at shutdown (after uvicorn has finished
    the open responses), stops and joins. `intake` (serve/intake.py): a run driven from outside takes
    scored groups at `/v1/rollouts`."""

    @asynccontextmanager
    async def lifespan(_app):
        server.start()
        yield
        await asyncio.to_thread(server.close)

    app = FastAPI(title="everyprompt", docs_url=None, redoc_url=None, lifespan=lifespan)
    tokenizer = server.tokenizer

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(
                    error_body(
                        "a valid API key is required: Authorization: Bearer KEY", "authentication_error"
                    ),
                    status_code=401,
                )
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            return JSONResponse(
                error_body(f"the request body is {size} bytes; at most {limits.max_body_bytes}"),
                status_code=413,
            )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, err: RequestValidationError):
        problem = err.errors()[0]
        if problem.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the request body is not valid JSON ({problem.get('msg')})"), 400)
        where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body")
        message = f"{where}: {problem.get('msg')}" if where else str(problem.get("msg"))
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(_request: Request, err: RequestError):
        return JSONResponse(error_body(err.message, param=err.param), status_code=err.status)

    @app.get("/health")
    async def health():
        return {"status": "ok" if server.failure is None else "failed", **server.load()}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": now(), "owned_by": "everyprompt"}],
        }

    if intake is not None:

        @app.post("/v1/rollouts")
        async def rollouts(body: Rollouts):
            try:
                problem = intake.add(body)
            except OSError as err:  # the journal could not be written (a full disk): nothing was queued
                raise RequestError(
                    503, f"the run could not write the groups down ({err}); none was kept: post them again"
                ) from None
            if problem:
                raise RequestError(400, problem, "groups")
            return {"accepted": len(body.groups), "queued": intake.queued, "version": server.version}

        @app.get("/v1/rollouts")
        async def rollouts_state():
            return {"queued": intake.queued, "received": intake.received, "version": server.version}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(400, "this model has no chat template: use /v1/completions", "messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **(body.chat_template_kwargs or {})
            )
        except Exception as err:  # the template's own error, e.g. roles out of order
            raise RequestError(
                400, f"the chat template cannot render these messages: {err}", "messages"
            ) from None
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        return await respond(body, request, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer(body.prompt).input_ids
        else:
            prompt_ids = list(body.prompt)
            vocab = len(tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise RequestError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return await respond(body, request, prompt_ids, chat=False)

    async def respond(body, request: Request, prompt_ids: list[int], chat: bool):
        cap = check_bounds(body, prompt_ids, limits)
        events: asyncio.Queue = asyncio.Queue()
        stops = body.stop_strings()
        sequences = [Sequence(i, events, tokenizer, stops) for i in range(body.n)]
        seed = body.seed if body.seed is not None else secrets.randbits(62)
        for sequence in sequences:
            seed_i = seed if body.n == 1 else derive_seed(seed, sequence.index)
            try:
                server.submit(sequence, prompt_ids, cap, body.temperature, body.top_p, seed_i)
            except (RuntimeError, ValueError) as err:
                for started in sequences:
                    server.cancel(started)
                raise RequestError(503 if isinstance(err, RuntimeError) else 400, str(err)) from None
        answer = Answer(body, sequences, prompt_ids, model_name, chat)
        if body.stream:
            return StreamingResponse(stream(answer, events), media_type="text/event-stream")
        watcher = asyncio.create_task(watch(request, sequences))
        try:
            async for _ in updates(sequences, events):
                pass
        finally:
            watcher.cancel()
            free(sequences)
        if any(s.finish == "error" for s in sequences):
            raise RequestError(500, f"the serving engine failed: {server.failure}")
        return answer.whole()

    async def updates(sequences: list[Sequence], events: asyncio.Queue):
        """Each sequence as an event changes it, until all are finished (a stop string the server found
        tells the engine to drop the row)."""
        while any(s.finish is None for s in sequences):
            index, event = await events.get()
            sequence = sequences[index]
            if sequence.apply(event) and sequence.finish == "stop":
                server.cancel(sequence)
            yield sequence

    def free(sequences: list[Sequence]) -> None:
        """The rows of the sequences still running (their client is gone, or the request failed)."""
        for sequence in sequences:
            if sequence.finish is None:
                server.cancel(sequence)

    async def watch(request: Request, sequences: list[Sequence]) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                free(sequences)
                return

    async def stream(answer: Answer, events: asyncio.Queue):
        try:
            for chunk in answer.opening():
                yield sse(chunk)
            async for sequence in updates(answer.sequences, events):
                chunk = answer.chunk(sequence)
                if chunk is not None:
                    yield sse(chunk)
            if answer.body.stream_options and answer.body.stream_options.include_usage:
                yield sse(answer.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the stream is cancelled) or it ended
            free(answer.sequences)

    return app


def check_bounds(body, prompt_ids: list[int], limits: Limits) -> int:
    """The request's token cap; RequestError for a request above the server's bounds."""
    if not prompt_ids:
        raise RequestError(400, "the prompt is empty", "prompt")
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise RequestError(
            400, f"the prompt has {len(prompt_ids)} tokens; at most {limits.max_prompt_tokens}", "messages"
        )
    if body.n > limits.max_n:
        raise RequestError(400, f"n={body.n}; at most {limits.max_n}", "n")
    cap = body.cap() or limits.max_tokens
    if cap > limits.max_tokens:
        raise RequestError(400, f"max_tokens={cap}; at most {limits.max_tokens}", "max_tokens")
    return cap


def sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


class Answer:
    """The response bodies of one request: whole, or as stream chunks."""

    def __init__(self, body, sequences: list[Sequence], prompt_ids: list[int], model: str, chat: bool):
        self.body, self.sequences, self.prompt_ids, self.chat = body, sequences, prompt_ids, chat
        prefix = "chatcmpl" if chat else "cmpl"
        self.head = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": now(), "model": model}
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, sequence: Sequence, tokens: list[int], values: list[float]):
        wanted = self.body.logprobs if self.chat else self.body.logprobs is not None
        if not wanted:
            return None
        pieces = sequence.pieces(tokens)
        return chat_logprobs(pieces, values) if self.chat else completion_logprobs(pieces, values)

    def _usage(self) -> dict:
        return usage(len(self.prompt_ids), sum(len(s.tokens) for s in self.sequences))

    def whole(self) -> dict:
        choices = []
        for sequence in self.sequences:
            choice = {"index": sequence.index, "finish_reason": FINISH.get(sequence.finish, "stop")}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": sequence.text}
            else:
                choice["text"] = sequence.text
            choice["logprobs"] = self._logprobs(sequence, sequence.tokens, sequence.logprobs)
            if self.body.return_token_ids:
                choice["token_ids"] = sequence.tokens
            choices.append(choice)
        out = {**self.head, "object": self.object, "choices": choices, "usage": self._usage()}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def _chunk(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head, "object": kind, "choices": choices}

    def opening(self) -> list[dict]:
        """Chat streams open each choice with the assistant's role (as OpenAI's do)."""
        if not self.chat:
            return []
        first = self._chunk(
            [
                {"index": s.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for s in self.sequences
            ]
        )
        if self.body.return_token_ids:
            first["prompt_token_ids"] = self.prompt_ids
        return [first]

    def chunk(self, sequence: Sequence) -> dict | None:
        text, tokens, values = sequence.delta()
        if not text and not tokens and sequence.finish is None:
            return None
        finish = None if sequence.finish is None else FINISH.get(sequence.finish, "stop")
        choice: dict = {"index": sequence.index, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(sequence, tokens, values)
        if self.body.return_token_ids:
            choice["token_ids"] = tokens
        chunk = self._chunk([choice])
        if not self.chat and self.body.return_token_ids and sequence.sent_tokens == len(tokens):
            chunk["prompt_token_ids"] = self.prompt_ids  # with a completion stream's first chunk
        return chunk

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self._usage()}
