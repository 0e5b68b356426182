"""What the RL loop asks of each of its two sides: `RolloutSide`, prompts in and a scored batch out, and
`LearnerSide`, a batch in and an update out.

The rollout side: `trainer/rollout_side/side.py`'s `LocalRolloutSide` samples with the run's own engine and
reward (over Ray workers too: `distributed/backend.py`); `serve/driven.py`'s `DrivenRolloutSide` serves the
policy and takes the groups a user's own loop posts. The learner side: `trainer/learner_side/learner.py`'s
`Learner` in this process; the Ray backend's `RankedLearner` (`distributed/learner.py`) over a group of
learner ranks. The loop (`trainer/loop.py`) calls nothing else, so a backend plugs in here without the
trainer knowing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from everyprompt.batch import RolloutBatch


class RolloutSide(ABC):
    """Scored `RolloutBatch`es out, one a step, from the weights the learner hands over."""

    version: int = 0  # the policy version (updates behind it) of the weights the side samples with
    episodes = None  # multi-turn environments (`envs/`): their episodes, or None (single-turn prompts)
    prompt_format = None  # how a prompt row becomes the model's tokens (data/formatting.py): the run shows it

    @property
    @abstractmethod
    def engine(self):
        """A rollout engine on the side's current weights (the run's evaluations decode with it)."""

    @abstractmethod
    def next_batch(self, step: int) -> RolloutBatch:
        """Step `step`'s scored groups, with `stats` and `timing` filled in."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The learner's weights after `version` updates (the weight sync): later samples carry that version."""

    @abstractmethod
    def sleep(self) -> None:
        """The learner trains now: free what the next `load_weights` brings back (or nothing)."""

    @abstractmethod
    def close(self) -> None:
        """Stop what the side started (reward workers, servers, environments); it is not used after this."""

    @abstractmethod
    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the side where it stopped."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s dict."""

    @abstractmethod
    def first_prompts(self, count: int) -> list[list[int]]:
        """The first `count` prompts' token ids as the model is given them (the startup parity check's)."""

    @abstractmethod
    def settings(self) -> dict:
        """This step's sampling settings by config key (the run's log and the curriculum's overrides)."""


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
