"""The environment contract, at the level of text: `init(row)` gives the episode's first messages,
`step(action)` takes the model's turn and answers with observation messages, a reward and whether the
episode is done. It follows skyrl-gym's (`env.init(prompt) -> (prompt, info)`, `env.step(action) ->
{observations, reward, done, metadata}`), so an adapter to it is thin. Tokens, loss masks and the
engine's pausing live elsewhere (docs/environments.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from everyprompt.errors import InputError

Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass
class StepResult:
    observations: list[Message]  # appended to the conversation before the model's next turn (none: done)
    reward: float | None = None  # this turn's reward; the episode's: the last or the sum (env.turn_rewards)
    done: bool = False
    metadata: dict = field(default_factory=dict)


class Environment(Protocol):
    def init(self, row: dict) -> list[Message]:
        """The episode's first messages for data row `row` (its prompt, the tools it offers)."""

    def step(self, action: str) -> StepResult:
        """The environment's answer to the model's turn `action` (its text)."""


class EnvironmentSetupError(InputError):
    """An environment name the registry does not know, or a data row an environment cannot start from."""


_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}
_AT_RUN_END: list[Callable[[], None]] = []  # what environments hold beyond an episode (servers), released
_FAMILIES: dict[str, Callable[..., Environment]] = {}  # "family:id" names: factory(id, **options)


def _register(table: dict, key: str, what: str) -> Callable:
    def add(factory):
        if key in table:
            raise ValueError(f"{what} {key!r} is already registered")
        table[key] = factory
        return factory

    return add


def register_environment(name: str) -> Callable:
    """Decorator: register an environment factory `factory(**options) -> Environment` as `name`."""
    return _register(_ENVIRONMENTS, name, "environment")


def register_environment_family(prefix: str) -> Callable:
    """Decorator: register a factory `factory(id, **options) -> Environment` for the names `prefix:ID`
    (another library's registry, e.g. `skyrl:gsm8k`); the factory refuses an id it does not know."""
    return _register(_FAMILIES, prefix, "environment family")


def registered_environments() -> list[str]:
    return sorted([*_ENVIRONMENTS, *(f"{prefix}:ID" for prefix in _FAMILIES)])


def make_environment(name: str, **options) -> Environment:
    """A fresh environment `name` (one per episode: environments keep the episode's state)."""
    prefix, colon, ident = name.partition(":")
    if colon and prefix in _FAMILIES:
        return _FAMILIES[prefix](ident, **options)
    if name not in _ENVIRONMENTS:
        known = ", ".join(registered_environments()) or "none"
        raise EnvironmentSetupError(f"unknown environment {name!r} (registered: {known})")
    return _ENVIRONMENTS[name](**options)


def at_run_end(release: Callable[[], None]) -> Callable[[], None]:
    """Register `release()`, called when a run's rollout side closes: what an environment family holds
    across episodes (a server it started) ends with the run, not with the process."""
    _AT_RUN_END.append(release)
    return release


def end_of_run() -> None:
    for release in _AT_RUN_END:
        release()
