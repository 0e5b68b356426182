"""A small OpenEnv environment of the tests' own, written with openenv-core's server interface and served
by its `create_app` (uvicorn runs `tests.envs.openenv_app:app`): the model is asked a row's question and
has two turns to answer it. Actions that ask for trouble, for the failure tests: a turn holding `RAISE`
makes the environment raise (the server answers an error), `SLOW` makes it sleep 30 s (past any test's
time limit); a reset with `question="RAISE"` raises; an episode reset with `mode="die"` ends the server's process at its first step (a server
killed mid-episode)."""

from __future__ import annotations

import os
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class AnswerAction(Action):
    message: str = Field(..., description="The model's turn")


class AnswerObservation(Observation):
    text: str = Field("", description="What the environment says")


class AnswerEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.answer = ""
        self.mode = ""

    def reset(self, seed=None, episode_id=None, answer: str = "0", question: str = "", mode: str = "", **_):
        self._state = State(episode_id=episode_id, step_count=0)
        if question == "RAISE":
            raise RuntimeError("this episode cannot start")
        self.answer, self.mode = str(answer), mode
        return AnswerObservation(text=f"Answer with one number. {question}".strip(), done=False, reward=None)

    def step(self, action: AnswerAction, timeout_s=None, **_) -> AnswerObservation:
        self._state.step_count += 1
        if self.mode == "die":
            os._exit(3)
        if "RAISE" in action.message:
            raise RuntimeError("the environment was asked to fail")
        if "SLOW" in action.message:
            time.sleep(30)
        right = self.answer in action.message
        done = right or self._state.step_count >= 2
        text = "Correct." if right else "Not quite; try once more."
        return AnswerObservation(text=text, done=done, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    AnswerEnvironment, AnswerAction, AnswerObservation, env_name="answer", max_concurrent_envs=64
)
