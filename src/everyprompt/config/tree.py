"""The run-level sections (evaluation, checkpoints, logging, Weights & Biases) and the root `Config`, whose
checks span sections. The sections of one concern live beside it (base, model, rollout, rl, zve, cluster,
teacher); loading and saving a config is load.py's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from everyprompt.algorithms import advantage_needs_components
from everyprompt.choices import GYM
from everyprompt.config.base import Section
from everyprompt.config.cluster import ClusterConfig
from everyprompt.config.model import DataConfig, ModelConfig, SFTConfig
from everyprompt.config.rl import RLConfig
from everyprompt.config.rollout import (
    EnvConfig,
    ExternalConfig,
    RewardsConfig,
    RolloutConfig,
)
from everyprompt.config.zve import (
    CurriculumConfig,
    ZVEConfig,
)


class EvalConfig(Section):
    every: int = Field(0, ge=0, description="Evaluate every N RL steps (0: only at the end).")
    num_samples: int = Field(4, ge=0, description="Samples per prompt for pass@k (0: greedy pass@1 only).")
    pass_k: int = Field(4, ge=1, description="k of the sampled pass@k.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for pass@k.")
    reward: str | None = Field(
        None,
        description="The reward that judges held-out answers (a registered name or package.module:function; "
        "None: rewards.function, as in training). E.g. `math` to evaluate a run trained on a judge model "
        "by the answers' correctness.",
    )

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        if self.num_samples and self.pass_k > self.num_samples:
            raise ValueError(f"pass_k ({self.pass_k}) must not exceed num_samples ({self.num_samples})")
        return self


class CheckpointConfig(Section):
    every: int = Field(50, ge=0, description="Save every N RL steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Step checkpoints kept on disk.")


class WandbConfig(Section):
    project: str | None = Field(
        None,
        description="Weights & Biases project: set it to log there too (pip install 'everyprompt[wandb]').",
    )
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="wandb's mode: online, offline (upload later with `wandb sync`), disabled."
    )
    entity: str | None = Field(None, description="wandb entity (user or team; default: the logged-in user).")

    @property
    def enabled(self) -> bool:
        """A project is set and the mode is not `disabled`."""
        return bool(self.project) and self.mode != "disabled"


class LoggingConfig(Section):
    progress: bool = Field(True, description="Show a progress bar.")
    tensorboard: bool = Field(True, description="Write TensorBoard event files.")
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases logging (off unless a project is set)."
    )


class Config(Section):
    seed: int = Field(0, description="Seed of model init, sampling and prompt order.")
    run_dir: str | None = Field(None, description="Run directory (default: runs/<name>-<time>).")
    name: str = Field("demo", description="Run name used in the default run directory.")
    threads: int = Field(
        0,
        ge=0,
        description="torch CPU threads (0: torch's default; an asynchronous run's two sides then take half "
        "each, docs/asynchrony.md).",
    )
    cpu_threads: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="On the CPU, a synchronous run's torch threads before each rollout and each update: "
        "adaptive fits them to the cores other processes left free in the phase before (one busy process "
        "on 2 cores made a step 10x slower with 2 threads, about 1x with 1: devices/cores.py); fixed keeps "
        "`threads` (or torch's default).",
    )
    keep_freed_memory: bool = Field(
        True,
        description="Large CPU tensors reuse the process's freed memory within a step instead of fresh "
        "pages from the OS (glibc malloc's thresholds raised, the free pages handed back at each step's "
        "end; devices/host.py).",
    )
    kept_block_mib: int = Field(
        1024,
        ge=1,
        le=1024,
        description="With keep_freed_memory: the largest block (MiB) kept for reuse; larger ones get fresh "
        "pages and go back to the OS when freed. Smaller: a lower peak (less fragmentation), more page "
        "faults; 4: SmolLM2's step peak about 20% lower, its update 13-50% slower in the runs measured (docs/performance.md).",
    )
    malloc: Literal["glibc", "auto", "tcmalloc", "jemalloc"] = Field(
        "glibc",
        description="The C allocator the training commands run on (devices/malloc.py): glibc's, or tcmalloc or "
        "jemalloc preloaded (the command starts itself again with the library; its processes inherit it); "
        "auto: tcmalloc where installed, else glibc's. On tcmalloc SmolLM2's step at group size 16 peaked at 6.03 "
        "GiB against 7.73 on glibc's (docs/performance.md). keep_freed_memory applies to glibc's alone.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    external: ExternalConfig = Field(default_factory=ExternalConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    zve: ZVEConfig = Field(default_factory=ZVEConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _episodes_need_a_native_chat_setup(self) -> Config:
        if self.env.name is None:
            return self
        setting = _first_set(
            {
                "rollout.engine=hf": self.rollout.engine == "hf",
                "rollout.partial=true": self.rollout.partial,
                "zve.filter.enabled=true": self.zve.filter.enabled,  # its pass rates are single-turn
            }
        )
        if setting is not None:
            raise ValueError(
                f"env.name={self.env.name} runs episodes in the native engine, not with {setting}"
            )
        if self.data.format == "plain" or self.data.system_prompt is not None:
            raise ValueError(
                f"env.name={self.env.name}: the environment writes the episode's first messages in the chat "
                "template; data.format=plain and data.system_prompt do not apply"
            )
        return self

    @model_validator(mode="after")
    def _gym_tasks_scored_by_their_own_scorers(self) -> Config:
        if self.rewards.function == "auto":  # resolved here, so the saved config names the reward
            self.rewards.function = "reasoning_gym" if self.data.task == GYM else "math"
        return self

    @model_validator(mode="after")
    def _task_levels_need_gym_tasks(self) -> Config:
        if self.curriculum.levels.enabled and self.data.task != GYM:
            raise ValueError(
                f"curriculum.levels.enabled moves reasoning-gym tasks through their levels: it needs "
                f"data.task={GYM}, not {self.data.task}"
            )
        return self

    @model_validator(mode="after")
    def _component_advantages_need_components(self) -> Config:
        if advantage_needs_components(self.rl.advantage) and len(self.rewards.components) < 2:
            raise ValueError(
                f"rl.advantage={self.rl.advantage} normalises each reward component within its group: it "
                f"needs rewards.components with two or more (got {len(self.rewards.components)})"
            )
        return self

    @model_validator(mode="after")
    def _external_rollouts_are_the_drivers(self) -> Config:
        if not self.external.enabled:
            return self
        setting = _first_set({  # what the run's own rollout side does, which a driven run leaves to its driver
            "env.name": self.env.name is not None,
            "rollout.engine=hf": self.rollout.engine == "hf",
            "rollout.partial=true": self.rollout.partial,
            "rl.max_staleness>0": self.rl.max_staleness > 0,
            "rl.router_replay=r3": self.rl.router_replay == "r3",  # the driver's rollouts carry no routes
            "zve.enabled": self.zve.enabled,
            "zve.filter.enabled": self.zve.filter.enabled,
            "curriculum.stages": bool(self.curriculum.stages),
            "curriculum.levels.enabled": self.curriculum.levels.enabled,
            "cluster.backend=ray": self.cluster.backend == "ray",
            f"rl.advantage={self.rl.advantage}": advantage_needs_components(self.rl.advantage),  # no parts
            "rl.teacher.by": self.rl.teacher.by is not None,  # its rows carry no data columns
        })  # fmt: skip
        if setting is not None:
            raise ValueError(
                f"external.enabled: the driver samples, scores and picks the groups, so {setting} does not "
                "apply (docs/serving.md)"
            )
        return self

    @model_validator(mode="after")
    def _compiled_layers_are_not_sharded(self) -> Config:
        if self.model.kernels == "compiled" and self.cluster.trainer_sharding == "fsdp2":
            raise ValueError(
                "model.kernels=compiled compiles each decoder layer, and fsdp2 gathers a layer's shards in "
                "hooks around it that the compiled layer would have to trace: use cluster.trainer_sharding=ddp "
                "or model.kernels=torch"
            )
        return self

    @model_validator(mode="after")
    def _rollout_logprobs_need_fp32(self) -> Config:
        if self.rl.old_logprobs == "rollout" and self.rollout.precision != "fp32":
            raise ValueError(
                f"rl.old_logprobs=rollout uses the engine's log-probs as the old policy's, which is exact only "
                f"in fp32; with rollout.precision={self.rollout.precision} set rl.old_logprobs=recompute"
            )
        return self


def _first_set(refused: dict[str, bool]) -> str | None:
    """The first of `refused`'s settings that is set (a validator's refusal names it), or None."""
    return next((setting for setting, present in refused.items() if present), None)
