"""The RL math: advantage estimators, policy losses and their aggregation, as pure tensor functions.

Everything is registered by name; the trainer calls only :func:`compute_advantages` and
:func:`policy_loss`, never an implementation directly. Importing the package loads only the registry
and the option schemas (no torch: a config is checked without it); the tensor functions load on first
use of their name.
"""

from everyprompt.algorithms import catalog as _catalog  # noqa: F401  (registers the built-ins)
from everyprompt.algorithms.loss_batch import LossBatch, LossSettings, RolloutCorrection
from everyprompt.algorithms.options import AGGREGATIONS, CORRECTION_LEVELS, CORRECTIONS, KL_ESTIMATORS
from everyprompt.algorithms.registry import (
    advantage_needs_components,
    policy_loss_spec,
    register_advantage,
    register_policy_loss,
    registered_advantages,
    registered_policy_losses,
)


def _module(name: str):
    """The tensor module `name` (each imported here by its own statement, on first use)."""
    if name == "objective":
        from everyprompt.algorithms import objective as module
    elif name == "aggregation":
        from everyprompt.algorithms import aggregation as module
    elif name == "advantages":
        from everyprompt.algorithms import advantages as module
    elif name == "corrections":
        from everyprompt.algorithms import corrections as module
    elif name == "distill":
        from everyprompt.algorithms import distill as module
    else:
        from everyprompt.algorithms import losses as module
    return module


_TENSOR_FUNCTIONS = {  # name -> its module (torch), imported on first access
    "aggregate": "aggregation",
    "compute_advantages": "objective",
    "distillation_advantages": "distill",
    "distillation_metrics": "distill",
    "distillation_sums": "distill",
    "entropy_groups": "losses",
    "host_floats": "objective",
    "kl_penalty": "corrections",
    "policy_loss": "objective",
    "rollout_correction": "corrections",
    "zvp_token_advantages": "advantages",
}


def __getattr__(name: str):
    if name in _TENSOR_FUNCTIONS:
        return getattr(_module(_TENSOR_FUNCTIONS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "CORRECTION_LEVELS",
    "KL_ESTIMATORS",
    "LossBatch",
    "LossSettings",
    "RolloutCorrection",
    "advantage_needs_components",
    "policy_loss_spec",
    "register_advantage",
    "register_policy_loss",
    "registered_advantages",
    "registered_policy_losses",
    *_TENSOR_FUNCTIONS,
]
