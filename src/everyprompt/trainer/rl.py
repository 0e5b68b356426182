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
import statistics
import time
import warnings
from pathlib import Path

import torch

from everyprompt.algorithms import compute_advantages, policy_loss, policy_loss_spec, zvp_token_advantages
from everyprompt.config import Config, ConfigError
from everyprompt.data.curriculum import Curriculum
from everyprompt.data.passrate import PassRateStore
from everyprompt.data.source import ALL, PromptSource, buckets_by_field, buckets_by_pass_rate
from everyprompt.models.replay import ReplayError, RouterReplay, same_expert_sets
from everyprompt.rewards import build_reward
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import GenerationRequest, NativeEngine, SamplingParams
from everyprompt.rollout.scheduler import LengthPredictor, admission_order
from everyprompt.trainer.batch import RolloutBatch
from everyprompt.trainer.checkpoint import save_checkpoint
from everyprompt.trainer.logprobs import check_packing, token_logprobs
from everyprompt.trainer.metrics import MetricsLogger
from everyprompt.trainer.optim import build_optimizer, build_scheduler
from everyprompt.zve import collect_groups, group_zero_variance, reshape_zero_variance, zvp_signs

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


def _engine_metrics(calls: list[dict[str, float]]) -> dict[str, float]:
    """rollout/* throughput figures of one step's generate calls (ZVE expansion makes several)."""
    calls = [c for c in calls if c]
    if not calls:
        return {}
    steps = sum(c["decode_steps"] for c in calls)
    wall = sum(c["wall_s"] for c in calls)
    return {
        "rollout/tokens_per_s": sum(c["tokens"] for c in calls) / wall if wall > 0 else 0.0,
        "rollout/slot_occupancy": sum(c["slot_occupancy"] * c["decode_steps"] for c in calls) / max(steps, 1),
        "rollout/decode_step_ms": sum(c["decode_step_ms"] * c["decode_steps"] for c in calls) / max(steps, 1),
    }


def zero_variance_rate(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """Share of groups whose valid rewards are all equal (their advantages are all zero)."""
    return float(group_zero_variance(rewards, group_index).double().mean())


def mismatch_metrics(batch: RolloutBatch, trainer_routes: list[torch.Tensor] | None) -> dict[str, float]:
    """How far the trainer's old-policy pass is from the engine that sampled (DESIGN: measured, not hidden).

    Over completion tokens: mean |logp_trainer - logp_engine|, the k3 KL estimate of KL(engine || trainer),
    the share of tokens whose ratio pi_trainer / pi_engine exceeds 2; with both sides' routes: the share
    of (token, MoE layer) pairs routed to the same expert set, and |dlogp| on tokens whose input token was
    routed differently in some layer ("flipped") and on the rest.
    """
    old, engine = torch.cat(batch.old_logprobs), torch.cat(batch.rollout_logprobs)
    if not old.numel():
        return {}
    log_ratio = (old - engine).double()
    metrics = {
        "mismatch/logp_abs_diff": float(log_ratio.abs().mean()),
        "mismatch/k3_kl": float((log_ratio.exp() - 1 - log_ratio).mean()),
        "mismatch/ratio_above_2": float((log_ratio > math.log(2)).double().mean()),
    }
    if trainer_routes is None or batch.routed_experts is None:
        return metrics
    same_pairs, pairs, flipped = 0, 0, []
    for prompt, trainer, engine_routes in zip(batch.prompt_ids, trainer_routes, batch.routed_experts):
        n = min(len(trainer), len(engine_routes))
        same = same_expert_sets(trainer[:n], engine_routes[:n])  # [n, L]
        same_pairs, pairs = same_pairs + int(same.sum()), pairs + same.numel()
        # completion target j is predicted from input token len(prompt) - 1 + j
        flipped.append(~same[len(prompt) - 1 :].all(-1))
    flipped_tokens = torch.cat(flipped)
    diff = log_ratio.abs()[: flipped_tokens.numel()]
    metrics["mismatch/routing_agreement"] = same_pairs / max(pairs, 1)
    metrics["mismatch/flipped_token_fraction"] = float(flipped_tokens.double().mean())
    if bool(flipped_tokens.any()):
        metrics["mismatch/logp_abs_diff_flipped"] = float(diff[flipped_tokens].mean())
    if bool((~flipped_tokens).any()):
        metrics["mismatch/logp_abs_diff_unflipped"] = float(diff[~flipped_tokens].mean())
    return metrics


class RLTrainer:
    """Composes the engine, reward function, optimizer, logger and checkpoints of one RL run."""

    def __init__(
        self,
        config: Config,
        model,
        tokenizer,
        prompts: list[dict],
        run_dir: str | Path,
        reference=None,
        store: PassRateStore | None = None,
    ):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.prompts, self.run_dir = prompts, Path(run_dir)
        self.rl = config.rl
        self.engine = NativeEngine.from_model(
            model, tokenizer, batch_size=config.rollout.batch_size, precision=config.rollout.precision
        )
        self.optimizer = build_optimizer(model, self.rl.lr, self.rl.weight_decay)
        self.scheduler = build_scheduler(
            self.optimizer, self.rl.warmup_steps, self.rl.steps, self.rl.lr_schedule
        )
        self.zve = config.zve
        self.store = store if store is not None else PassRateStore(ema_decay=config.zve.retirement.ema_decay)
        self.curriculum = Curriculum(config.curriculum) if config.curriculum.stages else None
        self.source = PromptSource(self._buckets(), config.seed)
        # rewards are scored in worker processes as completions stream out of the engine
        self.rewards = RewardPool(
            build_reward(config.rewards, self.run_dir), config.rewards.workers, config.rewards.timeout_s
        )
        self._reward_keys = sorted({key for row in prompts for key in row})
        self._reward_calls = 0
        self.lengths = LengthPredictor(self.store, default=config.rollout.max_new_tokens)
        self.step = 0
        self.reward_errors = 0
        self.retired_total = 0
        self.rollouts_total = 0  # rollouts generated so far (the offline filter's count in when it ran)
        self._prompt_ids = [tokenizer(p["prompt"]).input_ids for p in prompts]
        # MoE router hooks: replay (rl.router_replay) and the routing-mismatch metrics
        try:
            self.router = RouterReplay(model)
        except ReplayError as err:
            if self.rl.router_replay != "off":
                raise ConfigError(f"config key 'rl.router_replay': {err}") from None
            self.router = None
        # the engine records routes when they are replayed (r3) or compared with the old-policy pass
        self._record_routes = self.router is not None and (
            self.rl.router_replay == "r3" or self.rl.old_logprobs == "recompute"
        )
        self._pack = config.model.pack_sequences
        if self._pack and self._prompt_ids:
            check_packing(model, (self._prompt_ids * 2)[:2], tokenizer.pad_token_id)
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
            "source": self.source.state_dict(),
            "store": self.store.state_dict(),
            "curriculum": self.curriculum.state_dict() if self.curriculum else None,
            "reward_errors": self.reward_errors,
            "retired_total": self.retired_total,
            "rollouts_total": self.rollouts_total,
            "lengths": self.lengths.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.store.load_state_dict(state["store"])
        if self.curriculum is not None and state["curriculum"] is not None:
            self.curriculum.load_state_dict(state["curriculum"])
        self.source.load_state_dict(state["source"])
        self.reward_errors = state["reward_errors"]
        self.retired_total = state["retired_total"]
        self.rollouts_total = state["rollouts_total"]
        if "lengths" in state:
            self.lengths.load_state_dict(state["lengths"])
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
    def _buckets(self) -> dict[str, list[int]]:
        """Prompt buckets of the current curriculum stage (one bucket without a curriculum)."""
        if self.curriculum is None:
            return {ALL: list(range(len(self.prompts)))}
        if self.config.curriculum.difficulty == "field":
            return buckets_by_field(self.prompts, self.config.curriculum.field)
        return buckets_by_pass_rate(
            self.prompts, self.store.pass_rate, self.config.curriculum.pass_rate_edges
        )

    def settings(self) -> dict:
        """This step's sampling settings: the config's, with the curriculum stage's overrides."""
        rollout = self.config.rollout
        values = {
            "rollout.temperature": rollout.temperature,
            "rollout.top_p": rollout.top_p,
            "rl.group_size": self.rl.group_size,
            "rl.prompts_per_step": self.rl.prompts_per_step,
            "max_new_tokens": rollout.max_new_tokens,
        }
        if self.curriculum is not None:
            values.update(self.curriculum.stage.overrides)
            if self.curriculum.stage.max_new_tokens:
                values["max_new_tokens"] = self.curriculum.stage.max_new_tokens
        return values

    def rollout(self) -> RolloutBatch:
        """Sample and score this step's groups (with ZVE stage 1 when enabled); record their pass rates."""
        started = time.perf_counter()
        settings = self.settings()
        params = SamplingParams(
            settings["max_new_tokens"],
            settings["rollout.temperature"],
            settings["rollout.top_p"],
            record_routes=self._record_routes,
        )
        timing = {"reward_wait_s": 0.0, "generate_s": 0.0}
        engine_stats: list[dict[str, float]] = []
        components: dict[str, list[float | None]] = {}  # composite rewards: each component's values
        errors_before = self.rewards.stats.errors

        def sample(specs: list[tuple[int, int, int]]) -> list[tuple[object, float | None]]:
            requests = [
                GenerationRequest(
                    i, self._prompt_ids[index], derive_seed(self.config.seed, self.step, slot, s)
                )
                for i, (index, slot, s) in enumerate(specs)
            ]
            predicted = [
                self.lengths.predict(self.prompts[i]["prompt"], self._bucket(i)) for i, _, _ in specs
            ]
            order = admission_order(predicted, self.config.rollout.schedule)
            call, self._reward_calls = self._reward_calls, self._reward_calls + 1
            done: dict[int, tuple[object, str]] = {}
            began = time.perf_counter()
            for completion in self.engine.generate([requests[i] for i in order], params):
                text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                done[completion.request_id] = (completion, text)
                row = self.prompts[specs[completion.request_id][0]]
                self.rewards.submit(
                    (call, completion.request_id), text, {k: row.get(k) for k in self._reward_keys}
                )
            generated = time.perf_counter()
            timing["generate_s"] += generated - began
            engine_stats.append(dict(self.engine.stats))
            rewards = self.rewards.wait([(call, i) for i in range(len(specs))])
            for parts in self.rewards.last_components:
                for name, value in (parts or {}).items():
                    components.setdefault(name, []).append(value)
            timing["reward_wait_s"] += time.perf_counter() - generated
            for i, (index, _, _) in enumerate(specs):
                self.lengths.observe(self._bucket(index), [len(done[i][0].token_ids)])
            return [(done[i], r) for i, r in enumerate(rewards)]

        zve, expansion = self.zve, self.zve.expansion
        expand = zve.enabled and expansion.enabled
        mixture = self.curriculum.stage.mixture if self.curriculum is not None else None
        retire = zve.enabled and zve.retirement.enabled
        available = (
            (lambda index: self.store.is_available(self.prompts[index]["prompt"], self.step))
            if retire
            else None
        )
        collection = collect_groups(
            lambda count: self.source.take(count, mixture, available),
            sample,
            prompts_per_step=settings["rl.prompts_per_step"],
            group_size=settings["rl.group_size"],
            max_group_size=expansion.max_group_size if expand else None,
            expansion_step=expansion.step,
            dynamic_sampling=expand and expansion.dynamic_sampling,
            max_rollouts=expansion.max_rollouts_per_step,
            keep_zero_variance=not (zve.enabled and zve.drop_zero_variance)
            or (zve.reshape.enabled or zve.zvp.enabled),
        )
        stats = self._record_pass_rates(collection)
        stats.update(
            {
                "zve/generated_rollouts": float(collection.generated),
                "zve/expansion_rounds": float(collection.rounds),
                "zve/sampled_groups": float(collection.sampled_groups),
                "zve/dropped_groups": float(collection.dropped_groups),
                "zve/zero_variance_rate": collection.zv_sampled,
                "zve/zero_variance_rate_expanded": collection.zv_expanded,
                "reward/errors": float(self.rewards.stats.errors - errors_before),
                **_engine_metrics(engine_stats),
                **{
                    f"reward/{name}": statistics.fmean(v for v in values if v is not None)
                    if any(v is not None for v in values)
                    else math.nan
                    for name, values in components.items()
                },
            }
        )
        batch = self._assemble(collection.groups)
        batch.stats = stats
        batch.timing = {"rollout_s": time.perf_counter() - started, **timing}
        return batch

    def _bucket(self, index: int) -> str | None:
        """The prompt's difficulty bucket for length prediction: its curriculum field, when it has one."""
        value = self.prompts[index].get(self.config.curriculum.field)
        return None if value is None else str(value)

    def close(self) -> None:
        """Stop the reward workers (a trainer is not used after this)."""
        self.rewards.close()

    def _record_pass_rates(self, collection) -> dict[str, float]:
        """ZVE stage 4: every group updates its prompt's pass rate; retire / defer by the streak rules."""
        correct = self.zve.correct_reward
        visits = []
        for group in collection.all_groups:
            valid = group.valid_rewards()
            if valid:
                lengths = [len(c.token_ids) for c, _ in group.completions]
                visits.append(
                    (
                        self.prompts[group.prompt_index]["prompt"],
                        len(valid),
                        sum(r >= correct for r in valid),
                        sum(lengths) / len(lengths),
                    )
                )
        rules = self.zve.retirement
        if self.zve.enabled and rules.enabled:
            counts = self.store.record(
                visits, self.step, rules.retire_after, rules.defer_after, rules.defer_steps
            )
        else:
            counts = self.store.record(visits, self.step)
        self.retired_total += counts.retired
        status = self.store.counts()
        return {
            "zve/retired": float(counts.retired),
            "zve/deferred": float(counts.deferred),
            "zve/retired_total": float(self.retired_total),
            "zve/deferred_now": float(status["deferred"]),
        }

    def _assemble(self, groups) -> RolloutBatch:
        completions = [pair for g in groups for pair in g.completions]  # (Completion, text)
        rewards = [r for g in groups for r in g.rewards]
        group_index = torch.tensor([n for n, g in enumerate(groups) for _ in g.completions], dtype=torch.long)
        return RolloutBatch(
            prompt_ids=[c.prompt_ids for c, _ in completions],
            completion_ids=[c.token_ids for c, _ in completions],
            rollout_logprobs=[c.logprobs for c, _ in completions],
            rollout_entropies=(
                [c.entropies for c, _ in completions]
                if all(c.entropies is not None for c, _ in completions)
                else None
            ),
            routed_experts=(
                [c.routed_experts for c, _ in completions]
                if completions and all(c.routed_experts is not None for c, _ in completions)
                else None
            ),
            finish_reason=[c.finish_reason for c, _ in completions],
            group_index=group_index,
            prompt_index=[g.prompt_index for g in groups for _ in g.completions],
            completion_text=[t for _, t in completions],
            rewards=torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32),
        )

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        started = time.perf_counter()
        self.model.train()
        generator = torch.Generator().manual_seed(derive_seed(self.config.seed, self.step, 7))
        order = torch.randperm(len(batch), generator=generator)
        if self.rl.old_logprobs == "rollout":
            self._rollout_as_old(batch)
        elif self.rl.mini_batches > 1:
            self._old_logprobs(batch)
        stats: dict[str, list[float]] = {}
        for mini in order.chunk(self.rl.mini_batches):
            for key, value in self._mini_batch_step(batch, mini.tolist()).items():
                stats.setdefault(key, []).append(value)
        self.scheduler.step()
        metrics = {key: sum(values) / len(values) for key, values in stats.items()}
        metrics["time/train_s"] = time.perf_counter() - started
        return metrics

    def _logprobs(self, model, data: dict, rows: slice, with_entropy: bool = False, recorded=None):
        """`token_logprobs` of rows `rows` of a `RolloutBatch.padded` dict, packed when configured,
        with the batch's routes replayed when router replay is on (and `model` is the policy)."""
        replay = self.rl.router_replay != "off" and model is self.model and "routes" in data
        return token_logprobs(
            model,
            data["input_ids"][rows],
            self.config.rollout.temperature,
            with_entropy=with_entropy,
            lengths=data["lengths"][rows].tolist() if self._pack else None,
            pad_id=self.tokenizer.pad_token_id,
            router=self.router if model is self.model else None,
            routes=data["routes"][rows] if replay else None,
            recorded=recorded,
        )

    def _rollout_as_old(self, batch: RolloutBatch) -> None:
        """`rl.old_logprobs=rollout`: the engine's log-probs (and entropies) stand for the old policy's."""
        batch.old_logprobs = batch.rollout_logprobs
        if self._needs_entropy:
            if batch.rollout_entropies is None:
                raise RuntimeError(
                    f"rl.loss={self.rl.loss} needs the old policy's token entropies, which this rollout "
                    "engine does not return; set rl.old_logprobs=recompute"
                )
            batch.old_entropies = batch.rollout_entropies

    @torch.no_grad()
    def _old_logprobs(self, batch: RolloutBatch) -> None:
        """The trainer's pre-update log-probs (and entropies, when the loss needs them) of the batch."""
        rows = list(range(len(batch)))
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        for start in range(0, len(rows), self.rl.micro_batch_size):
            chunk = rows[start : start + self.rl.micro_batch_size]
            data = batch.padded(chunk, self.tokenizer.pad_token_id)
            recorded = [] if self.router is not None else None
            logp, entropy = self._logprobs(self.model, data, slice(None), self._needs_entropy, recorded)
            routes.extend(recorded or [])
            logprobs.extend(batch.completion_values(chunk, logp))
            if entropy is not None:
                entropies.extend(batch.completion_values(chunk, entropy))
        batch.old_logprobs = logprobs
        batch.old_entropies = entropies or None
        batch.old_routes = routes or None
        batch.stats.update(mismatch_metrics(batch, batch.old_routes))
        if self.rl.router_replay == "r2":  # R2: the updates replay the old policy's own routes
            batch.routed_experts = routes

    def _mini_batch_step(self, batch: RolloutBatch, rows: list[int]) -> dict[str, float]:
        data = batch.padded(rows, self.tokenizer.pad_token_id)
        advantages = batch.advantages[rows]
        num_tokens = float(data["mask"].sum().clamp(min=1))
        total_loss, entropy_sum, stats = 0.0, 0.0, {}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(rows), self.rl.micro_batch_size):
            part = slice(start, start + self.rl.micro_batch_size)
            mask = data["mask"][part]
            logp, entropy = self._logprobs(self.model, data, part, with_entropy=True)
            part_advantages = advantages[part]
            if batch.zvp_sign is not None:  # RL-ZVP: token advantages from the current policy's entropies
                sign = batch.zvp_sign[rows][part]
                token_advantages = zvp_token_advantages(entropy, mask, sign, self.zve.zvp.alpha)
                part_advantages = torch.where(
                    (sign != 0)[:, None], token_advantages, part_advantages[:, None].expand_as(logp)
                )
            # Without a separate old-policy pass (one mini-batch), this forward *is* the old policy.
            old_logp = data["old_logp"][part] if "old_logp" in data else logp.detach()
            old_entropy = data["old_entropy"][part] if "old_entropy" in data else entropy
            extra = {}
            if self.reference is not None:
                with torch.no_grad():
                    extra["ref_logp"], _ = self._logprobs(self.reference, data, part)
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

    def advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Group-relative advantages, then ZVE stages 2 (reshaping) and 3 (RL-ZVP signs) when enabled."""
        if not len(batch):
            return {}
        options = {"dead_zone": self.rl.dead_zone} if self.rl.dead_zone > 0 else {}
        batch.advantages = compute_advantages(self.rl.advantage, batch.rewards, batch.group_index, **options)
        zero = group_zero_variance(batch.rewards, batch.group_index)
        stats = {"zve/zero_variance_rate_batch": float(zero.double().mean())}
        if not self.zve.enabled:
            return stats
        still = zero.clone()
        if self.zve.reshape.enabled and bool(zero.any()):
            shape = self.zve.reshape
            shaped, informative = reshape_zero_variance(
                batch.rewards,
                batch.completion_ids,
                batch.group_index,
                shape.length_coef,
                shape.repetition_coef,
                self.settings()["max_new_tokens"],
                shape.reward_gap,
            )
            batch.advantages = torch.where(zero[batch.group_index], shaped, batch.advantages)
            still &= ~informative
            stats["zve/reshaped_groups"] = float(informative.sum())
        stats["zve/zero_variance_rate_reshaped"] = float(still.double().mean())
        if self.zve.zvp.enabled and bool(still.any()):
            batch.zvp_sign = zvp_signs(batch.rewards, batch.group_index, still, self.zve.correct_reward)
            zvp_groups = torch.zeros_like(still).index_put_(
                (batch.group_index,), batch.zvp_sign != 0, accumulate=True
            )
            still &= ~zvp_groups
            stats["zve/zvp_groups"] = float(zvp_groups.sum())
        stats["zve/zero_variance_rate_final"] = float(still.double().mean())
        return stats

    def train_step(self) -> dict[str, float]:
        batch = self.rollout()
        errors = int(batch.stats.get("reward/errors", 0))
        self.reward_errors += errors
        self.rollouts_total += int(batch.stats.get("zve/generated_rollouts", len(batch)))
        zve_stats = self.advantages(batch)
        if len(batch):
            metrics = self.update(batch)
        else:  # every group was zero-variance and dropped: nothing to learn from this step
            with warnings.catch_warnings():  # the schedule still advances one step per RL step
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
                self.scheduler.step()
            metrics = {"actor/skipped_updates": 1.0}
        sync_started = time.perf_counter()
        self.engine.load_weights(self.model.state_dict())
        self.step += 1
        metrics.update(zve_stats)
        metrics.update(self._batch_metrics(batch, errors))
        metrics["time/weight_sync_s"] = time.perf_counter() - sync_started
        metrics["rollout/total"] = float(self.rollouts_total)
        if self.curriculum is not None:
            metrics["curriculum/stage"] = float(self.curriculum.index + 1)  # the stage this step ran in
            accuracy = metrics.get("reward/accuracy", math.nan)
            if self.curriculum.observe(self.step, 0.0 if math.isnan(accuracy) else accuracy):
                self.source.set_buckets(self._buckets())
        return metrics

    def _batch_metrics(self, batch: RolloutBatch, errors: int) -> dict[str, float]:
        generated = batch.stats.get("zve/generated_rollouts", float(len(batch)))
        rewards = batch.rewards
        metrics = {
            **batch.stats,
            "reward/errors": float(errors),
            "reward/errors_total": float(self.reward_errors),
            "time/rollout_s": batch.timing["rollout_s"],
            "time/generate_s": batch.timing["generate_s"],
            # waited on rewards after the engine finished (scoring overlaps with generation)
            "time/reward_wait_s": batch.timing["reward_wait_s"],
        }
        if not len(batch):
            return {**metrics, "zve/informative_rollout_fraction": 0.0, "zve/signal_rollout_fraction": 0.0}
        valid = rewards[~torch.isnan(rewards)]
        tokens = sum(len(c) for c in batch.completion_ids)
        zero = group_zero_variance(rewards, batch.group_index)
        signal_groups = int((~zero).sum())
        carries = batch.advantages != 0
        if batch.zvp_sign is not None:
            carries |= batch.zvp_sign != 0
        metrics.update(
            {
                "reward/mean": float(valid.mean()) if valid.numel() else math.nan,
                "reward/accuracy": float((valid >= self.zve.correct_reward).float().mean())
                if valid.numel()
                else math.nan,
                "reward/none_fraction": 1.0 - valid.numel() / len(batch),
                # of all rollouts generated this step: those whose update carries a non-zero advantage,
                # and those in groups with a reward signal (before reshaping and RL-ZVP)
                "zve/informative_rollout_fraction": float(carries.sum()) / generated,
                "zve/signal_rollout_fraction": float((~zero)[batch.group_index].sum()) / generated,
                "zve/signal_groups": float(signal_groups),
                "zve/rollouts_per_signal_group": generated / signal_groups if signal_groups else math.inf,
                "rollout/tokens": float(tokens),
                "rollout/mean_length": tokens / len(batch),
                "rollout/truncated_fraction": batch.finish_reason.count("length") / len(batch),
            }
        )
        return metrics

    # ------------------------------------------------------------ the loop
    @property
    def finished(self) -> bool:
        """`rl.steps` done, or `rl.max_rollouts` rollouts generated (offline-filter samples included)."""
        budget = self.rl.max_rollouts
        return self.step >= self.rl.steps or (budget is not None and self.rollouts_total >= budget)

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
            while not self.finished:
                started = time.perf_counter()
                metrics = self.train_step()
                every = self.config.eval.every
                if evaluate_fn is not None and every and self.step % every == 0 and not self.finished:
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
