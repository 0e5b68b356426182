"""The one typed configuration tree of everyprompt.

Every setting lives here, with its type, its default and a one-line description; nothing else in the
package holds a default of its own. A run's config is a YAML file plus dotted command-line overrides
(``rl.lr=1e-4``); an unknown key or a bad value raises :class:`ConfigError`, whose message names the key,
the value and what was expected. The resolved config is written into the run directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from everyprompt.algorithms import policy_loss_spec, registered_advantages, registered_policy_losses
from everyprompt.algorithms.losses import CISPOOptions, ESPOOptions, GSPOOptions, PPOClipOptions


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message is meant for the user as is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoRAConfig(Section):
    enabled: bool = Field(False, description="Train LoRA adapters on the RL policy (peft; docs/training.md).")
    r: int = Field(8, gt=0, description="Adapter rank.")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update is alpha / r * B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], description="Linear layers adapted, by name."
    )
    target_parameters: list[str] = Field(
        [],
        description="Non-linear-layer weights adapted, by name: MoE experts (mlp.experts.gate_up_proj, "
        "mlp.experts.down_proj), routers (mlp.gate.weight).",
    )
    save_merged: bool = Field(False, description="Checkpoints also hold the merged model under merged/.")

    @model_validator(mode="after")
    def _some_target(self) -> LoRAConfig:
        if self.enabled and not (self.target_modules or self.target_parameters):
            raise ValueError("enabled with neither target_modules nor target_parameters")
        return self


class ModelConfig(Section):
    preset: Literal["tiny-moe", "tiny-chat-moe"] = Field(
        "tiny-moe",
        description="Built-in random-init Qwen3-MoE used when `path` is unset: with the character tokenizer "
        "(tiny-moe) or a locally trained BPE with a chat template (tiny-chat-moe).",
    )
    path: str | None = Field(
        None, description="Local Hugging Face causal-LM checkpoint directory (overrides `preset`)."
    )
    hidden_size: int = Field(128, gt=0, description="Preset only: hidden width.")
    num_layers: int = Field(4, gt=0, description="Preset only: decoder layers (all MoE).")
    num_experts: int = Field(8, gt=0, description="Preset only: routed experts per MoE layer.")
    top_k: int = Field(2, gt=0, description="Preset only: experts per token.")
    moe_intermediate_size: int = Field(128, gt=0, description="Preset only: hidden width of one expert.")
    num_heads: int = Field(4, gt=0, description="Preset only: attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="Preset only: key/value heads (GQA).")
    pack_sequences: bool = Field(
        True,
        description="Training forwards pack sequences into shared rows (position_ids restart per sequence) "
        "instead of padding each; checked against unpacked log-probs when training starts.",
    )
    moe_kernel: Literal["everyprompt", "transformers"] = Field(
        "everyprompt",
        description="Training forwards' MoE experts: everyprompt's sorted grouped-matmul kernel (same outputs "
        "and gradients, faster backward on CPU) or transformers' own; models whose experts the kernel does "
        "not fit keep transformers'.",
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Training precision: bf16 runs the trainer's forwards under autocast, weights, gradients "
        "and optimizer state staying fp32 (docs/training.md).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute decoder layers' activations in the backward pass (less memory, slower)."
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters for RL (off by default).")


class DataConfig(Section):
    task: Literal["arithmetic"] = Field(
        "arithmetic", description="Built-in verifiable task used when no files are given."
    )
    train_file: str | None = Field(
        None,
        description="Prompts for RL and SFT: .jsonl/.json/.parquet/.arrow or a `datasets` save_to_disk "
        "directory (fields `prompt` or `messages`, `answer`, optional `level`, `solution` for SFT).",
    )
    eval_file: str | None = Field(None, description="Held-out prompts for evaluation (as train_file).")
    columns: dict[str, str] = Field(
        {},
        description="The files' column for each field, e.g. {prompt: question} (fields: prompt, answer, "
        "solution, level, messages).",
    )
    format: Literal["auto", "plain", "chat"] = Field(
        "auto",
        description="Prompt rendering: raw text (plain) or the tokenizer's chat template (chat); auto: chat "
        "when the tokenizer has a template and the model is not the preset.",
    )
    system_prompt: str | None = Field(None, description="Chat format: a system message before each prompt.")
    template_kwargs: dict[str, Any] = Field(
        {}, description="Chat format: switches passed to the chat template, e.g. {enable_thinking: false}."
    )
    levels: list[int] = Field(
        [1, 2, 3, 4, 5], description="Difficulty levels (1..5) of the built-in task to use."
    )
    num_train: int = Field(20000, gt=0, description="Built-in task: problems in the train split.")
    num_eval: int = Field(500, gt=0, description="Built-in task: problems in the held-out split.")
    split_seed: int = Field(1234, description="Seed of the built-in task's train/held-out split.")

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, columns: dict[str, str]) -> dict[str, str]:
        from everyprompt.data.datasets import FIELDS

        unknown = sorted(set(columns) - set(FIELDS))
        if unknown:
            raise ValueError(f"maps {unknown}; the fields are {', '.join(FIELDS)}")
        return columns

    @model_validator(mode="after")
    def _chat_only_settings(self) -> DataConfig:
        if self.format == "plain" and (self.system_prompt is not None or self.template_kwargs):
            raise ValueError("system_prompt and template_kwargs need format chat (or auto), not plain")
        return self


class SFTConfig(Section):
    steps: int = Field(600, ge=0, description="SFT optimizer steps (0 skips SFT).")
    batch_size: int = Field(64, gt=0, description="Worked solutions per SFT step.")
    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    levels: list[int] = Field([1, 2, 3, 4, 5], description="Difficulty levels of the worked solutions.")
    checkpoint_every: int = Field(
        100, ge=0, description="Save a resumable SFT checkpoint every N steps (0: only the finished model)."
    )


class RolloutConfig(Section):
    engine: str = Field(
        "auto",
        description="Rollout engine: `native` (own decode path, the fast one; families in docs/models.md), "
        "`hf` (any transformers causal LM through its own forward), or `auto` (native where it runs the "
        "model, else hf; the choice is logged).",
    )
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        "fp32",
        description="Rollout engine arithmetic: fp32, bf16, or fp8 (native engine only: e4m3 projection "
        "weights with per-output-channel scales, re-quantised at every weight sync).",
    )
    max_new_tokens: int = Field(64, gt=0, description="Completion length cap (tokens).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; the trainer's log-probs use the same."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    parity_threshold: float = Field(
        1e-3,
        ge=0,
        description="Startup parity check: the largest mean |log-prob difference| (fp32) allowed between the "
        "engine and the trainer on a few completions before the first RL step; 0 turns the check off.",
    )
    parity_prompts: int = Field(4, gt=0, description="Training prompts the startup parity check samples.")
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end a completion (finish reason `stop`), besides every end-of-sequence id "
        "of the model's tokenizer and generation config (finish reason `eos`).",
    )
    batch_size: int = Field(256, gt=0, description="Sequences decoded together (continuous-batching slots).")
    schedule: Literal["fifo", "longest_first"] = Field(
        "longest_first",
        description="Admission order into the engine: as sampled, or longest predicted completion first "
        "(prediction: the prompt's mean length in the pass-rate store, else its bucket's, else the cap).",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return _known_engine(name)


def _known_engine(name: str) -> str:
    from everyprompt.rollout import engine_choices

    if name not in engine_choices():
        raise ValueError(f"expected one of {', '.join(engine_choices())}")
    return name


DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response against a reference answer.\n"
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Think step by step, then end with one line: Verdict: correct, Verdict: partial or Verdict: incorrect.\n"
)


class GenRMConfig(Section):
    model: str | None = Field(None, description="Judge: a local Hugging Face causal-LM checkpoint directory.")
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="Judge prompt; {question}, {reference} and {response} are filled from the prompt row's "
        "`prompt` and `answer` and the completion.",
    )
    values: dict[str, float] = Field(
        default_factory=dict,
        description="Reward per verdict (correct/partial/incorrect/better/tie/worse); unset ones keep "
        "+1 / 0 / -1.",
    )
    max_new_tokens: int = Field(256, gt=0, description="Judge output cap (reasoning + verdict).")
    greedy: bool = Field(True, description="Greedy judging (else sampled at `temperature`).")
    temperature: float = Field(1.0, gt=0, description="Judge sampling temperature when not greedy.")
    batch_size: int = Field(64, gt=0, description="Judge engine slots.")
    engine: str = Field("auto", description="Rollout engine that decodes the judge (as `rollout.engine`).")
    log_every: int = Field(
        16,
        ge=0,
        description="Write every n-th judged row (prompt, output, verdict) to genrm_samples.jsonl (0: off).",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return _known_engine(name)


class ScalarRMConfig(Section):
    model: str | None = Field(
        None, description="A local sequence-classification checkpoint with one output (the score)."
    )
    template: str = Field("{question}\n{response}", description="Text scored; {question} and {response}.")
    batch_size: int = Field(32, gt=0, description="Responses scored per forward pass.")


class RewardComponentConfig(Section):
    name: str = Field(..., description="Component name: logged as reward/<name>.")
    function: str = Field(..., description="Registered reward name, `package.module:function`, or `genrm`.")
    weight: float = Field(1.0, description="Weight of this component in the total.")


class RewardsConfig(Section):
    function: str = Field(
        "math",
        description="Registered reward name, `package.module:function`, `genrm` (a judge model) or "
        "`scalar_rm` (a sequence-classification reward model).",
    )
    genrm: GenRMConfig = Field(default_factory=GenRMConfig, description="The judge of `function: genrm`.")
    scalar_rm: ScalarRMConfig = Field(
        default_factory=ScalarRMConfig, description="The model of `function: scalar_rm`."
    )
    components: list[RewardComponentConfig] = Field(
        default_factory=list,
        description="Several weighted rewards summed (replaces `function` when given), each logged as "
        "reward/<name>.",
    )
    missing: Literal["skip", "zero"] = Field(
        "skip",
        description="A component that is None for a row: `skip` makes the row's total None, `zero` counts it 0.",
    )
    workers: int = Field(
        1,
        ge=0,
        description="Reward worker processes, fed completions as they finish (0: score inline, "
        "no overlap with generation and no time limit).",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Time limit of one reward call; past it the reward is None (an error)."
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Limit on a reward worker's one-time set-up (a judge loading its model), apart from the "
        "per-call timeout_s; a reward that fails to load stops the run.",
    )
    max_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run when more than this share of the rewards of the last `error_window` steps "
        "failed (a step whose rewards all failed stops it at once).",
    )
    error_window: int = Field(10, ge=1, description="Steps over which `max_error_fraction` is judged.")

    @model_validator(mode="after")
    def _check_functions(self) -> RewardsConfig:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"components: names must be unique, got {names}")
        taken = sorted(set(names) & {"mean", "accuracy", "errors", "errors_total", "none_fraction"})
        if taken:
            raise ValueError(f"components: {taken} would clash with the reward/* metrics of the same name")
        functions = [c.function for c in self.components] or [self.function]
        if "genrm" in functions and not self.genrm.model:
            raise ValueError("function 'genrm' needs rewards.genrm.model (a judge checkpoint directory)")
        if "scalar_rm" in functions and not self.scalar_rm.model:
            raise ValueError("function 'scalar_rm' needs rewards.scalar_rm.model (a checkpoint directory)")
        return self


class KLConfig(Section):
    estimator: Literal["k1", "k2", "k3"] | None = Field(
        None, description="KL estimator against the frozen starting policy (None: no KL term)."
    )
    coef: float = Field(1e-3, ge=0, description="Weight of the KL term in the loss.")


class RolloutCorrectionConfig(Section):
    mode: Literal["tis", "mis"] | None = Field(
        None, description="tis: truncated IS weight; mis: mask tokens outside [1/C, C]; None: off."
    )
    level: Literal["token", "sequence"] = Field("token", description="Ratio per token or per sequence.")
    cap: float = Field(2.0, gt=1, description="The cap C.")


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
    micro_batch_size: int = Field(
        64, gt=0, description="Sequences per forward/backward (gradient accumulation)."
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
        description="Policy loss (algorithms registry name: ppo_clip, gspo, gspo_token, espo, cispo).",
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
    kl: KLConfig = Field(default_factory=lambda: KLConfig(), description="KL penalty to the starting policy.")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=lambda: RolloutCorrectionConfig(),
        description="Train/rollout mismatch correction with the engine's log-probs.",
    )
    levels: list[int] | None = Field(
        None, description="Built-in task levels for RL prompts (None: data.levels)."
    )
    router_replay: Literal["off", "r2", "r3"] = Field(
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

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name not in registered_policy_losses():
            raise ValueError(f"expected one of {', '.join(registered_policy_losses())}")
        return name

    @field_validator("router_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

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


class EvalConfig(Section):
    every: int = Field(0, ge=0, description="Evaluate every N RL steps (0: only at the end).")
    num_samples: int = Field(4, ge=1, description="Samples per prompt for pass@k.")
    pass_k: int = Field(4, ge=1, description="k of the sampled pass@k.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for pass@k.")

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        if self.pass_k > self.num_samples:
            raise ValueError(f"pass_k ({self.pass_k}) must not exceed num_samples ({self.num_samples})")
        return self


class CheckpointConfig(Section):
    every: int = Field(50, ge=0, description="Save every N RL steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Step checkpoints kept on disk.")


class LoggingConfig(Section):
    progress: bool = Field(True, description="Show a progress bar.")
    tensorboard: bool = Field(True, description="Write TensorBoard event files.")


class Config(Section):
    seed: int = Field(0, description="Seed of model init, sampling and prompt order.")
    run_dir: str | None = Field(None, description="Run directory (default: runs/<name>-<time>).")
    name: str = Field("demo", description="Run name used in the default run directory.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    zve: ZVEConfig = Field(default_factory=ZVEConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _rollout_logprobs_need_fp32(self) -> Config:
        if self.rl.old_logprobs == "rollout" and self.rollout.precision != "fp32":
            raise ValueError(
                f"rl.old_logprobs=rollout uses the engine's log-probs as the old policy's, which is exact only "
                f"in fp32; with rollout.precision={self.rollout.precision} set rl.old_logprobs=recompute"
            )
        return self


DEMO_CONFIG = "demo.yaml"


def demo_config_path() -> Path:
    """The embedded default config (`configs/demo.yaml`, shipped inside the package)."""
    return Path(str(resources.files("everyprompt") / "configs" / DEMO_CONFIG))


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


def build_config(tree: dict, source: str = "") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        prefix = f"{source}: " if source else ""
        raise ConfigError(_describe_error(err.errors()[0], prefix)) from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (the embedded demo default when `path` is None) and apply dotted overrides."""
    path = Path(path) if path is not None else demo_config_path()
    tree = read_yaml(path)
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
    return build_config(tree, source=str(path))


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
