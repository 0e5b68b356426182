"""Config sections of the RL update: loss, advantages, KL, corrections, replay."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from everyprompt.algorithms import policy_loss_spec, registered_advantages, registered_policy_losses
from everyprompt.algorithms.options import (
    CISPOOptions,
    DPPOKLOptions,
    DPPOTVOptions,
    ESPOOptions,
    GSPOOptions,
    PPOClipOptions,
    SAPOOptions,
)
from everyprompt.config.base import YAML_WORDS, Section
from everyprompt.config.teacher import TeacherConfig

# micro_batch_size=auto: sequences a micro-batch on the CPU (the recipes' setting before auto; the
# smollm2 recipe's RL step peaked at 7.9 GiB of host memory with 16, 15.5 GiB with 64 on 2 cores), tokens
# a micro-batch on a GPU (SmolLM2's 64 sequences of ~100 tokens in one pass: on an H200 four passes of 16
# took 0.95 s of host-bound time, one pass 0.37 s where cuDNN had planned its width: docs/gpu.md). A larger
# model on a smaller card lowers it.
AUTO_CPU_SEQUENCES = 16
AUTO_GPU_TOKENS = 8192


class KLConfig(Section):
    estimator: Literal["k1", "k2", "k3"] | None = Field(
        None, description="KL estimator against the frozen starting policy (None: no KL term)."
    )
    coef: float = Field(1e-3, ge=0, description="Weight of the KL term in the loss.")


class RolloutCorrectionConfig(Section):
    mode: Literal["tis", "mis", "icepop"] | None = Field(
        None,
        description="tis: truncated IS weight; mis: mask tokens outside [1/C, C] (or `band`); icepop: the "
        "IS weight inside `band`, 0 outside; None: off.",
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Ratio per token, per sequence (product over its tokens), or per sequence as the "
        "geometric mean of its tokens' ratios (for sequence-level losses: GSPO, ESPO).",
    )
    cap: float = Field(2.0, gt=1, description="The cap C.")
    band: tuple[float, float] | None = Field(
        None,
        description="[low, high] ratio band of mis (instead of [1/C, C]; at the geometric level, the "
        "geometric-mean band) and icepop (default [0.5, 5]).",
    )

    @field_validator("band")
    @classmethod
    def _a_band(cls, band: tuple[float, float] | None) -> tuple[float, float] | None:
        if band is not None and not 0 <= band[0] < band[1]:
            raise ValueError("expected [low, high] with 0 <= low < high")
        return band

    @model_validator(mode="after")
    def _band_where_it_applies(self) -> RolloutCorrectionConfig:
        if self.band is not None and self.mode not in ("mis", "icepop"):
            raise ValueError(f"band applies to mode mis or icepop, not mode={self.mode}")
        return self


class RLConfig(Section):
    steps: int = Field(80, ge=0, description="RL steps (one rollout batch and its updates each).")
    max_rollouts: int | None = Field(
        None, gt=0, description="Stop once this many rollouts were generated (None: rl.steps only)."
    )
    prompts_per_step: int = Field(16, gt=0, description="Prompts sampled per step.")
    group_size: int = Field(8, ge=2, description="Completions per prompt (the GRPO group).")
    lr: float = Field(1e-5, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Schedule after warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_skipped_updates: int = Field(
        3,
        ge=1,
        description="Consecutive mini-batch updates skipped for a non-finite loss or gradient norm after which "
        "the run stops (its last checkpoint is the last good state).",
    )
    mini_batches: int = Field(2, gt=0, description="Optimizer steps per rollout batch (PPO mini-batches).")
    micro_batch_size: int | Literal["auto"] = Field(
        64,
        description="Sequences per forward/backward (gradient accumulation); auto: 16 on the CPU, and on "
        "a GPU as many as `micro_batch_tokens` tokens hold (docs/training.md).",
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="At most this many tokens (prompt + completion) per forward/backward, on top of "
        f"micro_batch_size (None: no cap; under micro_batch_size=auto on a GPU {AUTO_GPU_TOKENS}).",
    )
    advantage: str = Field("grpo", description="Advantage estimator (algorithms registry name).")
    dead_zone: float = Field(
        0.0,
        ge=0,
        description="grpo / dr_grpo: |R - group mean| below this gives advantage 0 (for noisy scalar "
        "reward models; 0 = off).",
    )
    loss: str = Field(
        "ppo_clip",
        description="Policy loss (algorithms registry name: ppo_clip, gspo, gspo_token, espo, cispo, sapo, "
        "dppo_tv, dppo_kl).",
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = Field(
        None, description="How per-token losses are reduced (None: the loss's own default)."
    )
    loss_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword options for a user-registered loss."
    )
    ppo: PPOClipOptions = Field(default_factory=PPOClipOptions, description="ppo_clip options.")
    gspo: GSPOOptions = Field(default_factory=GSPOOptions, description="gspo / gspo_token options.")
    cispo: CISPOOptions = Field(default_factory=CISPOOptions, description="cispo options.")
    espo: ESPOOptions = Field(default_factory=ESPOOptions, description="espo options.")
    sapo: SAPOOptions = Field(default_factory=SAPOOptions, description="sapo options.")
    dppo_tv: DPPOTVOptions = Field(default_factory=DPPOTVOptions, description="dppo_tv options.")
    dppo_kl: DPPOKLOptions = Field(default_factory=DPPOKLOptions, description="dppo_kl options.")
    kl: KLConfig = Field(default_factory=lambda: KLConfig(), description="KL penalty to the starting policy.")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=lambda: RolloutCorrectionConfig(),
        description="Train/rollout mismatch correction with the engine's log-probs.",
    )
    off_policy_mask: float | None = Field(
        None,
        gt=0,
        description="Off-policy sequence masking (DeepSeek-V3.2): drop a negative-advantage sequence whose mean "
        "per-token KL from the sampling engine's policy to the current one exceeds this (None: off).",
    )
    teacher: TeacherConfig = Field(
        default_factory=lambda: TeacherConfig(),
        description="On-policy distillation: the teacher(s) whose log-probs of the sampled tokens give a "
        "per-token advantage (no teacher by default).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous training: the rollout side generates batch b with the policy of update "
        "b - k, overlapping the learner's update (0: the synchronous loop). k >= 1 needs "
        "rl.old_logprobs=recompute and rl.rollout_correction (the decoupled objective, docs/asynchrony.md).",
    )
    async_mismatch_rows: int = Field(
        32,
        ge=0,
        description="Asynchronous runs (local backend): rows of each batch whose mismatch/* are measured "
        "against the weights that sampled them, on a replica in the rollout thread (0: off).",
    )
    levels: list[int] | None = Field(
        None, description="Built-in task levels for RL prompts (None: data.levels)."
    )
    router_replay: Annotated[Literal["off", "r2", "r3"], YAML_WORDS] = Field(
        "off",
        description="MoE router replay in the trainer's forwards: off; r2: the routes of the trainer's own "
        "old-policy pass; r3: the rollout engine's routes.",
    )
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description="Old-policy log-probs (and entropies) of the PPO ratio: a trainer forward pass before "
        "the update ('recompute'), or the rollout engine's own ('rollout': one forward pass fewer per step; "
        "exact only while engine and trainer compute alike, e.g. both fp32).",
    )

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, name: str) -> str:
        if name not in registered_advantages():
            raise ValueError(f"expected one of {', '.join(registered_advantages())}")
        return name

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _a_size_or_auto(cls, value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("expected a positive integer or auto")
        return value

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name not in registered_policy_losses():
            raise ValueError(f"expected one of {', '.join(registered_policy_losses())}")
        return name

    @model_validator(mode="after")
    def _r2_needs_recompute(self) -> RLConfig:
        if self.router_replay == "r2" and self.old_logprobs == "rollout":
            raise ValueError(
                "router_replay='r2' replays the routes of the trainer's own old-policy pass, which "
                "old_logprobs='rollout' skips; set rl.old_logprobs=recompute or use r3"
            )
        return self

    @model_validator(mode="after")
    def _dead_zone_estimators(self) -> RLConfig:
        if self.dead_zone > 0 and self.advantage not in ("grpo", "dr_grpo"):
            raise ValueError(
                f"dead_zone applies to the grpo and dr_grpo estimators, not advantage={self.advantage!r}"
            )
        return self

    @model_validator(mode="after")
    def _correction_needs_recompute(self) -> RLConfig:
        if self.old_logprobs == "rollout" and self.rollout_correction.mode is not None:
            raise ValueError(
                "rollout_correction compares the engine's log-probs with the trainer's old ones; with "
                "old_logprobs='rollout' they are the same, so set rl.old_logprobs=recompute"
            )
        return self

    @model_validator(mode="after")
    def _asynchrony_is_decoupled(self) -> RLConfig:
        if self.max_staleness == 0:
            return self
        if self.old_logprobs != "recompute":
            raise ValueError(
                f"max_staleness={self.max_staleness} clips around the learner's own old policy (proximal), "
                "which old_logprobs='rollout' skips; set rl.old_logprobs=recompute"
            )
        if self.rollout_correction.mode is None:
            raise ValueError(
                f"max_staleness={self.max_staleness} samples with an older policy than the learner's: set "
                "rl.rollout_correction.mode=tis (the decoupled objective's truncated importance weight) or "
                "mis (docs/asynchrony.md)"
            )
        return self

    def _loss_section(self) -> str | None:
        """The section of this config (rl.ppo, rl.gspo, ...) typed with the loss's option schema."""
        schema = policy_loss_spec(self.loss).options
        fields = type(self).model_fields
        return next((name for name, field in fields.items() if schema and field.annotation is schema), None)

    @model_validator(mode="after")
    def _loss_options_where_they_belong(self) -> RLConfig:
        section = self._loss_section()
        if section is not None and self.loss_options:
            raise ValueError(
                f"loss {self.loss!r} takes its options from rl.{section}.*, not rl.loss_options "
                f"(got {sorted(self.loss_options)})"
            )
        if section is None:
            policy_loss_spec(self.loss).resolve_options(self.loss_options)  # unknown or bad options
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """The options of `loss`: its section of this config when it has one, else `loss_options` checked
        against the loss's registered schema."""
        section = self._loss_section()
        if section is not None:
            return getattr(self, section).model_dump()
        return policy_loss_spec(self.loss).resolve_options(self.loss_options)

    def micro_batching(self, device_type: str) -> tuple[int | None, int | None]:
        """(sequences, tokens): the caps of one forward/backward on a device of `device_type` (None: no
        cap of that kind); `micro_batch_size=auto` decides by the device (see AUTO_*)."""
        if self.micro_batch_size != "auto":
            return self.micro_batch_size, self.micro_batch_tokens
        if device_type == "cpu":
            return AUTO_CPU_SEQUENCES, self.micro_batch_tokens
        return None, self.micro_batch_tokens or AUTO_GPU_TOKENS
