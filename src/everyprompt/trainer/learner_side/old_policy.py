"""The old policy's values of a batch, before its update: the engine's log-probs standing for them
(`rl.old_logprobs=rollout`), or the trainer's own no-grad pass (`recompute`), with its entropies when the
loss needs them and its routes under router replay; stored on the batch, with the pass's mismatch against
the engine (`mismatch/*`)."""

from __future__ import annotations

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.trainer.learner_side.mismatch import batch_mismatch, fed_tokens
from everyprompt.trainer.learner_side.passes import Passes


class OldPolicy:
    def __init__(self, passes: Passes, loss: str, needs_entropy: bool, router_replay: str):
        self.passes, self.loss, self.needs_entropy = passes, loss, needs_entropy
        # only r3 replays in this pass: r2 records the trainer's own routes, which the update then replays
        self.routes_key = "routes" if router_replay == "r3" else None

    def from_rollout(self, batch: RolloutBatch) -> None:
        """`rl.old_logprobs=rollout`: the engine's log-probs (and entropies) stand for the old policy's."""
        batch.old_logprobs = batch.rollout_logprobs
        if self.needs_entropy:
            if batch.rollout_entropies is None:
                raise RuntimeError(
                    f"rl.loss={self.loss} needs the old policy's token entropies, which this rollout "
                    "engine does not return; set rl.old_logprobs=recompute"
                )
            batch.old_entropies = batch.rollout_entropies

    @torch.no_grad()
    def recompute(self, batch: RolloutBatch, rows: list[int] | None = None) -> dict[str, float]:
        """The trainer's pre-update log-probs, entropies (when the loss needs them) and routes of `rows` of
        `batch` (all by default), stored on it (None for the other rows); returns their mismatch metrics."""
        rows = list(range(len(batch))) if rows is None else rows
        logprobs: list[tuple[tuple[int, int], list[torch.Tensor]]] = []
        entropies: list[tuple[tuple[int, int], list[torch.Tensor]]] = []
        routes: list[tuple[tuple[int, int], list[torch.Tensor]]] = []
        forward = self.passes.forward
        for key, chunk in self.passes.micro_batches(rows, batch.token_counts(rows)):
            padding = chunk is None  # fsdp2: a pass that keeps the ranks' collectives in step
            chunk = rows[:1] if padding else chunk
            data = self.passes.padded(batch, chunk)
            recorded = [] if forward.router is not None else None
            logp, entropy = forward(data, slice(None), self.needs_entropy, recorded, self.routes_key)
            if padding:
                continue
            routes.append((key, fed_tokens(batch, chunk, recorded or [])))
            logprobs.append((key, batch.completion_values(chunk, logp)))
            if entropy is not None:
                entropies.append((key, batch.completion_values(chunk, entropy)))
        order = self.passes.parallel.in_order
        in_rows, routes_in_rows = order(logprobs), order(routes)
        batch.old_logprobs = _spread(in_rows, rows, len(batch))
        batch.old_entropies = _spread(order(entropies), rows, len(batch))
        batch.old_routes = _spread(routes_in_rows, rows, len(batch))
        return batch_mismatch(batch, rows, in_rows, routes_in_rows or None)


def _spread(values: list, rows: list[int], every: int) -> list | None:
    """Per-row values of `rows` as one entry per batch row (None elsewhere); None without values."""
    if not values:
        return None
    out: list = [None] * every
    for row, value in zip(rows, values):
        out[row] = value
    return out
