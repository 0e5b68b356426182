"""The RL math's names and option schemas, without torch: what a config is checked against before any
model library loads (`everyprompt --help` and a config error answer at once). The math itself lives in
advantages.py, losses.py, gated.py, aggregation.py and corrections.py; catalog.py names which function
each registered name runs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTIONS = ("tis", "mis", "icepop")
ICEPOP_BAND = (0.5, 5.0)  # OpenRLHF's, AReaL's, verl's and NeMo-RL's default
CORRECTION_LEVELS = ("token", "sequence", "geometric")


class LossOptions(BaseModel):
    """Base of a loss's option schema: typed fields with defaults and descriptions, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class NoOptions(LossOptions):
    """A loss without options."""


class PPOClipOptions(LossOptions):
    clip_low: float = Field(0.2, ge=0, lt=1, description="Lower ratio epsilon: clip at 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="Upper ratio epsilon (DAPO clip-higher: > clip_low).")
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip constant c: caps a negative-advantage token's loss at -c A."
    )


class GSPOOptions(LossOptions):
    clip_low: float = Field(3e-4, ge=0, lt=1, description="Sequence-ratio lower epsilon.")
    clip_high: float = Field(4e-4, ge=0, description="Sequence-ratio upper epsilon.")


class CISPOOptions(LossOptions):
    clip_low: float = Field(1.0, ge=0, le=1, description="IS-weight lower epsilon (1: no lower bound).")
    clip_high: float = Field(0.28, ge=0, description="IS-weight upper epsilon: weight <= 1 + clip_high.")


class ESPOOptions(LossOptions):
    alpha: float = Field(0.02, gt=0, description="Clip scale: eps = alpha * mean group entropy / log|V|.")
    num_groups: int = Field(2, ge=1, description="Entropy groups per sequence.")
    high_frac: float = Field(
        0.2, gt=0, lt=1, description="K = 2: share of a sequence's tokens in the high-entropy group."
    )
    ratio_denominator: Literal["current", "old"] = Field(
        "current", description="Token ratio sg[s]*pi/sg[pi] ('current') or sg[s]*pi/pi_old ('old')."
    )


class SAPOOptions(LossOptions):
    tau_pos: float = Field(1.0, gt=0, description="Gate temperature of positive-advantage tokens.")
    tau_neg: float = Field(
        1.05, gt=0, description="Gate temperature of the others (larger: their gradient fades faster)."
    )


class DPPOTVOptions(LossOptions):
    delta_low: float = Field(0.2, gt=0, description="Mask where p - q < -delta_low (A <= 0).")
    delta_high: float = Field(0.2, gt=0, description="Mask where p - q > delta_high (A > 0).")


class DPPOKLOptions(LossOptions):
    delta_low: float = Field(
        0.05, gt=0, description="Mask where p < q and KL(Bern(q) || Bern(p)) > it (A <= 0)."
    )
    delta_high: float = Field(
        0.05, gt=0, description="Mask where p > q and KL(Bern(q) || Bern(p)) > it (A > 0)."
    )
