"""The calculator environment (envs/calculator.py) and the environment registry: expressions by hand,
everything that is not arithmetic refused with a message for the model, an episode's turns and reward."""

from __future__ import annotations

import pytest

from everyprompt.envs import (
    CalculatorEnv,
    EnvironmentSetupError,
    evaluate_expression,
    make_environment,
    register_environment,
    registered_environments,
)
from everyprompt.envs.calculator import CalculatorError, format_value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("37*48", 1776),
        ("(2+3)**2", 25),
        ("7/2", 3.5),
        ("-3+1", -2),
        (" 17 // 5 % 3 ", 0),
        ("2.5*4", 10.0),
        ("6 × 7", 42),
        ("8 ÷ 2", 4.0),
        ("3 − 1", 2),  # the signs SmolLM2 writes in its calls
    ],
)
def test_arithmetic_by_hand(text, value):
    assert evaluate_expression(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("abc", "not allowed"),
        ("2**100", "exponent above 64"),
        ("1/0", "division by zero"),
        ("10**18*10**18", "result too large"),
        ("9" * 201, "longer than 200"),
        ("", "empty"),
        ("3 +", "not an arithmetic expression"),
        ("'a'*3", "not allowed"),
        ("1e18**20", "result too large"),
        ("(-8)**0.5", "not a real number"),
    ],
)
def test_anything_but_arithmetic_is_refused(text, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate_expression(text)


def test_values_read_back_as_a_person_would_write_them():
    assert format_value(4.0) == "4" and format_value(1776) == "1776"
    assert format_value(1 / 3) == "0.3333333333"


def test_an_episode_answers_calls_and_judges_the_final_turn():
    env = make_environment("calculator", max_calls=2)
    messages = env.init({"prompt": "What is 37 times 48?", "answer": "1776"})
    assert [m["role"] for m in messages] == ["system", "user"] and "<calc>" in messages[0]["content"]
    first = env.step("Let me compute. <calc>37*48</calc>")
    assert first.observations == [{"role": "tool", "content": "1776"}] and not first.done
    assert first.reward is None
    error = env.step("<calc>37 * x</calc>")
    assert error.observations[0]["content"].startswith("error: not allowed") and not error.done
    final = env.step("The answer is 1776.")
    assert final.done and final.reward == 1.0 and final.metadata == {"calls": 2}
    wrong = CalculatorEnv()
    wrong.init({"prompt": "What is 2 + 2?", "answer": "4"})
    assert wrong.step("It is 5.").reward == 0.0


def test_calls_beyond_the_limit_are_judged_as_the_answer():
    env = CalculatorEnv(max_calls=1)
    env.init({"prompt": "What is 6 times 7?", "answer": "42"})
    assert not env.step("<calc>6*7</calc>").done
    last = env.step("<calc>6*7</calc> so 42")
    assert last.done and last.reward == 1.0


def test_a_row_without_prompt_or_answer_is_a_clear_error():
    with pytest.raises(EnvironmentSetupError, match=r"needs 'prompt' and 'answer'.*\['question'\]"):
        CalculatorEnv().init({"question": "2+2"})


def test_the_registry_names_what_it_knows():
    assert "calculator" in registered_environments()
    with pytest.raises(EnvironmentSetupError, match=r"unknown environment 'nope' \(registered: .*calculator"):
        make_environment("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_environment("calculator")(CalculatorEnv)


def test_the_example_is_one_worked_exchange_before_the_question():
    env = CalculatorEnv(example=True)
    messages = env.init({"prompt": "What is 6 × 7?", "answer": "42"})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    shown = CalculatorEnv().step(messages[2]["content"])  # the example's call computes the example's value
    assert shown.observations == [{"role": "tool", "content": messages[3]["content"]}]
    assert len(CalculatorEnv().init({"prompt": "q", "answer": "1"})) == 2
