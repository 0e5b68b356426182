"""Load and save models in Hugging Face format (safetensors), from a preset, a local directory or a Hub id."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from everyprompt.config import ModelConfig
from everyprompt.errors import InputError
from everyprompt.hub import check_model_name, resolve_model
from everyprompt.models.catalog import fetch_hint
from everyprompt.models.gguf import is_gguf, load_gguf
from everyprompt.models.lora import adapter_base_path, is_lora, load_adapter, merged_state_dict
from everyprompt.models.precision import hold_parameters_in
from everyprompt.models.presets import tiny_moe_config
from everyprompt.models.tokenizer import build_char_tokenizer, build_chat_tokenizer


class ModelError(InputError):
    """A model directory that cannot be loaded; the message names the path and what is missing."""


def load_pretrained(
    path: str | Path, model_class=AutoModelForCausalLM, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A checkpoint directory or GGUF file and its tokenizer (pad = eos when it has no pad token), local
    or named by its Hugging Face Hub id (hub.py); `model_class` picks the head
    (AutoModelForSequenceClassification for scalar reward models). The parameters are read as `dtype`
    (float32; bf16 for weights that will be held so: never a whole float32 copy of them), the buffers as
    transformers makes them."""
    path = resolve_model(path, hint=fetch_hint(Path(path)))
    if is_gguf(path):  # a llama.cpp file: dequantised, with its tokenizer and chat template
        model, tokenizer = load_gguf(path, model_class)
        return hold_parameters_in(model, dtype), tokenizer
    base = adapter_base_path(path)
    if base is not None:  # a LoRA checkpoint: its base with the adapter merged in
        if not base or not (Path(base) / "config.json").is_file():
            raise ModelError(
                f"{path}: a LoRA adapter whose base model {base!r} is not a checkpoint on this machine "
                "(the preset has none: train with model.lora.save_merged=true and use merged/)"
            )
        model, _ = load_pretrained(base, model_class, dtype)
        return load_adapter(model, path).merge_and_unload(), _load_tokenizer(path)
    if not (path / "config.json").is_file():
        hint = (
            ""
            if path.exists()
            else f"; no such path{fetch_hint(path)}, and a Hugging Face Hub id is ORG/NAME[@REVISION]"
        )
        raise ModelError(f"{path}: not a Hugging Face checkpoint directory (no config.json){hint}")
    try:
        model = model_class.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ModelError(f"{path}: cannot load the checkpoint ({err})") from None
    return model, _load_tokenizer(path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint directory, LoRA adapter or GGUF file at `path` (or Hub id), without
    its weights."""
    path = resolve_model(path, hint=fetch_hint(Path(path)))
    if is_gguf(path):
        return _load_tokenizer(path.parent, gguf_file=path.name)
    if not (path / "config.json").is_file() and adapter_base_path(path) is None:
        raise ModelError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
    return _load_tokenizer(path)


def _load_tokenizer(path: Path, **options) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **options)
    except (OSError, ValueError) as err:
        raise ModelError(f"{path}: cannot load the tokenizer ({err})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(
    model: ModelConfig, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The checkpoint at `model.path` if set, else a random-init preset (seeded) with its tokenizer
    (`PRESET_TOKENIZERS`); its parameters in `dtype` (load_pretrained)."""
    if model.path:
        check_model_name(model.path, "model.path", fetch_hint(Path(model.path)))
        return load_pretrained(model.path, dtype=dtype)
    tokenizer = PRESET_TOKENIZERS[model.preset]()
    config = tiny_moe_config(
        model, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        network = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    network.generation_config.pad_token_id = tokenizer.pad_token_id
    network.generation_config.eos_token_id = tokenizer.eos_token_id
    return hold_parameters_in(network, dtype), tokenizer


def config_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer `load_model_and_tokenizer(model, ...)` gives, without loading or making the weights."""
    if model.path:
        check_model_name(model.path, "model.path", fetch_hint(Path(model.path)))
        return load_tokenizer(model.path)
    return PRESET_TOKENIZERS[model.preset]()


def _chat_tokenizer() -> PreTrainedTokenizerBase:
    from everyprompt.data.wordproblems import tokenizer_corpus

    return build_chat_tokenizer(tokenizer_corpus(), vocab_size=512)


# preset -> its tokenizer: the character tokenizer (the demo's), or a byte-level BPE with a chat
# template trained on generated word problems (the CPU twins of chat recipes)
PRESET_TOKENIZERS = {"tiny-moe": build_char_tokenizer, "tiny-chat-moe": _chat_tokenizer}


def save_pretrained(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path, merged: bool = False
) -> None:
    """The model (a LoRA policy: its adapter, and with `merged` the merged model under `merged/`) and the
    tokenizer, in Hugging Face format."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    if merged and is_lora(model):
        whole = Path(directory) / "merged"
        model.get_base_model().save_pretrained(whole, state_dict=dict(merged_state_dict(model)))
        tokenizer.save_pretrained(whole)


def load_one_by_one(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` into `model`'s own tensors one at a time, after checking that the names are the
    model's and, as each is read, its shape. What `load_state_dict(strict=True)` does, without its copy of
    the whole mapping first (a mapping that makes or fetches its tensors as they are read, a LoRA
    policy's `MergedWeights` or a sync's `StreamedWeights`, would hold them all at once)."""
    own = model.state_dict()  # the model's own tensors, by name (its buffers too)
    missing = [name for name in own if name not in weights]
    unexpected = [name for name in weights if name not in own]
    if missing or unexpected:
        raise KeyError(
            f"the weights do not fit {type(model).__name__} "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    with torch.no_grad():
        for name, target in own.items():
            value = weights[name]
            if value.shape != target.shape:
                raise ValueError(
                    f"{name} is {tuple(value.shape)} in the weights, {tuple(target.shape)} in "
                    f"{type(model).__name__}"
                )
            target.copy_(value)


def as_held(value: torch.Tensor, held: torch.dtype | None) -> torch.Tensor:
    """`value` cast to `held`, the dtype its reader will hold it in, where that is a narrower floating
    type than its own (a float32 weight for a bf16 engine: the bits the reader's own cast would make,
    in half the bytes); otherwise `value` itself (never widened: that would add bytes and say nothing)."""
    if (
        held is None
        or not value.is_floating_point()
        or not held.is_floating_point
        or held.itemsize >= value.element_size()
    ):
        return value
    return value.to(held)


def weights_as_held(
    weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`' pairs one at a time, each `as_held` its dtype in `dtypes` (none: as they are), in the
    order an engine reads them: those outside the decoder layers first (the embedding, the final norm, the
    head), then each layer's (so a pipelined sync's engine starts on the first bucket, not the last)."""
    held = dtypes or {}
    order = sorted(weights, key=lambda name: ".layers." in name)  # stable: each layer's in its own order
    return ((name, as_held(weights[name], held.get(name))) for name in order)
