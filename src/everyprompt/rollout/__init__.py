"""Rollout: the engine protocol and the native engine that decodes over the policy's weights."""

from everyprompt.rollout.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from everyprompt.rollout.native import NativeEngine, UnsupportedModelError

__all__ = [
    "Completion",
    "GenerationRequest",
    "NativeEngine",
    "RolloutEngine",
    "SamplingParams",
    "UnsupportedModelError",
]
