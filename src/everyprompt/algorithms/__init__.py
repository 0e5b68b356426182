"""The RL math: advantage estimators, policy losses and their aggregation, as pure tensor functions.

Everything is registered by name; the trainer calls only :func:`compute_advantages` and
:func:`policy_loss`, never an implementation directly.
"""

from everyprompt.algorithms import advantages as _advantages  # noqa: F401  (registers estimators)
from everyprompt.algorithms import gated as _gated  # noqa: F401  (registers SAPO and DPPO)
from everyprompt.algorithms import losses as _losses  # noqa: F401  (registers losses)
from everyprompt.algorithms.advantages import zvp_token_advantages
from everyprompt.algorithms.aggregation import AGGREGATIONS, aggregate
from everyprompt.algorithms.corrections import (
    CORRECTION_LEVELS,
    CORRECTIONS,
    KL_ESTIMATORS,
    kl_penalty,
    rollout_correction,
)
from everyprompt.algorithms.distill import distillation_advantages, distillation_metrics, distillation_sums
from everyprompt.algorithms.losses import entropy_groups
from everyprompt.algorithms.registry import (
    advantage_needs_components,
    compute_advantages,
    host_floats,
    policy_loss,
    policy_loss_spec,
    register_advantage,
    register_policy_loss,
    registered_advantages,
    registered_policy_losses,
)

__all__ = [
    "advantage_needs_components",
    "AGGREGATIONS",
    "CORRECTIONS",
    "CORRECTION_LEVELS",
    "KL_ESTIMATORS",
    "aggregate",
    "compute_advantages",
    "distillation_advantages",
    "distillation_metrics",
    "distillation_sums",
    "entropy_groups",
    "host_floats",
    "kl_penalty",
    "policy_loss",
    "policy_loss_spec",
    "register_advantage",
    "register_policy_loss",
    "registered_advantages",
    "registered_policy_losses",
    "rollout_correction",
    "zvp_token_advantages",
]
