"""The serving side of the native engine: one generate call over a `LiveRequests` source runs in a thread
for the server's whole life, so requests from every client decode together (continuous batching); each
HTTP request's choices are `Sequence`s that receive their tokens as they are sampled.

Threads: the engine's thread samples and calls each sequence's `on_token` / `on_finish`, which only hand
the event to the server's event loop; decoding text, stop strings and responses happen there."""

from __future__ import annotations

import asyncio
import logging
import threading

from everyprompt.rollout.base import GenerationRequest, SamplingParams
from everyprompt.rollout.native.queue import LiveRequest, LiveRequests

log = logging.getLogger(__name__)


class Sequence:
    """One choice of a request: its tokens, log-probs and text so far. `events` is shared by the request's
    choices: (choice index, (token, logprob)) as tokens come, (choice index, finish reason) at the end."""

    def __init__(self, index: int, events: asyncio.Queue, tokenizer, stops: list[str]):
        self.index, self.events, self.tokenizer, self.stops = index, events, tokenizer, stops
        self.loop = asyncio.get_running_loop()
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finish: str | None = None  # eos | stop | length | error, once finished
        self.hold = max((len(s) for s in stops), default=1) - 1  # text held back: a stop may begin there
        self.sent_text = self.sent_tokens = 0  # what the stream has sent
        self._prefix = self._read = 0  # the decoding window: tokens[_prefix:_read] are already text
        self.engine_index: int | None = None

    # the engine's thread
    def on_token(self, token: int, logprob: float) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, (token, logprob)))

    def on_finish(self, reason: str) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, reason))

    # the event loop
    def apply(self, event) -> bool:
        """Take an event; True if it finished the sequence now (a stop string the server found counts:
        the engine is then told to drop it)."""
        if self.finish is not None:
            return False  # tokens the engine sampled before it heard the sequence was over
        if isinstance(event, str):
            self.finish = event
            if self._read < len(self.tokens):  # a character left unfinished at the end: as it is
                decode = self.tokenizer.decode
                before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
                self.text += decode(self.tokens[self._prefix :], skip_special_tokens=True)[len(before) :]
            return True
        token, logprob = event
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self._detokenize()
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent_text - len(stop)))
            if at >= 0:
                self.text, self.finish = self.text[:at], "stop"
                return True
        return False

    def _detokenize(self) -> None:
        """Extend `text` by the newest tokens, decoding only a window of them (a token's text can depend
        on its neighbours, and a character may span tokens: held until it is whole)."""
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
        now = decode(self.tokens[self._prefix :], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)

    def delta(self) -> tuple[str, list[int], list[float]]:
        """What the stream has not sent yet: text (short of a possible stop string's beginning and of an
        unfinished character), token ids and their log-probs."""
        end = len(self.text) if self.finish else max(self.sent_text, len(self.text) - self.hold)
        text = self.text[self.sent_text : end]
        self.sent_text += len(text)
        tokens, logprobs = self.tokens[self.sent_tokens :], self.logprobs[self.sent_tokens :]
        self.sent_tokens = len(self.tokens)
        return text, tokens, logprobs

    def pieces(self, tokens: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]


class ServingEngine:
    """The engine's thread and the requests it serves. `max_tokens`: the largest cap a request may ask
    (the cache's width is `max_prompt_tokens + max_tokens` per row)."""

    def __init__(self, engine, tokenizer, max_prompt_tokens: int, max_tokens: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.live = LiveRequests(max_prompt_tokens)
        self.params = SamplingParams(max_new_tokens=max_tokens)  # each row samples by its own settings
        self.thread = threading.Thread(target=self._run, name="everyprompt-serve-engine", daemon=True)
        self.failure: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            for completion in self.engine.generate(self.live, self.params):
                self.live.done(completion.request_id)
                entry = self.live.entries[completion.request_id]
                entry.on_finish(completion.finish_reason)
        except BaseException as err:  # every waiting client hears of it; the server answers 500
            self.failure = err
            log.exception("the serving engine stopped")
            for entry in self.live.entries:
                entry.on_finish("error")

    def submit(
        self, sequence: Sequence, prompt_ids: list[int], cap: int, temperature: float, top_p: float, seed: int
    ):
        """Queue `sequence` with its own settings (temperature 0: greedy)."""
        if self.failure is not None:
            raise RuntimeError(f"the serving engine stopped: {self.failure}")
        entry = LiveRequest(
            GenerationRequest(0, list(prompt_ids), seed, cap),
            temperature=temperature or 1.0,
            top_p=top_p,
            greedy=temperature == 0,
            on_token=sequence.on_token,
            on_finish=sequence.on_finish,
        )
        sequence.engine_index = self.live.submit(entry)

    def cancel(self, sequence: Sequence) -> None:
        if sequence.engine_index is not None:
            self.live.cancel(sequence.engine_index)

    def load(self) -> dict[str, int]:
        """Sequences decoding now and waiting for a row, and the tokens sampled since the start."""
        live = self.live
        return {"running": live.running(), "waiting": live.waiting(), "sampled_tokens": live.sampled_tokens}

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let the running ones end (their clients are gone by now) and join."""
        for index in range(len(self.live.entries)):
            self.live.cancel(index)
        self.live.close()
        self.thread.join(timeout)
