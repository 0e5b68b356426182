import pytest

from everyprompt.rewards import RewardError, extract_answer, get_reward, math_reward, score_completions
from everyprompt.rewards.base import register_reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7+8+0=15;3+4+1=8|85", "85"),
        ("so \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),
        ("nested \\boxed{x^{2}}", "x^{2}"),
        ("work 12 then\n#### 1,234", "1,234"),
        ("The answer is 42.", "42"),
        ("The answer is $3/4$", "3/4"),
        ("Q: 1+1\nA: 2", "2"),
        ("totals 1,234 and -5", "-5"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_math_reward_verifies_equivalence():
    completions = ["7+8+0=15;3+4+1=8|85", "|84", "\\boxed{0.5}", "#### 1/2", "nothing", "The answer is 2,000"]
    answers = ["85", "85", "\\frac{1}{2}", "0.5", "3", "2000"]
    assert math_reward(completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_integer_fast_path_equals_math_verify():
    from everyprompt.rewards.math import _math_verify_equal, answers_match

    for gold, predicted in [("85", "85"), ("85", "86"), ("-3", "-3"), ("0", "-0"), ("100", "0100")]:
        assert answers_match(gold, predicted) == _math_verify_equal(gold, predicted)


def test_reward_that_raises_gives_none_and_counts_errors():
    def fragile(completions, answer, **_):
        if any("boom" in c for c in completions):
            raise RuntimeError("cannot score")
        return [1.0 for _ in completions]

    rewards, errors = score_completions(fragile, ["ok", "boom", "fine"], {"answer": ["1", "2", "3"]})
    assert rewards == [1.0, None, 1.0]
    assert errors == 1


def test_reward_returning_wrong_length_is_a_contract_error():
    with pytest.raises(RewardError, match="returned 1 values for 2"):
        score_completions(lambda completions, **_: [1.0], ["a", "b"], {})


def test_registry_and_import_paths():
    assert get_reward("math") is math_reward
    assert get_reward("everyprompt.rewards.math:math_reward") is math_reward
    with pytest.raises(RewardError, match="unknown reward 'nope'; registered: .*math"):
        get_reward("nope")
    with pytest.raises(RewardError, match="cannot import module"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(RewardError, match="no callable"):
        get_reward("everyprompt.rewards.math:missing")
    with pytest.raises(RewardError, match="already registered"):
        register_reward("math")(math_reward)
