"""The rollout side of the RL loop: prompts in, a scored `RolloutBatch` out.

`next_batch(step)` draws the step's prompts (curriculum stage mixture, retired prompts skipped), admits
their requests into the engine longest-predicted-first, streams each finished completion to the reward
pool, grows zero-variance groups (ZVE stage 1), records every group in the pass-rate store (stage 4),
and assembles the batch. `load_weights` takes the learner's hand-off. Nothing here reads the learner.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.config import Config
from everyprompt.data.formatting import prompt_format_of
from everyprompt.data.passrate import PassRateStore
from everyprompt.envs.base import end_of_run
from everyprompt.envs.episode import Episodes
from everyprompt.generation import ScoredSamples, sample_and_score
from everyprompt.rewards import build_reward
from everyprompt.rewards.health import RewardHealth
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import (
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    build_engine,
    derive_seed,
    restore_decode_state,
    saved_decode_state,
)
from everyprompt.rollout.scheduler import LengthPredictor, admission_order
from everyprompt.trainer.interface import RolloutSide
from everyprompt.trainer.rollout_side.assemble import assemble_batch
from everyprompt.trainer.rollout_side.partial import PartialRollouts, tag
from everyprompt.trainer.rollout_side.plan import PromptPlan
from everyprompt.trainer.rollout_side.tally import StepTally
from everyprompt.zve import Group, collect_groups, group_zero_variance
from everyprompt.zve.expansion import InFlight

log = logging.getLogger(__name__)


class LocalRolloutSide(RolloutSide):
    """Owns the engine, the reward pool, the prompt plan (source, curriculum, task mix), the length
    predictor and the pass-rate store's updates."""

    def __init__(
        self,
        config: Config,
        engine: RolloutEngine,
        tokenizer,
        prompts: list[dict],
        rewards: RewardPool,
        store: PassRateStore,
    ):
        self.config, self._engine, self.tokenizer = config, engine, tokenizer
        self.prompts, self.rewards, self.store = prompts, rewards, store
        self.plan = PromptPlan(config, prompts, store.pass_rate)
        self.lengths = LengthPredictor(store, default=config.rollout.max_new_tokens)
        self.retired_total = 0
        self.health = RewardHealth(config.rewards.max_error_fraction, config.rewards.error_window)
        self.prompt_format = prompt_format_of(config, tokenizer)
        self.episodes = Episodes.from_config(config, tokenizer, engine)  # multi-turn: the env's prompts
        # an episode's prompt is its environment's first messages, made when the episode starts (one per
        # request: a server's environment may answer differently each time)
        self.prompt_ids = None if self.episodes else [self.prompt_format.prompt_ids(p) for p in prompts]
        keys = sorted({key for row in prompts for key in row})
        self._reward_rows = [{key: row.get(key) for key in keys} for row in prompts]
        self._calls = 0  # generate calls so far: keeps each call's reward keys apart
        self.version = 0  # the policy version of the engine's weights (updates behind them)
        rollout = config.rollout
        self.partial = (
            PartialRollouts(rollout.segment_tokens(), rollout.max_versions_per_sequence)
            if rollout.partial
            else None
        )

    @classmethod
    def build(
        cls, config: Config, model, tokenizer, prompts, run_dir, store: PassRateStore, *, engine=None
    ) -> LocalRolloutSide:
        """The configured reward in its worker pool, and `engine` or else the configured engine over
        `model`'s weights."""
        rewards = config.rewards
        pool = RewardPool(
            build_reward(rewards, run_dir),
            rewards.workers,
            rewards.timeout_s,
            load_timeout_s=rewards.load_timeout_s,
        )
        engine = engine if engine is not None else build_engine(config.rollout, model, tokenizer)
        return cls(config, engine, tokenizer, prompts, pool, store)

    @property
    def engine(self) -> RolloutEngine:
        return self._engine

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The learner's weights after `version` updates (weight sync): later tokens carry that version."""
        self.engine.load_weights(state_dict)
        self.version = version

    def sleep(self) -> None:
        """The engine frees its weights and cache until the next `load_weights` (the learner trains)."""
        if self.config.rollout.sleeps():
            self.engine.sleep()

    def close(self) -> None:
        """Stop the reward workers and what the environments hold (the side is not used after this)."""
        try:
            self.rewards.close()
        finally:
            if self.episodes is not None:
                end_of_run()  # servers an environment started (envs/openenv.py)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            **self.plan.state_dict(),  # source, curriculum, tasks
            "store": self.store.state_dict(),
            "lengths": self.lengths.state_dict(),
            "retired_total": self.retired_total,
            "reward_health": list(self.health.recent),
            "partial": self.partial.state_dict() if self.partial is not None else None,
            "decode": saved_decode_state(self.engine),
        }

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state["store"])
        self.plan.load_state_dict(state)
        self.lengths.load_state_dict(state["lengths"])
        self.retired_total = state["retired_total"]
        self.health.recent.extend(tuple(pair) for pair in state["reward_health"])
        if self.partial is not None and state.get("partial"):
            self.partial.load_state_dict(state["partial"])
        restore_decode_state(self.engine, state.get("decode"))

    # ------------------------------------------------------------ one batch
    def settings(self) -> dict:
        """This step's sampling settings: the config's, with the curriculum stage's overrides."""
        rollout, rl = self.config.rollout, self.config.rl
        values = {
            "rollout.temperature": rollout.temperature,
            "rollout.top_p": rollout.top_p,
            "rl.group_size": rl.group_size,
            "rl.prompts_per_step": rl.prompts_per_step,
            "max_new_tokens": rollout.max_new_tokens,
        }
        values.update(self.plan.overrides())
        return values

    def next_batch(self, step: int) -> RolloutBatch:
        """Sample and score step `step`'s groups (with ZVE stage 1 when enabled); record their pass rates."""
        started = time.perf_counter()
        settings = self.settings()
        params = SamplingParams(
            settings["max_new_tokens"],
            settings["rollout.temperature"],
            settings["rollout.top_p"],
            record_routes=self.engine.can_record_routes,  # replay and the routing-mismatch metrics
            stop=(*self.config.rollout.stop, *(self.episodes.stop if self.episodes else ())),
        )
        tally = StepTally()
        errors_before = self.rewards.stats.errors
        zve = self.config.zve
        expand = zve.enabled and zve.expansion.enabled
        finished = self._continue_carried(step, params, tally)  # partial rollouts: earlier steps' groups
        available = self._available(step)  # (after: the groups that just finished are no longer in flight)
        collection = collect_groups(
            lambda count: self.plan.take(count, available),
            lambda specs: self._sample(step, specs, params, tally),
            prompts_per_step=settings["rl.prompts_per_step"],
            group_size=settings["rl.group_size"],
            max_group_size=zve.expansion.max_group_size if expand else None,
            expansion_step=zve.expansion.step,
            dynamic_sampling=expand and zve.expansion.dynamic_sampling,
            max_rollouts=zve.expansion.max_rollouts_per_step,
        )
        if self.partial is not None:
            self.partial.hold(collection.in_flight, step, self.config.seed, settings["max_new_tokens"])
        self.health.check(step, self.rewards.take_failures(), tally.scored)
        if tally.environment_errors:  # their episodes have no reward; the run goes on
            log.warning("step %d: %d episode(s) ended by their environment raising, the first: %s",
                        step, len(tally.environment_errors), tally.environment_errors[0][1])  # fmt: skip
        batch = assemble_batch(finished + collection.groups, settings["max_new_tokens"], self.version)
        batch.teacher_keys = self._teacher_keys(batch.prompt_index)
        outcomes = self._outcomes(finished + collection.all_groups)
        batch.stats = {
            **self._record_pass_rates(outcomes, step),
            **self._partial_stats(batch),
            **collection.metrics(),
            **self._reward_stats(batch, collection.generated),
            **tally.metrics(),
            "reward/errors": float(self.rewards.stats.errors - errors_before),
        }
        accuracy = batch.stats["reward/accuracy"]
        rates = [(index, correct / scored) for index, scored, correct, _ in outcomes]
        batch.stats.update(self.plan.observe(step, 0.0 if math.isnan(accuracy) else accuracy, rates))
        batch.timing = {
            "rollout_s": time.perf_counter() - started,
            "generate_s": tally.generate_s,
            "reward_wait_s": tally.reward_wait_s,  # after the engine finished (scoring overlaps it)
        }
        return batch

    def _available(self, step: int):
        """Which prompts may be drawn: not retired or deferred (ZVE retirement), not in flight (partial
        rollouts); None when every prompt may."""
        zve = self.config.zve
        retiring = zve.enabled and zve.retirement.enabled
        busy = self.partial.in_flight_prompts if self.partial is not None else set()
        if not retiring and not busy:
            return None
        return lambda index: (
            index not in busy
            and (not retiring or self.store.is_available(self.prompts[index]["prompt"], step))
        )

    def _continue_carried(self, step: int, params: SamplingParams, tally: StepTally) -> list[Group]:
        """Partial rollouts: continue the unfinished samples of earlier steps under this step's weights;
        the groups this finishes."""
        if self.partial is None or not self.partial.carried:
            return []
        carried = self.partial.carried
        predicted = [
            self.lengths.predict(
                self.prompts[c.group.prompt_index]["prompt"], self._bucket(c.group.prompt_index)
            )
            for c in carried
        ]
        requests = self.partial.requests(predicted)
        order = admission_order([r.predicted_length for r in requests], self.config.rollout.schedule)
        rows = [self._reward_rows[c.group.prompt_index] for c in carried]
        scored = self._generate(
            [requests[i] for i in order],
            params,
            rows,
            tally,
            prefixes=[c.completion.token_ids for c in carried],
            finished=lambda more: self.partial.finished(
                more, len(carried[more.request_id].completion.token_ids), carried[more.request_id].cap
            ),
        )
        groups = self.partial.advance(scored, self.version)
        for group in groups:
            for completion, _ in group.completions:
                self.lengths.observe(self._bucket(group.prompt_index), [len(completion.token_ids)])
        return groups

    def _generate(self, requests, params, rows, tally: StepTally, **partial) -> ScoredSamples:
        """One generate-and-score call of this step (its own keys in the reward pool), tallied."""
        scored = sample_and_score(
            self.engine, self.tokenizer, requests, params, rows, self.rewards, self._calls, **partial
        )
        self._calls += 1
        tally.add(scored)
        return scored

    def _partial_stats(self, batch: RolloutBatch) -> dict[str, float]:
        """async/partial_sequences: the batch's sequences that span more than one policy version."""
        if self.partial is None:
            return {}
        spanning = sum(int(v.min() != v.max()) for v in batch.versions if len(v))
        return {
            "async/partial_sequences": float(spanning),
            "rollout/in_flight": float(len(self.partial.carried)),
        }

    def _sample(self, step: int, specs: list[tuple[int, int, int]], params, tally: StepTally) -> list:
        """One completion per (prompt index, group slot, sample number) spec: [((Completion, text), reward,
        the reward's components)]."""
        seed = self.config.seed
        predicted = [self.lengths.predict(self.prompts[i]["prompt"], self._bucket(i)) for i, _, _ in specs]
        episodes = [
            self.episodes.start(self.prompts[index]) if self.episodes else None for index, _, _ in specs
        ]
        requests = [
            GenerationRequest(
                i,
                self.prompt_ids[index] if episode is None else episode.prompt_ids,
                derive_seed(seed, step, slot, s),
                predicted_length=predicted[i],
                episode=episode,
            )
            for i, ((index, slot, s), episode) in enumerate(zip(specs, episodes))
        ]
        order = admission_order(predicted, self.config.rollout.schedule)
        rows = [self._reward_rows[index] for index, _, _ in specs]
        finished = None
        if self.partial is not None:  # a first segment of at most `partial_tokens` tokens
            cap = params.max_new_tokens
            requests = [replace(r, max_new_tokens=self.partial.first_cap(cap)) for r in requests]
            finished = lambda c: self.partial.finished(c, 0, cap)  # noqa: E731
        scored = self._generate([requests[i] for i in order], params, rows, tally, finished=finished)
        out = []
        for (index, _, _), completion, text, reward, parts in zip(
            specs, scored.completions, scored.texts, scored.rewards, scored.components
        ):
            if finished is not None and not finished(completion):  # carried on to the next step
                out.append((InFlight(tag(completion, self.version)), None, None))
                continue
            self.lengths.observe(self._bucket(index), [len(completion.token_ids)])
            out.append(((completion, text), reward, parts))
        return out

    def first_prompts(self, count: int) -> list[list[int]]:
        """The first `count` RL prompts' tokens as the model is given them (an episode's: its environment's
        first messages, from episodes started and ended for the purpose)."""
        if self.episodes is None:
            return self.prompt_ids[:count]
        out = []
        for row in self.prompts[:count]:
            episode = self.episodes.start(row)
            episode.end()
            out.append(episode.prompt_ids)
        return out

    @property
    def curriculum(self):
        """The staged curriculum (None without `curriculum.stages`)."""
        return self.plan.curriculum

    def _outcomes(self, groups: list[Group]) -> list[tuple[int, int, int, float]]:
        """(prompt index, valid rewards, those counted correct, mean completion length) of each finished
        group with a valid reward (once: an in-flight group when its last sample finishes)."""
        correct, out = self.config.zve.correct_reward, []
        for group in groups:
            valid = group.valid_rewards()
            if valid:
                lengths = [len(c.token_ids) for c, _ in group.completions]
                out.append((group.prompt_index, len(valid), sum(r >= correct for r in valid),
                            sum(lengths) / len(lengths)))  # fmt: skip
        return out

    def _teacher_keys(self, prompt_index: list[int]) -> list[str | None] | None:
        """Each row's prompt's `rl.teacher.by` value, which picks its teacher (None: not several teachers)."""
        by = self.config.rl.teacher.by
        if by is None:
            return None
        values = (self.prompts[index].get(by) for index in prompt_index)
        return [None if value is None else str(value) for value in values]

    def _bucket(self, index: int) -> str | None:
        """The prompt's difficulty bucket for length prediction: its curriculum field, when it has one."""
        value = self.prompts[index].get(self.config.curriculum.field)
        return None if value is None else str(value)

    def _record_pass_rates(self, outcomes: list[tuple[int, int, int, float]], step: int) -> dict[str, float]:
        """ZVE stage 4: every finished group's outcome (`_outcomes`) updates its prompt's pass rate;
        retire / defer by the streak rules."""
        zve = self.config.zve
        visits = [(self.prompts[index]["prompt"], *rest) for index, *rest in outcomes]
        rules = zve.retirement
        if zve.enabled and rules.enabled:
            counts = self.store.record(visits, step, rules.retire_after, rules.defer_after, rules.defer_steps)
        else:
            counts = self.store.record(visits, step)
        self.retired_total += counts.retired
        return {
            "zve/retired": float(counts.retired),
            "zve/deferred": float(counts.deferred),
            "zve/retired_total": float(self.retired_total),
            "zve/deferred_now": float(self.store.counts()["deferred"]),
        }

    def _reward_stats(self, batch: RolloutBatch, generated: int) -> dict[str, float]:
        """reward/* and rollout/* of the batch, and how many of the `generated` rollouts carry a signal.
        A batch can be empty with partial rollouts (every group still in flight): its figures are NaN."""
        rows = len(batch)
        episodes = batch.rewards[batch.episode_rows()]  # step-wise episodes: their rewards once each
        valid = episodes[~torch.isnan(episodes)]
        tokens = sum(len(c) for c in batch.completion_ids)
        zero = group_zero_variance(batch.rewards, batch.group_index)
        signal_groups = int((~zero).sum())
        correct = self.config.zve.correct_reward
        nan = math.nan
        return {
            "reward/mean": float(valid.mean()) if valid.numel() else nan,
            "reward/accuracy": float((valid >= correct).float().mean()) if valid.numel() else nan,
            "reward/none_fraction": 1.0 - valid.numel() / len(episodes) if rows else nan,
            # of all rollouts generated this step, those in groups with a reward signal (before ZVE 2-3)
            "zve/signal_rollout_fraction": float((~zero)[batch.group_index].sum()) / generated
            if generated
            else nan,
            "zve/signal_groups": float(signal_groups),
            "zve/rollouts_per_signal_group": generated / signal_groups if signal_groups else math.inf,
            "rollout/tokens": float(tokens),
            "rollout/environment_tokens": float(tokens - batch.trained_tokens(list(range(rows)))),
            "rollout/mean_length": tokens / rows if rows else nan,
            "rollout/truncated_fraction": batch.finish_reason.count("length") / rows if rows else nan,
        }
