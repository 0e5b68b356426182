"""LoRA adapters through peft (the `lora` extra): `model.lora` trains low-rank adapters on the RL policy
instead of its weights.

- Targets: `target_modules` (linear layers by name: attention and dense MLP projections) and
  `target_parameters` (parameters by name, for what is not an nn.Linear: MoE expert stacks such as
  `mlp.experts.gate_up_proj`, routers such as `mlp.gate.weight`).
- The engine receives merged weights at every sync (`merged_state_dict`): W + scale * B A computed
  out of place for each adapted weight as it is read, named as the base model's, so the engine never
  knows about the adapters and the base weights are never modified (merging in place and unmerging
  again would leave rounding drift in the base after every sync).
- The KL reference is the base model with the adapters disabled (`reference_forward`): no second copy.
- The frozen base is held in `base_dtype` (`model.frozen_dtype`: bf16 when training in bf16), the adapters
  in float32 (peft's own cast), as peers train LoRA on a bf16 base. An adapted weight merges in float32
  (W widened, exactly, plus the delta), so the engine rounds the sum once to its own precision. peft
  computes a linear layer's delta in float32 and a `target_parameters` one's in the base's dtype (as its
  forward adds it); the startup parity check widens the base before merging, so that its float32 engine
  gets exactly the network the widened policy computes.
- Checkpoints hold the adapter (`adapter_model.safetensors`, `adapter_config.json`) and, when
  `model.lora.save_merged`, a full merged model under `merged/`. A run resumes by loading its base (the
  SFT checkpoint or `model.path`) and the adapter on top (`load_adapter`).
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from everyprompt.errors import InputError
from everyprompt.models.precision import frozen_dtype, hold_parameters_in

ADAPTER_CONFIG = "adapter_config.json"


class LoRAError(InputError):
    """A LoRA set-up that cannot run: peft missing, or a target that matches nothing."""


def _peft():
    try:
        import peft
    except ImportError:
        raise LoRAError(
            "model.lora.enabled needs peft: pip install 'everyprompt[lora]' (or pip install peft)"
        ) from None
    return peft


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft model carrying adapters."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply_lora(model: nn.Module, lora, base_dtype: torch.dtype | None = None) -> nn.Module:
    """`model` wrapped with fresh adapters of a `model.lora` config section (config.LoRAConfig); the
    base weights are frozen, held in `base_dtype` (None: as they are), and only the adapters train (in
    float32)."""
    peft = _peft()
    if base_dtype is not None:
        hold_parameters_in(model, base_dtype)
    settings = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules) or None,
        target_parameters=list(lora.target_parameters) or None,
        bias="none",
    )
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, settings)
    except ValueError as err:
        raise LoRAError(f"config key 'model.lora': {err}") from None


def lora_base_dtype(config, device: torch.device) -> torch.dtype:
    """What a run's LoRA policy holds its frozen base in on `device`: `model.frozen_dtype`
    (models/precision.py). Under the Ray backend with GPUs for its actors (`cluster.num_gpus` > 0) the
    driver's copy, on its CPU, is held as the learner ranks hold theirs on their GPUs: the ranks rebuild
    from it (the driver lets it go once the run has started), and it had been a float32 copy of a bf16
    base (for Qwen3-30B-A3B, 122 GB of the driver's memory where 61 hold it)."""
    if config.cluster.backend == "ray" and config.cluster.num_gpus > 0:
        device = torch.device("cuda")  # the learner ranks' device
    return frozen_dtype(config.model, device)


def load_adapter(base: nn.Module, directory: str | Path, base_dtype: torch.dtype | None = None) -> nn.Module:
    """The adapter saved in `directory` on top of `base` (held in `base_dtype`; None: as it is),
    trainable (a resumed run)."""
    peft = _peft()
    if base_dtype is not None:
        hold_parameters_in(base, base_dtype)
    with warnings.catch_warnings():  # as in apply_lora
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.PeftModel.from_pretrained(base, str(directory), is_trainable=True)


def merged_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """The weights of `model` with every active adapter folded in, named as the base model's (what an
    engine loads); a plain model's own state dict. A LoRA policy's are `MergedWeights`: each adapted
    weight merged when it is read."""
    if not is_lora(model):
        return model.state_dict()
    return MergedWeights(model)


class MergedWeights(Mapping):
    """A model's weights as an engine loads them, each read from the model when it is read: a LoRA
    policy's adapted ones merged then (W + its adapters' deltas, out of place), so a reader that takes
    them one at a time (the native engine's weight load, a copy to the host) holds one merged tensor at
    a time, not a merged copy of every adapted weight (a 30B MoE with adapted experts: about 116 GB in
    float32). Each is looked up on its module as it is read, so a sharded model reads whole inside its
    layer's gather (`fully_shard`'s `unshard`: models/gathering.py) and its shards outside.
    Read later, they are the model's weights then, as a plain model's state dict is (own_copy in
    trainer/asynchrony.py copies them now); pickled (Ray's object store), they are a plain dict."""

    def __init__(self, model: nn.Module):
        from peft.tuners.tuners_utils import BaseTunerLayer

        base = model.get_base_model() if is_lora(model) else model
        self._where: dict[str, tuple[nn.Module, str]] = {}  # name -> (its module, its attribute)
        for key in base.state_dict():
            if ".lora_" in key:
                continue
            path, _, leaf = key.rpartition(".")
            self._where[key.replace(".base_layer", "")] = (base.get_submodule(path), leaf)
        self._adapters: dict[str, list] = {}  # weight name -> [(its adapter layer, adapter name)]
        for name, module in base.named_modules():
            if not isinstance(module, BaseTunerLayer) or module.merged:
                continue
            key = f"{name.replace('.base_layer', '')}.{getattr(module, 'parameter_name', None) or 'weight'}"
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):
                    self._adapters.setdefault(key, []).append((module, adapter))

    def place(self, key: str) -> tuple[nn.Module, str]:
        """The module holding weight `key` and its attribute name there (a LoRA layer's base layer)."""
        return self._where[key]

    def _own(self, key: str) -> torch.Tensor:
        module, leaf = self._where[key]
        return getattr(module, leaf).detach()

    def __getitem__(self, key: str) -> torch.Tensor:
        value = self._own(key)
        adapters = self._adapters.get(key, ())
        if not adapters:
            return value
        with torch.no_grad():
            value = value.to(self.dtype_of(key))
            for module, adapter in adapters:
                value = value + module.get_delta_weight(adapter).to(value.dtype)
        return value

    def dtype_of(self, key: str) -> torch.dtype:
        """The dtype `self[key]` has, without merging: an adapted weight's is the wider of its own and its
        adapters' (a bf16 base's adapted weights merge in float32)."""
        dtype = self._own(key).dtype
        for module, adapter in self._adapters.get(key, ()):
            dtype = torch.promote_types(dtype, module.lora_B[adapter].weight.dtype)
        return dtype

    def __contains__(self, key: object) -> bool:  # Mapping's own would merge the weight to find it
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __reduce__(self):
        return dict, (dict(self.items()),)


def _sizes_and_dtypes(weights: Mapping[str, torch.Tensor]):
    """Each tensor's (element count, dtype) in a state dict; of `MergedWeights` without merging (a merge
    keeps the shape; its dtype is `dtype_of`)."""
    if isinstance(weights, MergedWeights):
        return ((weights._own(key).numel(), weights.dtype_of(key)) for key in weights)
    return ((value.numel(), value.dtype) for value in weights.values())


def weights_nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    """The size of a state dict (of `MergedWeights` without merging)."""
    return sum(count * dtype.itemsize for count, dtype in _sizes_and_dtypes(weights))


def widest_dtype(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The widest floating dtype among a state dict's tensors (of `MergedWeights` without merging)."""
    floating = {dtype for _, dtype in _sizes_and_dtypes(weights) if dtype.is_floating_point}
    return functools.reduce(torch.promote_types, floating)


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` as a plain transformers model: a LoRA policy's base with its adapted weights
    merged as `MergedWeights` merges them (float32 on a bf16 base, not rounded back into it as peft's
    in-place merge would)."""
    if not is_lora(model):
        return copy.deepcopy(model)
    merged = MergedWeights(model)
    copied = copy.deepcopy(model).unload()  # the adapters dropped, the base weights as they are
    with torch.no_grad():
        for name, parameter in copied.named_parameters():
            if name in merged._adapters:
                parameter.data = merged[name]
    return copied


def reference_forward(model: nn.Module):
    """The context in which `model`'s forward is the base model's (adapters off): the KL reference."""
    return model.disable_adapter()


def adapter_base_path(directory: str | Path) -> str | None:
    """The base checkpoint an adapter directory was trained on ("" when it names none, e.g. the preset's;
    None: not an adapter directory)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("base_model_name_or_path") or ""
