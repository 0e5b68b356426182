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
        self.live = None  # the engine's live request source it was submitted to

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
        searched = len(self.text)  # stop strings were looked for up to here (minus their own length)
        self._detokenize()
        for stop in self.stops:
            at = self.text.find(stop, max(0, searched - len(stop) + 1))
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
    (the cache's width is `max_prompt_tokens + max_tokens` per row).

    `reload(state_dict)` puts new weights in (a run driven from outside, docs/serving.md): the requests in
    flight finish on the old weights, those that arrive meanwhile wait for the new ones; `version` counts
    the reloads."""

    def __init__(self, engine, tokenizer, max_prompt_tokens: int, max_tokens: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.live = LiveRequests(max_prompt_tokens)  # the generate call requests join now
        self.params = SamplingParams(max_new_tokens=max_tokens)  # each row samples by its own settings
        self.thread = threading.Thread(target=self._run, name="everyprompt-serve-engine", daemon=True)
        self.failure: BaseException | None = None
        self.version = 0
        self.sampled_before = 0  # tokens sampled by earlier generate calls
        self._lock = threading.Lock()
        self._weights = None  # the next weights, loaded between generate calls
        self._loaded = threading.Event()
        self._stopping = False

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                live = self.live
                for completion in self.engine.generate(live, self.params):
                    live.done(completion.request_id)
                    live.entries[completion.request_id].on_finish(completion.finish_reason)
                with self._lock:
                    self.sampled_before += live.sampled_tokens
                    if self._weights is not None:
                        self.engine.load_weights(self._weights)
                        self._weights, self.version = None, self.version + 1
                        self._loaded.set()
                    if self._stopping:
                        return
        except BaseException as err:  # every waiting client hears of it; the server answers 500
            self.failure = err
            log.exception("the serving engine stopped")
            for entry in [*live.entries, *self.live.entries]:
                entry.on_finish("error")
            self._loaded.set()

    def reload(self, state_dict, timeout: float | None = None) -> None:
        """Serve `state_dict` from now on: once the generate call in progress has finished its requests
        (new ones wait for the next call), the weights are loaded and the next call starts."""
        with self._lock:
            self._loaded.clear()
            self._weights = state_dict
            old, self.live = self.live, LiveRequests(self.max_prompt_tokens)
            old.close()
        if not self._loaded.wait(timeout) or self.failure is not None:
            raise RuntimeError(
                f"the serving engine did not take the new weights ({self.failure or 'timed out'})"
            )

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
        with self._lock:
            sequence.live = self.live
            sequence.engine_index = self.live.submit(entry)

    def cancel(self, sequence: Sequence) -> None:
        if sequence.engine_index is not None:
            sequence.live.cancel(sequence.engine_index)

    def load(self) -> dict[str, int]:
        """Sequences decoding now and waiting for a row, the tokens sampled since the start, and the
        weights' version."""
        with self._lock:
            live = self.live
            sampled = self.sampled_before + live.sampled_tokens
        return {
            "running": live.running(),
            "waiting": live.waiting(),
            "sampled_tokens": sampled,
            "version": self.version,
        }

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let the running ones end (their clients are gone by now) and join."""
        with self._lock:
            self._stopping = True
            live = self.live
        for index in range(len(live.entries)):
            live.cancel(index)
        live.close()
        self.thread.join(timeout)
