"""The learner side of the RL loop: a scored `RolloutBatch` in, one policy update out.

`update(batch)`:
  1. advantages through the registry, then ZVE stage 2 (reshaping) and stage 3 (RL-ZVP signs), in
     `trainer/learner_side/signal.py`; groups still zero-variance after every enabled stage leave the update
     (`zve.drop_zero_variance`);
  2. the old policy's log-probs: the engine's (`rl.old_logprobs=rollout`), or the trainer's
     (`recompute`): the first mini-batch's own forward for its rows, and for the other mini-batches' rows
     a no-grad pass before the first update;
  3. `rl.mini_batches` AdamW steps, each accumulated over micro-batches (`rl.micro_batching`: sequences
     and tokens a pass) with the whole mini-batch's loss denominators, so the gradient does not depend on
     how they are cut;
  4. the train-inference mismatch of the old policy against the engine (`mismatch/*`): from the first
     mini-batch's forward, at no extra cost.
`state_dict()` is the weights hand-off to the rollout side. Nothing here reads the rollout side.

The learner is the update's recipe; its collaborators own the state: `Optimization` (optim.py) the optimizer,
schedule and skip count; `PolicyForward` (forward.py) the policy's, the reference's and the router's passes;
`OldPolicy` (old_policy.py) the old values; `MiniBatchStep` (step.py) a step's micro-batches and loss;
the advantage term (distill.py) a teacher's share; `BehaviourReplica` (replica.py) the asynchronous mismatch.

In a data-parallel group (`trainer/learner_side/data_parallel.py`) every rank runs `update` on the same
batch, each its share of every pass's micro-batches; the update equals the single process's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from everyprompt.algorithms import policy_loss_spec
from everyprompt.batch import RolloutBatch
from everyprompt.config import Config
from everyprompt.devices.memory import memory_metrics
from everyprompt.models.compiled_layers import compiled_metrics
from everyprompt.models.gathering import gathered_weights
from everyprompt.models.io import save_pretrained, weights_as_held
from everyprompt.models.lora import is_lora, merged_state_dict, weights_nbytes
from everyprompt.rollout import derive_seed
from everyprompt.trainer.checkpoint import SHARDS
from everyprompt.trainer.interface import LearnerSide
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from everyprompt.trainer.learner_side.distill import advantage_term
from everyprompt.trainer.learner_side.forward import PolicyForward, policy_router
from everyprompt.trainer.learner_side.old_policy import OldPolicy
from everyprompt.trainer.learner_side.optim import Optimization
from everyprompt.trainer.learner_side.passes import Passes
from everyprompt.trainer.learner_side.replica import BehaviourReplica
from everyprompt.trainer.learner_side.signal import batch_advantages, carries_signal, drop_zero_variance
from everyprompt.trainer.learner_side.step import MiniBatchStep


class Learner(LearnerSide):
    """The policy's update: advantages and zero-variance elimination, the old policy, the mini-batch steps."""

    in_process = True

    def __init__(
        self, config: Config, model, pad_token_id: int, reference=None, parallel: DataParallel | None = None
    ):
        self.config, self.rl, self.zve = config, config.rl, config.zve
        self.pad_id = pad_token_id
        self.parallel = parallel or DataParallel()
        # the KL term's reference: the starting policy, frozen (a copy of `model` unless given); a LoRA
        # policy's is its own base, adapters disabled (no second copy)
        self.reference = None
        base_as_reference = self.rl.kl.estimator is not None and is_lora(model)
        if self.rl.kl.estimator is not None and not base_as_reference:
            self.reference = (reference or copy.deepcopy(model)).eval().requires_grad_(False)
        self.model = self.parallel.shard(model)  # fsdp2: sharded in place, before the optimizer sees it
        self.device = next(self.model.parameters()).device  # batches come to the model's device
        self.compiled_metrics = compiled_metrics(self.model)  # model.kernels=compiled: its layers' count
        self.optimization = Optimization(self.model, self.rl)
        self.router = policy_router(self.model, self.rl.router_replay)
        self.forward = PolicyForward(
            self.model, self.router, self.reference, base_as_reference, config, pad_token_id
        )
        passes = Passes(
            self.forward, self.parallel, self.rl.micro_batching(self.device.type), pad_token_id, self.device
        )
        needs_entropy = policy_loss_spec(self.rl.loss).needs_entropy
        self.old_policy = OldPolicy(passes, self.rl.loss, needs_entropy, self.rl.router_replay)
        # a term added to the estimator's advantages: rl.teacher's teachers (on this device), or none
        self.term = advantage_term(config, self.device)
        self.step = MiniBatchStep(passes, self.optimization, self.term, config)
        self._forwards_checked = False
        self._replica: BehaviourReplica | None = None  # asynchronous runs: measures the behaviour mismatch

    # ------------------------------------------------------------ hand-off and state
    def state_dict(self, streamed: bool = False) -> dict[str, torch.Tensor]:
        """The policy's weights for the rollout side's `load_weights` (a LoRA policy's merged); under `fsdp2`
        every rank calls, rank 0 gets them whole on its host, the others an empty dict."""
        weights = merged_state_dict(self.model) if not self.parallel.sharded else dict(self.engine_weights())
        self.last_sync_bytes = weights_nbytes(weights)
        return weights

    def engine_weights(self, dtypes: Mapping | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The same weights one at a time (a LoRA policy's merged as each is read), each cast to its dtype in
        `dtypes` where narrower (models/io.py's `as_held`); under `fsdp2` gathered a layer at a time to rank
        0's host (models/gathering.py): every rank must iterate to the end, and only rank 0 gets them."""
        if self.parallel.sharded:
            return gathered_weights(self.model, keep=self.parallel.rank == 0, dtypes=dtypes)
        return weights_as_held(merged_state_dict(self.model), dtypes)

    def save_model(self, model, tokenizer, directory: Path, merged: bool = False) -> None:
        """Writes `model`, brought to the learner's weights (trained in place: only another copy loads)."""
        if model is not self.model:
            model.load_state_dict(self.model.state_dict())
        save_pretrained(model, tokenizer, directory, merged=merged)

    def training_state(self, directory: Path | None = None) -> dict:
        """Counters, schedule and optimizer state (by parameter name: it resumes on any number of ranks), whole
        or, in a group given `directory`, each rank's share written there. In a group every rank calls."""
        shards = directory / SHARDS if directory is not None and self.parallel.distributed else None
        return {"version": self.version, **self.optimization.state(self.parallel.sharded, shards)}

    def load_training_state(self, state: dict) -> None:
        self.version = state["version"]
        self.optimization.load(state)

    # ------------------------------------------------------------ the update
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One policy update from `batch` (which gains advantages and old-policy values); its metrics."""
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if len(batch):  # (empty when every group is still in flight: partial rollouts)
            weights = {c.name: c.weight for c in self.config.rewards.components}
            metrics, still_zero_variance = batch_advantages(batch, self.rl, self.zve, weights)
            # a term's rows (a teacher's) carry its signal whatever their rewards
            still_zero_variance = self.term.prepare(batch, still_zero_variance)
            batch = drop_zero_variance(batch, still_zero_variance, self.zve, metrics)
        if len(batch) and (carries_signal(batch) or self.term.carries(batch)):
            metrics.update(self._optimize(batch))
            metrics["actor/no_signal_update"] = 0.0
        else:
            # no group carries an advantage (or none finished): no optimizer step and no schedule tick, so
            # Adam's momentum and the weight decay do not move a policy that had nothing to learn from
            metrics["actor/no_signal_update"] = 1.0
        self.version += 1
        metrics["time/train_s"] = time.perf_counter() - started
        metrics.update(memory_metrics(self.device) | self.compiled_metrics())
        return metrics

    def _optimize(self, batch: RolloutBatch) -> dict[str, float]:
        self.model.train()
        if not self._forwards_checked:
            self._forwards_checked = self.forward.check(batch)
        if self.rl.router_replay == "r3" and self.device.type != "cpu" and batch.routed_experts:
            self.router.check_values(torch.cat([routes.reshape(-1) for routes in batch.routed_experts]))
        generator = torch.Generator().manual_seed(derive_seed(self.config.seed, self.version, 7))
        order = torch.randperm(len(batch), generator=generator)
        minis = [mini.tolist() for mini in order.chunk(self.rl.mini_batches)]
        if self.rl.old_logprobs == "rollout":
            self.old_policy.from_rollout(batch)
        elif len(minis) > 1:  # the later mini-batches' rows, before the first update changes the policy
            self.old_logprobs(batch, sorted(row for mini in minis[1:] for row in mini))
        stats: dict[str, list[float]] = {}
        for number, mini in enumerate(minis):
            # the first mini-batch's forward is the old policy itself: its old values and its mismatch
            # come from it (`own_old`), at no extra cost
            for key, value in self.step(batch, mini, number == 0, self.version).items():
                stats.setdefault(key, []).append(value)
        self.optimization.advance_schedule()
        return {key: sum(values) / len(values) for key, values in stats.items()}

    def old_logprobs(self, batch: RolloutBatch, rows: list[int] | None = None) -> dict[str, float]:
        """The trainer's pre-update log-probs, entropies and routes of `rows` of `batch` (all by default),
        stored on it; their mismatch metrics (old_policy.py)."""
        return self.old_policy.recompute(batch, rows)

    # ------------------------------------------------------------ the behaviour mismatch (asynchronous runs)
    def make_replica(self) -> None:
        """The plain copy of the policy that `behaviour_mismatch` loads sampling weights into. Call it while
        nothing trains (a copy taken during an update could catch a router mid-replay)."""
        if self._replica is None:
            self._replica = BehaviourReplica(self.model, self.router is not None, self.config, self.pad_id)

    def behaviour_mismatch(self, batch: RolloutBatch, weights: dict[str, torch.Tensor], rows: list[int]):
        """`mismatch/*` of `rows` against the weights that sampled them (`trainer/learner_side/replica.py`); touches
        nothing the update uses, so the rollout thread may call it while the learner trains."""
        if not rows:
            return {}
        if self._replica is None:
            raise RuntimeError(
                "behaviour_mismatch needs make_replica() first, called while the learner is idle"
            )
        return self._replica.mismatch(batch, weights, rows)
