"""The one typed configuration tree of everyprompt.

Every setting lives here, with its type, its default and a one-line description; nothing else in the
package holds a default of its own. A run's config is a YAML file plus dotted command-line overrides
(``rl.lr=1e-4``); an unknown key or a bad value raises :class:`ConfigError`, whose message names the key,
the value and what was expected. The resolved config is written into the run directory.

The sections live by concern in this package (base, model, rollout, rl, zve, cluster); this module holds the
run-level sections, the root `Config`, and loading and saving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from everyprompt.algorithms import advantage_needs_components
from everyprompt.config.base import ConfigError, Section
from everyprompt.config.cluster import ClusterConfig
from everyprompt.config.model import DataConfig, LoRAConfig, ModelConfig, SFTConfig
from everyprompt.config.recipes import anchor_data_files, find_config, recipes_dir
from everyprompt.config.rl import KLConfig, RLConfig, RolloutCorrectionConfig
from everyprompt.config.rollout import (
    DEFAULT_JUDGE_TEMPLATE,
    EnvConfig,
    ExternalConfig,
    GenRMConfig,
    RewardComponentConfig,
    RewardsConfig,
    RolloutConfig,
    ScalarRMConfig,
)
from everyprompt.config.zve import (
    STAGE_OVERRIDES,
    CurriculumConfig,
    CurriculumStage,
    ExpansionConfig,
    OfflineFilterConfig,
    ReshapeConfig,
    RetirementConfig,
    ZVEConfig,
    ZVPConfig,
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
        refused = {
            "rollout.engine=hf": self.rollout.engine == "hf",
            "rollout.partial=true": self.rollout.partial,
            "zve.filter.enabled=true": self.zve.filter.enabled,  # its pass rates are single-turn
        }
        for setting, present in refused.items():
            if present:
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
        refused = {  # what the run's own rollout side does, which a driven run leaves to its driver
            "env.name": self.env.name is not None,
            "rollout.engine=hf": self.rollout.engine == "hf",
            "rollout.partial=true": self.rollout.partial,
            "rl.max_staleness>0": self.rl.max_staleness > 0,
            "rl.router_replay=r3": self.rl.router_replay == "r3",  # the driver's rollouts carry no routes
            "zve.enabled": self.zve.enabled,
            "zve.filter.enabled": self.zve.filter.enabled,
            "curriculum.stages": bool(self.curriculum.stages),
            "cluster.backend=ray": self.cluster.backend == "ray",
            f"rl.advantage={self.rl.advantage}": advantage_needs_components(self.rl.advantage),  # no parts
            "rl.teacher.by": self.rl.teacher.by is not None,  # its rows carry no data columns
        }
        for setting, present in refused.items():
            if present:
                raise ValueError(
                    f"external.enabled: the driver samples, scores and picks the groups, so {setting} does "
                    "not apply (docs/serving.md)"
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


DEMO_CONFIG = "demo.yaml"


def demo_config_path() -> Path:
    """The embedded default config (`configs/demo.yaml`, shipped inside the package)."""
    return recipes_dir() / DEMO_CONFIG


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


def build_config(tree: dict, source: str = "", overrides: dict[str, str] | None = None) -> Config:
    """Validate `tree` (read from the file `source`, then `overrides` applied: dotted key -> the
    KEY=VALUE text given); an error names where the bad value came from: the override, or the file and
    the line of the key."""
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        error = err.errors()[0]
        raise ConfigError(_describe_error(error, _origin(error["loc"], source, overrides or {}))) from None


def _origin(loc: tuple, source: str, overrides: dict[str, str]) -> str:
    """The prefix of an error at `loc`: the command-line override that set it, else the file (and line)."""
    key = ".".join(str(part) for part in loc)
    for dotted, text in overrides.items():
        if key == dotted or key.startswith(dotted + "."):
            return f"command-line override {text!r}: "
    if not source:
        return ""
    line = _line_of(Path(source), [str(part) for part in loc]) if Path(source).is_file() else None
    return f"{source}:{line}: " if line else f"{source}: "


def _line_of(path: Path, keys: list[str]) -> int | None:
    """The 1-based line of the deepest of `keys` (a dotted key's parts) written in the YAML file `path`."""
    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    line = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        found = next((value for name, value in node.value if name.value == key), None)
        if found is None:
            break
        line = next(name for name, value in node.value if value is found).start_mark.line + 1
        node = found
    return line


def read_yaml(path: str | Path) -> dict:
    """The config tree of the file (or recipe name) `path`, its data files found from the working
    directory, else beside the file (config/recipes.py)."""
    path = find_config(path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    return anchor_data_files(tree, path)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (the embedded demo default when `path` is None) and apply dotted overrides; an
    invalid value is named with where it came from (the override, or the file and its line)."""
    path = find_config(path) if path is not None else demo_config_path()
    tree = read_yaml(path)
    given: dict[str, str] = {}
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
        given[".".join(keys)] = text
    return build_config(tree, source=str(path), overrides=given)


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "STAGE_OVERRIDES",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CurriculumConfig",
    "CurriculumStage",
    "DataConfig",
    "EvalConfig",
    "ExpansionConfig",
    "EnvConfig",
    "ExternalConfig",
    "GenRMConfig",
    "KLConfig",
    "LoRAConfig",
    "LoggingConfig",
    "ModelConfig",
    "OfflineFilterConfig",
    "RLConfig",
    "ReshapeConfig",
    "RetirementConfig",
    "RewardComponentConfig",
    "RewardsConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SFTConfig",
    "ScalarRMConfig",
    "Section",
    "WandbConfig",
    "ZVEConfig",
    "ZVPConfig",
    "build_config",
    "demo_config_path",
    "find_config",
    "load_config",
    "save_config",
]
