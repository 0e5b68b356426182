"""Partial rollouts (`rollout.partial`): a sequence that spans weight updates (docs/asynchrony.md).

Each step, a sequence generates at most `rollout.partial_tokens` tokens under that step's weights. One
that is not finished by then is carried to the next step and continues there, under the newer weights,
from where it stopped: its prompt and tokens so far are prefilled again under the new weights (the KV
cache is recomputed, not kept, so every new token is sampled from exactly the new policy), and every
token keeps the version that sampled it, and its routes. In its `rollout.max_versions_per_sequence`-th
step a sequence runs to its end. A group with unfinished samples is in flight: it is not in any batch,
not grown by ZVE and not recorded in the pass-rate store until its last sample finishes, and then joins
that step's batch. Every choice here depends on the step only, never on timing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from everyprompt.rollout import Completion, GenerationRequest, derive_seed
from everyprompt.zve import Group
from everyprompt.zve.expansion import InFlight


def extend(done: Completion, more: Completion, version: int) -> Completion:
    """`done` continued by `more`, which was generated from done's prompt and tokens under policy
    `version`. Tokens, log-probs, entropies and versions are concatenated; routes (and router logits) are
    done's for the positions that fed done's own tokens, then more's: each position keeps the routing of
    the forward that sampled the token after it."""
    fed = len(done.prompt_ids) + len(done.token_ids) - 1  # the positions done's forwards routed

    def joined(first, second):
        return None if first is None or second is None else torch.cat([first[:fed], second[fed:]])

    entropies = None
    if done.entropies is not None and more.entropies is not None:
        entropies = torch.cat([done.entropies, more.entropies])
    before = done.versions if done.versions is not None else torch.full((len(done.token_ids),), version)
    return Completion(
        request_id=done.request_id,
        prompt_ids=done.prompt_ids,
        token_ids=[*done.token_ids, *more.token_ids],
        logprobs=torch.cat([done.logprobs, more.logprobs]),
        finish_reason=more.finish_reason,
        timing=more.timing,
        routed_experts=joined(done.routed_experts, more.routed_experts),
        router_logits=joined(done.router_logits, more.router_logits),
        entropies=entropies,
        versions=torch.cat(
            [before.to(torch.int32), torch.full((len(more.token_ids),), version, dtype=torch.int32)]
        ),
    )


def tag(completion: Completion, version: int) -> Completion:
    """The completion with every token marked as sampled by `version`."""
    completion.versions = torch.full((len(completion.token_ids),), version, dtype=torch.int32)
    return completion


@dataclass
class Carried:
    """An unfinished sample: its group and place in it, and what it has generated so far."""

    group: Group
    position: int  # its index in group.completions
    completion: Completion  # the tokens so far, with their versions and routes
    seed: int  # the sample's own seed; each continuation samples from a seed derived from it
    segments: int  # steps it has generated in so far
    cap: int  # the completion length cap it started under
    origin: int  # the step it started in


class PartialRollouts:
    """The carried samples of in-flight groups, continued step by step."""

    def __init__(self, segment_tokens: int, max_versions: int):
        self.segment, self.max_versions = segment_tokens, max_versions
        self.carried: list[Carried] = []

    def first_cap(self, cap: int) -> int:
        """The most tokens a new sample generates in its first step."""
        return min(self.segment, cap)

    @staticmethod
    def finished(completion: Completion, generated: int, cap: int) -> bool:
        """Whether a sample that had `generated` tokens before this `completion` segment is done."""
        return completion.finish_reason != "length" or generated + len(completion.token_ids) >= cap

    @property
    def in_flight_prompts(self) -> set[int]:
        return {c.group.prompt_index for c in self.carried}

    def hold(self, groups: list[Group], step: int, run_seed: int, cap: int) -> None:
        """Carry the unfinished samples of `groups` (sampled at `step`: sample s of group slot g had seed
        derive_seed(run_seed, step, g, s))."""
        for group in groups:
            for position, entry in enumerate(group.completions):
                if isinstance(entry, InFlight):
                    seed = derive_seed(run_seed, step, group.slot, position)
                    self.carried.append(Carried(group, position, entry.partial, seed, 1, cap, step))

    def requests(self, predicted: list[float]) -> list[GenerationRequest]:
        """This step's continuation of every carried sample (request id = its index in `carried`)."""
        out = []
        for number, (item, guess) in enumerate(zip(self.carried, predicted)):
            so_far = len(item.completion.token_ids)
            remaining = item.cap - so_far
            last = item.segments + 1 >= self.max_versions
            out.append(
                GenerationRequest(
                    number,
                    item.completion.prompt_ids + item.completion.token_ids,
                    derive_seed(item.seed, item.segments),
                    max_new_tokens=remaining if last else min(self.segment, remaining),
                    predicted_length=max(guess - so_far, 1.0),
                )
            )
        return out

    def advance(self, scored, version: int) -> list[Group]:
        """Fold this step's continuations (`ScoredSamples` of `requests`) into the carried samples; the
        groups whose last sample finished, oldest first."""
        still, done = [], []
        for item, more, text, reward, parts in zip(
            self.carried, scored.completions, scored.texts, scored.rewards, scored.components
        ):
            merged = extend(item.completion, more, version)
            if self.finished(more, len(item.completion.token_ids), item.cap):
                item.group.completions[item.position] = (merged, text)
                item.group.rewards[item.position] = reward
                item.group.components[item.position] = parts
                if not item.group.in_flight:
                    done.append((item.origin, item.group.slot, item.group))
            else:
                item.completion, item.segments = merged, item.segments + 1
                still.append(item)
        self.carried = still
        return [group for _, _, group in sorted(done, key=lambda entry: entry[:2])]

    # ------------------------------------------------------------ state (a checkpoint's)
    def state_dict(self) -> dict:
        groups: dict[int, Group] = {}
        for item in self.carried:
            groups.setdefault(id(item.group), item.group)
        carried = {(id(item.group), item.position): item for item in self.carried}
        out = []
        for key, group in groups.items():
            members = []
            for position, entry in enumerate(group.completions):
                item = carried.get((key, position))
                if item is not None:
                    members.append(
                        {
                            "carried": _completion_state(item.completion),
                            "seed": item.seed,
                            "segments": item.segments,
                            "cap": item.cap,
                            "origin": item.origin,
                        }
                    )
                else:
                    completion, text = entry
                    members.append({"done": _completion_state(completion), "text": text})
            out.append(
                {
                    "prompt_index": group.prompt_index,
                    "slot": group.slot,
                    "initial_size": group.initial_size,
                    "rewards": list(group.rewards),
                    "components": list(group.components),
                    "members": members,
                }
            )
        return {"groups": out}

    def load_state_dict(self, state: dict) -> None:
        self.carried = []
        for saved in state["groups"]:
            group = Group(saved["prompt_index"], saved["slot"], initial_size=saved["initial_size"])
            group.rewards = list(saved["rewards"])
            group.components = list(saved.get("components") or [None] * len(group.rewards))  # (older saves)
            for position, member in enumerate(saved["members"]):
                if "done" in member:
                    group.completions.append((Completion(**member["done"]), member["text"]))
                    continue
                completion = Completion(**member["carried"])
                group.completions.append(InFlight(completion))
                self.carried.append(
                    Carried(
                        group,
                        position,
                        completion,
                        member["seed"],
                        member["segments"],
                        member["cap"],
                        member["origin"],
                    )
                )


def _completion_state(completion: Completion) -> dict:
    return {item.name: getattr(completion, item.name) for item in fields(completion)}
