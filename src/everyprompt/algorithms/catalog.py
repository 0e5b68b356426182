"""The built-in estimators and losses, registered by the path of their function: naming them costs no
torch import (the config checks `rl.loss` and `rl.advantage` against the registry before any model
library loads); each function's module loads when it is first run."""

from __future__ import annotations

from everyprompt.algorithms.options import (
    CISPOOptions,
    DPPOKLOptions,
    DPPOTVOptions,
    ESPOOptions,
    GSPOOptions,
    PPOClipOptions,
    SAPOOptions,
)
from everyprompt.algorithms.registry import register_advantage, register_policy_loss

_ADVANTAGES = "everyprompt.algorithms.advantages"
_LOSSES = "everyprompt.algorithms.losses"
_GATED = "everyprompt.algorithms.gated"
SEQUENCE_MEAN = "seq-mean-token-mean"

register_advantage("grpo")(f"{_ADVANTAGES}:grpo_advantages")
register_advantage("dr_grpo")(f"{_ADVANTAGES}:dr_grpo_advantages")
register_advantage("rloo")(f"{_ADVANTAGES}:rloo_advantages")
register_advantage("gdpo", needs_components=True)(f"{_ADVANTAGES}:gdpo_advantages")

register_policy_loss("ppo_clip", options=PPOClipOptions)(f"{_LOSSES}:ppo_clip_loss")
register_policy_loss("gspo", default_agg=SEQUENCE_MEAN, options=GSPOOptions)(f"{_LOSSES}:gspo_loss")
register_policy_loss("gspo_token", default_agg=SEQUENCE_MEAN, options=GSPOOptions)(
    f"{_LOSSES}:gspo_token_loss"
)
register_policy_loss("cispo", options=CISPOOptions)(f"{_LOSSES}:cispo_loss")
register_policy_loss(
    "espo", default_agg=SEQUENCE_MEAN, needs_entropy=True, needs_vocab_size=True, options=ESPOOptions
)(f"{_LOSSES}:espo_loss")
register_policy_loss("sapo", default_agg=SEQUENCE_MEAN, options=SAPOOptions)(f"{_GATED}:sapo_loss")
register_policy_loss("dppo_tv", options=DPPOTVOptions)(f"{_GATED}:dppo_tv_loss")
register_policy_loss("dppo_kl", options=DPPOKLOptions)(f"{_GATED}:dppo_kl_loss")
