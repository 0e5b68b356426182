"""Multi-stage zero-variance elimination (ALGORITHMS.md section 3): no rollout wasted.

A group whose valid rewards are all equal has zero advantage everywhere. ZVE removes such groups at
every stage of a step:

  stage 0  offline filter        (`estimate_pass_rates`, before RL or `everyprompt filter`)
  stage 1  adaptive expansion    (`collect_groups`: resample zero-variance groups up to N_max, and
                                  optionally draw extra prompts until the step has enough informative
                                  groups, under a rollout budget)
  stage 2  reward reshaping      (`reshape_zero_variance`: group-centred length / repetition terms)
  stage 3  RL-ZVP                (token advantages from entropies; applied in the trainer's forward)
  stage 4  online retirement     (`data.passrate.PassRateStore.record`)

Decisions where ALGORITHMS.md is silent:
- A reshaped group's advantages are its centred shaping terms, not std-normalised: the terms are a
  tie-breaker of size ~lambda, and dividing by the group std would make a one-token length difference
  weigh as much as a right-vs-wrong difference.
- After expansion, the update takes at most `prompts_per_step` groups, informative ones first; with
  dynamic sampling the remaining zero-variance groups are only used when the budget ran out first.
- A completion is "correct" when its reward reaches `zve.correct_reward` (1 for verifiable rewards);
  pass rates, retirement and RL-ZVP's sign all use that test.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from everyprompt.rewards.shaping import repetition_rate, reshape_rewards


@dataclass
class Group:
    """One prompt's completions in one step (its size grows under expansion)."""

    prompt_index: int
    slot: int  # creation order within the step (seeds and the batch's group order derive from it)
    completions: list = field(default_factory=list)  # rollout.Completion
    rewards: list[float | None] = field(default_factory=list)
    initial_size: int = 0

    @property
    def size(self) -> int:
        return len(self.completions)

    def valid_rewards(self) -> list[float]:
        return [r for r in self.rewards if r is not None and not math.isnan(r)]

    @property
    def zero_variance(self) -> bool:
        values = self.valid_rewards()
        return len(values) == 0 or max(values) == min(values)

    def initially_zero_variance(self) -> bool:
        values = [r for r in self.rewards[: self.initial_size] if r is not None and not math.isnan(r)]
        return len(values) == 0 or max(values) == min(values)


@dataclass
class Collection:
    """The groups an update uses and the accounting of how they were obtained."""

    groups: list[Group]  # the update's groups, in batch order
    all_groups: list[Group]  # every group sampled this step (the pass-rate store records them all)
    generated: int  # rollouts sampled this step, used or not
    rounds: int  # expansion rounds run
    sampled_groups: int  # groups opened this step (dynamic sampling adds to the first draw)
    zv_sampled: float  # zero-variance rate of the first draw at N0 (what plain GRPO would see)
    zv_expanded: float  # zero-variance rate of all groups after expansion
    dropped_groups: int  # groups sampled but left out of the update


Sampler = Callable[[list[tuple[int, int, int]]], list[tuple[object, float | None]]]


def collect_groups(
    take_prompts: Callable[[int], list[int]],
    sample: Sampler,
    prompts_per_step: int,
    group_size: int,
    max_group_size: int | None = None,
    expansion_step: int | None = None,
    dynamic_sampling: bool = False,
    max_rollouts: int | None = None,
    keep_zero_variance: bool = True,
) -> Collection:
    """ZVE stage 1: draw `group_size` (N0) completions per prompt, then grow zero-variance groups.

    `sample(specs)` generates and scores one completion per (prompt index, slot, sample number) spec and
    returns (completion, reward) pairs in order; `take_prompts(n)` gives the next n prompt indices.
    Zero-variance groups get `expansion_step` more samples per round until they turn informative or
    reach `max_group_size`; with `dynamic_sampling`, extra prompts are drawn until `prompts_per_step`
    groups are informative. Nothing is sampled past `max_rollouts`. Without expansion
    (`max_group_size` None or <= N0) this is plain GRPO sampling.
    """
    max_group_size = max(max_group_size or group_size, group_size)
    step = expansion_step or group_size
    budget = max_rollouts if max_rollouts is not None else 2 * prompts_per_step * group_size
    budget = max(budget, prompts_per_step * group_size)  # the first draw is always taken whole
    groups: list[Group] = []
    generated, rounds = 0, 0

    def run(specs: list[tuple[int, int, int]]) -> None:
        nonlocal generated
        for (_, slot, _), (completion, reward) in zip(specs, sample(specs)):
            groups[slot].completions.append(completion)
            groups[slot].rewards.append(reward)
        generated += len(specs)

    def open_groups(count: int) -> None:
        fresh = []
        for index in take_prompts(count):
            groups.append(Group(index, len(groups), initial_size=group_size))
            fresh.extend((index, len(groups) - 1, s) for s in range(group_size))
        run(fresh)

    open_groups(prompts_per_step)
    first_draw = len(groups)
    while True:
        # expansion rounds over every zero-variance group that can still grow
        while True:
            growable = [g for g in groups if g.zero_variance and g.size < max_group_size]
            room = budget - generated
            if not growable or room <= 0:
                break
            specs = []
            for g in growable:
                extra = min(step, max_group_size - g.size, room - len(specs))
                specs.extend((g.prompt_index, g.slot, g.size + s) for s in range(extra))
                if len(specs) >= room:
                    break
            run(specs)
            rounds += 1
        informative = sum(not g.zero_variance for g in groups)
        need = prompts_per_step - informative
        if not dynamic_sampling or need <= 0 or budget - generated < group_size:
            break
        open_groups(min(need, (budget - generated) // group_size))

    ordered = [g for g in groups if not g.zero_variance] + [g for g in groups if g.zero_variance]
    chosen = ordered[:prompts_per_step]
    if not keep_zero_variance:
        chosen = [g for g in chosen if not g.zero_variance]
    chosen.sort(key=lambda g: g.slot)
    return Collection(
        groups=chosen,
        all_groups=groups,
        generated=generated,
        rounds=rounds,
        sampled_groups=len(groups),
        zv_sampled=sum(g.initially_zero_variance() for g in groups[:first_draw]) / max(first_draw, 1),
        zv_expanded=sum(g.zero_variance for g in groups) / max(len(groups), 1),
        dropped_groups=len(groups) - len(chosen),
    )


def group_zero_variance(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[G] bool: groups whose valid rewards are all equal (or that have none)."""
    groups = int(group_index.max()) + 1
    valid = ~torch.isnan(rewards)
    values, index = rewards[valid].double(), group_index[valid]
    low = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amin")
    high = torch.full((groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amax")
    return high <= low


def reshape_zero_variance(
    rewards: torch.Tensor,  # [N], NaN where None
    completion_ids: Sequence[Sequence[int]],
    group_index: torch.Tensor,  # [N] long
    length_coef: float,
    repetition_coef: float,
    max_length: int,
    reward_gap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ZVE stage 2: (advantages [N] of the reshaped groups, 0 elsewhere; [G] bool groups now informative).

    Only zero-variance groups are reshaped; a reshaped group's advantage is its shaped reward minus the
    group mean (the shaping term itself, since the group's rewards were equal).
    """
    zero_variance = group_zero_variance(rewards, group_index)
    apply = zero_variance[group_index]
    lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float64)
    repetition = torch.tensor([repetition_rate(list(ids)) for ids in completion_ids], dtype=torch.float64)
    shaped = reshape_rewards(
        rewards.double(),
        lengths,
        repetition,
        group_index,
        apply,
        length_coef,
        repetition_coef,
        max_length,
        reward_gap,
    )
    advantages = torch.where(
        apply & ~torch.isnan(rewards), shaped - rewards.double(), torch.zeros_like(shaped)
    )
    # advantages equal the (centred) terms: informative where any member's term is non-zero
    groups = zero_variance.numel()
    moved = torch.zeros(groups, dtype=torch.bool).index_put_(
        (group_index,), advantages.abs() > 1e-12, accumulate=True
    )
    return advantages.to(rewards.dtype), zero_variance & moved


def zvp_signs(
    rewards: torch.Tensor, group_index: torch.Tensor, still_zero: torch.Tensor, correct_reward: float
) -> torch.Tensor:
    """[N] RL-ZVP sign per completion: +1 in an all-correct group, -1 in an all-wrong one, 0 elsewhere."""
    valid = ~torch.isnan(rewards)
    correct = torch.where(
        valid, (rewards >= correct_reward).double(), torch.zeros_like(rewards, dtype=torch.float64)
    )
    groups = still_zero.numel()
    any_correct = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, correct) > 0
    has_valid = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, valid.double()) > 0
    sign = torch.where(any_correct, 1, -1) * (still_zero & has_valid)
    return sign[group_index].to(torch.long)


def seeded_sample(indices: Sequence[int], count: int | None, seed: int) -> list[int]:
    """`count` of `indices` chosen by `seed` (all of them, in order, when count is None or too big)."""
    if count is None or count >= len(indices):
        return list(indices)
    return sorted(random.Random(seed).sample(list(indices), count))


@dataclass
class PassRateEstimate:
    attempts: list[int]  # per prompt: valid (scored) samples
    successes: list[int]  # per prompt: correct samples
    mean_length: list[float]  # per prompt: mean completion length (tokens)
    errors: int  # reward-function failures (scored None)

    def rate(self, index: int) -> float | None:
        return self.successes[index] / self.attempts[index] if self.attempts[index] else None


def estimate_pass_rates(
    engine,
    tokenizer,
    rows: list[dict],
    reward_fn,
    samples: int,
    params,
    seed: int,
    correct_reward: float = 1.0,
    chunk: int = 1024,
    progress: Callable[[int], None] | None = None,
) -> PassRateEstimate:
    """ZVE stage 0: `samples` completions per prompt from `engine`, scored; per-prompt pass counts.

    Completions are generated `chunk` requests at a time; `progress(n)` is called after each chunk with
    the number of prompts it finished.
    """
    from everyprompt.rewards import score_completions
    from everyprompt.rollout import GenerationRequest
    from everyprompt.trainer.rl import derive_seed, reward_columns

    attempts = [0] * len(rows)
    successes = [0] * len(rows)
    lengths = [0.0] * len(rows)
    errors = 0
    per_chunk = max(1, chunk // samples)
    for start in range(0, len(rows), per_chunk):
        block = list(range(start, min(start + per_chunk, len(rows))))
        prompt_ids = {i: tokenizer(rows[i]["prompt"]).input_ids for i in block}
        requests = [
            GenerationRequest(n, prompt_ids[i], derive_seed(seed, 0x51F7, i, s))
            for n, (i, s) in enumerate((i, s) for i in block for s in range(samples))
        ]
        completions = sorted(engine.generate(requests, params), key=lambda c: c.request_id)
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        owners = [i for i in block for _ in range(samples)]
        rewards, failed = score_completions(reward_fn, texts, reward_columns([rows[i] for i in owners]))
        errors += failed
        for owner, completion, reward in zip(owners, completions, rewards):
            lengths[owner] += len(completion.token_ids) / samples
            if reward is not None:
                attempts[owner] += 1
                successes[owner] += int(reward >= correct_reward)
        if progress is not None:
            progress(len(block))
    return PassRateEstimate(attempts, successes, lengths, errors)


@dataclass
class FilterResult:
    kept: list[int]  # indices of prompts with low < p < high
    too_easy: int  # p >= high
    too_hard: int  # p <= low
    unscored: int  # no valid reward at all (dropped)
    histogram: dict[str, int]  # pass-rate value ("0.375") -> prompts


def filter_by_pass_rate(estimate: PassRateEstimate, low: float = 0.0, high: float = 1.0) -> FilterResult:
    """Keep prompts whose estimated pass rate lies strictly inside (low, high)."""
    kept, too_easy, too_hard, unscored = [], 0, 0, 0
    histogram: dict[str, int] = {}
    for index in range(len(estimate.attempts)):
        p = estimate.rate(index)
        if p is None:
            unscored += 1
            continue
        histogram[f"{p:.3f}"] = histogram.get(f"{p:.3f}", 0) + 1
        if p >= high:
            too_easy += 1
        elif p <= low:
            too_hard += 1
        else:
            kept.append(index)
    return FilterResult(kept, too_easy, too_hard, unscored, dict(sorted(histogram.items())))


def run_offline_filter(model, tokenizer, rows: list[dict], config, store=None):
    """Stage 0 as `everyprompt filter` and the training pipeline run it: estimate, filter, record.

    Samples with the config's rollout settings and reward; records every scored prompt in `store`
    (when given) at step -1. Returns (PassRateEstimate, FilterResult).
    """
    from everyprompt.rewards import build_reward
    from everyprompt.rollout import NativeEngine, SamplingParams
    from everyprompt.trainer.metrics import progress_bar

    rules, rollout = config.zve.filter, config.rollout
    engine = NativeEngine.from_model(
        model, tokenizer, batch_size=rollout.batch_size, precision=rollout.precision
    )
    params = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p)
    with progress_bar(len(rows), "pass rates", enabled=config.logging.progress) as advance:
        estimate = estimate_pass_rates(
            engine,
            tokenizer,
            rows,
            build_reward(config.rewards),
            rules.samples,
            params,
            config.seed,
            config.zve.correct_reward,
            progress=advance,
        )
    if store is not None:
        store.record(
            [
                (row["prompt"], estimate.attempts[i], estimate.successes[i], estimate.mean_length[i])
                for i, row in enumerate(rows)
                if estimate.attempts[i]
            ],
            step=-1,
        )
    return estimate, filter_by_pass_rate(estimate, rules.low, rules.high)
