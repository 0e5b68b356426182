"""reasoning-gym's procedural tasks as prompt rows (`data.task=reasoning-gym`; docs/data.md).

A task is one of the library's registered datasets (`leg_counting`, `chain_sum`, ...); a level is a
global level of its curriculum (every attribute at that level, as the library's `set_global_level` sets
it). Items are made from the run's `data.split_seed`: the held-out items of each task first, at the task's
`level`, then the training items of each level in use, skipping any question already dealt, so the splits
are disjoint by construction and the held-out split does not change with `num_train` or the levels
trained on. Each row carries what the task's own scorer needs (`gym`: the task, the config it was made
with and the item itself), which the `reasoning_gym` reward hands to `score_answer`.

The library is imported only here and in the reward (an extra: `pip install 'everyprompt[tasks]'`).
"""

from __future__ import annotations

import dataclasses
import difflib
import zlib
from collections.abc import Iterable
from typing import Any

from everyprompt.config import Config, ConfigError, GymTaskConfig
from everyprompt.data.source import split_counts
from everyprompt.errors import InputError

EXTRA = "pip install 'everyprompt[tasks]'"
KEY = "data.reasoning_gym.tasks"


class MissingExtra(InputError):
    """An optional library a config asks for is not installed; the message names the extra."""


def library():
    """The `reasoning_gym` module, or MissingExtra naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise MissingExtra(
            f"data.task=reasoning-gym needs the reasoning-gym package, which is not installed ({err}); "
            f"{EXTRA}"
        ) from None
    return reasoning_gym


def _registry() -> tuple[dict, dict]:
    library()
    from reasoning_gym.factory import CURRICULA, DATASETS

    return DATASETS, CURRICULA


def known_task(name: str, key: str = KEY) -> None:
    """ConfigError naming `key` when reasoning-gym has no task `name` (with the nearest names)."""
    datasets, _ = _registry()
    if name not in datasets:
        near = difflib.get_close_matches(name, datasets, n=3, cutoff=0.6)
        hint = (
            f"; did you mean {', '.join(near)}?"
            if near
            else f"; its {len(datasets)} tasks: {', '.join(sorted(datasets))}"
        )
        raise ConfigError(f"config key '{key}.{name}': reasoning-gym has no task {name!r}{hint}")


def top_level(name: str) -> int:
    """The highest global level of the task's curriculum (its longest attribute's last level)."""
    _, curricula = _registry()
    if name not in curricula:
        return 0
    attributes = curricula[name]().attributes.values()
    return max((len(a.levels) for a in attributes), default=1) - 1


def task_config(name: str, task: GymTaskConfig, level: int | None, key: str = KEY):
    """The task's dataclass config at `level` (None: its defaults) with `task.settings` on top; a
    ConfigError naming the key for an unknown task, a level it lacks, a setting it does not take or one it
    refuses."""
    known_task(name, key)
    datasets, curricula = _registry()
    config_cls = datasets[name][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(task.settings) - fields)
    if unknown:
        raise ConfigError(
            f"config key '{key}.{name}.settings': {name} takes no setting {unknown}; it takes "
            f"{', '.join(sorted(fields - {'seed', 'size'}))}"
        )
    args = dict(task.settings)
    if level is not None:
        if name not in curricula:
            raise ConfigError(
                f"config key '{key}.{name}.level': {name} has no curriculum, so no levels; leave level unset"
            )
        if level > top_level(name):
            raise ConfigError(
                f"config key '{key}.{name}.level': {name}'s levels are 0..{top_level(name)}, not {level}"
            )
        curriculum = curricula[name]()
        curriculum.set_global_level(level)
        try:
            made = dataclasses.asdict(curriculum.generate_configuration())
        except (AssertionError, ValueError, TypeError) as err:
            raise ConfigError(
                f"config key '{key}.{name}.level': reasoning-gym cannot make {name}'s level {level} ({err})"
            ) from None
        level_set = set()
        for attribute in curriculum.attributes.values():
            names = ("lower_field_name", "upper_field_name", "field_name")
            level_set |= {getattr(attribute, n) for n in names if getattr(attribute, n, None)}
        clash = sorted(level_set & set(args))
        if clash:
            raise ConfigError(
                f"config key '{key}.{name}.settings': {clash} are set by the task's level {level}; "
                "drop them or the level"
            )
        args = {**{k: made[k] for k in sorted(level_set) if k in made}, **args}
    try:
        config = config_cls(**args)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as err:
        raise ConfigError(
            f"config key '{key}.{name}': reasoning-gym refuses the settings {args} ({err})"
        ) from None
    return config


def _seed(split_seed: int, *parts: object) -> int:
    return zlib.crc32("/".join(map(str, (split_seed, *parts))).encode()) & 0x7FFFFFFF


def _json_copy(value: Any) -> Any:
    """Tuples as lists, as JSON, Parquet and the reward's row all hold them."""
    if isinstance(value, dict):
        return {str(k): _json_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_copy(v) for v in value]
    return value


def make_items(
    name: str, config, seed: int, count: int, dealt: set[str], level: int | None, read: str = "auto"
) -> list[dict]:
    """`count` rows of task `name` made with `config` from `seed`, none whose question is in `dealt`
    (those made are added to it); `read`: how the reward reads the model's answer."""
    datasets, _ = _registry()
    made = dataclasses.replace(config, seed=seed, size=max(count, 1)) if hasattr(config, "seed") else config
    dataset = datasets[name][0](config=made)
    settings = _json_copy(dataclasses.asdict(made))  # what the reward rebuilds the task's scorer from
    rows: list[dict] = []
    index, limit = 0, 50 * count + 1000
    while len(rows) < count:
        if index >= limit:
            raise ConfigError(
                f"config key '{KEY}.{name}': could not make {count} distinct questions at "
                f"{'level ' + str(level) if level is not None else 'its settings'} in {limit} tries (it has "
                f"{len(rows)}); ask fewer (data.num_train, data.num_eval) or widen the task's settings"
            )
        item = dataset[index]
        index += 1
        if item["question"] in dealt:
            continue
        dealt.add(item["question"])
        entry = _json_copy(item)
        rows.append(
            {
                "prompt": item["question"],
                "answer": "" if item.get("answer") is None else str(item["answer"]),
                "level": level,
                "task": name,
                "gym": {"task": name, "config": settings, "entry": entry, "read": read},
            }
        )
    return rows


class GymRows:
    """The held-out and training rows of `data.reasoning_gym` under a config, made once each."""

    def __init__(self, config: Config):
        self.config = config
        self.tasks = config.data.reasoning_gym.tasks
        self.read = config.data.reasoning_gym.answer
        # every task's config at its held-out level and each training level: every name, setting and level
        # checked here, before any work
        self.configs = {
            (name, level): task_config(name, task, level)
            for name, task in self.tasks.items()
            for level in {task.level, *self.training_levels(name)}
        }
        self._dealt: set[str] = set()
        self._held_out: list[dict] | None = None
        self._train: list[dict] | None = None

    def training_levels(self, name: str) -> list[int | None]:
        """The levels the task is trained at: its `level`, or start..top with curriculum.levels."""
        levels, task = self.config.curriculum.levels, self.tasks[name]
        if not levels.enabled:
            return [task.level]
        top = levels.top if levels.top is not None else task.level
        if top is None:
            raise ConfigError(
                f"config key '{KEY}.{name}.level': curriculum.levels needs each task's level (the held-out "
                "one, and the top of its climb unless curriculum.levels.top is set)"
            )
        if top > top_level(name):
            raise ConfigError(
                f"config key 'curriculum.levels.top': {name}'s levels are 0..{top_level(name)}, not {top}"
            )
        if levels.start > top:
            raise ConfigError(
                f"config key 'curriculum.levels.start': {levels.start} is above {name}'s top level {top}"
            )
        return list(range(levels.start, top + 1))

    def _shares(self, count: int) -> dict[str, int]:
        return split_counts(count, {name: task.weight for name, task in self.tasks.items()})

    def held_out(self) -> list[dict]:
        if self._held_out is None:
            data, rows = self.config.data, []
            for name, count in self._shares(data.num_eval).items():
                level = self.tasks[name].level
                seed = _seed(data.split_seed, name, "held-out")
                rows += make_items(
                    name, self.configs[name, level], seed, count, self._dealt, level, self.read
                )
            self._held_out = rows
        return self._held_out

    def train(self) -> list[dict]:
        if self._train is None:
            self.held_out()  # dealt first: training items never repeat a held-out question
            data, rows = self.config.data, []
            for name, count in self._shares(data.num_train).items():
                for level in self.training_levels(name):
                    seed = _seed(data.split_seed, name, "train", level)
                    rows += make_items(
                        name, self.configs[name, level], seed, count, self._dealt, level, self.read
                    )
            self._train = rows
        return self._train


def bucket(task: str, level: int | None) -> str:
    """The prompt-source bucket of a task's items at a level."""
    return task if level is None else f"{task}@{level}"


def buckets(rows: Iterable[dict]) -> dict[str, list[int]]:
    """Row indices by task and level."""
    out: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        out.setdefault(bucket(row["task"], row["level"]), []).append(index)
    return out
