"""GenRM verdict parsing on real-looking judge outputs, malformed ones included."""

import pytest

from everyprompt.rewards.genrm import parse_verdict, verdict_value

OUTPUTS = [
    ("The response computes 12*7 = 84, matching the reference.\nVerdict: correct", "correct"),
    ("The final answer 85 differs from the reference 84.\n\nVerdict: Incorrect", "incorrect"),
    ("Steps are right but the answer is left unsimplified (2/4).\nVerdict: partially correct", "partial"),
    ("**Verdict:** [[Partial]]", "partial"),
    ("Comparing A with the reference, A is clearer.\nFinal verdict = better", "better"),
    ("Both reach 84 by the same route.\nVERDICT: TIE", "tie"),
    ("The response is worse than the reference.\nVerdict: worse.", "worse"),
    ("Answer matches. \\boxed{correct}", "correct"),
    # the judge first writes a draft verdict, then revises it: the last one counts
    ("Verdict: correct\nWait, 12*7 is 84, not 74 as the response says.\nVerdict: incorrect", "incorrect"),
    # "incorrect" must not be read as "correct", nor "partially correct" as "correct"
    ("Judgement: incorrect", "incorrect"),
    ("The reasoning holds up.\n\nCorrect.", "correct"),
    ("Grade: wrong", "incorrect"),
    # malformed: no verdict, a verdict outside the vocabulary, a truncated output
    ("The response seems plausible but I am not sure.", None),
    ("Verdict: maybe", None),
    ("Let me check the arithmetic: 12*7 = 8", None),
    ("", None),
    ("Is the answer correct? Let me see", None),
]


@pytest.mark.parametrize(("text", "expected"), OUTPUTS)
def test_verdicts_are_parsed_or_none(text, expected):
    assert parse_verdict(text) == expected


def test_verdict_values_default_and_configured():
    assert verdict_value("Verdict: correct") == 1.0
    assert verdict_value("Verdict: partial") == 0.0
    assert verdict_value("Verdict: incorrect") == -1.0
    assert verdict_value("Verdict: tie") == 0.0
    assert verdict_value("Verdict: partial", {"partial": 0.5, "incorrect": 0.0}) == 0.5
    assert verdict_value("no verdict here") is None


def test_an_all_tie_group_has_zero_advantage_and_is_zero_variance():
    import torch

    from everyprompt.algorithms import compute_advantages
    from everyprompt.zve import group_zero_variance

    judged = ["A and B agree.\nVerdict: tie"] * 4 + ["Verdict: better", "Verdict: worse", "Verdict: tie", "x"]
    rewards = torch.tensor([float("nan") if (v := verdict_value(t)) is None else v for t in judged])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantages = compute_advantages("grpo", rewards, groups)
    assert torch.equal(advantages[:4], torch.zeros(4))  # no random-sign push on equal-quality answers
    assert group_zero_variance(rewards, groups).tolist() == [True, False]  # ZVE sees the tie group
    assert advantages[4] > 0 > advantages[5] and advantages[7] == 0  # the unparseable row is left out
