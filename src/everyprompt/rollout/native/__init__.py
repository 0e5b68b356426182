"""The native rollout engine: continuous batching over a preallocated KV cache, on the policy's weights,
for the families in `families.FAMILIES` (docs/models.md)."""

from everyprompt.rollout.native.engine import PRECISIONS, NativeEngine
from everyprompt.rollout.native.families import FAMILIES, unsupported_settings
from everyprompt.rollout.native.weights import FP8Weight

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

__all__ = [
    "FAMILIES",
    "FP8Weight",
    "NativeEngine",
    "PRECISIONS",
    "SUPPORTED_ARCHITECTURES",
    "unsupported_settings",
]
