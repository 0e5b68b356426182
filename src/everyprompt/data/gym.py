"""reasoning-gym's procedural tasks as prompt rows (`data.task=reasoning-gym`; docs/data.md).

A task is one of the library's registered datasets (`leg_counting`, `chain_sum`, ...); a level is a
global level of its curriculum (every attribute at that level, as the library's `set_global_level` sets
it). Items are made from the run's `data.split_seed`: the held-out items of each task first, at the task's
`level`, then the training items of each level in use, skipping any question already dealt, so the splits
are disjoint by construction and the held-out split does not change with `num_train` or the levels
trained on. Each row carries what the task's own scorer needs (`gym`: how its config was made, the task,
its level and settings, the seed and size, and the item's index in that dataset), from which the
`reasoning_gym` reward makes the config and the item again, exactly as the library made them, and hands
them to `score_answer`. A config or an item read back from JSON would not always do: some hold enums
(word_sorting, aiw), dates and times (time_intervals), nested configs or tuple grids (arc_agi, rearc),
which JSON turns into text and lists their scorers refuse or misread. The row also holds the item in
JSON (`entry`) for a person to read.

The library is imported only here and in the reward (an extra: `pip install 'everyprompt[tasks]'`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import warnings
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
        with warnings.catch_warnings():
            # cellpylib, which reasoning-gym imports, compiles with four SyntaxWarnings ("is" with a
            # literal) wherever Python writes no bytecode cache: printed at every start, not ours to fix
            warnings.simplefilter("ignore", SyntaxWarning)
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


NONSENSE = "zq-not-an-answer"  # an answer no task's question has


def check_scorer(name: str, config, level: int | None) -> None:
    """A ConfigError naming the task when its scorer gives full marks to a nonsense answer: such a reward
    carries no signal (reasoning-gym 0.1.25's game_of_life_halting compares bool(answer), True for any
    text, with bool of its own answer, True for "True" and "False" alike)."""
    datasets, _ = _registry()
    dataset = datasets[name][0](config=config)
    item = dataset[0]
    try:
        scored = dataset.score_answer(NONSENSE, item)
    except Exception:  # noqa: BLE001  (a scorer that cannot read the answer does not accept it)
        return
    if scored >= 1.0:
        where = f"level {level}" if level is not None else "its settings"
        raise ConfigError(
            f"config key '{KEY}.{name}': reasoning-gym's scorer of {name} ({where}) gives full marks to a "
            f"nonsense answer ({NONSENSE!r}), so it carries no learning signal; use another task"
        )


def _seed(split_seed: int, *parts: object) -> int:
    return zlib.crc32("/".join(map(str, (split_seed, *parts))).encode()) & 0x7FFFFFFF


def _json_copy(value: Any) -> Any:
    """`value` as JSON holds it: tuples and sets as lists, an enum as its value, anything else JSON has no
    type for (dates, times, a library's objects) as its text."""
    if isinstance(value, dict):
        return {str(k): _json_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_copy(v) for v in value]
    if isinstance(value, enum.Enum):
        return _json_copy(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a task's items are made: its config from the level and settings (`task_config`), then the
    seed and size. JSON in a row (`as_json`), and made again from it in a reward worker."""

    task: str
    level: int | None
    settings: dict
    seed: int
    size: int

    def config(self):
        made = task_config(self.task, GymTaskConfig(settings=self.settings), self.level)
        if not hasattr(made, "seed"):
            return made
        return dataclasses.replace(made, seed=self.seed, size=self.size)

    def dataset(self):
        datasets, _ = _registry()
        return datasets[self.task][0](config=self.config())

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def make_items(recipe: Recipe, count: int, dealt: set[str], read: str = "auto") -> list[dict]:
    """`count` rows of `recipe`'s task, none whose question is in `dealt` (those made are added to it);
    `read`: how the reward reads the model's answer."""
    name, level = recipe.task, recipe.level
    dataset = recipe.dataset()
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
        gym = {**recipe.as_json(), "index": index - 1, "entry": _json_copy(item), "read": read}
        rows.append(
            {
                "prompt": item["question"],
                "answer": "" if item.get("answer") is None else str(item["answer"]),
                "level": level,
                "task": name,
                "gym": gym,
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
        for name, task in self.tasks.items():
            for level in {task.level, *self.training_levels(name)}:
                check_scorer(name, task_config(name, task, level), level)
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

    def recipe(self, name: str, level: int | None, seed: int, count: int) -> Recipe:
        return Recipe(name, level, dict(self.tasks[name].settings), seed, max(count, 1))

    def _shares(self, count: int) -> dict[str, int]:
        return split_counts(count, {name: task.weight for name, task in self.tasks.items()})

    def held_out(self) -> list[dict]:
        if self._held_out is None:
            data, rows = self.config.data, []
            for name, count in self._shares(data.num_eval).items():
                level = self.tasks[name].level
                seed = _seed(data.split_seed, name, "held-out")
                rows += make_items(self.recipe(name, level, seed, count), count, self._dealt, self.read)
            self._held_out = rows
        return self._held_out

    def train(self) -> list[dict]:
        if self._train is None:
            self.held_out()  # dealt first: training items never repeat a held-out question
            data, rows = self.config.data, []
            for name, count in self._shares(data.num_train).items():
                for level in self.training_levels(name):
                    seed = _seed(data.split_seed, name, "train", level)
                    rows += make_items(self.recipe(name, level, seed, count), count, self._dealt, self.read)
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
