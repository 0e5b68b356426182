"""The behaviour mismatch of an asynchronous run: its batches were sampled by weights some updates older
than the learner's, so the learner's own forward no longer measures the engine. A plain replica of the
policy (no adapters, no sharding), loaded with the weights that sampled a batch, computes its rows'
log-probs and routes as the old-policy pass would (r3 replaying the engine's routes), and `mismatch/*`
compares them with the engine's. It shares nothing with the update, so the rollout thread may use it
while the learner trains.
"""

from __future__ import annotations

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.config import Config
from everyprompt.models.lora import plain_copy
from everyprompt.models.replay import RouterReplay
from everyprompt.trainer.learner_side.forward import PolicyForward
from everyprompt.trainer.learner_side.mismatch import batch_mismatch, fed_tokens


class BehaviourReplica:
    """A plain copy of `model` (taken now: call while nothing trains, or a router could be mid-replay),
    run through the learner's own forward (`PolicyForward`) with no KL reference."""

    def __init__(self, model, with_router: bool, config: Config, pad_id: int):
        self.model = plain_copy(model).eval().requires_grad_(False)
        router = RouterReplay(self.model) if with_router else None
        self.forward = PolicyForward(self.model, router, None, False, config, pad_id)
        self.replayed = "routes" if config.rl.router_replay == "r3" else None  # r3: the engine's routes

    @torch.no_grad()
    def mismatch(self, batch: RolloutBatch, weights: dict[str, torch.Tensor], rows: list[int]) -> dict:
        """`mismatch/*` of `rows` of `batch` against `weights`, the policy that sampled them."""
        self.model.load_state_dict(weights)
        data = batch.padded(rows, self.forward.pad_id, next(self.model.parameters()).device)
        recorded = [] if self.forward.router is not None else None
        logp, _ = self.forward(data, slice(None), recorded=recorded, routes_key=self.replayed)
        routes = fed_tokens(batch, rows, recorded) if recorded else None
        return batch_mismatch(batch, rows, batch.completion_values(rows, logp), routes)
