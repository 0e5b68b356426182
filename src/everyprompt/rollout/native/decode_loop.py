"""One native `generate` call's loop (engine.py's `generate`): admit queued requests into free cache rows,
then decode every active row a step at a time, each step's tokens read back once and judged on the host
(appended, stopped, a turn ended: sequences.py), finished rows yielded and refilled.

A step is a sample (the active rows' next tokens from their pending logits) and a forward (the tokens fed,
the next pending logits written): step.py's `DecodeStep`. Where the device runs apart from the host (the
static step on a GPU: `Decoding.overlap`), the forward is sent before the host reads the step's tokens,
fed to every active row, so that the device computes it while the host judges the tokens, finishes rows
and admits others. A row that finished at that step has decoded one token for nothing: its row is freed
all the same, and its next occupant's prefill overwrites what that token wrote. Elsewhere (the CPU, where a
step's cost follows its rows, and the plain step) the host reads first and feeds only the rows that go on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from everyprompt.devices.phases import phase
from everyprompt.devices.placement import read_later
from everyprompt.devices.sdpa import attention_kernels
from everyprompt.rollout.base import Completion, SamplingParams, call_stats
from everyprompt.rollout.native.admit_finish import finish, prefill
from everyprompt.rollout.native.cache import compact
from everyprompt.rollout.native.call import Call
from everyprompt.rollout.native.extend import extend
from everyprompt.rollout.native.queue import LiveRequests, Queue
from everyprompt.rollout.native.rows import Record, on_device
from everyprompt.rollout.native.sequences import Turns, take_tokens
from everyprompt.rollout.native.step import DecodeStep
from everyprompt.rollout.stops import StopStrings

TIMES = ("prefill_s", "decode_s", "sample_s", "extend_s")
COUNTS = ("decode_steps", "sample_steps", "busy", "tokens", "shrinks", "admissions", "extends")


class DecodeCall:
    """The loop of one generate call of `engine` over `source` with `stepper` (the call's decode step);
    iterate it for the completions, then read `stats`. `shared`: the engine's own cache storage."""

    def __init__(
        self, engine, source: Queue | LiveRequests, params: SamplingParams, stepper: DecodeStep, shared
    ):
        self.engine, self.source, self.stepper = engine, source, stepper
        self.began = time.perf_counter()
        self.pool, width = source.pool(engine.batch_size), source.width(params)
        self.overlap = engine.decoding.overlap and stepper.static
        self.stops = StopStrings(engine.tokenizer, params.stop)
        # overlapping, a row that finishes at its limit has its last token fed too: one position more
        caches = stepper.views(self.pool, width + self.overlap, shared)
        layers = engine.call_layers(stepper.static)
        stepper.start(caches, layers, self.pool)
        record = Record.start(engine, params, self.pool, width)
        # the call's rows, cache, record, requests and settings: one owner, which the operations take
        self.call = Call(engine, layers, caches, stepper.rows(self.pool), record, source.requests, params)
        self.clock = dict.fromkeys(TIMES, 0.0) | dict.fromkeys(COUNTS, 0)
        self.indexed: tuple[list[int], torch.Tensor] = (  # the last rows uploaded as an index
            [],
            torch.zeros(0, dtype=torch.long, device=engine.device),
        )
        self.turns = Turns()  # episodes waiting for their environment's answer
        self.pending: list = []  # finished rows' completions waiting for their routes' copy (`_finish`)

    def __iter__(self) -> Iterator[Completion]:
        state, source, turns = self.call.rows, self.source, self.turns
        while True:
            if turns.pending and (ended := self._resolve()):
                yield from self._finish(ended)
            self._admit()
            active = state.active
            if not active:  # nothing running and (after the admission above) nothing queued
                yield from self._ready()
                if turns.pending:  # every running episode waits for its environment
                    turns.wait()
                    continue
                if source.wait():  # a live source: the next arrival
                    continue
                break
            index = self._index(active)
            tick = time.perf_counter()
            with phase("sample"):  # the profiler's ranges (devices/phases.py): nothing otherwise
                fed, logprobs, entropies = self._sample(active, index)
                # the decode step's one read back: its tokens with their log-probs and entropies (float64
                # holds each exactly), so that a finished row's completion needs no read of its own
                read = read_later(torch.stack([fed.double(), logprobs, entropies]))
            sampling = time.perf_counter() - tick
            # overlapping, every active row is fed before the host reads: it judges while the device computes
            if self.overlap:
                self._feed(active, index, fed)
            tick = time.perf_counter()
            with phase("read"):
                tokens, logprobs, entropies = read()
                tokens = [int(token) for token in tokens]
            sampling += time.perf_counter() - tick
            yield from self._ready()  # the last step's finished rows, their routes copied by now
            self.clock["sample_s"] += sampling
            self.clock["sample_steps"] += 1
            self.clock["tokens"] += len(active)
            cancelled = source.sampled(active, tokens, logprobs, state)  # live: streamed, given up
            engine = self.engine
            sampled_now = (tokens, logprobs, entropies)
            finished = take_tokens(self.call, sampled_now, active, self.stops, turns)
            finished += [slot for slot in cancelled if slot not in finished]
            if finished:
                yield from self._finish(finished)
            going_on = [position for position, slot in enumerate(active) if state.request[slot] >= 0]
            self.clock["busy"] += len(going_on) / self.pool
            if not going_on:
                continue
            if not self.overlap and len(going_on) < len(active):
                fed = fed[on_device(going_on, engine.device)]
            running = self._compacted([active[position] for position in going_on])
            if not self.overlap:
                stepped = self._feed(running, None, fed)
                if not (self.stepper.compiled or self.stepper.static):
                    engine.compiler.add_eager(sampling + stepped)

    def _resolve(self) -> list[int]:
        """The episodes whose environment answered: their observations fed (extend.py); returns the slots
        that ended (no observation, an error, the time limit, or the token cap reached by the observation)."""
        ended, answered = self.turns.resolve(self.call.rows, self.call.requests)
        if answered:
            tick = time.perf_counter()
            with phase("extend"):
                capped, forwards = extend(self.call, answered)
            ended += capped
            self.clock["extend_s"] += time.perf_counter() - tick
            self.clock["extends"] += forwards
        return ended

    def _admit(self) -> None:
        """Free rows filled from the source: the admitted prompts prefilled."""
        free = self.call.rows.free
        admitted = self.source.take(len(free)) if free else []
        if not admitted:
            return
        tick = time.perf_counter()
        with phase("prefill"), attention_kernels(self.engine.device):  # not cuDNN's: devices/sdpa.py
            prefill(self.call, admitted, free[: len(admitted)])
        self.clock["prefill_s"] += time.perf_counter() - tick
        self.clock["admissions"] += 1

    def _index(self, rows: list[int]) -> torch.Tensor:
        """`rows` on the device (the active rows' index, uploaded again only when they change)."""
        if self.indexed[0] != rows:
            self.indexed = (rows, on_device(rows, self.engine.device))
        return self.indexed[1]

    def _sample(self, active: list[int], index: torch.Tensor):
        """The active rows' tokens, log-probs and entropies [n] (on the device); their counts of sampled
        tokens advanced."""
        state = self.call.rows
        settings = self.source.sampling(active, state, self.call.params)
        sampled, logprobs, entropies = self.stepper.sample(state, active, index, settings)
        state.count_sampled(index)
        return sampled, logprobs, entropies

    def _feed(self, running: list[int], index: torch.Tensor | None, fed: torch.Tensor) -> float:
        """The forward of `fed` [n] into rows `running` (host, ascending; `index`: on the device, made here
        when None); its host seconds."""
        tick, state = time.perf_counter(), self.call.rows
        index = self._index(running) if index is None else index
        with phase("forward"):  # attention: torch's choice of kernel (devices/sdpa.py says why)
            logits = self.stepper.forward(self.call, running, index, fed)
        state.fed(running, index, logits)
        stepped = time.perf_counter() - tick
        self.clock["decode_s"] += stepped
        self.clock["decode_steps"] += 1
        return stepped

    def _compacted(self, running: list[int]) -> list[int]:
        """With nothing left to admit, the running rows moved to the front and the idle ones dropped where
        that makes the steps cheaper (step.py: `compacts`); the running rows then."""
        state, source = self.call.rows, self.source
        if not (source.drained and not self.turns.pending and self.stepper.compacts(running, state.pool)):
            return running
        kept = on_device(running, self.engine.device)
        self.call.caches = compact(self.call.caches, kept)
        state.select(running, kept)
        if self.call.record is not None:
            self.call.record.select(kept)
        self.clock["shrinks"] += 1
        return list(range(len(running)))

    def _finish(self, slots: list[int]) -> Iterator[Completion]:
        """Free `slots` and yield their completions; overlapping with routes recorded, a step later (after
        the next read, by when the routes' copy has arrived without the host waiting for the forward
        already sent): `_ready`."""
        made = finish(self.call, slots, self.began, self.stops)
        if self.overlap and self.call.record is not None:
            self.pending.append(made)
            return
        # a loop, not `yield from` a list: a value sent into this generator (a Ray rollout worker's generator
        # task sends some: tests/distributed/) would reach the list's iterator, which has no `send`
        for completion in made():  # noqa: UP028
            yield completion

    def _ready(self) -> Iterator[Completion]:
        """The completions whose routes were on their way."""
        pending, self.pending = self.pending, []
        for made in pending:
            for completion in made():  # noqa: UP028 (see `_finish`)
                yield completion

    def stats(self) -> dict[str, float]:
        """The call's figures (once it has ended): throughput, the decode step's own, the compiler's."""
        clock = self.clock
        stats = call_stats(clock, time.perf_counter() - self.began, self.pool)
        stats["sample_ms"] = 1000 * clock["sample_s"] / max(clock["sample_steps"], 1)
        stats["overlapped"] = float(self.overlap)
        if any(request.episode is not None for request in self.call.requests):
            # episodes' observations (extend.py): the forwards that fed them and their seconds
            stats["extends"], stats["extend_s"] = float(clock["extends"]), clock["extend_s"]
        stats.update(self.engine.compiler.stats())
        stats.update(self.stepper.stats())
        return stats
