"""The state of one native `generate` call besides the KV cache, and its one owner: each cache row's
decoding state (`Rows`), and what the call records per fed position (`Record`: routed experts, router
logits). Row i of every array is cache row i; `select(rows)` keeps rows as the pool shrinks.

`Rows` holds every per-row array and is the only code that writes them: the loop (decode_loop.py) and
what it calls (admit_finish.py, sequences.py, extend.py) change a row through its operations (admit,
count a sample, take a step's tokens, take fed logits, observe, extend, pause, free, select); the decode
steps and the queue read the arrays and never write them. (The static step's graph writes each row's
pending logits into the buffers the rows' tensors view: the captured forward's output, static_step.py.)

The tensors live on the engine's device. The loop decides (who is admitted, who finished, how wide a
step reads the cache) from a host-side mirror kept in step with them, so that a decode step reads back
from the device only its sampled tokens with their log-probs and entropies (one copy, one sync), never
the state it wrote; a finished row's completion is made from the mirror.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from everyprompt.devices.placement import copy_later, upload
from everyprompt.rollout.base import SamplingParams, UnsupportedModelError


def on_device(values: list, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """A host list as a tensor on `device`: one host-to-device copy that does not wait (devices/placement.py:
    `upload`), so the loop's index uploads add no sync to the decode step's one read back."""
    return upload(torch.tensor(values, dtype=dtype), device)


class Record:
    """What a generate call records per fed position besides the sampled tokens, in buffers
    [slots, width, L_moe, ...] indexed like the cache: each MoE layer's top-k experts (`record_routes`,
    int16) and router logits (`record_router_logits`, float32)."""

    def __init__(self, routes: torch.Tensor | None, logits: torch.Tensor | None):
        self.routes, self.logits = routes, logits

    @classmethod
    def start(cls, engine, params: SamplingParams, slots: int, width: int) -> Record | None:
        if not (params.record_routes or params.record_router_logits):
            return None
        routers = [layer.router for layer in engine.layers if layer.router is not None]
        layers = len(routers)
        if not layers:
            wanted = "record_routes" if params.record_routes else "record_router_logits"
            raise UnsupportedModelError(f"{wanted} needs a mixture-of-experts model; this one has no router")
        experts, device = routers[0].shape[1], engine.device
        return cls(
            torch.zeros(slots, width, layers, engine.moe.routing.top_k, dtype=torch.int16, device=device)
            if params.record_routes
            else None,
            torch.zeros(slots, width, layers, experts, device=device)
            if params.record_router_logits
            else None,
        )

    def store(
        self, captured: list, rows: torch.Tensor, columns: torch.Tensor, step: int | None = None
    ) -> None:
        """Write one forward's (experts, logits) per MoE layer, each [B, T, .], into cache rows `rows` at
        positions `columns`: every position of a prefill ([T] columns, step None), or each row's one fed
        token of a decode step ([len(rows)] columns, step 0: rows index the forward's batch too)."""
        values = [
            None if buffer is None else torch.stack([layer[field] for layer in captured], dim=2)
            for field, buffer in enumerate((self.routes, self.logits))
        ]  # [B, T, L_moe, k or E]; only what was asked for is stacked (a replay run records routes alone)
        if step is None:
            self.put(*values, rows[:, None], columns[None, :])
        else:
            self.put(*(None if v is None else v[rows, step] for v in values), rows, columns)

    def put(self, routes, logits, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Write experts and router logits (already stacked over MoE layers, [..., L_moe, k or E]; None
        where not recorded) at cache rows `rows` and positions `columns` (broadcast together)."""
        for values, buffer in ((routes, self.routes), (logits, self.logits)):
            if buffer is not None:
                buffer[rows, columns] = values.to(buffer.dtype)

    def select(self, rows: torch.Tensor) -> None:
        self.routes = None if self.routes is None else self.routes[rows]
        self.logits = None if self.logits is None else self.logits[rows]

    def take(self, rows: torch.Tensor, lengths: list[int]) -> Callable[[], list[dict[str, torch.Tensor]]]:
        """Finished rows' first `lengths` positions, as Completion fields on the host: taken from the buffers
        now (the rows may be refilled next), copied over in one copy per recorded kind for all the rows,
        which the returned function waits for (devices/placement.py: `copy_later`)."""
        copies = [
            (name, copy_later(buffer[rows, : max(lengths)]))
            for name, buffer in (("routed_experts", self.routes), ("router_logits", self.logits))
            if buffer is not None
        ]

        def fields() -> list[dict[str, torch.Tensor]]:
            out: list[dict[str, torch.Tensor]] = [{} for _ in lengths]
            for name, copied in copies:
                for entry, row, length in zip(out, copied(), lengths):
                    entry[name] = row[:length].clone()
            return out

        return fields


@dataclass(frozen=True)
class Admission:
    """Prompts entering free rows: host lists by admitted row, and the same on the device."""

    slots: list[int]  # the rows they enter
    requests: list[int]  # each one's index into the call's requests
    lengths: list[int]  # its prompt's tokens
    limits: list[int]  # its cap on sampled tokens
    on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, lengths, seeds) [n] each


class Rows:
    """Per-row decoding state of one `generate` call (row i of every array is cache row i): tensors on
    `device` for the step, and their host mirror for the loop's decisions. Read anywhere; written only here."""

    STEP = ("length", "step", "seed", "logits")  # what a decode step reads (static.StepBuffers has them)
    # the host mirror, a list each (`__init__` says what): `select` keeps their rows as it keeps STEP's
    HOST = ("request", "host_length", "limit", "tokens", "token_logprobs", "token_entropies", "observed")

    def __init__(self, slots: int, vocab_size: int, device: torch.device, buffers=None):
        """`buffers` (static.StepBuffers): the step tensors are views of the engine's static buffers (whose
        addresses `select` keeps, as it keeps every tensor's)."""
        if buffers is None:
            self.length = torch.zeros(slots, dtype=torch.long, device=device)  # tokens in the cache
            self.step = torch.zeros(slots, dtype=torch.long, device=device)  # tokens sampled so far
            self.seed = torch.zeros(slots, dtype=torch.long, device=device)
            self.logits = torch.zeros(slots, vocab_size, device=device)  # pending next-token logits
        else:
            for name in self.STEP:
                setattr(self, name, getattr(buffers, name)[:slots])
        # the host mirror: index into the call's requests (-1: free), cache length, token limit, the
        # completion's tokens so far with each one's log-prob and entropy (0 for an observation token: not
        # the model's), as the steps' reads brought them, and, for episodes (GenerationRequest.episode), the
        # indices of the completion's tokens that are observation tokens (extend.py)
        self.request = [-1] * slots
        self.host_length = [0] * slots
        self.limit = [0] * slots
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self.token_logprobs: list[array] = [array("f") for _ in range(slots)]  # float32, as sampled
        self.token_entropies: list[array] = [array("f") for _ in range(slots)]
        self.observed: list[list[int]] = [[] for _ in range(slots)]
        self.paused: set[int] = set()  # rows whose episode's environment is answering (sequences.Turns)

    # ------------------------------------------------------------ reading
    @property
    def free(self) -> list[int]:
        return [slot for slot, request in enumerate(self.request) if request < 0]

    @property
    def active(self) -> list[int]:
        return [slot for slot, request in enumerate(self.request) if request >= 0 and slot not in self.paused]

    @property
    def pool(self) -> int:
        return len(self.request)

    # ------------------------------------------------------------ a row's life
    def admit(self, admission: Admission, logits: torch.Tensor) -> None:
        """Prompts prefilled into free rows: their lengths, seeds and pending logits [n, V], no token yet."""
        rows, lengths, seeds = admission.on_device
        self.length[rows] = lengths
        self.step[rows] = 0
        self.logits[rows] = logits
        self.seed[rows] = seeds
        for slot, request, length, limit in zip(
            admission.slots, admission.requests, admission.lengths, admission.limits
        ):
            self.request[slot], self.host_length[slot], self.limit[slot] = request, length, limit
            self.tokens[slot], self.token_logprobs[slot], self.token_entropies[slot] = (
                [],
                array("f"),
                array("f"),
            )

    def count_sampled(self, index: torch.Tensor) -> None:
        """Rows `index` (device) sampled a token: the sampler's noise counter moves on."""
        self.step[index] += 1

    def append(self, slot: int, token: int, logprob: float, entropy: float) -> None:
        """A token the step sampled for row `slot`, as the step's read brought it."""
        self.tokens[slot].append(token)
        self.token_logprobs[slot].append(logprob)
        self.token_entropies[slot].append(entropy)

    def fed(self, running: list[int], index: torch.Tensor, logits: torch.Tensor | None) -> None:
        """Rows `running` (host) / `index` (device) were fed a token: one position more each, and their next
        pending logits [n, V] (None: the static step's graph wrote them into the buffers these view)."""
        if logits is not None:
            self.logits[index] = logits
        self.length[index] += 1
        for slot in running:
            self.host_length[slot] += 1

    def observe(self, slot: int, tokens: list[int]) -> None:
        """An environment's observation `tokens` joins row `slot`'s completion: not the model's tokens
        (log-prob and entropy 0, masked out: `observed`)."""
        count = len(self.tokens[slot])
        self.observed[slot].extend(range(count, count + len(tokens)))
        self.tokens[slot].extend(tokens)
        self.token_logprobs[slot].extend([0.0] * len(tokens))
        self.token_entropies[slot].extend([0.0] * len(tokens))

    def extended(self, slot: int, fed: int, logits: torch.Tensor) -> None:
        """Row `slot` was fed `fed` observation tokens in one forward: its length and its count of sampled
        tokens move on by them (the sampler's noise, as a token a step would have), its pending logits [V]."""
        self.logits[slot] = logits
        self.length[slot] = self.host_length[slot] + fed
        self.step[slot] += fed
        self.host_length[slot] += fed

    def pause(self, slot: int) -> None:
        """Row `slot`'s episode waits for its environment: it is neither sampled nor fed."""
        self.paused.add(slot)

    def resume(self, slot: int) -> None:
        self.paused.discard(slot)

    def free_row(self, slot: int) -> None:
        """Row `slot`'s completion is made: the row is free for the next prompt."""
        self.request[slot], self.observed[slot] = -1, []

    def select(self, rows: list[int], index: torch.Tensor) -> None:
        """Keep `rows` (host indices; `index`: the same on the device), in that order, as rows [0, len(rows))."""
        for name in self.STEP:  # moved within their storage: addresses kept
            values = getattr(self, name)
            values[: len(rows)] = values[index]
            setattr(self, name, values[: len(rows)])
        for name in self.HOST:
            values = getattr(self, name)
            setattr(self, name, [values[row] for row in rows])
