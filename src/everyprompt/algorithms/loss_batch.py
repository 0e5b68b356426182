"""What a policy loss is fed: `LossBatch`, the tensors of one micro-batch, and `LossSettings`, how the
registered objective is corrected, penalised and reduced (the run's `rl.*` keys, fixed for a run).

A registered loss is `fn(batch: LossBatch, **options) -> (per-token loss [B, T], metrics)`; `policy_loss`
(objective.py) runs it with the settings. Shapes: B sequences of the micro-batch, T its completion
positions (padded: `mask` is 0 past each sequence's end). Importing this module loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch's tensors, all [B, T] on one device.

    `advantages` may be given as [B] (one per sequence): it is then expanded to [B, T] (a view). The
    denominators are the whole mini-batch's when this is one micro-batch of it, so that the micro-batches'
    losses add up to the mini-batch's (aggregation.py); None: this batch's own.
    """

    logp: Tensor  # [B, T] log-probs under the policy being trained (carries the gradient)
    old_logp: Tensor  # [B, T] log-probs under the policy that sampled (detached)
    advantages: Tensor  # [B, T], or [B] expanded on construction
    mask: Tensor  # [B, T] 1 on completion tokens, 0 on padding
    entropy: Tensor | None = None  # [B, T] token entropies under the sampling policy (ESPO's groups)
    ref_logp: Tensor | None = None  # [B, T] the KL reference's log-probs (the KL penalty)
    rollout_logp: Tensor | None = None  # [B, T] the engine's log-probs (rollout corrections, off-policy mask)
    num_tokens: float | None = None  # completion tokens of the whole mini-batch (token means)
    num_sequences: float | None = None  # its sequences (sequence means)

    def __post_init__(self) -> None:
        if self.advantages.dim() == 1:
            object.__setattr__(self, "advantages", self.advantages[:, None].expand_as(self.logp))
        if self.advantages.shape != self.logp.shape or self.mask.shape != self.logp.shape:
            raise ValueError(
                f"a loss batch's tensors are [B, T] alike: logp {tuple(self.logp.shape)}, advantages "
                f"{tuple(self.advantages.shape)}, mask {tuple(self.mask.shape)}"
            )


@dataclass(frozen=True)
class RolloutCorrection:
    """A train-inference mismatch correction (algorithms/corrections.py): `mode` tis, mis or icepop (None:
    off), at `level` token or sequence, TIS's `cap`, MIS's and IcePop's ratio `band`."""

    mode: str | None = None
    level: str = "token"
    cap: float = 2.0
    band: tuple[float, float] | None = None


@dataclass(frozen=True)
class LossSettings:
    """How `policy_loss` turns a registered per-token objective into the scalar loss.

    `agg`: the reduction (the loss's registered default when None) and `max_length`, its constant for
    the `seq-mean-token-sum-norm` family; `kl` / `kl_coef`: the estimator of the penalty against
    `LossBatch.ref_logp`, and its weight; `correction`: the rollout-correction weights; `off_policy_mask`:
    the KL threshold of the off-policy sequence mask (None: off); `vocab_size`: given to losses that need
    it (ESPO's entropy normaliser).
    """

    agg: str | None = None
    max_length: int | None = None
    kl: str | None = None
    kl_coef: float = 0.0
    correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    off_policy_mask: float | None = None
    vocab_size: int | None = None
