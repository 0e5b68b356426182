"""A run whose rollouts an outside program drives (config `external`): an environment of its own (a
`verifiers` environment, an agent harness) generates through the run's OpenAI-compatible endpoint, scores
what it got, and posts each group to `POST /v1/rollouts`; every RL step trains on the next
`rl.prompts_per_step` groups posted, and the endpoint then serves the updated weights (docs/serving.md).

`DrivenRolloutSide` stands where the rollout side does in the loop: it owns the native engine (behind the
server), the groups posted and the version of the weights served."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import torch

from everyprompt.batch import RolloutBatch
from everyprompt.data.formatting import prompt_format_of
from everyprompt.errors import RunError
from everyprompt.run.layout import RunLayout
from everyprompt.serve.intake import Group, Intake
from everyprompt.trainer.interface import RolloutSide


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


class DrivenRolloutSide(RolloutSide):
    """The rollout side of a run driven from outside: the server over the policy's native engine, the
    groups posted to it, and the weights it serves (`load_weights` after each update)."""

    episodes = None  # the driver runs any environment itself

    def __init__(self, config, model, tokenizer, prompts: list[dict], run_dir: Path):
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
        journal = RunLayout(run_dir).rollouts_journal  # read back first: a resumed run's groups come first
        self.intake = Intake(config.rl.group_size, len(tokenizer), rollout.max_new_tokens, journal)
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

    def first_prompts(self, count: int) -> list[list[int]]:
        """The first `count` prompts' tokens as the model is given them (the startup parity check's)."""
        return self.prompt_ids[:count]

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
            "external/queued": float(self.intake.queued),
        }
        batch.timing = {"rollout_s": time.perf_counter() - began, "external_wait_s": waited}
        return batch

    def settings(self) -> dict:
        return {
            "rl.group_size": self.config.rl.group_size,
            "rl.prompts_per_step": self.config.rl.prompts_per_step,
        }

    def state_dict(self) -> dict:
        return {"received": self.intake.received, "taken": self.intake.taken}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the groups the checkpoint's steps took: the journal's later ones are queued."""
        self.intake.resume(state.get("taken", 0))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.serving.close()
        self.socket.close()
        self.intake.close()
