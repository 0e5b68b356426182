"""Environments for multi-turn episodes (docs/environments.md): the text-level contract an episode's
environment keeps, the registry that names environments in configs, the built-in calculator tool, skyrl-gym's environments and OpenEnv's servers."""

from everyprompt.envs.base import (
    Environment,
    EnvironmentSetupError,
    StepResult,
    make_environment,
    register_environment,
    register_environment_family,
    registered_environments,
)
from everyprompt.envs.calculator import CalculatorEnv, evaluate_expression
from everyprompt.envs.openenv import OpenEnvEnvironment
from everyprompt.envs.skyrl import SkyrlEnvironment

__all__ = [
    "CalculatorEnv",
    "Environment",
    "EnvironmentSetupError",
    "OpenEnvEnvironment",
    "StepResult",
    "evaluate_expression",
    "make_environment",
    "SkyrlEnvironment",
    "register_environment",
    "register_environment_family",
    "registered_environments",
]
