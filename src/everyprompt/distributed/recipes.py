"""A model sent to an actor as what rebuilds it: its transformers config, its LoRA settings if any, and
its weights (a state dict, or in Ray's object store in buckets: distributed/buckets.py). Nothing is
pickled as a module: peft's parametrised layers are classes made at run time, and a config plus weights
is what a checkpoint is too."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from everyprompt.models.attention import CUDA_SDPA
from everyprompt.models.io import load_one_by_one
from everyprompt.models.lora import is_lora, merged_state_dict, widest_dtype
from everyprompt.models.precision import FP32_CPU_SDPA

# the learner's attention implementations chosen by its device and precision (models/attention.py and
# precision.py): an actor's model is built with SDPA's, and a learner rank's kernels choose again for its
# device (float32 attention on a CPU under bf16, no cuDNN on CUDA)
DEVICE_ATTENTION = (CUDA_SDPA, FP32_CPU_SDPA)


@dataclass
class ModelRecipe:
    config: Any  # the transformers config of the (base) model
    weights: Any  # its state dict, or a BucketedWeights in the object store
    lora: Any = None  # config.LoRAConfig of the adapters the weights carry; None: a plain model
    dtype: torch.dtype = torch.float32  # of the (base) model's parameters: a LoRA policy's adapters are fp32

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
        weights = merged_state_dict(model)  # merged as read (sent in buckets); a bf16 base's in fp32
        return cls(config, weights, None, widest_dtype(weights))

    def build(self, weights: Mapping[str, torch.Tensor] | None = None, base_dtype: torch.dtype | None = None):
        """The model, in eval mode (`weights`: the weights to read when `self.weights` is in the object
        store, `buckets.readable`; read one at a time, so a streamed bucket at a time is held);
        a LoRA policy's base in `base_dtype` when given (a learner rank's own `model.frozen_dtype`: the
        driver's copy lives on its CPU), else in the recipe's dtype."""
        from transformers import AutoModelForCausalLM

        from everyprompt.models.experts import register_sorted_experts

        register_sorted_experts()  # the config may name it (model.moe_kernel)
        options = {"dtype": base_dtype if self.lora is not None and base_dtype is not None else self.dtype}
        if getattr(self.config, "_attn_implementation", None) in DEVICE_ATTENTION:
            options["attn_implementation"] = "sdpa"  # the device's choice, made again where the model runs
        # from_config writes its options into the config it is given: a copy, not the sender's
        model = AutoModelForCausalLM.from_config(copy.deepcopy(self.config), **options)
        if self.lora is not None:
            from everyprompt.models.lora import apply_lora

            model = apply_lora(model, self.lora)  # the base as built, the adapters fp32
        load_one_by_one(model, weights if weights is not None else self.weights)
        return model.eval()


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype
