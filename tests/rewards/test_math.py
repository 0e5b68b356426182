import json
from pathlib import Path

import pytest

from everyprompt.rewards import RewardError, extract_answer, get_reward, math_reward, score_completions
from everyprompt.rewards.base import register_reward
from everyprompt.rewards.math import extract_with_rule


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
        # chat models: the result of the last equation when talk follows it, not a number in the talk
        ("99 + 31 = 130.\n\nThis is a classic example of adding 99 and 31.", "130"),
        ("The answer to this classic math problem is 0. In mathematics, 0 + 3 is special.", "0"),
        ("The answer is 16 - 16 = 0.", "0"),
        ("First, 5 + 9 = 14.\nNext, 14 + 45 = 50.\nSo, 5 + ", "50"),  # cut off mid-expression
        ("1 + 8 = 9", "9"),  # a bare equation: its result is its last number
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

    rewards, failures = score_completions(fragile, ["ok", "boom", "fine"], {"answer": ["1", "2", "3"]})
    assert rewards == [1.0, None, 1.0]
    assert [f.summary for f in failures] == ["RuntimeError: cannot score"]
    assert "raise RuntimeError" in failures[0].traceback


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (float("nan"), "reward value nan is not finite"),
        (float("inf"), "reward value inf is not finite"),
        ("1.0", "reward value '1.0' (str) is not a number"),
        ([1.0], "reward value [1.0] (list) is not a number"),
    ],
)
def test_a_value_that_is_not_a_finite_number_scores_none_and_fails(value, why):
    def odd(completions, **_):  # the bad value on row "b", good values elsewhere
        return [value if c == "b" else 1.0 for c in completions]

    rewards, failures = score_completions(odd, ["a", "b", "c"], {})
    assert rewards == [1.0, None, 1.0]
    assert len(failures) == 1 and failures[0].summary == f"ValueError: {why}"


def test_a_reward_returning_the_wrong_number_of_values_is_scored_row_by_row():
    calls = []

    def short(completions, **_):
        calls.append(len(completions))
        return [0.5]  # right for one row, wrong for several

    assert score_completions(short, ["a", "b"], {}) == ([0.5, 0.5], [])
    assert calls == [2, 1, 1]
    rewards, failures = score_completions(lambda completions, **_: [1.0, 2.0], ["a"], {})
    assert rewards == [None] and "returned 2 values for 1 completions" in failures[0].summary
    rewards, failures = score_completions(lambda completions, **_: 1.0, ["a"], {})
    assert rewards == [None] and "returned float values for 1 completions" in failures[0].summary


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


def test_references_are_extracted_like_completions():
    """GSM8K's raw `answer` (steps, then `#### N`) and a MATH solution with \\boxed{} score as they come;
    a bare reference is kept whole (the last-number fallback would turn \\frac{1}{2} into 2)."""
    from everyprompt.rewards.math import math_reward, reference_answer

    gsm8k = "She sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"
    math = "The sum is $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."
    assert reference_answer(gsm8k) == "72"
    assert reference_answer(math) == "\\frac{1}{2}"
    assert reference_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert reference_answer(" 1,234 ") == "1,234"
    rewards = math_reward(
        ["so the answer is 72", "#### 71", "\\boxed{0.5}", "it is 1234"],
        answer=[gsm8k, gsm8k, math, "#### 1,234"],
    )
    assert rewards == [1.0, 0.0, 1.0, 1.0]


def test_the_extraction_policy_reads_real_chat_completions_as_a_reader_does():
    """60 greedy completions of SmolLM2-135M-Instruct on the `questions` task (levels 1, 2, 4), each with
    the answer a reader takes from it (None where it states none). The policy agrees on 53; the last-number
    policy it replaced on 41. Where the reader finds no answer the policy still takes something (6 of the 7
    misses); none of them changes a reward since the `undefined` rule (2026-11-28: '0 + 0 is undefined ...'
    was scored right, its reasoning's 0 read as the answer)."""
    import json
    from pathlib import Path

    from everyprompt.rewards.math import answers_match

    rows = [json.loads(line) for line in (Path(__file__).parent / "chat_completions.jsonl").open()]
    assert len(rows) >= 50
    agree = rewards_agree = 0
    for row in rows:
        found, reader = extract_answer(row["completion"]), row["reader_answer"]
        agree += found is None if reader is None else found is not None and answers_match(reader, found)
        judged = reader is not None and answers_match(row["answer"], reader)
        rewards_agree += judged == bool(math_reward([row["completion"]], answer=[row["answer"]])[0])
    assert agree >= 53, agree
    assert rewards_agree == len(rows), rewards_agree


# docs/rewards.md, "How often the reward misreads": 100 completions of SmolLM2 read by a person, 2026-11-28
AUDIT = Path(__file__).parent / "reward_audit_smollm2.jsonl"


def test_the_audits_misreads_are_gone_and_no_reading_got_worse():
    """The audit sheet (25 completions each of the instruct model and of the smollm2 recipe's seed 1 at RL
    steps 10, 20 and 30, read by a person): the reward as the runs were evaluated with it misread one (a
    reward where the person reads none); today's reward misreads none, and reads as the person does
    everywhere but nine completions, each scored 0 either way: eight that state no answer (it takes a number
    of their talk) and one whose last equation answers another question than the one asked (row 70)."""
    from bench.quality.reward_audit import score

    rows = [json.loads(line) for line in AUDIT.open()]
    result = score(rows)
    assert result["rows"] == 100
    assert result["misread_as_recorded_rows"] == [73]
    assert result["misread"] == 0
    differ = result["readings_differ_same_score"]
    assert [i for i in differ if rows[i]["reader_answer"] is not None] == [70] and len(differ) == 9


def test_a_completion_that_calls_the_result_undefined_states_no_number():
    """Audit row 73 (RL step 20): the reasoning's 0 was read as the answer to '0 + 0' and scored 1."""
    completion = json.loads(AUDIT.read_text().splitlines()[73])["completion"]
    assert "is undefined" in completion
    assert extract_with_rule(completion) == ("undefined", "undefined")
    assert math_reward([completion], answer=["0"]) == [0.0]
    # a result stated after the word answers, and a reference that is itself undefined matches it
    assert extract_answer("Division by zero is undefined, but 6 / 2 = 3 here.") == "3"
    assert math_reward(["So 1/0 is undefined."], answer=["undefined"]) == [1.0]


def test_a_bare_number_on_the_first_line_is_the_answer_over_the_numbers_of_the_talk_after_it():
    """Audit row 65 (RL step 20): '1.5' then prose about 5 and 5; the last number (5) was read."""
    completion = json.loads(AUDIT.read_text().splitlines()[65])["completion"]
    assert completion.startswith("1.5\n")
    assert extract_with_rule(completion) == ("1.5", "leading")
    assert extract_with_rule("42\n\nThe answer is 41.") == ("41", "statement")  # a statement wins
    assert extract_with_rule("Step 1: add 4 and 5.") == ("5", "last_number")  # not a bare first line
