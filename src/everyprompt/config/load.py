"""Loading and saving a config: a YAML file plus dotted overrides into the typed tree (tree.py), with a
`ConfigError` naming the key, the value, the file and line where the value came from, and what was
expected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from everyprompt.config.base import ConfigError
from everyprompt.config.recipes import anchor_data_files, find_config, recipes_dir
from everyprompt.config.tree import Config

DEMO_CONFIG = "demo.yaml"


def demo_config_path() -> Path:
    """The embedded default config (`configs/demo.yaml`, shipped inside the package)."""
    return recipes_dir() / DEMO_CONFIG


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and its YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. rl.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({err.__class__.__name__})") from None
    return key.strip().split("."), value


def apply_override(tree: dict, path: list[str], value: Any) -> None:
    node: Any = tree
    model: type[BaseModel] | None = Config
    for depth, part in enumerate(path):
        dotted = ".".join(path[: depth + 1])
        if model is not None and part not in model.model_fields:
            valid = ", ".join(sorted(model.model_fields))
            raise ConfigError(f"unknown config key '{dotted}' (valid keys here: {valid})")
        annotation = model.model_fields[part].annotation if model is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if depth == len(path) - 1:
            node[part] = value
        else:
            child = node.get(part)
            if child is not None and not isinstance(child, dict):
                raise ConfigError(f"config key '{dotted}' is a value, not a section")
            node = node.setdefault(part, {})


def _describe_error(err: dict, source: str) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        parent = _section_for(err["loc"][:-1])
        valid = ", ".join(sorted(parent.model_fields)) if parent else ""
        return f"{source}unknown config key '{key}' (valid keys here: {valid})"
    given = err.get("input")
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(given, dict):  # a rule across a section's keys: the message names them
        where = f"config section '{key}'" if key else "config"  # '' is the top level: rules across sections
        return f"{source}{where}: {message}"
    return f"{source}config key '{key}': {message}, got {given!r}"


def _section_for(loc: tuple) -> type[BaseModel] | None:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if model else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return model


def build_config(tree: dict, source: str = "", overrides: dict[str, str] | None = None) -> Config:
    """Validate `tree` (read from the file `source`, then `overrides` applied: dotted key -> the
    KEY=VALUE text given); an error names where the bad value came from: the override, or the file and
    the line of the key."""
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        error = err.errors()[0]
        raise ConfigError(_describe_error(error, _origin(error["loc"], source, overrides or {}))) from None


def _origin(loc: tuple, source: str, overrides: dict[str, str]) -> str:
    """The prefix of an error at `loc`: the command-line override that set it, else the file (and line)."""
    key = ".".join(str(part) for part in loc)
    for dotted, text in overrides.items():
        if key == dotted or key.startswith(dotted + "."):
            return f"command-line override {text!r}: "
    if not source:
        return ""
    line = _line_of(Path(source), [str(part) for part in loc]) if Path(source).is_file() else None
    return f"{source}:{line}: " if line else f"{source}: "


def _line_of(path: Path, keys: list[str]) -> int | None:
    """The 1-based line of the deepest of `keys` (a dotted key's parts) written in the YAML file `path`."""
    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    line = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        found = next((value for name, value in node.value if name.value == key), None)
        if found is None:
            break
        line = next(name for name, value in node.value if value is found).start_mark.line + 1
        node = found
    return line


def read_yaml(path: str | Path) -> dict:
    """The config tree of the file (or recipe name) `path`, its data files found from the working
    directory, else beside the file (config/recipes.py)."""
    path = find_config(path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    return anchor_data_files(tree, path)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (the embedded demo default when `path` is None) and apply dotted overrides; an
    invalid value is named with where it came from (the override, or the file and its line)."""
    path = find_config(path) if path is not None else demo_config_path()
    tree = read_yaml(path)
    given: dict[str, str] = {}
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
        given[".".join(keys)] = text
    return build_config(tree, source=str(path), overrides=given)


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
