"""Environments for multi-turn episodes (docs/environments.md): the text-level contract an episode's
environment keeps, the registry that names environments in configs, and the built-in calculator tool."""

from everyprompt.envs.base import (
    Environment,
    EnvironmentSetupError,
    StepResult,
    make_environment,
    register_environment,
    registered_environments,
)
from everyprompt.envs.calculator import CalculatorEnv, evaluate_expression

__all__ = [
    "CalculatorEnv",
    "Environment",
    "EnvironmentSetupError",
    "StepResult",
    "evaluate_expression",
    "make_environment",
    "register_environment",
    "registered_environments",
]
