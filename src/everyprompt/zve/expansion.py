"""ZVE stage 1, adaptive group expansion (docs/zve.md): sample N0 per prompt, grow the zero-variance
groups up to N_max, optionally draw extra prompts until the step has enough informative groups.

Decisions where the method's paper is silent:
- After expansion, the update takes at most `prompts_per_step` groups, informative ones first; with
  dynamic sampling the remaining zero-variance groups are only used when the budget ran out first.
- Groups still zero-variance after every enabled stage are left out by the learner (stages 2 and 3
  run there), not here: this collector returns every chosen group.
- With partial rollouts a sample can come back unfinished (`InFlight`): its group is in flight. It is
  neither grown nor counted as informative or zero-variance, and is returned apart (`Collection.in_flight`)
  for the rollout side to finish in a later step, when it joins that step's batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class InFlight:
    """A sample that is not finished yet (partial rollouts): what it has generated so far."""

    partial: object  # rollout.Completion


@dataclass
class Group:
    """One prompt's completions in one step (its size grows under expansion)."""

    prompt_index: int
    slot: int  # creation order within the step (seeds and the batch's group order derive from it)
    completions: list = field(default_factory=list)  # rollout.Completion
    rewards: list[float | None] = field(default_factory=list)
    initial_size: int = 0
    # a composite reward's parts, one entry per sample (None where it has none; all None when not given)
    components: list[dict | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.components:
            self.components = [None] * len(self.completions)

    @property
    def size(self) -> int:
        return len(self.completions)

    @property
    def in_flight(self) -> bool:
        """Some of its samples are still being generated (partial rollouts)."""
        return any(isinstance(c, InFlight) for c in self.completions)

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
    all_groups: list[Group]  # every finished group sampled this step (the pass-rate store records them)
    generated: int  # rollouts sampled this step, used or not
    rounds: int  # expansion rounds run
    sampled_groups: int  # groups opened this step (dynamic sampling adds to the first draw)
    zv_sampled: float  # zero-variance rate of the first draw at N0 (what plain GRPO would see)
    zv_expanded: float  # zero-variance rate of all groups after expansion
    dropped_groups: int  # groups sampled but left out of the update
    in_flight: list[Group] = field(default_factory=list)  # groups with unfinished samples (partial rollouts)

    def metrics(self) -> dict[str, float]:
        """The step's zve/* figures of how its groups were obtained."""
        return {
            "zve/generated_rollouts": float(self.generated),
            "zve/expansion_rounds": float(self.rounds),
            "zve/sampled_groups": float(self.sampled_groups),
            "zve/dropped_groups": float(self.dropped_groups),
            "zve/zero_variance_rate": self.zv_sampled,
            "zve/zero_variance_rate_expanded": self.zv_expanded,
        }


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
) -> Collection:
    """ZVE stage 1: draw `group_size` (N0) completions per prompt, then grow zero-variance groups.

    `sample(specs)` generates and scores one completion per (prompt index, slot, sample number) spec and
    returns (completion, reward, the reward's components or None) in order; `take_prompts(n)` gives the next
    n prompt indices.
    Zero-variance groups get `expansion_step` more samples per round until they turn informative or
    reach `max_group_size`; with `dynamic_sampling`, extra prompts are drawn until `prompts_per_step`
    groups are informative. Nothing is sampled past `max_rollouts`. Without expansion
    (`max_group_size` None or <= N0) this is plain GRPO sampling.
    """
    if prompts_per_step == 0:  # every group of the step came from earlier ones (partial rollouts)
        return Collection([], [], 0, 0, 0, math.nan, math.nan, 0)
    max_group_size = max(max_group_size or group_size, group_size)
    step = expansion_step or group_size
    budget = max_rollouts if max_rollouts is not None else 2 * prompts_per_step * group_size
    budget = max(budget, prompts_per_step * group_size)  # the first draw is always taken whole
    groups: list[Group] = []
    generated, rounds = 0, 0

    def run(specs: list[tuple[int, int, int]]) -> None:
        nonlocal generated
        for (_, slot, _), (completion, reward, parts) in zip(specs, sample(specs)):
            groups[slot].completions.append(completion)
            groups[slot].rewards.append(reward)
            groups[slot].components.append(parts)
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
            growable = [g for g in groups if g.zero_variance and not g.in_flight and g.size < max_group_size]
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
        informative = sum(not g.zero_variance and not g.in_flight for g in groups)
        need = prompts_per_step - informative
        if not dynamic_sampling or need <= 0 or budget - generated < group_size:
            break
        open_groups(min(need, (budget - generated) // group_size))

    finished = [g for g in groups if not g.in_flight]
    ordered = [g for g in finished if not g.zero_variance] + [g for g in finished if g.zero_variance]
    chosen = ordered[:prompts_per_step]
    chosen.sort(key=lambda g: g.slot)
    first = [g for g in groups[:first_draw] if not g.in_flight]
    return Collection(
        groups=chosen,
        all_groups=finished,
        generated=generated,
        rounds=rounds,
        sampled_groups=len(groups),
        zv_sampled=sum(g.initially_zero_variance() for g in first) / len(first) if first else math.nan,
        zv_expanded=sum(g.zero_variance for g in finished) / len(finished) if finished else math.nan,
        dropped_groups=len(finished) - len(chosen),
        in_flight=[g for g in groups if g.in_flight],
    )
