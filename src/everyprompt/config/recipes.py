"""Recipes: the configs that ship inside the package (the repository's `configs/`), found by their bare
names (`everyprompt train smollm2`), and the rule that lets a config find the data files beside it.

A config argument is a file when one exists at that path; else a bare name (no directory, `.yaml` optional)
is the recipe of that name; anything else is a missing file, named with the recipes there are.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from everyprompt.config.base import ConfigError

RECIPES = "configs"  # the package folder that holds them (a link to the repository's configs/)
SUFFIX = ".yaml"
DATA_KEYS = ("train_file", "eval_file")  # the data section's files, found beside the config as well


def recipes_dir() -> Path:
    return Path(str(resources.files("everyprompt") / RECIPES))


def recipe_names() -> list[str]:
    return sorted(path.stem for path in recipes_dir().glob(f"*{SUFFIX}"))


def recipe_summary(name: str) -> str:
    """The recipe's first comment line (each recipe starts with one that says what it runs)."""
    for line in (recipes_dir() / f"{name}{SUFFIX}").read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def find_config(text: str | Path) -> Path:
    """The config file an argument names: the file itself, else the recipe of that bare name."""
    path = Path(text)
    if path.is_file():
        return path
    name = path.name.removesuffix(SUFFIX)
    if path.parent == Path(".") and name in recipe_names():
        return recipes_dir() / f"{name}{SUFFIX}"
    raise ConfigError(
        f"config file not found: {text} (nor a recipe of that name: the recipes are "
        f"{', '.join(recipe_names())}; `everyprompt recipes` says what each runs)"
    )


def anchor_data_files(tree: dict, path: Path) -> dict:
    """`tree` (read from the config file `path`) with each relative data file that is not in the working
    directory but is beside the config replaced by that file's path: a recipe finds the data it ships with,
    wherever it is run from; a file in the working directory comes first, as it always did."""
    data = tree.get("data")
    if not isinstance(data, dict):
        return tree
    for key in DATA_KEYS:
        value = data.get(key)
        if not isinstance(value, str) or "://" in value or Path(value).is_absolute() or Path(value).exists():
            continue
        beside = path.parent / value
        if beside.exists():
            data[key] = str(beside)
    return tree
