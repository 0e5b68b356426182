"""A model sent to an actor as what rebuilds it: its transformers config, its LoRA settings if any, and
its weights (a state dict, in Ray's object store when large). Nothing is pickled as a module: peft's
parametrised layers are classes made at run time, and a config plus weights is what a checkpoint is too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from everyprompt.models.lora import is_lora, merged_state_dict


@dataclass
class ModelRecipe:
    config: Any  # the transformers config of the (base) model
    weights: Any  # its state dict, or an ObjectRef to one
    lora: Any = None  # config.LoRAConfig of the adapters the weights carry; None: a plain model
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, model, lora=None) -> ModelRecipe:
        """`model` as it trains: a LoRA policy with its adapters (`lora`: the model.lora section)."""
        if is_lora(model):
            return cls(model.get_base_model().config, model.state_dict(), lora, _dtype(model))
        return cls(model.config, model.state_dict(), None, _dtype(model))

    @classmethod
    def plain(cls, model) -> ModelRecipe:
        """`model` as an engine runs it: a plain transformers model (a LoRA policy's adapters merged)."""
        config = model.get_base_model().config if is_lora(model) else model.config
        return cls(config, dict(merged_state_dict(model)), None, _dtype(model))

    def build(self, weights: dict[str, torch.Tensor] | None = None):
        """The model, in eval mode (`weights`: the resolved state dict when `self.weights` is a reference)."""
        from transformers import AutoModelForCausalLM

        from everyprompt.models.experts import register_sorted_experts

        register_sorted_experts()  # the config may name it (model.moe_kernel)
        model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        if self.lora is not None:
            from everyprompt.models.lora import apply_lora

            model = apply_lora(model, self.lora)
        model.load_state_dict(weights if weights is not None else self.weights)
        return model.eval()


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype
