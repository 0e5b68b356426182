"""The built-in estimators and losses, registered as Deferred functions: naming them costs no torch import
(the config checks `rl.loss` and `rl.advantage` against the registry before any model library loads);
each function's module loads when it is first run."""

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
from everyprompt.algorithms.registry import Deferred, register_advantage, register_policy_loss

SEQUENCE_MEAN = "seq-mean-token-mean"


def _advantages():
    from everyprompt.algorithms import advantages

    return advantages


def _losses():
    from everyprompt.algorithms import losses

    return losses


def _gated():
    from everyprompt.algorithms import gated

    return gated


register_advantage("grpo")(Deferred(lambda: _advantages().grpo_advantages))
register_advantage("dr_grpo")(Deferred(lambda: _advantages().dr_grpo_advantages))
register_advantage("rloo")(Deferred(lambda: _advantages().rloo_advantages))
register_advantage("gdpo", needs_components=True)(Deferred(lambda: _advantages().gdpo_advantages))

register_policy_loss("ppo_clip", options=PPOClipOptions)(Deferred(lambda: _losses().ppo_clip_loss))
register_policy_loss("gspo", default_agg=SEQUENCE_MEAN, options=GSPOOptions)(
    Deferred(lambda: _losses().gspo_loss)
)
register_policy_loss("gspo_token", default_agg=SEQUENCE_MEAN, options=GSPOOptions)(
    Deferred(lambda: _losses().gspo_token_loss)
)
register_policy_loss("cispo", options=CISPOOptions)(Deferred(lambda: _losses().cispo_loss))
register_policy_loss(
    "espo", default_agg=SEQUENCE_MEAN, needs_entropy=True, needs_vocab_size=True, options=ESPOOptions
)(Deferred(lambda: _losses().espo_loss))
register_policy_loss("sapo", default_agg=SEQUENCE_MEAN, options=SAPOOptions)(
    Deferred(lambda: _gated().sapo_loss)
)
register_policy_loss("dppo_tv", options=DPPOTVOptions)(Deferred(lambda: _gated().dppo_tv_loss))
register_policy_loss("dppo_kl", options=DPPOKLOptions)(Deferred(lambda: _gated().dppo_kl_loss))
