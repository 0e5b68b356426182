"""Models: the tiny MoE preset, the character tokenizer, HF checkpoint load/save; the learner's layer
kernels (models/kernels.py). The package imports nothing heavy itself (the CLI's parser reads
catalog.py): each name below loads its module, and with it torch and transformers, on first use."""

from importlib import import_module

_NAMES = {
    "build_char_tokenizer": "tokenizer",
    "load_model_and_tokenizer": "io",
    "save_pretrained": "io",
    "tiny_moe_config": "presets",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_NAMES)
