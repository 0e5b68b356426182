"""Config sections of zero-variance elimination and the curriculum."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from everyprompt.config.base import Section
from everyprompt.config.tasks import TaskLevelsConfig


class OfflineFilterConfig(Section):
    enabled: bool = Field(
        False, description="Stage 0: estimate the RL prompts' pass rates before RL and drop the extremes."
    )
    samples: int = Field(8, ge=1, description="Samples per prompt for the pass-rate estimate.")
    low: float = Field(0.0, ge=0, le=1, description="Drop prompts with pass rate <= low (too hard).")
    high: float = Field(1.0, ge=0, le=1, description="Drop prompts with pass rate >= high (too easy).")
    max_prompts: int | None = Field(
        None, gt=0, description="Estimate on a seeded sample of this many prompts (None: all)."
    )

    @model_validator(mode="after")
    def _band(self) -> OfflineFilterConfig:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class ExpansionConfig(Section):
    enabled: bool = Field(True, description="Stage 1: resample zero-variance groups up to max_group_size.")
    max_group_size: int = Field(16, ge=2, description="N_max: largest group after expansion.")
    step: int | None = Field(
        None, gt=0, description="Samples added to a zero-variance group per round (None: rl.group_size)."
    )
    dynamic_sampling: bool = Field(
        False,
        description="Draw extra prompts until the step holds rl.prompts_per_step informative groups.",
    )
    max_rollouts_per_step: int | None = Field(
        None, gt=0, description="Rollout budget per step (None: 2 x prompts_per_step x group_size)."
    )


class ReshapeConfig(Section):
    enabled: bool = Field(True, description="Stage 2: break ties in zero-variance groups by shaping terms.")
    length_coef: float = Field(0.05, ge=0, description="lambda: weight of the centred length term.")
    repetition_coef: float = Field(0.05, ge=0, description="mu: weight of the centred repetition term.")
    reward_gap: float = Field(
        1.0, gt=0, description="Smallest gap between reward levels; lambda + mu must stay below it."
    )

    @model_validator(mode="after")
    def _bounded(self) -> ReshapeConfig:
        if self.length_coef + self.repetition_coef >= self.reward_gap:
            raise ValueError(
                f"length_coef + repetition_coef ({self.length_coef + self.repetition_coef:g}) must stay below "
                f"reward_gap ({self.reward_gap:g}), or a wrong answer could outrank a right one"
            )
        return self


class ZVPConfig(Section):
    enabled: bool = Field(True, description="Stage 3: entropy-guided token advantages (RL-ZVP).")
    alpha: float = Field(0.1, gt=0, description="alpha: scale of the entropy advantages.")


class RetirementConfig(Section):
    enabled: bool = Field(True, description="Stage 4: retire always-solved prompts, defer never-solved ones.")
    retire_after: int = Field(2, ge=1, description="All-correct groups in a row before a prompt retires.")
    defer_after: int = Field(2, ge=1, description="All-wrong groups in a row before a prompt is deferred.")
    defer_steps: int = Field(50, ge=0, description="Steps a deferred prompt sits out.")
    ema_decay: float = Field(0.5, ge=0, lt=1, description="Decay of the pass-rate EMA per visit.")


class ZVEConfig(Section):
    enabled: bool = Field(False, description="Multi-stage zero-variance elimination (docs/zve.md).")
    filter: OfflineFilterConfig = Field(
        default_factory=lambda: OfflineFilterConfig(), description="Stage 0: the offline pass-rate filter."
    )
    expansion: ExpansionConfig = Field(
        default_factory=lambda: ExpansionConfig(),
        description="Stage 1: adaptive group expansion and dynamic sampling.",
    )
    reshape: ReshapeConfig = Field(
        default_factory=lambda: ReshapeConfig(),
        description="Stage 2: reward reshaping of zero-variance groups.",
    )
    zvp: ZVPConfig = Field(
        default_factory=lambda: ZVPConfig(), description="Stage 3: RL-ZVP token advantages."
    )
    retirement: RetirementConfig = Field(
        default_factory=lambda: RetirementConfig(), description="Stage 4: online retirement and deferral."
    )
    drop_zero_variance: bool = Field(
        True, description="Leave groups still zero-variance after every enabled stage out of the update."
    )
    pass_rates: str | None = Field(
        None, description="A pass-rate store to start from (e.g. written by `everyprompt filter`)."
    )
    correct_reward: float = Field(
        1.0, description="A completion counts as correct at this reward or above (pass rates, RL-ZVP sign)."
    )


class CurriculumStage(Section):
    mixture: dict[str, float] = Field(
        description="Weight per difficulty bucket (a value of the difficulty field, or easy/medium/hard)."
    )
    steps: int | None = Field(None, gt=0, description="Steps in this stage (None: until the run ends).")
    advance_accuracy: float | None = Field(
        None, gt=0, le=1, description="Advance early once the recent training accuracy reaches this."
    )
    max_new_tokens: int | None = Field(None, gt=0, description="Response length cap in this stage.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Per-stage settings: rollout.temperature, rollout.top_p, rl.group_size, rl.prompts_per_step.",
    )

    @field_validator("mixture", mode="before")
    @classmethod
    def _string_keys(cls, mixture: Any) -> Any:
        return {str(k): w for k, w in mixture.items()} if isinstance(mixture, dict) else mixture

    @field_validator("mixture")
    @classmethod
    def _weights(cls, mixture: dict[str, float]) -> dict[str, float]:
        if not mixture or any(w < 0 for w in mixture.values()) or sum(mixture.values()) <= 0:
            raise ValueError("expected non-negative weights with a positive sum")
        return mixture

    @field_validator("overrides")
    @classmethod
    def _known_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(overrides) - set(STAGE_OVERRIDES))
        if unknown:
            raise ValueError(
                f"unknown stage override(s) {unknown}; expected some of {', '.join(STAGE_OVERRIDES)}"
            )
        return overrides


STAGE_OVERRIDES = ("rollout.temperature", "rollout.top_p", "rl.group_size", "rl.prompts_per_step")


class CurriculumConfig(Section):
    difficulty: Literal["field", "pass_rate"] = Field(
        "field", description="Bucket prompts by a dataset field or by pass-rate band."
    )
    field: str = Field("level", description="The dataset field that names a prompt's bucket.")
    pass_rate_edges: tuple[float, float] = Field(
        (0.3, 0.8),
        description="Pass rate below the first edge: hard; from the second: easy; between: medium.",
    )
    window: int = Field(5, ge=1, description="Steps averaged for a stage's advance_accuracy test.")
    stages: list[CurriculumStage] = Field(
        default_factory=list, description="The stages, in order (empty: no curriculum)."
    )
    levels: TaskLevelsConfig = Field(
        default_factory=TaskLevelsConfig,
        description="reasoning-gym tasks moved through their own curricula's levels by pass rate (docs/data.md).",
    )

    @model_validator(mode="after")
    def _stages_or_levels(self) -> CurriculumConfig:
        if self.levels.enabled and self.stages:
            raise ValueError("curriculum.levels.enabled and curriculum.stages are two curricula; keep one")
        return self
