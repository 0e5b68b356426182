"""`TokenEpisode` (envs/episode.py): an environment's messages rendered into the tokens the engine feeds,
by hand with the calculator and a ChatML template, through the native engine, and the refusals."""

from __future__ import annotations

import pytest

from everyprompt.envs import CalculatorEnv, EnvironmentSetupError, StepResult
from everyprompt.envs.episode import TokenEpisode
from everyprompt.models.tokenizer import build_chat_tokenizer

CORPUS = ["What is 6 x 7? <calc>6*7</calc> The answer is 42. tool assistant user system"] * 20
ROW = {"prompt": "What is 6 x 7?", "answer": "42"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(CORPUS, vocab_size=300)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_a_tool_call_is_answered_with_the_tokens_the_template_writes_after_the_turn(tokenizer):
    episode = TokenEpisode(CalculatorEnv(), tokenizer, ROW)
    assert tokenizer.decode(episode.prompt_ids).endswith(
        "<|im_start|>user\nWhat is 6 x 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    first_turn = _ids(tokenizer, "Let me see. <calc>6*7</calc>")  # the engine stopped at </calc>
    observation = episode.turn_ended(first_turn)
    assert (
        tokenizer.decode(observation) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    # the whole sequence, as fed, is the template's rendering of the conversation so far
    conversation = tokenizer.apply_chat_template(
        [*CalculatorEnv().init(ROW), {"role": "assistant", "content": "Let me see. <calc>6*7</calc>"},
         {"role": "tool", "content": "42"}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert tokenizer.decode(episode.prompt_ids + first_turn + observation) == conversation
    final = _ids(tokenizer, "The answer is 42.") + [tokenizer.eos_token_id]
    assert episode.turn_ended(first_turn + observation + final) is None
    assert episode.reward == 1.0 and episode.turns == 2
    assert episode.messages[-1] == {"role": "assistant", "content": "The answer is 42."}


def test_a_wrong_final_answer_gets_no_reward_and_a_bad_call_gets_the_error_back(tokenizer):
    episode = TokenEpisode(CalculatorEnv(), tokenizer, ROW)
    turn = _ids(tokenizer, "<calc>6*x</calc>")
    observation = episode.turn_ended(turn)
    assert "error: not allowed in an expression" in tokenizer.decode(observation)
    assert episode.turn_ended(turn + observation + _ids(tokenizer, "It is 41.")) is None
    assert episode.reward == 0.0


class _Rewriting:
    """An environment whose template-facing messages make a template rewrite history (see below)."""

    def init(self, row):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        return StepResult([{"role": "user", "content": "again"}])


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_difference(tokenizer):
    import copy

    stripping = copy.deepcopy(tokenizer)  # renders past assistant turns stripped of their text
    stripping.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}(hidden){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    episode = TokenEpisode(_Rewriting(), stripping, {})
    with pytest.raises(EnvironmentSetupError, match="renders the conversation differently"):
        episode.turn_ended(_ids(tokenizer, "hello"))


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(EnvironmentSetupError, match="chat template"):
        TokenEpisode(CalculatorEnv(), plain, ROW)


class _AnswersOnce:
    """Answers the first turn with a user message, then ends the episode with reward 0.5."""

    def init(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        if not hasattr(self, "answered"):
            self.answered = action
            return StepResult([{"role": "user", "content": "Are you sure?"}])
        return StepResult([], reward=0.5, done=True)


def test_the_engine_feeds_the_rendered_answer_and_masks_it(tokenizer):
    from everyprompt.config import ModelConfig
    from everyprompt.models import load_model_and_tokenizer
    from everyprompt.rollout import GenerationRequest, SamplingParams
    from everyprompt.rollout.native import NativeEngine

    config = ModelConfig(
        hidden_size=32, num_layers=2, num_experts=4, moe_intermediate_size=32, num_heads=2, num_kv_heads=1
    )
    model, _ = load_model_and_tokenizer(config, seed=0)
    model.resize_token_embeddings(len(tokenizer))
    engine = NativeEngine.from_model(model, tokenizer, 2)
    probe = TokenEpisode(_AnswersOnce(), tokenizer, ROW)
    (first,) = engine.generate([GenerationRequest(0, probe.prompt_ids)], SamplingParams(8, greedy=True))
    stop = tokenizer.decode(first.token_ids[1:2])  # ends the first turn at its second token
    episode = TokenEpisode(_AnswersOnce(), tokenizer, ROW)
    params = SamplingParams(40, greedy=True, stop=(stop,))
    (done,) = engine.generate([GenerationRequest(0, episode.prompt_ids, episode=episode)], params)
    mask = done.completion_mask
    assert mask is not None and episode.turns >= 1
    masked = [i for i, own in enumerate(mask.tolist()) if not own]
    assert masked == list(range(masked[0], masked[-1] + 1))  # one observation, in one piece
    assert done.finish_reason != "length" or masked[-1] < len(done.token_ids) - 1
    # prompt, the model's turn and the fed answer: the template's rendering of the conversation
    text = tokenizer.decode(episode.prompt_ids + done.token_ids[: masked[-1] + 1], skip_special_tokens=False)
    conversation = [
        {"role": "user", "content": ROW["prompt"]},
        episode.messages[1],
        {"role": "user", "content": "Are you sure?"},
    ]
    assert episode.messages[1]["role"] == "assistant"
    assert text == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert episode.reward == (0.5 if episode.turns == 2 else None)


class _Raises:
    def init(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        raise RuntimeError("the sandbox is gone")


class _Endless:
    def init(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return StepResult([{"role": "user", "content": "more"}], reward=0.25)


def test_an_environment_that_raises_ends_its_episode_with_the_error_recorded(tokenizer):
    episode = TokenEpisode(_Raises(), tokenizer, ROW)
    assert episode.turn_ended(_ids(tokenizer, "hello")) is None
    assert episode.error == "_Raises.step raised RuntimeError: the sandbox is gone"
    assert episode.error_reason == "RuntimeError"
    assert episode.reward is None and episode.turns == 1


def test_an_episode_ends_after_max_turns_whatever_the_environment_says(tokenizer):
    episode = TokenEpisode(_Endless(), tokenizer, ROW, max_turns=2)
    tokens = _ids(tokenizer, "a")
    observation = episode.turn_ended(tokens)
    assert observation
    assert episode.turn_ended(tokens + observation + _ids(tokenizer, "b")) is None
    assert episode.turns == 2 and episode.reward == 0.25 and episode.error is None


class _Graded:
    """Rewards each turn by its number (1, 2, 3): the episode's reward is the last or the sum."""

    def __init__(self):
        self.turns = 0

    def init(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turns += 1
        return StepResult([{"role": "user", "content": "again"}], reward=float(self.turns))


@pytest.mark.parametrize(("turn_rewards", "expected"), [("last", 3.0), ("sum", 6.0)])
def test_turn_rewards_make_the_episodes_reward_as_configured(tokenizer, turn_rewards, expected):
    episode = TokenEpisode(_Graded(), tokenizer, ROW, max_turns=3, turn_rewards=turn_rewards)
    tokens = _ids(tokenizer, "a")
    for _ in range(3):
        observation = episode.turn_ended(tokens)
        tokens = [*tokens, *(observation or []), *_ids(tokenizer, "b")]
    assert observation is None and episode.turns == 3 and episode.reward == expected


def test_a_turn_with_special_tokens_or_closed_by_the_model_gets_the_same_answer_text(tokenizer):
    """Seen in a run: a random model wrote `</think>` inside its turn, which the action text drops; the fed
    answer must not depend on the turn's text. A turn the model closed with EOS is not closed twice."""
    think = tokenizer.convert_tokens_to_ids("</think>")
    answer = "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    episode = TokenEpisode(CalculatorEnv(), tokenizer, ROW)
    assert (
        tokenizer.decode(
            episode.turn_ended(_ids(tokenizer, "<calc>6*7") + [think] + _ids(tokenizer, "</calc>"))
        )
        == answer
    )
    closed = TokenEpisode(CalculatorEnv(), tokenizer, ROW)
    fed = closed.turn_ended(_ids(tokenizer, "<calc>6*7</calc>") + [tokenizer.eos_token_id])
    assert tokenizer.decode(fed) == answer.removeprefix("<|im_end|>")


def test_a_template_that_cannot_be_fed_is_refused_as_contiguous_before_any_episode_runs(tokenizer):
    import copy

    from everyprompt.envs.episode import Episodes

    hiding = copy.deepcopy(tokenizer)
    hiding.chat_template = tokenizer.chat_template.replace(  # past model turns rendered unlike the live one
        "{{ message['content'] }}",
        "{% if message['role'] == 'assistant' %}A: {% endif %}{{ message['content'] }}",
    )
    with pytest.raises(EnvironmentSetupError, match="renders the conversation differently"):
        Episodes("calculator", {}, hiding, trajectory="contiguous")
    assert Episodes("calculator", {}, hiding).stepwise  # auto: such a template trains turn by turn


class _Closing(_Graded):
    """Counts its close() calls; raises on the second turn when asked to."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail, self.closed = fail, 0

    def step(self, action):
        if self.fail and self.turns:
            raise RuntimeError("gone")
        return super().step(action)

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("fail", [False, True])
def test_an_episode_closes_its_environment_once_when_it_ends(tokenizer, fail):
    env = _Closing(fail)
    episode = TokenEpisode(env, tokenizer, ROW, max_turns=2)
    tokens = _ids(tokenizer, "a")
    observation = episode.turn_ended(tokens)
    assert observation and env.closed == 0  # still running: not closed
    assert episode.turn_ended([*tokens, *observation, *_ids(tokenizer, "b")]) is None
    assert env.closed == 1 and (episode.error is not None) == fail
