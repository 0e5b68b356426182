"""The config tree's building blocks: the Section base model and ConfigError."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message is meant for the user as is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
