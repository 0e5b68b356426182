"""Name -> function registries for advantage estimators and policy losses (the entry points that run
them: objective.py).

A policy loss registers with its option schema (a `LossOptions` model): each option's type, default and
description live there and nowhere else; `policy_loss` fills unset options from it and rejects unknown
ones by name. A registered function is a callable, or a `Deferred` one (the built-ins, catalog.py) whose
module loads at its first call: the registry, and with it every config check, is torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from everyprompt.algorithms.options import AGGREGATIONS, LossOptions, NoOptions  # noqa: F401  (re-exported)

_ADVANTAGES: dict[str, Callable | Deferred] = {}
_NEEDS_COMPONENTS: set[str] = set()  # estimators given each reward component ([N, K]) as `components`
_POLICY_LOSSES: dict[str, LossSpec] = {}


@dataclass(frozen=True)
class Deferred:
    """A registered function not loaded yet: `load()` imports its module and returns it."""

    load: Callable[[], Callable]


def resolve(target: Callable | Deferred) -> Callable:
    """The function `target` is, or the one a Deferred loads."""
    return target.load() if isinstance(target, Deferred) else target


@dataclass(frozen=True)
class LossSpec:
    target: Callable | Deferred  # the loss function, or one loaded at its first use
    default_agg: str = "token-mean"
    needs_entropy: bool = False
    needs_vocab_size: bool = False  # the loss is given the model's vocabulary size (vocab_size=...)
    options: type[LossOptions] | None = None  # None: options are passed through unchecked

    @property
    def fn(self) -> Callable:
        return resolve(self.target)

    def resolve_options(self, given: dict[str, Any]) -> dict[str, Any]:
        """`given` checked against the schema, unset options at their defaults."""
        if self.options is None:
            return dict(given)
        try:
            return self.options.model_validate(given).model_dump()
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(
                f"loss option {where!r}: {first['msg']} (options of this loss: "
                f"{', '.join(self.options.model_fields)})"
            ) from None


def _lookup(table: dict, kind: str, name: str):
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]


def register_advantage(name: str, *, needs_components: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register `fn(rewards [N], group_index [N], **options) -> advantages [N]` as `name`;
    `needs_components`: it is also given the reward's components (`components` [N, K], `weights` [K])."""

    def decorate(fn: Callable | Deferred) -> Callable | Deferred:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGES[name] = fn
        if needs_components:
            _NEEDS_COMPONENTS.add(name)
        return fn

    return decorate


def advantage_function(name: str) -> Callable:
    """The estimator registered as `name`."""
    return resolve(_lookup(_ADVANTAGES, "advantage estimator", name))


def advantage_needs_components(name: str) -> bool:
    """Whether the estimator `name` is given the reward's components (GDPO)."""
    _lookup(_ADVANTAGES, "advantage estimator", name)
    return name in _NEEDS_COMPONENTS


def register_policy_loss(
    name: str,
    *,
    default_agg: str = "token-mean",
    needs_entropy: bool = False,
    needs_vocab_size: bool = False,
    options: type[LossOptions] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator: register `fn(batch: LossBatch, **options)` as `name` (loss_batch.py: the micro-batch's
    log-probs, old log-probs, advantages, mask and entropies, [B, T] each).

    The function returns (per-token loss [B, T], detached metrics). `default_agg` is the aggregation used
    when the caller names none; `needs_entropy` makes a batch without entropies an error;
    `needs_vocab_size` passes `vocab_size`; `options` is the schema of the loss's keyword options.
    """
    if default_agg not in AGGREGATIONS:
        raise ValueError(f"default_agg {default_agg!r} is not one of {', '.join(AGGREGATIONS)}")

    def decorate(fn: Callable | Deferred) -> Callable | Deferred:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = LossSpec(fn, default_agg, needs_entropy, needs_vocab_size, options)
        return fn

    return decorate


def registered_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def registered_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def policy_loss_spec(name: str) -> LossSpec:
    """How the loss `name` was registered (its default aggregation, whether it needs entropies)."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)
