"""Rollout: the engine protocol (base.py) and registry (`build_engine`: registry.py), the native engine, sampling, scheduling."""

from everyprompt.rollout import hf as _hf  # noqa: F401  (registers "hf")
from everyprompt.rollout import native as _native  # noqa: F401  (registers "native")
from everyprompt.rollout.base import (
    ENGINE_OFFERS,
    Completion,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    UnsupportedModelError,
    offers,
    restore_decode_state,
    saved_decode_state,
    summed_stats,
)
from everyprompt.rollout.registry import (
    build_engine,
    engine_choices,
    engines_for,
    make_engine,
    register_engine,
    registered_engines,
    resolve_engine,
)
from everyprompt.rollout.sampling import derive_seed

__all__ = [
    "ENGINE_OFFERS",
    "offers",
    "Completion",
    "GenerationRequest",
    "RolloutEngine",
    "SamplingParams",
    "UnsupportedModelError",
    "build_engine",
    "derive_seed",
    "engine_choices",
    "engines_for",
    "make_engine",
    "register_engine",
    "registered_engines",
    "resolve_engine",
    "restore_decode_state",
    "saved_decode_state",
    "summed_stats",
]
