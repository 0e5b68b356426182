"""What the commands share: exit codes and a config from `[CONFIG.yaml] KEY=VALUE ...` arguments."""

from __future__ import annotations

import re
from pathlib import Path

from everyprompt.config import Config, ConfigError, load_config

EXIT_USAGE = 2  # bad input: a config key, a file, a checkpoint, a model
EXIT_FAILURE = 1  # the run went wrong, or a sweep's cell failed


# an override's key: dotted names (`rl.steps`, `data.reasoning_gym.tasks.leg_counting.weight`)
_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


def is_override(value: str) -> bool:
    """Whether a command-line value is a KEY=VALUE override rather than a file: a sweep's run directories
    are named `arm,seed=1`, so a path may hold `=` too (`RUN/levels,seed=4/config.yaml`)."""
    key, equals, _ = value.partition("=")
    return bool(equals) and _KEY.fullmatch(key) is not None and not Path(value).is_file()


def split_config_args(values: list[str]) -> tuple[str | None, list[str]]:
    """(the config file if one is given, the KEY=VALUE overrides)."""
    files = [v for v in values if not is_override(v)]
    if len(files) > 1:
        raise ConfigError(f"expected at most one config file, got {files}; overrides are KEY=VALUE")
    return (files[0] if files else None), [v for v in values if is_override(v)]


def config_from(values: list[str], extra: list[str] = ()) -> Config:
    """The config of `[CONFIG.yaml] KEY=VALUE ...` (the embedded demo config without a file), then `extra`."""
    path, overrides = split_config_args(values)
    return load_config(path, [*overrides, *extra])


def add_config_argument(parser, help: str = "optional CONFIG.yaml, then KEY=VALUE overrides") -> None:
    parser.add_argument("config", nargs="*", help=help)
