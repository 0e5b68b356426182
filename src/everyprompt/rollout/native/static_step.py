"""The native engine's static decode step: a step whose every input and output lives in a buffer
allocated once per engine, so that it can be captured as a CUDA graph (graphs.py) and replayed.

A step has two phases, each one body over rows [0, b) of the buffers, b the step's bucket (graphs.py):
- `sample`: the pending logits [b, V] of each row, its seed and its count of sampled tokens (the sampler's
  noise is a pure function of seed and count) and the sampling settings (the call's, baked into the
  graph, or each row's, from buffers) give the sampled tokens, their log-probs and entropies [b];
- `forward`: the fed tokens [b] at each row's cache length [b] go through the model, writing each row's key
  and value at that position (in place, at device-side positions) and attending over the cache's whole
  width, masked by each row's length read from the device; the next-token logits [b, V] go into the
  pending logits, and each MoE layer's experts and router logits into the route buffers.
Nothing in a body reads the device back, branches on a device value, or keeps what it allocates: what
changes between steps is device data. The loop around it (decode_loop.py) fills the fed tokens and per-row
settings before a step, and after it copies out what it keeps (tokens, log-probs, routes) from the rows
that run, then reads the sampled tokens back with their log-probs and entropies: the step's one sync
(on a CUDA device, after the next forward is sent).

Padding rows are inert: rows of the bucket that do not run this step (free, finished, waiting for an
environment, or past the call's pool) are fed the pad token at their own row's length (a row beyond the
call's rows at length 0), so they write only cache positions of their own row that a later occupant
writes before reading, and nothing of theirs is copied out. On a GPU the MoE layer's expert blocks are
sized for the worst case (moe.py), so a padding token takes no other token's place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from everyprompt.rollout.native.call import Call
from everyprompt.rollout.native.graphs import StepGraphs
from everyprompt.rollout.native.rows import Rows
from everyprompt.rollout.native.step import DecodeStep, StepModel
from everyprompt.rollout.native.trust import Output

# the share of a replay's recorded experts that may differ from the eager step's: a router's near-tie goes
# either way under one unit of rounding (trust.py); a graph that routes wrongly differs in far more
ROUTE_FLIPS = 0.02


@dataclass
class StepBuffers:
    """The static step's buffers, `rows` rows each (row i is cache row i), on the engine's device."""

    fed: torch.Tensor  # [N] int64: the token each row is fed this step
    length: torch.Tensor  # [N] int64: tokens in each row's cache (the fed token's position)
    step: torch.Tensor  # [N] int64: tokens sampled so far (the sampler's noise counter)
    seed: torch.Tensor  # [N] int64
    logits: torch.Tensor  # [N, V] float32: each row's pending next-token logits
    temperature: torch.Tensor  # [N, 1] float32: per-row settings (a server's rows each ask their own)
    top_p: torch.Tensor  # [N, 1] float32
    greedy: torch.Tensor  # [N] bool
    sampled: torch.Tensor  # [N] int64: the sample phase's tokens ...
    logprobs: torch.Tensor  # [N] float32: ... their log-probs ...
    entropies: torch.Tensor  # [N] float32: ... and the entropies of their distributions
    routes: torch.Tensor | None = None  # [N, L_moe, k] int16: the forward's experts per MoE layer
    router_logits: torch.Tensor | None = None  # [N, L_moe, E] float32

    @classmethod
    def allocate(cls, rows: int, vocab_size: int, device, moe: tuple[int, int, int] | None = None):
        """Buffers of `rows` rows; `moe` (layers, top_k, experts) for a mixture-of-experts model."""

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        long = torch.long
        return cls(
            fed=zeros(rows, dtype=long),
            length=zeros(rows, dtype=long),
            step=zeros(rows, dtype=long),
            seed=zeros(rows, dtype=long),
            logits=zeros(rows, vocab_size),
            temperature=torch.ones(rows, 1, device=device),
            top_p=torch.ones(rows, 1, device=device),
            greedy=zeros(rows, dtype=torch.bool),
            sampled=zeros(rows, dtype=long),
            logprobs=zeros(rows),
            entropies=zeros(rows),
            routes=None if moe is None else zeros(rows, moe[0], moe[1], dtype=torch.int16),
            router_logits=None if moe is None else zeros(rows, moe[0], moe[2]),
        )

    @property
    def rows(self) -> int:
        return self.fed.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


class StaticStep(DecodeStep):
    """The static step of one engine (step.py's interface): its buffers back the call's `Rows`, its cache
    is the engine's whole storage, and each phase runs through its graphs."""

    static = True

    def __init__(self, model: StepModel, buffers: StepBuffers, graphs: StepGraphs):
        super().__init__(model)
        self.buffers, self.graphs = buffers, graphs
        self.caches: list[tuple[torch.Tensor, ...]] = []  # the cache storage, whole: rows [0, N)
        self.layers: list | None = None  # the call's decode layers (kept: graphs read their addresses)

    def views(self, pool: int, width: int, shared: bool):
        """The call's cache: the first `pool` rows of the engine's storage, its whole width (graphs are
        dropped if the storage had to grow)."""
        whole = self.model.cache.whole(self.buffers.rows, width)
        if whole is not self.caches:
            self.graphs.reset()
        self.caches = whole
        return [tuple(t[:pool] for t in entry) for entry in whole]

    def rows(self, pool: int) -> Rows:
        model = self.model
        return Rows(pool, model.vocab_size, model.device, self.buffers)

    def start(self, caches, layers, pool: int) -> None:
        """A call's decode layers (graphs are dropped if they moved); every row's length starts at 0 (a
        padding row, fed at its length, stays within the storage)."""
        if layers is not self.layers:
            self.graphs.reset()
        self.layers = layers
        self.buffers.length.zero_()
        self.graphs.start_call()

    def compacts(self, running: list[int], pool: int) -> bool:
        """Only where it takes the step to a smaller bucket: a step runs its bucket's rows whichever of them
        are idle, so moving rows within a bucket buys nothing and costs a copy of every layer's cache (two
        kernels a tensor, after the step's read back, with the device idle). The buckets the steps run are
        those that compacting at every finished row would give."""
        padded = self.graphs.padded
        return padded(len(running)) < padded(running[-1] + 1)

    def sample(self, state: Rows, active: list[int], index: torch.Tensor, settings):
        """The sample phase for rows `active` (host) / `index` (device): their tokens, log-probs and
        entropies. `settings`: the call's (temperature, top_p, greedy), or each active row's tensors; the
        phase reads every row's count of sampled tokens from the buffers."""
        buffers = self.buffers
        per_row = isinstance(settings[2], torch.Tensor)
        if per_row:
            temperature, top_p, greedy = settings
            buffers.temperature[index] = temperature
            buffers.top_p[index] = top_p
            buffers.greedy[index] = greedy

        def body(rows: int) -> None:
            options = (
                (buffers.temperature[:rows], buffers.top_p[:rows], buffers.greedy[:rows])
                if per_row
                else settings
            )
            tokens, logprobs, entropies = self.model.sample(
                buffers.logits[:rows], buffers.seed[:rows], buffers.step[:rows], *options
            )
            buffers.sampled[:rows].copy_(tokens)
            buffers.logprobs[:rows].copy_(logprobs)
            buffers.entropies[:rows].copy_(entropies)

        def outputs(rows: int) -> list[Output]:  # sampled from the same logits: the same tokens
            return [
                Output(buffers.sampled[:rows]),
                Output(buffers.logprobs[:rows]),
                Output(buffers.entropies[:rows]),
            ]

        self.graphs.run("sample", "rows" if per_row else tuple(settings), active[-1] + 1, body, outputs)
        return buffers.sampled[index], buffers.logprobs[index], buffers.entropies[index]

    def forward(self, call: Call, running: list[int], running_index, fed) -> None:
        """The forward phase: `fed` [n] into rows `running` (host, ascending) / `running_index` (device),
        the bucket's other rows fed the pad token; their next-token logits go to the buffers the rows'
        pending logits view (so None is returned), their routes into the call's record when it records."""
        buffers, record = self.buffers, call.record
        routes = record is not None and record.routes is not None
        router_logits = record is not None and record.logits is not None
        # the recorded buffers, by the field of each MoE layer's (experts, router logits) they take
        recorded = [(field, buffer) for field, (wanted, buffer) in enumerate(
            ((routes, buffers.routes), (router_logits, buffers.router_logits))) if wanted]  # fmt: skip
        buffers.fed.fill_(self.model.pad_token_id)
        buffers.fed[running_index] = fed

        def body(rows: int) -> None:
            caches = [tuple(t[:rows] for t in entry) for entry in self.caches]
            out, captured = self.model.decode(
                self.layers, buffers.fed[:rows], buffers.length[:rows], caches, bool(recorded)
            )
            buffers.logits[:rows].copy_(out)
            for field, buffer in recorded:
                buffer[:rows].copy_(torch.stack([layer[field][:, 0] for layer in captured], dim=1))

        precision = self.model.precision

        def outputs(rows: int) -> list[Output]:  # computed at the step's precision (trust.py)
            judged = [Output(buffers.logits[:rows], precision)]
            for field, buffer in recorded:  # the experts picked from rounded scores may flip on a near-tie
                judged.append(Output(buffer[:rows], precision, flips=ROUTE_FLIPS if field == 0 else 0.0))
            return judged

        self.graphs.run("forward", (routes, router_logits), running[-1] + 1, body, outputs)
        if record is not None:
            record.put(
                buffers.routes[running_index] if routes else None,
                buffers.router_logits[running_index] if router_logits else None,
                running_index,
                buffers.length[running_index],
            )
        return None

    def stats(self) -> dict[str, float]:
        return {"static_step": 1.0, **self.graphs.stats()}
