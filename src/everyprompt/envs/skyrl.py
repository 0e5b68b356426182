"""skyrl-gym's environments in process: `env.name=skyrl:ID` runs any environment skyrl-gym registers
(`gsm8k`, `gsm8k_multi_turn`, `aime`, ...) through everyprompt's text contract (envs/base.py), which was
written after skyrl-gym's, so the adapter only translates names.

Per episode the adapter makes a fresh `skyrl_gym.make(ID, env_config=..., extras=...)`, with the data
row's `reward_spec` (or `{"method": "rule", "ground_truth": answer}` from an everyprompt row) and
`extra_info`, and `max_turns` from the options or the row; `env.init(messages)` gives the prompt and each
`env.step(action)` answers a model turn. The optional extra `everyprompt[envs]` installs skyrl-gym.
"""

from __future__ import annotations

from everyprompt.envs.base import (
    EnvironmentSetupError,
    Message,
    StepResult,
    register_environment_family,
)

INSTALL = "pip install 'everyprompt[envs]'"


def _skyrl_gym():
    try:
        import skyrl_gym
    except ImportError:
        raise EnvironmentSetupError(f"env.name=skyrl:... needs skyrl-gym: {INSTALL}") from None
    return skyrl_gym


@register_environment_family("skyrl")
class SkyrlEnvironment:
    """One episode of skyrl-gym environment `ident`. Options (`env.options`): `env_config` (the
    environment's configuration, a mapping), `max_turns` (passed to the environment in its extras; the
    row's own `max_turns` otherwise), `extras` (more extras for every episode), `stop` (strings that end
    a model turn, e.g. a tool call's closing tag; a turn otherwise ends at the end-of-sequence token)."""

    def __init__(
        self,
        ident: str,
        env_config: dict | None = None,
        max_turns: int | None = None,
        extras: dict | None = None,
        stop: list[str] | tuple[str, ...] = (),
    ):
        gym = _skyrl_gym()
        if ident not in gym.registry:
            raise EnvironmentSetupError(
                f"skyrl-gym has no environment {ident!r} (registered: {', '.join(sorted(gym.registry))})"
            )
        self.ident, self.env_config = ident, dict(env_config or {})
        self.max_turns, self.extras, self.stop = max_turns, dict(extras or {}), tuple(stop)
        self.env = None

    def init(self, row: dict) -> list[Message]:
        from omegaconf import OmegaConf  # a dependency of skyrl-gym; its environments read attributes

        messages = row.get("messages") or row.get("prompt")
        if not isinstance(messages, list):  # a question as text (everyprompt's rows), else a conversation
            messages = [{"role": "user", "content": str(messages)}]
        extras = {
            "reward_spec": self._reward_spec(row),
            "extra_info": row.get("extra_info") or {},
            **self.extras,
        }
        max_turns = self.max_turns or row.get("max_turns")
        if max_turns:
            extras["max_turns"] = int(max_turns)
        try:
            self.env = _skyrl_gym().make(
                self.ident, env_config=OmegaConf.create(self.env_config), extras=extras
            )
            prompt, _info = self.env.init([dict(m) for m in messages])
        except (AssertionError, KeyError, TypeError, ValueError) as err:
            raise EnvironmentSetupError(
                f"skyrl-gym environment {self.ident!r} cannot start from a row with fields {sorted(row)}: "
                f"{type(err).__name__}: {err}"
            ) from None
        return [dict(m) for m in prompt]

    def _reward_spec(self, row: dict) -> dict:
        if row.get("reward_spec") is not None:
            return dict(row["reward_spec"])
        if row.get("answer") is not None:
            return {"method": "rule", "ground_truth": str(row["answer"])}
        raise EnvironmentSetupError(
            f"skyrl-gym environment {self.ident!r} needs a `reward_spec` or an `answer` in each data row; "
            f"a row has {sorted(row)}"
        )

    def step(self, action: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("step() before init()")
        out = self.env.step(action)
        reward = out.get("reward")
        return StepResult(
            observations=[dict(m) for m in out.get("observations") or []],
            reward=None if reward is None else float(reward),
            done=bool(out.get("done")),
            metadata=dict(out.get("metadata") or {}),
        )

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
