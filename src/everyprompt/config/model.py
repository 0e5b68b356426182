"""Config sections of the model, its data and the SFT warm start."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from everyprompt.choices import FIELDS, GYM, TASKS
from everyprompt.config.base import Section
from everyprompt.config.tasks import GymConfig
from everyprompt.devices import check_device_setting


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
        None,
        description="A Hugging Face causal-LM checkpoint: a local directory, a .gguf file, or a Hub id "
        "ORG/NAME[@REVISION] (overrides `preset`).",
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
    logprob_chunk: int = Field(
        512,
        ge=0,
        description="Training forwards run the LM head on the targets the loss reads only (completion tokens), "
        "this many at a time, so no [batch, length, vocab] logits exist (docs/training.md); 0: the model's "
        "full logits.",
    )
    moe_kernel: Literal["everyprompt", "transformers"] = Field(
        "everyprompt",
        description="Training forwards' MoE experts: everyprompt's sorted grouped-matmul kernel (same outputs "
        "and gradients, faster backward on CPU) or transformers' own; models whose experts the kernel does "
        "not fit keep transformers'.",
    )
    dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Training precision: bf16 runs the trainer's forwards under autocast, weights, gradients "
        "and optimizer state staying fp32 (docs/training.md); auto: bf16 on CUDA, fp32 on the CPU.",
    )
    cpu_bf16: Literal["auto", "native", "emulated"] = Field(
        "auto",
        description="How a CPU computes model.dtype=bf16's matrix products: native (torch's bf16 kernels), "
        "emulated (its float32 kernels on bf16-rounded operands, the result rounded to bf16: the same format, "
        "fp32 speed), or auto: emulated where a bf16 product is 4x slower than an fp32 one or more on this "
        "CPU (no AVX-512 BF16 or AMX), else native. GPUs compute bf16 natively.",
    )
    frozen_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="What the weights no update touches are held in: a LoRA policy's base and a distillation "
        "teacher. auto: bf16 on CUDA when model.dtype is bf16 (half their memory; their norms and residual "
        "adds become bf16 too, as in a bf16 model), else fp32 (a CPU's bf16 elementwise work is slow); fp32 "
        "or bf16: that always (docs/training.md).",
    )
    device: str = Field(
        "auto",
        description="Where the learner's policy (and SFT) runs: auto (the first CUDA device when torch sees "
        "one, else the CPU), cpu, cuda, or cuda:N; under Ray, the GPU the actor was given (docs/gpu.md).",
    )
    kernels: Literal["torch", "liger", "compiled"] = Field(
        "torch",
        description="The learner's layer kernels: torch's own, liger (Liger's Triton RMSNorm, SwiGLU and "
        "rotary kernels; CUDA only, the `kernels` extra), or compiled (each decoder layer through "
        "torch.compile; the first update compiles); docs/training.md.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute decoder layers' activations in the backward pass (less memory, slower)."
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters for RL (off by default).")

    @field_validator("device")
    @classmethod
    def _a_device_setting(cls, value: str) -> str:
        return check_device_setting(value)


class DataConfig(Section):
    task: str = Field(
        "arithmetic",
        description="Built-in verifiable task used when no files are given: arithmetic (bare sums with "
        "worked solutions, for models trained from scratch) or questions (arithmetic questions and word "
        "problems in English, for pretrained chat models); or reasoning-gym: the procedural tasks of "
        "`reasoning_gym` (everyprompt[tasks]) named in data.reasoning_gym; docs/data.md.",
    )
    reasoning_gym: GymConfig = Field(
        default_factory=GymConfig, description="data.task=reasoning-gym: the tasks, their mix and levels."
    )
    train_file: str | None = Field(
        None,
        description="Prompts for RL and SFT: .jsonl/.json/.parquet/.arrow or a `datasets` save_to_disk "
        "directory, or a Hub dataset file hf://datasets/ORG/NAME[@REVISION]/PATH (fields `prompt` or `messages`, `answer`, optional `level`, `solution` for SFT).",
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
        "whenever the tokenizer has a chat template.",
    )
    system_prompt: str | None = Field(None, description="Chat format: a system message before each prompt.")
    template_kwargs: dict[str, Any] = Field(
        {}, description="Chat format: switches passed to the chat template, e.g. {enable_thinking: false}."
    )
    levels: list[int] = Field(
        [1, 2, 3, 4, 5], description="Difficulty levels (1..5) of the built-in task to use."
    )
    num_train: int = Field(
        20000,
        gt=0,
        description="Built-in task: problems in the train split (reasoning-gym: at each training level, "
        "shared by the tasks' weights).",
    )
    num_eval: int = Field(
        500,
        gt=0,
        description="Built-in task: problems in the held-out split (reasoning-gym: shared likewise).",
    )
    split_seed: int = Field(1234, description="Seed of the built-in task's train/held-out split.")

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        if task not in (*TASKS, GYM):
            raise ValueError(f"expected one of {', '.join((*TASKS, GYM))}")
        return task

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(FIELDS))
        if unknown:
            raise ValueError(f"maps {unknown}; the fields are {', '.join(FIELDS)}")
        return columns

    @model_validator(mode="after")
    def _gym_tasks(self) -> DataConfig:
        tasks = self.reasoning_gym.tasks
        if self.task == GYM and not tasks:
            raise ValueError(f"data.task={GYM} needs data.reasoning_gym.tasks (e.g. {{leg_counting: {{}}}})")
        if tasks and self.task != GYM:
            raise ValueError(
                f"data.reasoning_gym.tasks is set; it is read with data.task={GYM}, not {self.task}"
            )
        if self.task == GYM and self.train_file:
            raise ValueError(f"data.train_file and data.task={GYM} both name the RL prompts; keep one")
        return self

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
