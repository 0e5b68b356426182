"""The plain decode step of a native generate call: eager operators, or the compiled step of compiled.py.
The static step (static.py, replayed as CUDA graphs on a GPU) answers the same calls of the engine's loop:
`views` (the call's cache), `slots` (its decoding state), `start`, `sample` (the active rows' next tokens),
`forward` (the running rows' fed tokens through the model) and `stats`."""

from __future__ import annotations

import torch

from everyprompt.rollout.native.cache import readable
from everyprompt.rollout.native.state import Slots


class PlainStep:
    """Eager: each step reads the rows up to the last running one and the cache up to the furthest
    position (on the CPU a step's cost follows them). Compiled: the call's whole cache width, masked."""

    static = False

    def __init__(self, engine, forward, sample, compiled: bool):
        self.engine, self._forward, self._sample, self.compiled = engine, forward, sample, compiled

    def views(self, pool: int, width: int, shared: bool):
        # a compiled step reads the call's whole cache width (masked), so its cache is contiguous and of one
        # layout for the whole call
        return self.engine.cache.views(pool, width, shared, exact=self.compiled)

    def slots(self, pool: int, max_new_tokens: int) -> Slots:
        engine = self.engine
        return Slots(pool, max_new_tokens, engine.config.vocab_size, engine.device)

    def start(self, caches, layers, pool: int) -> None:
        pass

    def sample(self, state: Slots, active: list[int], index: torch.Tensor, step: torch.Tensor, settings):
        """The active rows' samples; `step` [n]: their counts of sampled tokens (the loop's, read once)."""
        return self._sample(state.logits[index], state.seed[index], step, *settings)

    def forward(self, layers, state: Slots, running: list[int], running_index, fed, caches, record) -> None:
        engine = self.engine
        if len(running) == len(state.request):  # every row runs (slots ascend): fed is in row order
            tokens = fed
        else:
            tokens = torch.full(
                (len(state.request),), engine.pad_token_id, dtype=torch.long, device=engine.device
            )
            tokens[running_index] = fed
        positions, seen = state.length, caches  # idle rows write at their own row's stale length
        if not self.compiled:  # the rows and cache slots this step reads, known on the host: the rows
            top = running[-1] + 1  # past the last running one are left out (a live pool keeps them)
            seen = readable(caches, max(state.host_length[:top]) + 1, top)
            tokens, positions = tokens[:top], positions[:top]
        logits, routes = self._forward(layers, tokens, positions, seen, record is not None)
        state.logits[running_index] = logits[running_index]
        if record is not None:
            record.store(routes, running_index, state.length[running_index], step=0)

    def stats(self) -> dict[str, float]:
        return {"static_step": 0.0}
