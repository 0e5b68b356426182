"""A slice of a large model for the startup checks (`rollout.parity_layers`): a float32 copy of its first
decoder layers, with its embeddings, final norm and head.

The checks compare two computations of the model in float32 (the engine's and the trainer's, packed and
unpacked rows, the chunked head and the model's own): for a 30B model that is a float32 copy of 122 GB,
twice. What they are for, a layer computed otherwise than transformers computes it, shows in any layer,
so a large model is checked on a slice that holds every kind of layer it has. The slice is made of the
model's own weights (a LoRA policy's merged, only the slice's read) and is a model of its own: its logits
are the whole model's hidden states after those layers through its final norm and head. A sharded
(fsdp2) policy with a base held in bf16 cannot be widened in place, so it is checked on such a copy too,
its layers gathered one at a time on every rank (models/gathering.py).
"""

from __future__ import annotations

import copy
import re

import torch

from everyprompt.models.gathering import gathered_weights
from everyprompt.models.lora import is_lora, merged_state_dict
from everyprompt.models.precision import forward_kernels

WHOLE_MODEL_BYTES = 4 * 2**30  # `auto`: a model whose float32 copy is this size or less is checked whole
SLICE_LAYERS = 4  # `auto`, a larger model: its first layers (more when its kinds of layer need them)
LAYER_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")  # a decoder layer's weight: model.layers.N....


def checked_layers(setting: str | int, model, only_narrow: bool = False) -> int | None:
    """How many of `model`'s first decoder layers the startup checks run (`rollout.parity_layers`); None:
    the model itself. `only_narrow` (the learner's own checks): a float32 model is checked itself, with
    its own kernels, however large; a slice is for a model they would otherwise widen whole. A sharded
    (fsdp2) model cannot be widened in place, so it is checked on a float32 copy even where the `auto`
    rule takes the whole model."""
    if only_narrow and not narrow(model):
        return None
    layers = model.config.num_hidden_layers
    if setting == "auto":
        if 4 * sum(p.numel() for p in model.parameters()) <= WHOLE_MODEL_BYTES:  # a DTensor's: whole
            setting = layers
        else:
            kinds = list(getattr(model.config, "layer_types", None) or ())
            setting = max([SLICE_LAYERS, *(kinds.index(kind) + 1 for kind in set(kinds))])
    if setting >= layers:
        return layers if _sharded(model) else None  # a sharded model: a float32 copy of all its layers
    return setting


def _sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def narrow(model) -> bool:
    """Whether any floating parameter of `model` is narrower than float32 (a base held in bf16)."""
    return any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters())


def model_slice(model, layers: int):
    """A float32 plain model of `model`'s first `layers` decoder layers with its embeddings, final norm and
    head (a LoRA policy's adapters merged), on `model`'s device, in eval mode; only those weights are read
    (merged) and copied."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.get_base_model().config if is_lora(model) else model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]

    def wanted(key: str) -> bool:
        match = LAYER_KEY.match(key)
        return match is None or int(match.group(1)) < layers

    device = next(model.parameters()).device
    if _sharded(model):  # every rank gathers the slice's layers, one at a time, and keeps them
        read = gathered_weights(model, keep=True, wanted=wanted, device=str(device))
        kept = {key: value.float() for key, value in read}
    else:
        weights = merged_state_dict(model)
        kept = {key: weights[key].float() for key in weights if wanted(key)}
    sliced = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sliced.load_state_dict(kept)
    return sliced.to(device).eval()


def checked_model(model, layers: int | None, model_config):
    """What a startup check runs: `model` itself (`layers` None), else the slice of its first `layers`
    with the forward kernels the learner gives a model it scores with (models/precision.py)."""
    return model if layers is None else forward_kernels(model_slice(model, layers), model_config)
