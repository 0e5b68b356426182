"""The rollout batch: everything one RL step knows about its completions, in one typed structure.

It is what crosses from the rollout side to the learner side (the only thing besides the weights), so it
lives here, on neutral ground below both: the rollout side fills the fields up to `timing`; the learner
adds advantages, old-policy log-probs and routes; the Ray backend ships it between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # N prompts' token ids (BOS included)
    completion_ids: list[list[int]]  # N sampled completions (EOS included when finished by EOS)
    rollout_logprobs: list[torch.Tensor]  # N tensors [len(completion)]: the engine's log-probs
    finish_reason: list[str]  # N x "eos" | "stop" | "length"
    group_index: torch.Tensor  # [N] long: the prompt group of each completion (0..P-1)
    prompt_index: list[int]  # N: index of the prompt in the data
    completion_text: list[str] = field(default_factory=list)  # N decoded completions (no special tokens)
    rewards: torch.Tensor | None = None  # [N] float, NaN where the reward is None
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    advantages: torch.Tensor | None = None  # [N] float
    rollout_entropies: list[torch.Tensor] | None = None  # N x [len(completion)]: engine's token entropies
    # N x [len(completion)]: the trainer's pre-update log-probs and their token entropies (None for the rows
    # whose old values come from the first mini-batch's own forward)
    old_logprobs: list[torch.Tensor | None] | None = None
    old_entropies: list[torch.Tensor | None] | None = None
    zvp_sign: torch.Tensor | None = None  # [N] long: RL-ZVP +1 all-correct / -1 all-wrong group, 0 else
    stats: dict[str, float] = field(default_factory=dict)  # how the batch was collected (ZVE accounting)
    routed_experts: list[torch.Tensor] | None = None  # N x [prompt + completion - 1, L_moe, k] int16 (replay)
    old_routes: list[torch.Tensor] | None = None  # the same, as the trainer's old-policy pass routed them
    timing: dict[str, float] = field(default_factory=dict)
    versions: list[torch.Tensor] | None = None  # N x [len(completion)] int32: policy version per token
    max_new_tokens: int = 0  # the completion cap the batch was sampled with (the curriculum stage's)
    # N x [len(completion)] bool, True on the model's own tokens: a multi-turn episode's completion holds
    # environment tokens too (observations, tool output), which are never trained (docs/environments.md).
    # None: every completion token is the model's.
    completion_mask: list[torch.Tensor] | None = None
    # N: the value of each row's prompt's `rl.teacher.by` column, which picks its distillation teacher (None:
    # one teacher or none)
    teacher_keys: list[str | None] | None = None
    # [N] long: the episode of each row when a step-wise episode trains one row per turn (envs/stepwise.py);
    # its rows share the episode's reward, and advantages are computed once per episode. None: a row each
    episode_index: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def trained_tokens(self, rows: list[int]) -> int:
        """The model's own completion tokens of `rows` (what the loss averages over)."""
        if self.completion_mask is None:
            return sum(len(self.completion_ids[r]) for r in rows)
        return int(sum(int(self.completion_mask[r].sum()) for r in rows))

    def token_counts(self, rows: list[int]) -> list[int]:
        """Each of `rows`' tokens, prompt and completion (what a forward pass of it holds)."""
        return [len(self.prompt_ids[r]) + len(self.completion_ids[r]) for r in rows]

    def episode_rows(self) -> list[int]:
        """One row per episode, its first: every row unless step-wise episodes span several (an episode's
        rows are consecutive, its number one above the last's)."""
        if self.episode_index is None:
            return list(range(len(self)))
        episodes = self.episode_index.tolist()
        return [r for r, e in enumerate(episodes) if r == 0 or e != episodes[r - 1]]

    @property
    def num_groups(self) -> int:
        return int(self.group_index.max()) + 1 if len(self) else 0

    def padded(
        self, rows: list[int] | torch.Tensor, pad_id: int, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Right-padded training tensors for `rows`, on `device`.

        input_ids [n, L]: prompt + completion; lengths [n] and prompt_lengths [n] (host): its real tokens
        and its prompt tokens per row; the rest are
        [n, L - 1], aligned with the *targets*
        input_ids[:, 1:]: mask (1 on the model's completion tokens, 0 on environment tokens and elsewhere),
        rollout_logp (engine log-probs, 0 elsewhere), old_logp / old_entropy (trainer's pre-update
        log-probs and entropies, when computed). routes and
        old_routes: lists of each row's [fed tokens, L_moe, k].

        Token ids are laid out on the host and moved in one copy each; per-token values (which may live
        on the device already, as the trainer's old log-probs do) are concatenated and scattered into
        place on `device`, one operation per field whatever the row count.
        """
        device = torch.device(device)
        rows = [int(r) for r in rows]
        lengths = [len(self.prompt_ids[r]) + len(self.completion_ids[r]) for r in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for out, r in enumerate(rows):
            input_ids[out, : lengths[out]] = torch.tensor(self.prompt_ids[r] + self.completion_ids[r])
        # the target positions of every completion token: (row, column) on the host, then on the device
        row_index, column_index = [], []
        for out, r in enumerate(rows):
            start = len(self.prompt_ids[r]) - 1  # target index of the first completion token
            row_index += [out] * len(self.completion_ids[r])
            column_index += range(start, start + len(self.completion_ids[r]))
        where = torch.tensor([row_index, column_index], dtype=torch.long).to(device, non_blocking=True)
        shape = (len(rows), width - 1)

        def scatter(values: list | None) -> torch.Tensor | None:
            """Per-row completion values into a [n, L - 1] tensor (rows whose entry is None stay 0)."""
            if values is None:
                return None
            out = torch.zeros(shape, device=device)
            present = [values[r] is not None for r in rows]
            if all(present):
                out[where[0], where[1]] = upload([values[r] for r in rows], device).to(out.dtype)
            elif any(present):
                for position, r in enumerate(rows):
                    if values[r] is not None:
                        start = len(self.prompt_ids[r]) - 1
                        out[position, start : start + len(values[r])] = values[r].to(device)
            return out

        mask = torch.zeros(shape, device=device)
        if self.completion_mask is None:
            mask[where[0], where[1]] = 1.0
        else:  # an episode's environment tokens are inputs, never targets of the loss
            trained = upload([self.completion_mask[r] for r in rows], device).to(torch.float32)
            mask[where[0], where[1]] = trained
        tensors = {
            "input_ids": input_ids.to(device, non_blocking=True),
            "lengths": torch.tensor(lengths),  # on the host: it steers packing, not arithmetic
            # on the host too: the first target the loss reads is row i's prompt_lengths[i] - 1
            "prompt_lengths": torch.tensor([len(self.prompt_ids[r]) for r in rows]),
            "mask": mask,
            "rollout_logp": scatter(self.rollout_logprobs),
        }
        for key, routes in (("routes", self.routed_experts), ("old_routes", self.old_routes)):
            if routes is not None:  # N x [length - 1, L_moe, k] (None: a row not yet computed)
                tensors[key] = [None if routes[r] is None else routes[r].to(device) for r in rows]
        if self.old_logprobs is not None:
            tensors["old_logp"] = scatter(self.old_logprobs)
        if self.old_entropies is not None:
            tensors["old_entropy"] = scatter(self.old_entropies)
        return tensors

    def completion_values(self, rows: list[int], padded_values: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of `padded` for one target-aligned [n, L - 1] tensor: per-row completion slices."""
        out = []
        for index, r in enumerate(rows):
            start = len(self.prompt_ids[r]) - 1
            out.append(padded_values[index, start : start + len(self.completion_ids[r])].detach().clone())
        return out

    def select(self, rows: list[int]) -> RolloutBatch:
        """The batch of `rows` only (in that order), groups renumbered 0.. keeping their order."""
        index = torch.tensor(rows, dtype=torch.long)
        kept_groups = self.group_index[index]
        _, group_index = torch.unique(kept_groups, return_inverse=True)
        per_row = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "group_index":
                per_row[item.name] = group_index.reshape(-1)
            elif item.name == "episode_index" and value is not None:
                per_row[item.name] = torch.unique(value[index], return_inverse=True)[1].reshape(-1)
            elif item.name == "reward_components":
                per_row[item.name] = {name: values[index] for name, values in value.items()}
            elif isinstance(value, torch.Tensor):
                per_row[item.name] = value[index]
            elif isinstance(value, list) and value:  # per-row lists (an empty one stays empty)
                per_row[item.name] = [value[r] for r in rows]
        return replace(self, **per_row)


def upload(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`parts` concatenated on `device`: those on the host in one copy that does not wait for the device
    (torch waits for the stream after a blocking upload: copied row by row, a learner update's 64 rows of
    engine log-probs made most of the 74 stream syncs an H200 counted), those already there as they
    are. (A copy to the host waits: its values are read right after.)"""
    upward = device.type != "cpu"
    if all(part.device.type == "cpu" for part in parts):
        return torch.cat(parts).to(device, non_blocking=upward)
    return torch.cat([part.to(device, non_blocking=upward) for part in parts])
