"""What a sweep runs: a grid of config overrides times seeds, each cell a normal run directory.

    everyprompt sweep configs/demo.yaml rl.loss=ppo_clip,espo zve.enabled=true --seeds 0,1

`KEY=v1,v2` is a grid axis; `KEY=v` (one value) applies to every cell. A value that is itself a YAML list
or mapping is written in brackets and is not split: `rl.levels=[4,5],[5]` is two values. The plan is
saved as `SWEEP/sweep.json` beside a copy of the base config (`SWEEP/base.yaml`), so a sweep resumes from
its directory alone and two different sweeps never share one.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from everyprompt.config import (
    Config,
    ConfigError,
    apply_override,
    build_config,
    demo_config_path,
    find_config,
    parse_override,
    read_yaml,
)
from everyprompt.run.files import write_json_atomic
from everyprompt.run.layout import SweepLayout


def split_values(raw: str) -> list[str]:
    """`a,b,[1,2]` -> ['a', 'b', '[1,2]']: commas inside brackets, braces or quotes do not split."""
    values, current, depth, quote = [], [], 0, ""
    for char in raw:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current))
            current = []
            continue
        current.append(char)
    values.append("".join(current))
    return values


def parse_axes(arguments: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """KEY=VALUE arguments -> (overrides for every cell, {key: its values} for the grid's axes)."""
    fixed: list[str] = []
    grid: dict[str, list[str]] = {}
    for text in arguments:
        key, _, raw = text.partition("=")
        key = key.strip()
        values = split_values(raw)
        for value in values:  # a malformed override (no '=', a value that is not YAML) fails here, naming it
            parse_override(f"{key}={value}")
        if key in grid or any(f.partition("=")[0].strip() == key for f in fixed):
            raise ConfigError(
                f"sweep: config key '{key}' is given twice; give its values once, comma-separated"
            )
        if key == "seed":
            raise ConfigError("sweep: give the seeds with --seeds 0,1,2, not as seed=...")
        if any(not v.strip() for v in values):
            raise ConfigError(f"sweep: config key '{key}' has an empty value in {text!r}")
        if len(values) == 1:
            fixed.append(f"{key}={values[0]}")
        else:
            if len(set(values)) != len(values):
                raise ConfigError(f"sweep: config key '{key}' repeats a value in {text!r}")
            grid[key] = values
    return fixed, grid


def parse_seeds(text: str | None) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; a bad list is a ConfigError naming it."""
    if text is None:
        return []
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"sweep: --seeds {text!r}: expected integers separated by commas, e.g. 0,1,2"
        ) from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"sweep: --seeds {text!r} repeats a seed")
    return seeds


def _label(value: str) -> str:
    """A value as it may stand in a directory name (a path by its last part)."""
    value = value.strip().rstrip("/").rpartition("/")[2] if "/" in value else value
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", value.strip()).strip("-") or "empty"


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: its directory name, its arm (when the plan names arms) and the overrides that
    make it (the arm's, the grid's values, the seed)."""

    name: str
    overrides: tuple[str, ...]
    seed: int
    arm: str | None = None


@dataclass
class SweepPlan:
    """The base config (a YAML tree), the overrides of every cell, the grid's axes and the seeds.

    `arms` (library use, e.g. the benchmarks): named bundles of overrides, each crossed with the grid;
    "DAPO" is several keys at once, which a grid of single keys cannot say."""

    base: dict
    fixed: list[str] = field(default_factory=list)
    grid: dict[str, list[str]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)
    source: str = ""  # where the base config came from, for people reading sweep.json
    arms: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, config: str | None, arguments: list[str], seeds: str | None) -> SweepPlan:
        path = find_config(config) if config is not None else demo_config_path()
        fixed, grid = parse_axes(arguments)
        base = read_yaml(path)
        plan = cls(base, fixed, grid, parse_seeds(seeds) or [int(base.get("seed", 0))], str(path))
        plan.validate()
        return plan

    def cells(self) -> list[Cell]:
        """Every arm times every combination of the axes' values times the seeds; the seed varies fastest."""
        keys = list(self.grid)
        short = {key: key.rpartition(".")[2] for key in keys}
        clashing = {s for s in short.values() if list(short.values()).count(s) > 1}
        cells, names = [], set()
        arms = list(self.arms.items()) or [(None, [])]
        for (arm, bundle), values in itertools.product(
            arms, itertools.product(*(self.grid[k] for k in keys))
        ):
            for seed in self.seeds:
                parts = [_label(arm)] if arm is not None else []
                parts += [
                    f"{key if short[key] in clashing else short[key]}={_label(v)}"
                    for key, v in zip(keys, values)
                ]
                name = ",".join([*parts, f"seed={seed}"])
                while name in names:  # two values that only differ in characters a name cannot hold
                    name += "+"
                names.add(name)
                overrides = (*bundle, *(f"{k}={v}" for k, v in zip(keys, values)), f"seed={seed}")
                cells.append(Cell(name, overrides, seed, arm))
        return cells

    def config_of(self, cell: Cell) -> Config:
        """The cell's config: the base tree with the plan's and the cell's overrides."""
        tree = copy.deepcopy(self.base)
        for text in [*self.fixed, *cell.overrides]:
            apply_override(tree, *parse_override(text))
        return build_config(tree, source=self.source)

    def validate(self) -> None:
        """Build every cell's config: a bad key or value fails here, before any cell runs."""
        for cell in self.cells():
            try:
                self.config_of(cell)
            except ConfigError as err:
                raise ConfigError(f"sweep cell {cell.name}: {err}") from None

    # ------------------------------------------------------------ the sweep directory
    def save(self, sweep_dir: Path) -> None:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        layout = SweepLayout(sweep_dir)
        layout.base_config.write_text(yaml.safe_dump(self.base, sort_keys=False), encoding="utf-8")
        plan = {k: v for k, v in asdict(self).items() if k != "base"}
        plan["cells"] = [asdict(c) for c in self.cells()]
        write_json_atomic(layout.plan, plan)

    @classmethod
    def load(cls, sweep_dir: Path) -> SweepPlan:
        import json

        layout = SweepLayout(sweep_dir)
        path = layout.plan
        if not path.is_file():
            raise ConfigError(f"{sweep_dir}: no {path.name}; is it a sweep directory?")
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            plan = cls(
                read_yaml(layout.base_config),
                saved["fixed"],
                saved["grid"],
                saved["seeds"],
                saved.get("source", ""),
                saved.get("arms", {}),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{path}: not a sweep plan ({err})") from None
        return plan

    def same_as(self, other: SweepPlan) -> list[str]:
        """What differs between two plans (empty when a sweep directory may be resumed with this one)."""
        return [
            name
            for name in ("base", "fixed", "grid", "seeds", "arms")
            if getattr(self, name) != getattr(other, name)
        ]
