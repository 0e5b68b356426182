"""What every kind of episode shares: the chat template's rendering of a conversation, the check that a
tokenizer has one, and how the rewards of an episode's turns make its reward (`env.turn_rewards`)."""

from __future__ import annotations

from everyprompt.envs.base import EnvironmentSetupError, Message

# env.turn_rewards: how a turn's reward joins the episode's so far (None: no turn rewarded yet)
TURN_REWARDS = {
    "last": lambda episode, turn: turn,
    "sum": lambda episode, turn: (episode or 0.0) + turn,
    "turn": lambda episode, turn: (
        (episode or 0.0) + turn
    ),  # step-wise: each row its turn's; the episode's their sum
}


def require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise EnvironmentSetupError("multi-turn environments need a tokenizer with a chat template")


def render(tokenizer, messages: list[Message], options: dict) -> str:
    """`messages` as the chat template writes them, the next assistant turn opened."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
