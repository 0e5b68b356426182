"""Load and save models in Hugging Face format (safetensors), from a preset or a local directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from everyprompt.config import ModelConfig
from everyprompt.models.presets import tiny_moe_config
from everyprompt.models.tokenizer import build_char_tokenizer


class ModelError(ValueError):
    """A model directory that cannot be loaded; the message names the path and what is missing."""


def load_pretrained(
    path: str | Path, model_class=AutoModelForCausalLM
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local checkpoint (fp32) and its tokenizer (pad = eos when it has no pad token); `model_class`
    picks the head (AutoModelForSequenceClassification for scalar reward models)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = model_class.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise ModelError(f"{path}: cannot load the checkpoint ({err})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_model_and_tokenizer(
    model: ModelConfig, seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The checkpoint at `model.path` if set, else a random-init preset (seeded) with the char tokenizer."""
    if model.path:
        return load_pretrained(model.path)
    tokenizer = build_char_tokenizer()
    config = tiny_moe_config(
        model, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        network = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    network.generation_config.pad_token_id = tokenizer.pad_token_id
    return network, tokenizer


def save_pretrained(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path
) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
