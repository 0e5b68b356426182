"""Models: the tiny MoE preset, the character tokenizer, HF checkpoint load/save; the learner's layer
kernels (models/kernels.py: its entries register when their modules are imported here)."""

from everyprompt.models import compiled_layers, liger  # noqa: F401 (they register their layer kernels)
from everyprompt.models.io import load_model_and_tokenizer, save_pretrained
from everyprompt.models.presets import tiny_moe_config
from everyprompt.models.tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer", "load_model_and_tokenizer", "save_pretrained", "tiny_moe_config"]
