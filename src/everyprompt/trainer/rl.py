"""The RL loop: rollout -> rewards -> advantages -> clipped policy update -> weight sync.

One step samples `prompts_per_step` prompts, `group_size` completions each, from the rollout engine;
scores them with the reward function; computes group-relative advantages and the policy loss through
the algorithm registries; takes `mini_batches` AdamW steps over the batch, each accumulated over
micro-batches with the mini-batch's own loss denominators (so the gradient does not depend on the
micro-batch size); then copies the new weights into the engine.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from pathlib import Path

import torch

from everyprompt.algorithms import compute_advantages, policy_loss, policy_loss_spec
from everyprompt.config import Config
from everyprompt.data import PromptCursor
from everyprompt.rewards import get_reward, score_completions
from everyprompt.rollout import GenerationRequest, NativeEngine, SamplingParams
from everyprompt.trainer.batch import RolloutBatch
from everyprompt.trainer.checkpoint import save_checkpoint
from everyprompt.trainer.logprobs import token_logprobs
from everyprompt.trainer.metrics import MetricsLogger
from everyprompt.trainer.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and processes)."""
    value = 0x2545F4914F6CDD1D
    for part in parts:
        value = (value * 6364136223846793005 + part + 1442695040888963407) % (1 << 63)
    return value


def reward_columns(rows: list[dict]) -> dict[str, list]:
    keys = sorted({key for row in rows for key in row})
    return {key: [row.get(key) for row in rows] for key in keys}


def zero_variance_rate(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """Share of groups whose valid rewards are all equal (their advantages are all zero)."""
    groups = int(group_index.max()) + 1
    valid = ~torch.isnan(rewards)
    values, index = rewards[valid].double(), group_index[valid]
    low = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amin")
    high = torch.full((groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amax")
    # a group with no valid reward has low = inf > high = -inf: zero variance as well
    return float((high <= low).double().mean())


class RLTrainer:
    """Composes the engine, reward function, optimizer, logger and checkpoints of one RL run."""

    def __init__(
        self, config: Config, model, tokenizer, prompts: list[dict], run_dir: str | Path, reference=None
    ):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.prompts, self.run_dir = prompts, Path(run_dir)
        self.rl = config.rl
        self.reward_fn = get_reward(config.rewards.function)
        self.engine = NativeEngine.from_model(model, tokenizer, batch_size=config.rollout.batch_size)
        self.optimizer = build_optimizer(model, self.rl.lr, self.rl.weight_decay)
        self.scheduler = build_scheduler(
            self.optimizer, self.rl.warmup_steps, self.rl.steps, self.rl.lr_schedule
        )
        self.cursor = PromptCursor(len(prompts), config.seed)
        self.step = 0
        self.reward_errors = 0
        self._prompt_ids = [tokenizer(p["prompt"]).input_ids for p in prompts]
        self._needs_entropy = policy_loss_spec(self.rl.loss).needs_entropy
        self._loss_options = self.rl.loss_kwargs()
        if self.rl.loss == "espo":
            self._loss_options["vocab_size"] = model.config.vocab_size
        # The KL term's reference: the starting policy, frozen (a copy of `model` unless given).
        self.reference = None
        if self.rl.kl.estimator is not None:
            self.reference = (reference or copy.deepcopy(model)).eval().requires_grad_(False)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "cursor": self.cursor.state_dict(),
            "reward_errors": self.reward_errors,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        self.reward_errors = state["reward_errors"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.engine.load_weights(self.model.state_dict())

    def save(self) -> Path:
        return save_checkpoint(
            self.run_dir,
            f"step_{self.step}",
            self.model,
            self.tokenizer,
            self.state_dict(),
            keep_last=self.config.checkpoint.keep_last,
        )

    # ------------------------------------------------------------ one step
    def rollout(self) -> RolloutBatch:
        started = time.perf_counter()
        prompt_indices = self.cursor.take(self.rl.prompts_per_step)
        requests = []
        for group, index in enumerate(prompt_indices):
            for sample in range(self.rl.group_size):
                seed = derive_seed(self.config.seed, self.step, group, sample)
                requests.append(GenerationRequest(len(requests), self._prompt_ids[index], seed))
        params = SamplingParams(
            self.config.rollout.max_new_tokens, self.config.rollout.temperature, self.config.rollout.top_p
        )
        completions = sorted(self.engine.generate(requests, params), key=lambda c: c.request_id)
        group_index = torch.arange(len(prompt_indices)).repeat_interleave(self.rl.group_size)
        return RolloutBatch(
            prompt_ids=[c.prompt_ids for c in completions],
            completion_ids=[c.token_ids for c in completions],
            rollout_logprobs=[c.logprobs for c in completions],
            finish_reason=[c.finish_reason for c in completions],
            group_index=group_index,
            prompt_index=[prompt_indices[g] for g in group_index.tolist()],
            completion_text=self.tokenizer.batch_decode(
                [c.token_ids for c in completions], skip_special_tokens=True
            ),
            timing={"rollout_s": time.perf_counter() - started},
        )

    def score(self, batch: RolloutBatch) -> int:
        started = time.perf_counter()
        rows = [self.prompts[i] for i in batch.prompt_index]
        rewards, errors = score_completions(self.reward_fn, batch.completion_text, reward_columns(rows))
        batch.rewards = torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32)
        batch.timing["reward_s"] = time.perf_counter() - started
        return errors

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        started = time.perf_counter()
        self.model.train()
        generator = torch.Generator().manual_seed(derive_seed(self.config.seed, self.step, 7))
        order = torch.randperm(len(batch), generator=generator)
        if self.rl.mini_batches > 1:
            self._old_logprobs(batch)
        stats: dict[str, list[float]] = {}
        for mini in order.chunk(self.rl.mini_batches):
            for key, value in self._mini_batch_step(batch, mini.tolist()).items():
                stats.setdefault(key, []).append(value)
        self.scheduler.step()
        metrics = {key: sum(values) / len(values) for key, values in stats.items()}
        metrics["time/train_s"] = time.perf_counter() - started
        return metrics

    @torch.no_grad()
    def _old_logprobs(self, batch: RolloutBatch) -> None:
        """The trainer's pre-update log-probs (and entropies, when the loss needs them) of the batch."""
        rows = list(range(len(batch)))
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        for start in range(0, len(rows), self.rl.micro_batch_size):
            chunk = rows[start : start + self.rl.micro_batch_size]
            data = batch.padded(chunk, self.tokenizer.pad_token_id)
            logp, entropy = token_logprobs(
                self.model,
                data["input_ids"],
                self.config.rollout.temperature,
                with_entropy=self._needs_entropy,
            )
            logprobs.extend(batch.completion_values(chunk, logp))
            if entropy is not None:
                entropies.extend(batch.completion_values(chunk, entropy))
        batch.old_logprobs = logprobs
        batch.old_entropies = entropies or None

    def _mini_batch_step(self, batch: RolloutBatch, rows: list[int]) -> dict[str, float]:
        data = batch.padded(rows, self.tokenizer.pad_token_id)
        advantages = batch.advantages[rows]
        num_tokens = float(data["mask"].sum().clamp(min=1))
        total_loss, entropy_sum, stats = 0.0, 0.0, {}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(rows), self.rl.micro_batch_size):
            part = slice(start, start + self.rl.micro_batch_size)
            mask = data["mask"][part]
            input_ids = data["input_ids"][part]
            logp, entropy = token_logprobs(
                self.model, input_ids, self.config.rollout.temperature, with_entropy=True
            )
            # Without a separate old-policy pass (one mini-batch), this forward *is* the old policy.
            old_logp = data["old_logp"][part] if "old_logp" in data else logp.detach()
            old_entropy = data["old_entropy"][part] if "old_entropy" in data else entropy
            extra = {}
            if self.reference is not None:
                with torch.no_grad():
                    extra["ref_logp"], _ = token_logprobs(
                        self.reference, input_ids, self.config.rollout.temperature
                    )
            loss, metrics = policy_loss(
                self.rl.loss,
                logp,
                old_logp,
                advantages[part],
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
                **extra,
                **self._loss_options,
            )
            if not torch.isfinite(loss):
                log.warning("non-finite loss at step %d; this mini-batch's update is skipped", self.step)
                self.optimizer.zero_grad(set_to_none=True)
                return {"actor/skipped_updates": 1.0}
            loss.backward()
            total_loss += float(loss.detach())
            entropy_sum += float((entropy * mask).sum())
            weight = float(mask.sum()) / num_tokens
            for key, value in metrics.items():
                stats[key] = stats.get(key, 0.0) + value * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.rl.max_grad_norm)
        self.optimizer.step()
        return {
            **stats,
            "loss/policy": total_loss,
            "actor/entropy": entropy_sum / num_tokens,
            "actor/grad_norm": float(grad_norm),
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/skipped_updates": 0.0,
        }

    def train_step(self) -> dict[str, float]:
        batch = self.rollout()
        errors = self.score(batch)
        self.reward_errors += errors
        batch.advantages = compute_advantages(self.rl.advantage, batch.rewards, batch.group_index)
        metrics = self.update(batch)
        sync_started = time.perf_counter()
        self.engine.load_weights(self.model.state_dict())
        self.step += 1
        metrics.update(self._batch_metrics(batch, errors))
        metrics["time/weight_sync_s"] = time.perf_counter() - sync_started
        return metrics

    def _batch_metrics(self, batch: RolloutBatch, errors: int) -> dict[str, float]:
        rewards = batch.rewards
        valid = rewards[~torch.isnan(rewards)]
        tokens = sum(len(c) for c in batch.completion_ids)
        return {
            "reward/mean": float(valid.mean()) if valid.numel() else math.nan,
            "reward/accuracy": float((valid >= 1.0).float().mean()) if valid.numel() else math.nan,
            "reward/none_fraction": 1.0 - valid.numel() / len(batch),
            "reward/errors": float(errors),
            "reward/errors_total": float(self.reward_errors),
            "zve/zero_variance_rate": zero_variance_rate(rewards, batch.group_index),
            "zve/informative_rollout_fraction": float((batch.advantages != 0).float().mean()),
            "rollout/tokens": float(tokens),
            "rollout/tokens_per_s": tokens / max(batch.timing["rollout_s"], 1e-9),
            "rollout/mean_length": tokens / len(batch),
            "rollout/truncated_fraction": batch.finish_reason.count("length") / len(batch),
            "time/rollout_s": batch.timing["rollout_s"],
            "time/reward_s": batch.timing["reward_s"],
        }

    # ------------------------------------------------------------ the loop
    def train(self, evaluate_fn=None) -> list[dict[str, float]]:
        """Run until `rl.steps`; checkpoint every `checkpoint.every` steps and at the end."""
        logger = MetricsLogger(
            self.run_dir,
            self.rl.steps,
            "RL",
            start_step=self.step,
            progress=self.config.logging.progress,
            tensorboard=self.config.logging.tensorboard,
        )
        history = []
        try:
            while self.step < self.rl.steps:
                started = time.perf_counter()
                metrics = self.train_step()
                every = self.config.eval.every
                if evaluate_fn is not None and every and self.step % every == 0 and self.step < self.rl.steps:
                    metrics.update({f"eval/{k}": v for k, v in evaluate_fn(self.engine).items()})
                metrics["time/step_s"] = time.perf_counter() - started
                logger.log(self.step, metrics)
                history.append(metrics)
                if self.config.checkpoint.every and self.step % self.config.checkpoint.every == 0:
                    self.save()
            if not (self.run_dir / "checkpoints" / f"step_{self.step}").is_dir():
                self.save()
        finally:
            logger.close()
        return history
