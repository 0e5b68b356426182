"""The one typed configuration tree of everyprompt.

Every setting lives in this package, with its type, its default and a one-line description; nothing else
in the package holds a default of its own. A run's config is a YAML file plus dotted command-line
overrides (``rl.lr=1e-4``); an unknown key or a bad value raises :class:`ConfigError`, whose message names
the key, the value and what was expected. The resolved config is written into the run directory.

The rooms: the sections by concern (base, model, rollout, rl, zve, cluster, teacher), the run-level
sections and the root `Config` (tree.py), loading and saving (load.py), the recipes shipped with the
package (recipes.py). This module only re-exports them.
"""

from __future__ import annotations

from everyprompt.config.base import (
    ConfigError,
    Section,
)
from everyprompt.config.cluster import (
    ClusterConfig,
)
from everyprompt.config.load import (
    DEMO_CONFIG,
    apply_override,
    build_config,
    demo_config_path,
    load_config,
    parse_override,
    read_yaml,
    save_config,
)
from everyprompt.config.model import (
    DataConfig,
    LoRAConfig,
    ModelConfig,
    SFTConfig,
)
from everyprompt.config.recipes import (
    anchor_data_files,
    find_config,
    recipes_dir,
)
from everyprompt.config.rl import (
    KLConfig,
    RLConfig,
    RolloutCorrectionConfig,
)
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
from everyprompt.config.tasks import (
    GYM_PREFIX,
    GymConfig,
    GymTaskConfig,
    TaskLevelsConfig,
    gym_overrides,
)
from everyprompt.config.tree import (
    CheckpointConfig,
    Config,
    EvalConfig,
    LoggingConfig,
    WandbConfig,
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

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CurriculumConfig",
    "CurriculumStage",
    "DEFAULT_JUDGE_TEMPLATE",
    "DEMO_CONFIG",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "ExpansionConfig",
    "ExternalConfig",
    "GYM_PREFIX",
    "GenRMConfig",
    "GymConfig",
    "GymTaskConfig",
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
    "STAGE_OVERRIDES",
    "TaskLevelsConfig",
    "ScalarRMConfig",
    "Section",
    "WandbConfig",
    "ZVEConfig",
    "ZVPConfig",
    "anchor_data_files",
    "apply_override",
    "build_config",
    "demo_config_path",
    "find_config",
    "gym_overrides",
    "load_config",
    "parse_override",
    "read_yaml",
    "recipes_dir",
    "save_config",
]
