"""How the learner's passes reach a batch's rows: the policy's forward, this rank's micro-batches of them
(its share of the data-parallel group, cut by the sequence and token caps), and the padded tensors on the
model's device. The old policy's pass (old_policy.py) and the update's steps (step.py) both run through it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from everyprompt.trainer.learner_side.forward import PolicyForward


@dataclass(frozen=True)
class Passes:
    forward: PolicyForward
    parallel: DataParallel
    caps: tuple[int | None, int | None]  # a micro-batch's sequences and tokens (None: no cap)
    pad_id: int
    device: torch.device  # the model's: batches come to it

    def micro_batches(self, items, lengths: list[int]) -> list[tuple[tuple[int, int], list | None]]:
        """This rank's micro-batches of `items` (rows of a batch, or positions in a mini-batch; `lengths`:
        each one's tokens), each with its place in the whole; a None chunk is fsdp2's padding pass
        (data_parallel.py)."""
        return self.parallel.micro_batches(items, *self.caps, lengths)

    def padded(self, batch: RolloutBatch, rows: list[int]) -> dict[str, torch.Tensor]:
        """Rows `rows` of `batch` as padded tensors on the model's device (`RolloutBatch.padded`)."""
        return batch.padded(rows, self.pad_id, self.device)
