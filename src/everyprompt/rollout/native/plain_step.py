"""The plain decode step of a native generate call (step.py's interface): eager operators, or the compiled
step of compiled.py. Each step runs the rows up to the last running one, in a cache of the call's own
layout; the static step (static_step.py) is the one that can be captured."""

from __future__ import annotations

import torch

from everyprompt.rollout.native.cache import readable
from everyprompt.rollout.native.call import Call
from everyprompt.rollout.native.rows import Rows
from everyprompt.rollout.native.step import DecodeStep


class PlainStep(DecodeStep):
    """Eager: each step reads the rows up to the last running one and the cache up to the furthest
    position (on the CPU a step's cost follows them). Compiled: the call's whole cache width, masked."""

    def views(self, pool: int, width: int, shared: bool):
        # a compiled step reads the call's whole cache width (masked), so its cache is contiguous and of one
        # layout for the whole call
        return self.model.cache.views(pool, width, shared, exact=self.compiled)

    def sample(self, state: Rows, active: list[int], index: torch.Tensor, settings):
        """The active rows' samples, from their pending logits, seeds and counts of sampled tokens."""
        return self.model.sample(state.logits[index], state.seed[index], state.step[index], *settings)

    def forward(self, call: Call, running: list[int], running_index, fed):
        model, state, caches, record = self.model, call.rows, call.caches, call.record
        if len(running) == len(state.request):  # every row runs (slots ascend): fed is in row order
            tokens = fed
        else:
            tokens = torch.full(
                (len(state.request),), model.pad_token_id, dtype=torch.long, device=model.device
            )
            tokens[running_index] = fed
        positions, seen = state.length, caches  # idle rows write at their own row's stale length
        if not self.compiled:  # the rows and cache slots this step reads, known on the host: the rows
            top = running[-1] + 1  # past the last running one are left out (a live pool keeps them)
            seen = readable(caches, max(state.host_length[:top]) + 1, top)
            tokens, positions = tokens[:top], positions[:top]
        logits, routes = self.model.decode(call.layers, tokens, positions, seen, record is not None)
        if record is not None:
            record.store(routes, running_index, state.length[running_index], step=0)
        return logits[running_index]

    def stats(self) -> dict[str, float]:
        return {"static_step": 0.0}
