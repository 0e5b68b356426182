"""A run whose rollouts an outside program drives (config `external`): an environment of its own (a
`verifiers` environment, an agent harness) generates through the run's OpenAI-compatible endpoint, scores
what it got, and posts each group to `POST /v1/rollouts`; every RL step trains on the next
`rl.prompts_per_step` groups posted, and the endpoint then serves the updated weights (docs/serving.md).

`DrivenRolloutSide` stands where the rollout side does in the loop: it owns the native engine (behind the
server), the groups posted and the version of the weights served."""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Literal

import torch
from pydantic import BaseModel, Field

from everyprompt.batch import RolloutBatch
from everyprompt.data.formatting import prompt_format_of
from everyprompt.errors import RunError

POLL_S = 1.0  # how often a step waiting for groups looks whether the server still runs


class Sample(BaseModel):
    """One rollout of a group, as the driver saw it: `prompt_token_ids` and `token_ids` as the endpoint
    returned them (`return_token_ids`); a multi-turn rollout's `token_ids` hold every token after the
    prompt and `mask` says which are the model's (True) and which its environment's (False)."""

    prompt_token_ids: list[int] = Field(min_length=1)
    token_ids: list[int] = Field(min_length=1)
    logprobs: list[float]  # the model's log-prob of each token (any value at environment tokens)
    mask: list[bool] | None = None
    reward: float | None  # None: could not be scored (left out of the group's statistics)
    finish_reason: Literal["stop", "length", "eos"] = "stop"


class Group(BaseModel):
    samples: list[Sample] = Field(min_length=1)


class Rollouts(BaseModel):
    groups: list[Group] = Field(min_length=1)


class Intake:
    """The groups posted and not yet trained on; `check` refuses a group the learner could not train on."""

    def __init__(self, group_size: int, vocab_size: int, max_tokens: int):
        self.group_size, self.vocab_size, self.max_tokens = group_size, vocab_size, max_tokens
        self.groups: queue.Queue[Group] = queue.Queue()
        self.received = 0

    def check(self, group: Group, where: str) -> str | None:
        """What is wrong with `group` (the message of a 400), or None."""
        if len(group.samples) != self.group_size:
            return f"{where}: {len(group.samples)} samples; rl.group_size is {self.group_size}"
        for number, sample in enumerate(group.samples):
            at = f"{where}.samples[{number}]"
            if len(sample.logprobs) != len(sample.token_ids):
                return f"{at}: {len(sample.logprobs)} logprobs for {len(sample.token_ids)} token_ids"
            if sample.mask is not None and len(sample.mask) != len(sample.token_ids):
                return f"{at}: {len(sample.mask)} mask values for {len(sample.token_ids)} token_ids"
            if sample.mask is not None and not any(sample.mask):
                return f"{at}: no token of the model's own (mask is all false)"
            if len(sample.token_ids) > self.max_tokens:
                return f"{at}: {len(sample.token_ids)} token_ids; at most {self.max_tokens}"
            ids = [*sample.prompt_token_ids, *sample.token_ids]
            if any(not 0 <= t < self.vocab_size for t in ids):
                return f"{at}: token ids must be in [0, {self.vocab_size})"
            if sample.reward is not None and not math.isfinite(sample.reward):
                return f"{at}: reward must be a finite number or null"
        return None

    def add(self, rollouts: Rollouts) -> str | None:
        """Queue every group, or none of them (the message of the first problem)."""
        for number, group in enumerate(rollouts.groups):
            problem = self.check(group, f"groups[{number}]")
            if problem:
                return problem
        for group in rollouts.groups:
            self.groups.put(group)
            self.received += 1
        return None

    def take(self, count: int, wait_s: float, alive) -> list[Group]:
        """The next `count` groups, waiting up to `wait_s` seconds for them; RunError past that."""
        taken, deadline = [], time.monotonic() + wait_s
        while len(taken) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunError(
                    f"external.wait_s={wait_s:g} s passed with {len(taken)} of the step's {count} groups "
                    "posted to /v1/rollouts (is the driver running? docs/serving.md)"
                )
            if not alive():
                raise RunError("the run's server stopped while waiting for groups")
            try:
                taken.append(self.groups.get(timeout=min(left, POLL_S)))
            except queue.Empty:
                continue
        return taken


def assemble(groups: list[Group], tokenizer, version: int, max_new_tokens: int) -> RolloutBatch:
    """The learner's batch of posted groups (prompt index -1: no prompt of the run's data)."""
    samples = [s for g in groups for s in g.samples]
    masked = any(s.mask is not None for s in samples)
    return RolloutBatch(
        prompt_ids=[list(s.prompt_token_ids) for s in samples],
        completion_ids=[list(s.token_ids) for s in samples],
        rollout_logprobs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
        finish_reason=[s.finish_reason for s in samples],
        group_index=torch.tensor([n for n, g in enumerate(groups) for _ in g.samples], dtype=torch.long),
        prompt_index=[-1] * len(samples),
        completion_text=[tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples],
        rewards=torch.tensor([math.nan if s.reward is None else s.reward for s in samples]),
        max_new_tokens=max_new_tokens,
        completion_mask=[
            torch.tensor(s.mask if s.mask is not None else [True] * len(s.token_ids)) for s in samples
        ]
        if masked
        else None,
        versions=[torch.full((len(s.token_ids),), version, dtype=torch.int32) for s in samples],
    )


def batch_stats(batch: RolloutBatch, correct: float) -> dict[str, float]:
    valid = batch.rewards[~torch.isnan(batch.rewards)]
    rows = len(batch)
    tokens = sum(len(c) for c in batch.completion_ids)
    return {
        "reward/mean": float(valid.mean()) if valid.numel() else math.nan,
        "reward/accuracy": float((valid >= correct).float().mean()) if valid.numel() else math.nan,
        "reward/none_fraction": 1.0 - valid.numel() / rows,
        "rollout/tokens": float(tokens),
        "rollout/environment_tokens": float(tokens - batch.trained_tokens(list(range(rows)))),
        "rollout/mean_length": tokens / rows,
        "rollout/truncated_fraction": batch.finish_reason.count("length") / rows,
    }


class DrivenRolloutSide:
    """The rollout side of a run driven from outside: the server over the policy's native engine, the
    groups posted to it, and the weights it serves (`load_weights` after each update)."""

    episodes = None  # the driver runs any environment itself

    def __init__(self, config, model, tokenizer, prompts: list[dict]):
        import uvicorn

        from everyprompt.rollout import build_engine
        from everyprompt.rollout.native import NativeEngine
        from everyprompt.serve.app import create_app
        from everyprompt.serve.engine import ServingEngine
        from everyprompt.serve.protocol import Limits
        from everyprompt.serve.server import ServeError, api_key_for, listen

        self.config, self.model, self.tokenizer = config, model, tokenizer
        # the run's own prompts, never sampled here: the startup parity check and the run's log read them
        self.prompt_format = prompt_format_of(config, tokenizer)
        self.prompt_ids = [self.prompt_format.prompt_ids(p) for p in prompts]
        external, rollout = config.external, config.rollout
        engine = build_engine(rollout, model, tokenizer)
        if not isinstance(engine, NativeEngine):
            raise ServeError(
                f"external.enabled serves the policy from the native engine; this model runs on "
                f"{type(engine).__name__} (docs/models.md)"
            )
        limits = Limits(
            max_tokens=rollout.max_new_tokens,
            max_prompt_tokens=external.max_prompt_tokens,
            max_n=max(config.rl.group_size, 8),
        )
        self.serving = ServingEngine(engine, tokenizer, limits.max_prompt_tokens, limits.max_tokens)
        self.intake = Intake(config.rl.group_size, len(tokenizer), rollout.max_new_tokens)
        self.version, self._eval_engine = 0, None
        key = api_key_for(external.host, None)  # $EVERYPROMPT_API_KEY: never a config file's
        self.socket, self.url = listen(external.host, external.port, "external.port")
        app = create_app(self.serving, "policy", limits, key, intake=self.intake)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.socket]},
            name="everyprompt-driven-server",
            daemon=True,
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RunError("the run's server did not start")
            time.sleep(0.05)
        print(
            f"everyprompt: the policy is served on {self.url}; post scored groups to {self.url}/rollouts",
            flush=True,
        )

    @property
    def engine(self):
        """An engine for the run's evaluations, on the weights the learner has now (the served one
        belongs to the server's thread)."""
        from everyprompt.rollout import build_engine

        if self._eval_engine is None:
            self._eval_engine = build_engine(self.config.rollout, self.model, self.tokenizer)
            self._eval_version = self.version
        elif self._eval_version != self.version:
            from everyprompt.models.lora import merged_state_dict

            self._eval_engine.load_weights(merged_state_dict(self.model))
            self._eval_version = self.version
        return self._eval_engine

    def sleep(self) -> None:
        """Nothing: the server answers the driver while the learner trains."""

    def load_weights(self, state_dict, version: int) -> None:
        self.serving.reload(state_dict)
        self.version = version

    def next_batch(self, step: int) -> RolloutBatch:
        began = time.perf_counter()
        count = self.config.rl.prompts_per_step
        groups = self.intake.take(count, self.config.external.wait_s, self.thread.is_alive)
        waited = time.perf_counter() - began
        batch = assemble(groups, self.tokenizer, self.version, self.config.rollout.max_new_tokens)
        batch.stats = {
            **batch_stats(batch, self.config.zve.correct_reward),
            "external/queued": float(self.intake.groups.qsize()),
        }
        batch.timing = {"rollout_s": time.perf_counter() - began, "external_wait_s": waited}
        return batch

    def settings(self) -> dict:
        return {
            "rl.group_size": self.config.rl.group_size,
            "rl.prompts_per_step": self.config.rl.prompts_per_step,
        }

    def state_dict(self) -> dict:
        return {"received": self.intake.received}

    def load_state_dict(self, state: dict) -> None:
        pass  # the groups a driver posted before a restart went with the process; it posts new ones

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.serving.close()
        self.socket.close()
