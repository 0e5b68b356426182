"""An environment's episode as the rollout engine sees it (`rollout.base.Episode`): text in, tokens out.

The environment speaks messages (envs/base.py); the engine speaks tokens. `TokenEpisode` renders the
episode's first messages into the prompt with the tokenizer's chat template, and at the end of each model
turn decodes the turn, asks the environment, and renders its answer the same way: the tokens fed are
exactly the characters the chat template writes after the model's turn (closing the turn, the tool or user
message, the opening of the next assistant turn), so the sequence the model sees is the one the template
would render for the whole conversation. A template that rewrites earlier turns when a conversation grows
(some strip past reasoning) cannot be fed incrementally and is refused, naming the first difference.
"""

from __future__ import annotations

from everyprompt.envs.base import Environment, EnvironmentSetupError, Message, make_environment
from everyprompt.envs.stepwise import StepwiseEpisode
from everyprompt.envs.template import EpisodeState, render, require_chat_template
from everyprompt.rollout.base import offers

TURN = "<<everyprompt: the model's turn>>"  # stands for a model turn's text when the template is rendered
# model turns the template check renders: plain, and with a thinking block a reasoning template may drop
PROBE_TURNS = (TURN, f"<think>\n{TURN}\n</think>\n\n{TURN}")


class TokenEpisode(EpisodeState):
    """One episode of `env` on data row `row`, tokenised by `tokenizer` (which must have a chat template).

    `prompt_ids` is the request's prompt; pass the episode as `GenerationRequest.episode`. After the engine
    finishes the completion, `reward` is the episode's (the last non-None reward a step gave, or with
    `turn_rewards="sum"` their sum; None if none did), `turns` the number of model turns and `messages` the whole conversation; `error` what the
    environment raised, if it did (or that it took longer than `time_limit` seconds on a turn: the engine
    says so). After `max_turns` model turns the episode ends whatever the environment says.

    The tokens fed after a turn are the characters the template writes after an assistant message's
    content up to the next assistant opening. They are found by rendering the conversation with `TURN` in
    place of each model turn's text (the model's own tokens are never re-tokenised, and a turn that holds
    special tokens renders like any other); the rendering before `TURN` must be the last one (checked)."""

    def __init__(self, env: Environment, tokenizer, row: dict, *args, **kwargs):
        super().__init__(env, tokenizer, row, *args, **kwargs)
        self.template: list[Message] = list(self.messages)  # the conversation with TURN for model turns
        self.rendered = render(tokenizer, self.template, self.options)
        self.prompt_ids: list[int] = self._ids(self.rendered)
        self.consumed = 0  # completion tokens already part of earlier turns and observations
        self.turns = 0

    def turn_ended(self, token_ids: list[int]) -> list[int] | None:
        """`token_ids`: the completion so far; its tokens after `consumed` are the model's new turn."""
        turn = token_ids[self.consumed :]
        self.turns += 1
        action = self.tokenizer.decode(turn, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": action})
        try:
            result = self.env.step(action)
        except Exception as err:  # noqa: BLE001 (the environment's failure ends its episode, never the run)
            self.failed("step", err)
            return None
        if not self.answered(result, self.turns):
            return None
        self.template += [{"role": "assistant", "content": TURN}, *result.observations]
        rendered = render(self.tokenizer, self.template, self.options)
        after = continuation(self.rendered, rendered)
        if turn and turn[-1] == self.tokenizer.eos_token_id:  # the model closed its turn itself
            after = after.removeprefix(self.tokenizer.decode(turn[-1:], skip_special_tokens=False))
        observation = self._ids(after)
        self.rendered = rendered
        self.consumed = len(token_ids) + len(observation)
        return observation

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids


def continuation(before: str, rendered: str) -> str:
    """What `rendered` (a conversation ending in a model turn `TURN`, then other messages, then the next
    assistant opening) writes after the turn; EnvironmentSetupError unless `before + TURN` starts it."""
    start = before + TURN
    if not rendered.startswith(start):
        at = next((i for i, (a, b) in enumerate(zip(rendered, start)) if a != b), len(start))
        raise EnvironmentSetupError(
            "the chat template renders the conversation differently once it grows (at character "
            f"{at}: {start[at : at + 40]!r} became {rendered[at : at + 40]!r}); an episode's turns can "
            "only be fed to the model if each rendering extends the last"
        )
    return rendered[len(start) :]


def probe_environment(name: str, options: dict) -> Environment:
    """An environment `name` made with `options` and never started: an unknown name, an option it does
    not take or a server that does not answer is an EnvironmentSetupError here, before any episode."""
    try:
        return make_environment(name, **options)  # an unknown name lists the registered ones
    except TypeError as err:  # an option the environment does not take
        raise EnvironmentSetupError(f"env.options {options} for environment {name!r}: {err}") from None


class Episodes:
    """The configured environment's episodes (config `env`): one fresh environment and `TokenEpisode` per
    request (an environment keeps its episode's state), and the stop strings that end its model turns."""

    def __init__(
        self,
        name: str,
        options: dict,
        tokenizer,
        template_kwargs: dict | None = None,
        max_turns: int = 8,
        time_limit: float | None = None,
        turn_rewards: str = "last",
        trajectory: str = "auto",
        stepwise_schedule: str = "auto",
    ):
        self.name, self.options, self.max_turns = name, dict(options), max_turns
        self.stepwise_schedule = stepwise_schedule
        self.time_limit, self.turn_rewards = time_limit, turn_rewards
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        self.stop: tuple[str, ...] = tuple(getattr(probe_environment(name, self.options), "stop", ()))
        require_chat_template(self.tokenizer)
        rewrites = self._rewrites()
        if trajectory == "contiguous" and rewrites is not None:
            raise EnvironmentSetupError(
                f"env.trajectory=contiguous: {rewrites}; set env.trajectory=stepwise (or auto)"
            )
        self.stepwise = trajectory == "stepwise" or rewrites is not None

    def _rewrites(self) -> str | None:
        """How the template rewrites a conversation's earlier turns as it grows (None: each rendering
        extends the last, so an episode can be fed as one sequence; see TokenEpisode)."""
        first = [{"role": "user", "content": "?"}]
        tokenizer, options = self.tokenizer, self.template_kwargs
        for turn in PROBE_TURNS:
            grown = [*first, {"role": "assistant", "content": turn}, {"role": "user", "content": "!"}]
            try:
                continuation(
                    render(tokenizer, first, options) + turn.removesuffix(TURN),
                    render(tokenizer, grown, options),
                )
            except EnvironmentSetupError as err:
                return str(err)
        return None

    @classmethod
    def from_config(cls, config, tokenizer, engine) -> Episodes | None:
        """`config.env`'s episodes for `engine`'s completions, or None for single-turn runs;
        EnvironmentSetupError if the engine cannot run episodes (`rollout.engine=auto` may pick hf)."""
        if config.env.name is None:
            return None
        if not offers(engine, "episodes"):
            raise EnvironmentSetupError(
                f"env.name={config.env.name} needs a rollout engine that runs episodes (the native one); "
                f"this run's is {type(engine).__name__} (rollout.engine={config.rollout.engine})"
            )
        env = config.env
        episodes = cls(
            env.name,
            env.options,
            tokenizer,
            config.data.template_kwargs,
            env.max_turns,
            env.time_limit_s,
            env.turn_rewards,
            env.trajectory,
            env.stepwise_schedule,
        )
        if episodes.stepwise and env.stepwise_schedule == "continuous" and not offers(engine, "live"):
            raise EnvironmentSetupError(
                "env.stepwise_schedule=continuous needs a rollout engine that takes requests while a call runs "
                f"(the native one); this run's is {type(engine).__name__}: set env.stepwise_schedule=auto or rounds"
            )
        if env.turn_rewards == "turn" and not episodes.stepwise:
            raise EnvironmentSetupError(
                "env.turn_rewards=turn trains each turn on its own reward, which needs step-wise episodes: this "
                f"chat template extends each rendering, so env.trajectory={env.trajectory} feeds episodes as one "
                "sequence; set env.trajectory=stepwise"
            )
        if episodes.stepwise and config.zve.enabled:
            raise EnvironmentSetupError(
                "zve.enabled: zero-variance elimination is not built for step-wise episodes (env.trajectory "
                f"{env.trajectory} resolved to stepwise for this chat template); set zve.enabled=false"
            )
        return episodes

    def start(self, row: dict) -> TokenEpisode | StepwiseEpisode:
        """A new episode on data row `row`, fed as one sequence or step-wise (`stepwise`);
        EnvironmentSetupError if the environment cannot start from it."""
        env = make_environment(self.name, **self.options)
        args = (
            env,
            self.tokenizer,
            row,
            self.template_kwargs,
            self.max_turns,
            self.time_limit,
            self.turn_rewards,
        )
        if self.stepwise:
            return StepwiseEpisode(*args, schedule=self.stepwise_schedule)
        return TokenEpisode(*args)
