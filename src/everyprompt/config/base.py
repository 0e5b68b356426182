"""The config tree's building blocks: the Section base model and ConfigError."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from everyprompt.errors import InputError


class ConfigError(InputError):
    """A config file or override that cannot be used; the message is meant for the user as is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _spelled(value: Any) -> Any:
    """YAML reads a bare `on` / `off` as a boolean: take the boolean as the word it spelled."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# a setting whose words include `on` / `off`: Annotated[Literal[...], YAML_WORDS]
YAML_WORDS = BeforeValidator(_spelled)
