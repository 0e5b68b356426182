"""The `rl.teacher` section: on-policy distillation from one teacher, or from several chosen per prompt by a
data column (docs/algorithms.md, "On-policy distillation")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from everyprompt.config.base import Section


class TeacherConfig(Section):
    model: str | None = Field(
        None,
        description="The teacher of every prompt: a checkpoint directory, a .gguf file or a Hub id "
        "ORG/NAME[@REVISION]; its tokenizer must be the student's (None: no teacher, unless `models`).",
    )
    by: str | None = Field(
        None,
        description="Several teachers: the prompt rows' column whose value picks each prompt's teacher from "
        "`models` (a built-in task's rows have `level`).",
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="Several teachers: value of the `by` column -> teacher (path or Hub id); a prompt whose "
        "value is not listed gets no distillation term.",
    )
    coef: float = Field(
        1.0, gt=0, description="Scale of the per-token advantage -(log p_student - log p_teacher)."
    )
    mode: Literal["add", "alone"] = Field(
        "add",
        description="add: the distillation advantage is added to the estimator's (rl.advantage); alone: "
        "pure distillation, the reward's advantage is not used.",
    )

    @property
    def enabled(self) -> bool:
        return self.model is not None or bool(self.models)

    def named(self) -> dict[str, str]:
        """Each teacher by the key a row is matched with: '' for the one teacher of every prompt."""
        return {"": self.model} if self.model is not None else dict(self.models)

    @field_validator("models", mode="before")
    @classmethod
    def _values_as_text(cls, models: object) -> object:
        """A column's values are matched as text: YAML's `1: path` names the rows whose value is 1."""
        return {str(key): value for key, value in models.items()} if isinstance(models, dict) else models

    @model_validator(mode="after")
    def _one_way_to_name_teachers(self) -> TeacherConfig:
        if self.model is not None and (self.by is not None or self.models):
            raise ValueError("name one teacher (model) or several (by and models), not both")
        if bool(self.models) != (self.by is not None):
            missing = (
                "by (the data column that picks a teacher)" if self.models else "models (value -> teacher)"
            )
            raise ValueError(f"several teachers need both by and models; {missing} is not set")
        return self
