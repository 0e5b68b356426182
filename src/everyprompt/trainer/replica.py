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
from everyprompt.models.precision import autocast
from everyprompt.models.replay import RouterReplay
from everyprompt.trainer.logprobs import token_logprobs
from everyprompt.trainer.mismatch import batch_mismatch, fed_tokens


class BehaviourReplica:
    """A plain copy of `model` (taken now: call while nothing trains, or a router could be mid-replay)."""

    def __init__(self, model, with_router: bool, config: Config, pad_id: int):
        self.model = plain_copy(model).eval().requires_grad_(False)
        self.router = RouterReplay(self.model) if with_router else None
        self.config, self.pad_id = config, pad_id

    @torch.no_grad()
    def mismatch(self, batch: RolloutBatch, weights: dict[str, torch.Tensor], rows: list[int]) -> dict:
        """`mismatch/*` of `rows` of `batch` against `weights`, the policy that sampled them."""
        self.model.load_state_dict(weights)
        data = batch.padded(rows, self.pad_id)
        recorded = [] if self.router is not None else None
        replayed = self.config.rl.router_replay == "r3" and "routes" in data
        with autocast(self.model, self.config.model.dtype):
            logp, _ = token_logprobs(
                self.model,
                data["input_ids"],
                self.config.rollout.temperature,
                lengths=data["lengths"].tolist() if self.config.model.pack_sequences else None,
                pad_id=self.pad_id,
                router=self.router,
                routes=data["routes"] if replayed else None,
                recorded=recorded,
            )
        routes = fed_tokens(batch, rows, recorded) if recorded else None
        return batch_mismatch(batch, rows, batch.completion_values(rows, logp), routes)
