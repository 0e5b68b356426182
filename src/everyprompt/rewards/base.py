"""Reward registry, user functions by import path, and error-isolating scoring."""

from __future__ import annotations

import importlib
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from everyprompt.errors import InputError

RewardFunction = Callable[..., list]
_REGISTRY: dict[str, RewardFunction] = {}


class RewardError(InputError):
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


@dataclass(frozen=True)
class RewardFailure:
    """One row the reward function could not score: what went wrong (`summary`, one line: the same for
    the same bug) and where (`traceback`)."""

    summary: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, err: BaseException) -> RewardFailure:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return cls(f"{type(err).__name__}: {err}", text)


def summarize_failures(failures: list[RewardFailure]) -> dict[str, tuple[int, RewardFailure]]:
    """Distinct failures (by summary, in order of first appearance): their count and first occurrence."""
    out: dict[str, tuple[int, RewardFailure]] = {}
    for failure in failures:
        count, first = out.get(failure.summary, (0, failure))
        out[failure.summary] = (count + 1, first)
    return out


def _as_reward(value: Any) -> float | None:
    """A reward value as a float (None stays None: "could not be scored"); ValueError for anything that
    is not a finite number: NaN, inf, a string, a list."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ValueError(f"reward value {value!r} ({type(value).__name__}) is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"reward value {number} is not finite")
    return number


def _checked(values: Any, count: int, fn: RewardFunction) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != count:
        length = len(values) if hasattr(values, "__len__") else type(values).__name__
        raise ValueError(
            f"reward function {getattr(fn, '__name__', fn)!r} returned {length} values for {count} completions"
        )
    return list(values)


def score_completions(
    fn: RewardFunction, completions: list[str], columns: dict[str, list]
) -> tuple[list[float | None], list[RewardFailure]]:
    """Rewards for `completions` and the failures of the rows that could not be scored.

    The batch is scored in one call; if that call raises or returns the wrong number of values, each
    row is scored alone, so that one bad row costs only itself. A row whose call raises, or whose value
    is not a finite number (NaN, inf, a string), gets None and a `RewardFailure`. Nothing is logged
    here: the caller reports each distinct failure once.
    """
    try:
        values = _checked(fn(completions, **columns), len(completions), fn)
    except Exception as err:  # noqa: BLE001  (user code: isolate, count, keep going)
        if len(completions) == 1:  # already one row: retrying it alone would only call it twice
            return [None], [RewardFailure.from_exception(err)]
        values = None
    rewards: list[float | None] = []
    failures: list[RewardFailure] = []
    for index, completion in enumerate(completions):
        try:
            if values is None:
                row = {key: [column[index]] for key, column in columns.items()}
                rewards.append(_as_reward(_checked(fn([completion], **row), 1, fn)[0]))
            else:
                rewards.append(_as_reward(values[index]))
        except Exception as err:  # noqa: BLE001
            rewards.append(None)
            failures.append(RewardFailure.from_exception(err))
    return rewards, failures
