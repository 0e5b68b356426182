"""The native engine's decode step as its generate loop calls it (decode_loop.py), and the little of the engine a
step reads (`StepModel`). Two steps implement it: the plain step (plain_step.py; eager, or through
torch.compile: compiled.py) and the static step (static_step.py; its buffers allocated once, replayed as
CUDA graphs: graphs.py). Which one a call gets is decided once, by how the engine decodes
(choices.decoding).

A call runs: `rows` (its decoding state, rows.py), `views` (its cache), `start`; then, each decode step,
`sample` (the active rows' next tokens from their pending logits) and `forward` (the running rows' fed
tokens through the model, giving their next pending logits, which the loop hands to the rows; on a CUDA
device the static step's is sent before the step's tokens are read, for every active row); and `stats`
once the call ends. A step reads the rows and never writes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from everyprompt.rollout.native.cache import KVCache
from everyprompt.rollout.native.rows import Rows

if TYPE_CHECKING:
    from everyprompt.rollout.native.call import Call


@dataclass(frozen=True)
class StepModel:
    """What a decode step reads of its engine: the decode forward `decode(layers, tokens [B], positions [B],
    caches, record) -> (logits [B, V], routes)` and the sampler `sample(logits, seeds, positions,
    temperature, top_p, greedy) -> (tokens, log-probs, entropies)` (eager, or torch.compile's: `compiled`),
    the engine's cache, its vocabulary size, pad token and device, and the precision its decode computes in
    (a graph's replay is judged at it: trust.py)."""

    decode: Callable
    sample: Callable
    cache: KVCache
    vocab_size: int
    pad_token_id: int
    device: torch.device
    precision: torch.dtype
    compiled: bool = False


class DecodeStep(ABC):
    """One generate call's decode step. `static`: it runs on buffers allocated once (the static step);
    `compiled`: its forward runs through torch.compile."""

    static: bool = False

    def __init__(self, model: StepModel):
        self.model = model

    @property
    def compiled(self) -> bool:
        return self.model.compiled

    def rows(self, pool: int) -> Rows:
        """The call's decoding state: `pool` rows."""
        model = self.model
        return Rows(pool, model.vocab_size, model.device)

    @abstractmethod
    def views(self, pool: int, width: int, shared: bool) -> list[tuple[torch.Tensor, ...]]:
        """The call's cache: per layer, views of `pool` rows and at least `width` positions (`shared`: the
        engine's own storage, else a cache of the call's own)."""

    def start(self, caches, layers, pool: int) -> None:  # noqa: B027 (the plain step has nothing to set up)
        """The call begins: its cache views `caches` and decode layers `layers`."""

    def compacts(self, running: list[int], pool: int) -> bool:
        """Whether, with nothing left to admit, the rows `running` (host, ascending) of a pool of `pool`
        move to rows [0, n) and the others are dropped: whenever any row is idle, as a plain step's cost
        follows its rows (on a CPU, most of all), and copying the cache is cheaper than idle rows."""
        return len(running) < pool

    @abstractmethod
    def sample(
        self, state: Rows, active: list[int], index: torch.Tensor, settings
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens, log-probs and entropies [n] the rows `active` (host) / `index` (device) sample from
        their pending logits (`state.step`: their counts of sampled tokens, the noise's counter);
        `settings`: the call's (temperature, top_p, greedy), or each active row's tensors."""

    @abstractmethod
    def forward(
        self, call: Call, running: list[int], running_index: torch.Tensor, fed: torch.Tensor
    ) -> torch.Tensor | None:
        """`fed` [n] into rows `running` (host, ascending) / `running_index` (device) at their lengths, through
        the call's layers and cache; their routes go into the call's record. Returns their next-token logits
        [n, V] for the rows (`Rows.fed`), or None where the step wrote them into the buffers the rows' pending
        logits view (the static step's graph)."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """The call's figures of this step (merged into the engine's `stats`)."""
