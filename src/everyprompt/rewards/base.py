"""Reward registry, user functions by import path, and error-isolating scoring."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

RewardFunction = Callable[..., list]
_REGISTRY: dict[str, RewardFunction] = {}
log = logging.getLogger(__name__)


class RewardError(ValueError):
    """A reward function that cannot be found or that breaks the reward contract."""


def register_reward(name: str) -> Callable[[RewardFunction], RewardFunction]:
    def decorate(fn: RewardFunction) -> RewardFunction:
        if name in _REGISTRY:
            raise RewardError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorate


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(spec: str) -> RewardFunction:
    """A registered reward by name, or a user function given as ``package.module:function``."""
    if ":" not in spec:
        if spec not in _REGISTRY:
            raise RewardError(
                f"unknown reward {spec!r}; registered: {', '.join(registered_rewards())} "
                "(or give a user function as package.module:function)"
            )
        return _REGISTRY[spec]
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def reward_columns(rows: list[dict]) -> dict[str, list]:
    """The keyword columns of a reward call for `rows`: every field any row has, None where a row lacks it."""
    keys = sorted({key for row in rows for key in row})
    return {key: [row.get(key) for row in rows] for key in keys}


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) else number


def score_completions(
    fn: RewardFunction, completions: list[str], columns: dict[str, list]
) -> tuple[list[float | None], int]:
    """Rewards for `completions` and the number of rows whose scoring failed.

    The batch is scored in one call; if that call raises, each row is scored alone so that one bad row
    costs only itself: a row whose call raises (or returns a non-number) gets None and counts as an error.
    """
    try:
        values = fn(completions, **columns)
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {getattr(fn, '__name__', fn)!r} returned {len(values)} values "
                f"for {len(completions)} completions"
            )
        return [_as_reward(v) for v in values], 0
    except RewardError:
        raise
    except Exception as err:  # noqa: BLE001  (user code: isolate, count, keep going)
        if len(completions) == 1:  # already one row: retrying it alone would only call it twice
            log.warning("reward function failed: %s: %s", type(err).__name__, err)
            return [None], 1
        log.debug("batch reward call failed (%s); scoring rows one by one", err)
    rewards: list[float | None] = []
    errors = 0
    for index, completion in enumerate(completions):
        row = {key: [values[index]] for key, values in columns.items()}
        try:
            rewards.append(_as_reward(fn([completion], **row)[0]))
        except Exception as err:  # noqa: BLE001
            log.warning("reward function failed on row %d: %s: %s", index, type(err).__name__, err)
            rewards.append(None)
            errors += 1
    return rewards, errors
