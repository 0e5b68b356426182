"""Models: the tiny MoE preset, the character tokenizer, HF checkpoint load/save; the learner's layer
kernels (models/kernels.py). The package imports nothing heavy itself (the CLI's parser reads
catalog.py): each name below loads its module, and with it torch and transformers, on first use."""


def __getattr__(name: str):
    if name in ("load_model_and_tokenizer", "save_pretrained"):
        from everyprompt.models import io

        return getattr(io, name)
    if name == "tiny_moe_config":
        from everyprompt.models.presets import tiny_moe_config

        return tiny_moe_config
    if name == "build_char_tokenizer":
        from everyprompt.models.tokenizer import build_char_tokenizer

        return build_char_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_char_tokenizer", "load_model_and_tokenizer", "save_pretrained", "tiny_moe_config"]
