"""The startup parity check: the rollout engine and the trainer score the same completions.

A fast path that computes a model differently from transformers (a family nobody tested, a setting
missed) would otherwise train on log-probs of the wrong distribution without a word. Before the first
RL step, an fp32 engine of the run's kind samples a few completions of training prompts and the
trainer's forward re-scores them (in fp32 too: a base held in bf16, `model.frozen_dtype`, is widened
for the check, exactly); a mean |log-prob difference| above `rollout.parity_threshold` stops
the run with the gap and the engine named. The figure is logged either way (`parity/logp_abs_diff`).

A large model is checked on a slice of itself (`rollout.parity_layers`): a float32 copy of its first few
decoder layers, with its embeddings, final norm and head, which the engine and the trainer then both
run. A float32 engine of the whole model, and the trainer's model widened to float32 beside it, would
take twice the model's float32 size (about 244 GB for a 30B model); what the check is for, a layer
computed differently by the engine, shows in any layer, so a slice holding every kind of layer the model
has finds it at a small fraction of that.
"""

from __future__ import annotations

import torch

from everyprompt.models.precision import parameters_in_float32
from everyprompt.models.slices import checked_layers, checked_model
from everyprompt.rollout import (
    GenerationRequest,
    SamplingParams,
    UnsupportedModelError,
    make_engine,
    resolve_engine,
)
from everyprompt.rollout.sampling import derive_seed
from everyprompt.trainer.learner_side.logprobs import token_logprobs


class ParityError(UnsupportedModelError):
    """The engine's log-probs of a model are not the trainer's."""


def _trainer_logprobs(model, prompt_ids: list[int], token_ids: list[int], temperature: float) -> torch.Tensor:
    """The completion's log-probs as the learner computes them (`trainer.logprobs.token_logprobs`)."""
    ids = torch.tensor([prompt_ids + token_ids], device=next(model.parameters()).device)
    logprobs, _ = token_logprobs(model, ids, temperature)
    return logprobs[0, len(prompt_ids) - 1 :].cpu()


@torch.no_grad()
def parity_gap(
    model,
    tokenizer,
    engine: str,
    prompt_ids: list[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> dict[str, float]:
    """Mean |engine - trainer| log-prob over the completion tokens of `prompt_ids`, both in fp32."""
    device = next(model.parameters()).device
    requests = [
        GenerationRequest(i, ids, seed=derive_seed(seed, 7919, i)) for i, ids in enumerate(prompt_ids)
    ]
    params = SamplingParams(max_new_tokens, temperature=temperature)
    training = model.training
    model.eval()
    try:
        with parameters_in_float32(model):  # the engine merges from the widened weights too (lora.py)
            fp32 = make_engine(engine, model, tokenizer, len(prompt_ids), precision="fp32", device=device)
            completions = fp32.generate(requests, params)
            del fp32
            gaps = [
                (c.logprobs - _trainer_logprobs(model, c.prompt_ids, c.token_ids, temperature)).abs()
                for c in completions
            ]
    finally:
        model.train(training)
    gap = torch.cat(gaps)
    return {
        "parity/logp_abs_diff": float(gap.mean()),
        "parity/logp_abs_diff_max": float(gap.max()),
        "parity/tokens": float(gap.numel()),
    }


def check_parity(model, tokenizer, config, prompt_ids: list[list[int]]) -> dict[str, float]:
    """`parity_gap` on the first `rollout.parity_prompts` prompts, on the whole model or a slice of it
    (`checked_layers`); ParityError above the threshold."""
    rollout = config.rollout
    engine = resolve_engine(rollout.engine, model.config, rollout.precision)
    layers = checked_layers(rollout.parity_layers, model)
    figures = parity_gap(
        checked_model(model, layers, config.model),
        tokenizer,
        engine,
        prompt_ids[: rollout.parity_prompts],
        temperature=rollout.temperature,
        max_new_tokens=min(rollout.max_new_tokens, 32),
        seed=config.seed,
    )
    figures["parity/layers"] = float(layers or model.config.num_hidden_layers)
    gap = figures["parity/logp_abs_diff"]
    if gap > rollout.parity_threshold:
        where = "" if layers is None else f" (its first {layers} layers, rollout.parity_layers)"
        raise ParityError(
            f"the {engine} engine's log-probs of this {model.config.model_type} model{where} differ from the "
            f"trainer's by {gap:.2e} on average in fp32 (rollout.parity_threshold={rollout.parity_threshold:g}): the engine "
            f"computes the model differently; run it with rollout.engine=hf"
            + (" or report the model" if engine == "hf" else "")
        )
    return figures
