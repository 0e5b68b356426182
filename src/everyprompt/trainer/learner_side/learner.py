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

In a data-parallel group (`trainer/learner_side/data_parallel.py`) every rank runs `update` on the same
batch, each its share of every pass's micro-batches; the update equals the single process's.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from everyprompt.algorithms import host_floats, policy_loss, policy_loss_spec, zvp_token_advantages
from everyprompt.batch import RolloutBatch
from everyprompt.config import Config
from everyprompt.devices.memory import memory_metrics
from everyprompt.models.compiled_layers import compiled_metrics
from everyprompt.models.gathering import gathered_weights
from everyprompt.models.io import save_pretrained, weights_as_held
from everyprompt.models.lora import is_lora, merged_state_dict, weights_nbytes
from everyprompt.rollout import derive_seed
from everyprompt.trainer.checkpoint import SHARDS, load_optimizer_state, portable_optimizer_state
from everyprompt.trainer.interface import LearnerSide
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from everyprompt.trainer.learner_side.distill import advantage_term
from everyprompt.trainer.learner_side.forward import PolicyForward, policy_router
from everyprompt.trainer.learner_side.mismatch import (
    batch_mismatch,
    batch_mismatch_values,
    fed_tokens,
    finish_mismatch,
)
from everyprompt.trainer.learner_side.optim import NumericsError, build_optimizer, build_scheduler
from everyprompt.trainer.learner_side.replica import BehaviourReplica
from everyprompt.trainer.learner_side.signal import batch_advantages, carries_signal, drop_zero_variance

log = logging.getLogger(__name__)

# which routes the update passes replay, per rl.router_replay (a `RolloutBatch.padded` key; off: none)
REPLAYED_ROUTES = {"off": None, "r2": "old_routes", "r3": "routes"}


class Learner(LearnerSide):
    """Owns the policy's optimizer, schedule, router replay and KL reference."""

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
        self.base_as_reference = self.rl.kl.estimator is not None and is_lora(model)
        if self.rl.kl.estimator is not None and not self.base_as_reference:
            self.reference = (reference or copy.deepcopy(model)).eval().requires_grad_(False)
        self.model = self.parallel.shard(model)  # fsdp2: sharded in place, before the optimizer sees it
        self.device = next(self.model.parameters()).device  # batches come to the model's device
        self.caps = self.rl.micro_batching(self.device.type)  # a micro-batch's sequences and tokens
        self.compiled_metrics = compiled_metrics(self.model)  # model.kernels=compiled: its layers' count
        self.optimizer = build_optimizer(self.model, self.rl.lr, self.rl.weight_decay)
        self.scheduler = build_scheduler(
            self.optimizer, self.rl.warmup_steps, self.rl.steps, self.rl.lr_schedule
        )
        self.router = policy_router(self.model, self.rl.router_replay)
        self.forward = PolicyForward(
            self.model, self.router, self.reference, self.base_as_reference, config, pad_token_id
        )
        # a term added to the estimator's advantages: rl.teacher's teachers (on this device), or none
        self.term = advantage_term(config, self.device)
        self.loss_spec = policy_loss_spec(self.rl.loss)
        self.loss_options = self.rl.loss_kwargs()
        self.consecutive_skips = 0  # mini-batch updates skipped in a row for non-finite numbers
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
        return {
            "version": self.version,
            "consecutive_skips": self.consecutive_skips,
            "optimizer": portable_optimizer_state(self.model, self.optimizer, self.parallel.sharded, shards),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_training_state(self, state: dict) -> None:
        self.version = state["version"]
        self.consecutive_skips = state["consecutive_skips"]
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

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
            self._rollout_as_old(batch)
        elif len(minis) > 1:  # the later mini-batches' rows, before the first update changes the policy
            self.old_logprobs(batch, sorted(row for mini in minis[1:] for row in mini))
        stats: dict[str, list[float]] = {}
        for number, mini in enumerate(minis):
            # the first mini-batch's forward is the old policy itself: its old values and its mismatch
            # come from it (`own_old`), at no extra cost
            for key, value in self._mini_batch_step(batch, mini, own_old=number == 0).items():
                stats.setdefault(key, []).append(value)
        self._advance_schedule()
        return {key: sum(values) / len(values) for key, values in stats.items()}

    def _advance_schedule(self) -> None:
        """One schedule step per update with signal, also when its optimizer step was skipped (non-finite)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            self.scheduler.step()

    def _skip(self, what: str, value: float) -> dict[str, float]:
        """Drop this mini-batch's update (its gradient is not finite); stop after too many in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips += 1
        log.warning("update %d: %s is %s; this mini-batch's update is skipped", self.version, what, value)
        if self.consecutive_skips >= self.rl.max_skipped_updates:
            raise NumericsError(
                f"{self.consecutive_skips} updates in a row were skipped for a non-finite loss or gradient norm "
                f"(last: {what} = {value}; rl.max_skipped_updates={self.rl.max_skipped_updates}); lower rl.lr "
                "or look for the batch that produces it"
            )
        return {"actor/skipped_updates": 1.0}

    def _rollout_as_old(self, batch: RolloutBatch) -> None:
        """`rl.old_logprobs=rollout`: the engine's log-probs (and entropies) stand for the old policy's."""
        batch.old_logprobs = batch.rollout_logprobs
        if self.loss_spec.needs_entropy:
            if batch.rollout_entropies is None:
                raise RuntimeError(
                    f"rl.loss={self.rl.loss} needs the old policy's token entropies, which this rollout "
                    "engine does not return; set rl.old_logprobs=recompute"
                )
            batch.old_entropies = batch.rollout_entropies

    @torch.no_grad()
    def old_logprobs(self, batch: RolloutBatch, rows: list[int] | None = None) -> dict[str, float]:
        """The trainer's pre-update log-probs, entropies (when the loss needs them) and routes of `rows` of
        `batch` (all by default), stored on it (None for the other rows); returns their mismatch metrics.
        Only r3 replays here: r2 records the trainer's own routes, which the update passes then replay."""
        rows = list(range(len(batch))) if rows is None else rows
        logprobs: list[tuple[int, list[torch.Tensor]]] = []
        entropies: list[tuple[int, list[torch.Tensor]]] = []
        routes: list[tuple[int, list[torch.Tensor]]] = []
        routes_key = "routes" if self.rl.router_replay == "r3" else None
        for key, chunk in self.parallel.micro_batches(rows, *self.caps, batch.token_counts(rows)):
            padding = chunk is None  # fsdp2: a pass that keeps the ranks' collectives in step
            chunk = rows[:1] if padding else chunk
            data = batch.padded(chunk, self.pad_id, self.device)
            needs_entropy = self.loss_spec.needs_entropy
            recorded = [] if self.router is not None else None
            logp, entropy = self.forward(data, slice(None), needs_entropy, recorded, routes_key)
            if padding:
                continue
            routes.append((key, fed_tokens(batch, chunk, recorded or [])))
            logprobs.append((key, batch.completion_values(chunk, logp)))
            if entropy is not None:
                entropies.append((key, batch.completion_values(chunk, entropy)))
        order = self.parallel.in_order
        every = len(batch)

        def spread(values: list) -> list | None:  # per-row values of `rows` -> one entry per batch row
            if not values:
                return None
            out: list = [None] * every
            for row, value in zip(rows, values):
                out[row] = value
            return out

        logprobs, routes = order(logprobs), order(routes)
        batch.old_logprobs = spread(logprobs)
        batch.old_entropies = spread(order(entropies))
        batch.old_routes = spread(routes)
        return batch_mismatch(batch, rows, logprobs, routes or None)

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

    def _mini_batch_step(self, batch: RolloutBatch, rows: list[int], own_old: bool) -> dict[str, float]:
        """One optimizer step over `rows`. `own_old`: the policy has not moved since the batch was handed
        over, so this forward is the old policy: it stands for the old values (unless the engine's do:
        `rl.old_logprobs=rollout`) and gives the old policy's mismatch on these rows."""
        measure = own_old
        data = batch.padded(rows, self.pad_id, self.device)
        if own_old:  # the old values of these rows are this forward's own (r2 then routes by itself)
            for key in ("old_logp", "old_entropy", "old_routes"):
                if self.rl.old_logprobs == "recompute":
                    data.pop(key, None)
        advantages = batch.advantages[rows].to(self.device, non_blocking=True)
        num_tokens = float(max(batch.trained_tokens(rows), 1))  # the mask's sum
        routes_key = REPLAYED_ROUTES[self.rl.router_replay]
        self.optimizer.zero_grad(set_to_none=True)
        # gradient checkpointing re-runs the routers in the backward pass: replay must still be in force
        held: list | None = [] if self.config.model.gradient_checkpointing else None
        try:
            return self._accumulate(batch, rows, data, advantages, num_tokens, routes_key, measure, held)
        finally:
            for release in held or []:
                release()

    def _accumulate(self, batch, rows, data, advantages, num_tokens, routes_key, measure, held):
        """The micro-batches' forward and backward passes of a mini-batch step (this rank's share of
        them), the gradients' reduction across ranks, then the optimizer step. The step's figures stay on
        the device until one read back, with the finite flag and the gradient norm that decide whether the
        step is taken."""
        zero = torch.zeros((), device=self.device)
        sums: dict[str, torch.Tensor] = {"loss/policy": zero, "entropy_sum": zero}
        measured: list[tuple[int, list]] = []
        used: list[tuple[int, list]] = []
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for key, chunk in self.parallel.micro_batches(range(len(rows)), *self.caps, batch.token_counts(rows)):
            padding = chunk is None  # fsdp2: a zero-weighted pass that keeps the collectives in step
            part = slice(0, 1) if padding else slice(chunk[0], chunk[-1] + 1)
            used_routes = [] if measure else None
            loss, logp, entropy, metrics = self._micro_batch(
                batch, rows, data, part, advantages, num_tokens, routes_key, used_routes, held
            )
            if padding:
                loss = loss * 0.0
            else:
                finite = finite & torch.isfinite(loss.detach())
            loss.backward()
            while held:  # this micro-batch's replay, kept through its backward's recomputation
                held.pop()()
            if padding:
                continue
            mask = data["mask"][part]
            if measure:
                measured.append((key, batch.completion_values(rows[part], logp)))
                used.append((key, fed_tokens(batch, rows[part], used_routes)))
            weight = batch.trained_tokens(rows[part]) / num_tokens
            part_sums = {"loss/policy": loss.detach(), "entropy_sum": (entropy * mask).sum(), **metrics}
            for name, value in part_sums.items():  # sums (*_sum) add up; per-token means by their weight
                value = value if name == "loss/policy" or name.endswith("_sum") else value * weight
                sums[name] = sums.get(name, zero) + value
        # one read back from the device for the whole step: whether every loss was finite, the gradient
        # norm (together they decide whether the step is taken), the step's figures and its mismatch
        self.parallel.reduce_gradients(self.model)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.rl.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        mismatch = {}
        if measure:
            order = self.parallel.in_order
            mismatch = batch_mismatch_values(batch, rows, order(measured), order(used) or None)
        read = host_floats({"learner:finite": finite, "learner:grad_norm": grad_norm, **sums, **mismatch})
        finite_here = read.pop("learner:finite") >= 1.0
        if self.parallel.any(not finite_here):
            return self._skip("loss" if not finite_here else "another rank's loss", read["loss/policy"])
        grad_norm = read.pop("learner:grad_norm")
        if not math.isfinite(grad_norm):
            return self._skip("gradient norm", grad_norm)
        self.optimizer.step()
        self.consecutive_skips = 0
        stats = self.parallel.sum({name: read[name] for name in sums})
        self.term.finish(stats, num_tokens)
        stats.update(finish_mismatch(read))
        return {  # the entropy's sum taken out before the rest is copied in: it is not a metric itself
            "actor/entropy": stats.pop("entropy_sum") / num_tokens,
            **stats,
            "actor/grad_norm": grad_norm,
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/skipped_updates": 0.0,
        }

    def _micro_batch(self, batch, rows, data, part, advantages, num_tokens, routes_key, used_routes, held):
        """One micro-batch's loss (divided by the whole mini-batch's counts), log-probs, entropies and
        the loss's metrics."""
        mask = data["mask"][part]
        extra = self.forward.reference_logprobs(data, part)  # first: no replay of the policy's is in force
        scores = self.term.scores(self.forward, data, part, rows[part], batch)  # a teacher's, unreplayed
        logp, entropy = self.forward(data, part, True, used_routes, routes_key, held)
        part_advantages = advantages[part]
        if batch.zvp_sign is not None:  # RL-ZVP: token advantages from the current policy's entropies
            sign = batch.zvp_sign[rows][part].to(self.device)
            token_advantages = zvp_token_advantages(entropy, mask, sign, self.zve.zvp.alpha)
            part_advantages = torch.where(
                (sign != 0)[:, None], token_advantages, part_advantages[:, None].expand_as(logp)
            )
        # without old-policy values (recompute, one mini-batch) this forward *is* the old policy
        old_logp = data["old_logp"][part] if "old_logp" in data else logp.detach()
        old_entropy = data["old_entropy"][part] if "old_entropy" in data else entropy
        # the term's share (a teacher's), from the policy that sampled (the old one)
        part_advantages, added = self.term.advantages(scores, old_logp, part_advantages, mask)
        loss, metrics = policy_loss(
            self.rl.loss,
            logp,
            old_logp,
            part_advantages,
            mask,
            entropy=old_entropy,
            agg=self.rl.loss_agg,
            max_length=self.config.rollout.max_new_tokens,
            num_tokens=num_tokens,
            num_sequences=len(rows),
            kl=self.rl.kl.estimator,
            kl_coef=self.rl.kl.coef,
            rollout_logp=data["rollout_logp"][part],
            correction=self.rl.rollout_correction.mode,
            correction_level=self.rl.rollout_correction.level,
            correction_cap=self.rl.rollout_correction.cap,
            correction_band=self.rl.rollout_correction.band,
            off_policy_mask=self.rl.off_policy_mask,
            vocab_size=self.model.config.vocab_size,
            host_metrics=False,
            **extra,
            **self.loss_options,
        )
        return loss, logp, entropy, {**metrics, **added}
