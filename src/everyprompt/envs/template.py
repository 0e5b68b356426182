"""What every kind of episode shares: the chat template's rendering of a conversation, the check that a
tokenizer has one, how the rewards of an episode's turns make its reward (`env.turn_rewards`), and the
episode's own state (`EpisodeState`: the conversation, the reward, the error, the environment's close)."""

from __future__ import annotations

from everyprompt.envs.base import Environment, EnvironmentSetupError, Message, StepResult
from everyprompt.rollout.base import end_episode


def _summed(episode: float | None, turn: float) -> float:
    return (episode or 0.0) + turn


# env.turn_rewards: how a turn's reward joins the episode's so far (None: no turn rewarded yet); `turn`
# (step-wise: each row its own turn's reward) keeps the episode's as their sum
TURN_REWARDS = {"last": lambda episode, turn: turn, "sum": _summed, "turn": _summed}


def require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise EnvironmentSetupError("multi-turn environments need a tokenizer with a chat template")


def render(tokenizer, messages: list[Message], options: dict) -> str:
    """`messages` as the chat template writes them, the next assistant turn opened."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)


class EpisodeState:
    """What an episode of `env` on data row `row` keeps, however its turns reach the engine: the
    conversation (`messages`, from `env.init(row)`), the episode's `reward` (the turns' by `turn_rewards`;
    None while none was given), `error` (what the environment raised, if it did), the last step's
    `metadata`, and its limits (`max_turns`, `time_limit` seconds for one answer)."""

    def __init__(
        self,
        env: Environment,
        tokenizer,
        row: dict,
        template_kwargs: dict | None = None,
        max_turns: int = 8,
        time_limit: float | None = None,
        turn_rewards: str = "last",
    ):
        require_chat_template(tokenizer)
        self.env, self.tokenizer, self.options = env, tokenizer, dict(template_kwargs or {})
        self.max_turns, self.time_limit, self.combine = max_turns, time_limit, TURN_REWARDS[turn_rewards]
        self.per_turn = turn_rewards == "turn"  # step-wise: each turn's row trained on its own turn's reward
        self.messages: list[Message] = list(env.init(row))
        self.reward: float | None = None
        self.error: str | None = None
        self.error_reason: str | None = None
        self.metadata: dict = {}

    def answered(self, result: StepResult, turns: int) -> bool:
        """Take the environment's answer to turn number `turns`; True when the episode goes on (its
        observations then joined the conversation), False when it ended (done, nothing to say, or its
        last turn)."""
        if result.reward is not None:
            self.reward = self.combine(self.reward, result.reward)
        self.metadata = result.metadata
        if result.done or not result.observations or turns >= self.max_turns:
            self.end()
            return False
        self.messages.extend(result.observations)
        return True

    def failed(self, what: str, err: BaseException) -> None:
        """The environment's `what` (step) raised: the episode ends with the error, never the run."""
        end_episode(
            self, type(err).__name__, f"{type(self.env).__name__}.{what} raised {type(err).__name__}: {err}"
        )
        self.end()

    def end(self) -> None:
        """The episode is over: the environment's `close()`, where it has one, frees what it holds."""
        close = getattr(self.env, "close", None)
        if close is not None:
            try:
                close()
            except Exception as err:  # noqa: BLE001 (closing must not lose the episode)
                if self.error is None:
                    end_episode(
                        self,
                        type(err).__name__,
                        f"{type(self.env).__name__}.close raised {type(err).__name__}: {err}",
                    )
