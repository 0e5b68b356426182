"""Config sections of procedural tasks from reasoning-gym (`data.task=reasoning-gym`) and of the curriculum
that moves each task through its difficulty levels (`curriculum.levels`); docs/data.md.

What the library itself must say (a task's name, its settings, its levels) is checked when the run's rows
are made (data/gym.py), before any model loads: the config tree does not import the library.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from everyprompt.config.base import ConfigError, Section

RESERVED_SETTINGS = ("seed", "size")  # set by everyprompt: the split's seed and the number of items
GYM_PREFIX = "reasoning-gym:"  # `--data reasoning-gym:chain_sum@1,products` (eval, filter)


def gym_overrides(spec: str, what: str = "--data") -> list[str]:
    """The config overrides `reasoning-gym:TASK[@LEVEL],...` stands for: data.task=reasoning-gym and those
    tasks, weight 1 each, at their levels (none given: the task's defaults); ConfigError naming `what` for a
    spec that does not parse (exit 2)."""
    tasks = []
    for part in spec.removeprefix(GYM_PREFIX).split(","):
        name, _, level = part.strip().partition("@")
        if not name or (level and not level.isdigit()):
            raise ConfigError(
                f"{what}={spec}: expected reasoning-gym:TASK[@LEVEL],... (e.g. reasoning-gym:chain_sum@1,products)"
            )
        tasks.append(f"{name}: {{level: {level}}}" if level else f"{name}: {{}}")
    return ["data.task=reasoning-gym", f"data.reasoning_gym.tasks={{{', '.join(tasks)}}}"]


class GymTaskConfig(Section):
    weight: float = Field(
        1.0, gt=0, description="The task's share of each step's prompts (and of num_train)."
    )
    level: int | None = Field(
        None,
        ge=0,
        description="The task's difficulty level (0: its curriculum's easiest) of the held-out items and, "
        "without curriculum.levels, of the training items; None: the task's defaults and `settings` alone.",
    )
    settings: dict[str, Any] = Field(
        {},
        description="The task's own config fields (reasoning-gym's dataclass of the task, e.g. "
        "{min_animals: 2, max_animals: 4}); a field the level sets may not be given as well.",
    )

    @field_validator("settings")
    @classmethod
    def _not_reserved(cls, settings: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(settings) & set(RESERVED_SETTINGS))
        if taken:
            raise ValueError(
                f"{taken} are set by everyprompt (data.split_seed and data.num_train / num_eval), not here"
            )
        return settings


class GymConfig(Section):
    tasks: dict[str, GymTaskConfig] = Field(
        {},
        description="reasoning-gym tasks by name and their mix, e.g. {leg_counting: {weight: 1, level: 1}}.",
    )
    answer: Literal["auto", "tags", "final"] = Field(
        "auto",
        description="How the task's scorer is handed the model's answer: tags (the last <answer>...</answer>, "
        "reasoning-gym's convention), final (the final-answer rule of the math reward: \\boxed{}, "
        "'the answer is', the last number) or auto (the tags when the completion has them, else final).",
    )

    @field_validator("tasks", mode="before")
    @classmethod
    def _names_as_strings(cls, tasks: Any) -> Any:
        if isinstance(tasks, dict):  # `tasks: {leg_counting: null}` or `{leg_counting: {}}`: the defaults
            return {str(k): ({} if v is None else v) for k, v in tasks.items()}
        return tasks


class TaskLevelsConfig(Section):
    enabled: bool = Field(
        False,
        description="Move each reasoning-gym task through its curriculum's levels by its recent pass rate "
        "(data.task=reasoning-gym; replaces curriculum.stages).",
    )
    start: int = Field(0, ge=0, description="The level every task starts at (and never goes below).")
    top: int | None = Field(
        None,
        ge=0,
        description="The highest level a task may reach (None: each task's own `level`, the held-out one).",
    )
    window: int = Field(
        8, ge=1, description="A task's groups at its current level averaged for the move (cleared after one)."
    )
    promote: float = Field(
        0.75,
        gt=0,
        le=1,
        description="Move a task up a level once its recent groups' mean pass rate reaches this.",
    )
    demote: float = Field(
        0.1, ge=0, lt=1, description="Move a task down a level once that mean is at or below this."
    )

    @model_validator(mode="after")
    def _ordered(self) -> TaskLevelsConfig:
        if self.demote >= self.promote:
            raise ValueError(f"demote ({self.demote}) must be below promote ({self.promote})")
        if self.top is not None and self.top < self.start:
            raise ValueError(f"top ({self.top}) must not be below start ({self.start})")
        return self
