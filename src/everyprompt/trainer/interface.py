"""What the RL loop asks of a learner side (DESIGN: the two sides of the loop). `trainer/learner_side/learner.py`'s
`Learner` implements it in this process; the Ray backend's `RankedLearner` (`distributed/learner.py`)
implements it over a group of learner ranks. The loop calls nothing else, so a backend plugs in here
without the trainer knowing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from everyprompt.batch import RolloutBatch


class LearnerSide(ABC):
    """A scored `RolloutBatch` in, one policy update out; the weights handed to the rollout side."""

    version: int = 0  # updates taken: the policy version of the weights `state_dict` hands over
    last_sync_bytes: int = 0  # the size of the weights `state_dict` last handed over
    in_process: bool = False  # it trains in this process, beside the rollout side (see make_replica)
    # `save_model` never reads the caller's copy: nothing needs its weights once the run has started
    saves_own_weights: bool = False

    @abstractmethod
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One policy update from `batch`; its metrics (namespaced keys)."""

    @abstractmethod
    def state_dict(self, streamed: bool = False) -> dict[str, torch.Tensor]:
        """The policy's weights for the rollout side's `load_weights` (a LoRA policy's merged). `streamed`:
        the caller hands them to `load_weights` at once, and only there, so a backend may return weights
        still being sent (the Ray learner's pipelined sync)."""

    @abstractmethod
    def training_state(self, directory: Path | None = None) -> dict:
        """Counters, schedule and optimizer state: what a checkpoint needs to resume the learner.
        `directory`: the checkpoint being written, where a learner of several ranks writes each rank's
        share of the optimizer state itself, so that nothing is gathered (the dict then names them)."""

    @abstractmethod
    def load_training_state(self, state: dict) -> None:
        """Resume from `training_state()`'s dict."""

    @abstractmethod
    def save_model(self, model, tokenizer, directory: Path, merged: bool = False) -> None:
        """Write the policy and `tokenizer` into a checkpoint's `directory` in Hugging Face format (a LoRA
        policy: its adapter, and with `merged` the merged model too). `model` is the caller's copy of the
        policy, which a learner may write from or ignore (`saves_own_weights`)."""

    def make_replica(self) -> None:
        """In-process learners: prepare `behaviour_mismatch` (asynchronous runs measure with it)."""
        raise NotImplementedError(f"{type(self).__name__} measures no behaviour mismatch")

    def behaviour_mismatch(self, batch: RolloutBatch, weights: dict[str, torch.Tensor], rows: list[int]):
        """In-process learners: `mismatch/*` of `rows` against the weights that sampled them."""
        raise NotImplementedError(f"{type(self).__name__} measures no behaviour mismatch")
