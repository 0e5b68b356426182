"""Who builds the loop's two sides, by `cluster.backend`: the layer that composes them chooses, so the
trainer never knows which backend runs it.

- `local`: the rollout side and a `Learner` in this process, over one model (the learner trains it in
  place).
- `ray`: rollout workers and learner ranks as Ray actors (`distributed/`); Ray is an optional extra,
  imported only when this backend is chosen.

A backend is a function `(config, model, tokenizer, prompts, run_dir, store, reference) -> (rollout side,
learner side, [what to close after the rollout side])`.
"""

from __future__ import annotations

from pathlib import Path

from everyprompt.config import Config
from everyprompt.data.passrate import PassRateStore
from everyprompt.models.lora import apply_lora, is_lora, lora_base_dtype
from everyprompt.trainer import Learner, LocalRolloutSide, RLTrainer


def local_sides(config: Config, model, tokenizer, prompts, run_dir, store, reference):
    """Both sides in this process, over `model`; nothing more to close. `external.enabled`: the rollout
    side is the run's endpoint, fed by an outside driver (serve/driven.py)."""
    learner = Learner(config, model, tokenizer.pad_token_id, reference)
    if config.external.enabled:
        from everyprompt.serve.driven import DrivenRolloutSide

        return DrivenRolloutSide(config, model, tokenizer, prompts, run_dir), learner, []
    return LocalRolloutSide.build(config, model, tokenizer, prompts, run_dir, store), learner, []


def ray_sides(config: Config, model, tokenizer, prompts, run_dir, store, reference):
    """Rollout workers and learner ranks as Ray actors, driven from this process."""
    from everyprompt.distributed.backend import ray_sides as build  # the `ray` extra: loaded when chosen

    return build(config, model, tokenizer, prompts, run_dir, store, reference)


BACKENDS = {"local": local_sides, "ray": ray_sides}


def build_trainer(
    config: Config,
    model,
    tokenizer,
    prompts: list[dict],
    run_dir: str | Path,
    reference=None,
    store: PassRateStore | None = None,
) -> RLTrainer:
    """The RL loop over `model`, its sides built by `cluster.backend`: the engines get its weights, the
    learner trains it (with `model.lora.enabled`, fresh adapters on it unless it carries them already: a
    resumed run; its base then held in `model.frozen_dtype`)."""
    store = store if store is not None else PassRateStore(ema_decay=config.zve.retirement.ema_decay)
    if config.model.lora.enabled and not is_lora(model):
        base_dtype = lora_base_dtype(config, next(model.parameters()).device)
        model = apply_lora(model, config.model.lora, base_dtype)
    build = BACKENDS[config.cluster.backend]
    rollout, learner, closers = build(config, model, tokenizer, prompts, run_dir, store, reference)
    return RLTrainer(config, rollout, learner, model, tokenizer, run_dir, closers=closers)
