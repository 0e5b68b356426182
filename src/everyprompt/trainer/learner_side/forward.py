"""The learner's forward passes: the policy's token log-probs under router replay and the training
precision, the KL reference's (a frozen copy, or a LoRA policy's own base with its adapters off) and a
distillation teacher's."""

from __future__ import annotations

import torch

from everyprompt.config import Config, ConfigError
from everyprompt.models.lora import reference_forward
from everyprompt.models.precision import autocast, parameters_in_float32
from everyprompt.models.replay import ReplayError, RouterReplay
from everyprompt.models.slices import checked_layers, checked_model
from everyprompt.trainer.learner_side.head import check_head
from everyprompt.trainer.learner_side.logprobs import check_packing, token_logprobs


def policy_router(model, replay: str) -> RouterReplay | None:
    """The model's MoE router hooks (replay and route metrics); None for a dense model unless replay is on."""
    try:
        return RouterReplay(model)
    except ReplayError as err:
        if replay != "off":
            raise ConfigError(f"config key 'rl.router_replay': {err}") from None
        return None


class PolicyForward:
    """`forward(data, rows, ...)`: the policy's log-probs of rows of a `RolloutBatch.padded` dict;
    `reference_logprobs(data, rows)`: the KL reference's."""

    def __init__(self, model, router, reference, base_as_reference: bool, config: Config, pad_id: int):
        self.model, self.router, self.reference = model, router, reference
        self.base_as_reference = base_as_reference
        self.config, self.pad_id = config, pad_id

    def __call__(
        self, data: dict, rows: slice, with_entropy=False, recorded=None, routes_key=None, hold=None
    ):
        """The policy's `token_logprobs` of rows `rows`, packed when configured, under the training precision
        (`model.dtype`): it replays `data[routes_key]` when given (kept in force until the callables put in
        `hold` run, when given: see token_logprobs) and records the routes it used into `recorded` (a list)
        when given."""
        return self._logprobs(
            self.model,
            data,
            rows,
            with_entropy=with_entropy,
            recorded=recorded,
            routes_key=routes_key,
            hold=hold,
            policy=True,
        )

    def check(self, batch) -> bool:
        """Before the first training forward: packed and one-by-one log-probs agree for this model, and so
        do the chunked head's and its own logits' (else an error); True. Both compare in float32: a float32
        policy is checked as it is, one with a base held in bf16 (`model.frozen_dtype`) widened while they
        run, or, large, on a float32 slice of its first layers (`rollout.parity_layers`, models/slices.py)
        where widening would copy it whole."""
        sequences = [batch.prompt_ids[i] + batch.completion_ids[i] for i in range(min(2, len(batch)))]
        layers = checked_layers(self.config.rollout.parity_layers, self.model, only_narrow=True)
        model = checked_model(self.model, layers, self.config.model)
        with parameters_in_float32(model):
            if self.config.model.pack_sequences:
                check_packing(model, (sequences * 2)[:2], self.pad_id)
            if self.config.model.logprob_chunk:
                check_head(model, sequences[0], self.config.model.logprob_chunk)
        return True

    @torch.no_grad()
    def reference_logprobs(self, data: dict, rows: slice) -> dict[str, torch.Tensor]:
        """The KL reference's log-probs of rows `rows` as the loss's `ref_logp` (none without KL); its own
        routing, nothing recorded."""
        if self.reference is not None:
            return {"ref_logp": self.frozen_logprobs(self.reference, data, rows)}
        if self.base_as_reference:
            with reference_forward(self.model):
                return {"ref_logp": self.frozen_logprobs(self.model, data, rows)}
        return {}

    @torch.no_grad()
    def frozen_logprobs(self, model, data: dict, rows: slice | torch.Tensor) -> torch.Tensor:
        """A frozen model's (the reference's, a teacher's) log-probs of rows `rows` (a slice, or positions)
        of `data`, under the training precision: its own routing, nothing recorded."""
        return self._logprobs(model, data, rows, policy=False)[0]

    def _logprobs(
        self,
        model,
        data,
        rows,
        *,
        with_entropy=False,
        recorded=None,
        routes_key=None,
        hold=None,
        policy: bool,
    ):
        with autocast(model, self.config.model.dtype, self.config.model.cpu_bf16):
            return token_logprobs(
                model,
                data["input_ids"][rows],
                self.config.rollout.temperature,
                with_entropy=with_entropy,
                lengths=data["lengths"][rows].tolist() if self.config.model.pack_sequences else None,
                pad_id=self.pad_id,
                router=self.router if policy else None,
                routes=data[routes_key][rows] if policy and routes_key in data else None,
                recorded=recorded if policy and self.router is not None else None,
                hold=hold if policy else None,
                chunk=self.config.model.logprob_chunk,
                first_targets=(data["prompt_lengths"][rows] - 1).tolist(),
            )
