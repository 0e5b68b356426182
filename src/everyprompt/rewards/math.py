"""Math answer verification: our own final-answer extraction, then `math-verify` for equivalence.

The extraction policy (docs/rewards.md), in order; the first rule that finds an answer decides, and within
a rule the last occurrence wins:

1. `boxed`: the last ``\\boxed{...}``;
2. `hashes`: the text after the last ``####`` (GSM8K's layout);
3. `statement`: an explicit statement, "the answer is X" or an ``Answer:`` / ``A:`` line;
4. `undefined`: "... is undefined" (or not defined, indeterminate) with no result stated after it: the
   completion's answer is that there is none, not a number of its reasoning ("0 + 0 is undefined ...
   any number multiplied by 0 results in 0, which is undefined");
5. `equation`: the result of the last equation (``= X``, "equals X", "is equal to X") when prose follows
   it: a chat model states its result and keeps talking, and numbers in that talk ("a classic example of
   adding 99 and 31") are not its answer;
6. `leading`: a first line that is a number alone (``1.5`` then prose about the question's numbers);
7. `last_number`: the last number in the completion.

A completion cut off in the middle of an expression (`So, 5 + `, at the length cap) is read without its
unfinished last sentence.

Integers on both sides are compared directly (the common case, and much faster); anything else goes
through math-verify's parser and symbolic comparison.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from everyprompt.rewards.base import register_reward

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_INTEGER = re.compile(r"-?\d+")
_ANSWER_IS = re.compile(
    r"answer(?: to [^.\n]{0,80}?)? is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.(?=\s|$)|\n|$)", re.IGNORECASE
)
_ANSWER_LINE = re.compile(r"(?:^|\n)\s*(?:A|Answer|Final answer)\s*:\s*([^\n]+)", re.IGNORECASE)
_EQUATION = re.compile(
    r"(?:=|\bequals\b|\bis equal to\b)\s*\$?\s*(" + _NUMBER.pattern + r")(?![\d/])", re.IGNORECASE
)
_PROSE = re.compile(r"[A-Za-z]{3,}")
_UNDEFINED = re.compile(r"\b(?:is|are|be|remains)\s+(?:undefined|not defined|indeterminate)\b", re.IGNORECASE)
_LEADING_NUMBER = re.compile(r"\s*(" + _NUMBER.pattern + r")\.?[ \t]*(?:\n|$)")
UNDEFINED = "undefined"


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip() or None
            depth -= 1
    return None


def _after_hashes(text: str) -> str | None:
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def _statement(text: str) -> str | None:
    for pattern in (_ANSWER_IS, _ANSWER_LINE):
        matches = [m.strip() for m in pattern.findall(text)]
        if matches and matches[-1]:
            stated = matches[-1]
            # "The answer is 16 - 16 = 0.": the working, then its result
            result = _EQUATION.findall(stated)
            return result[-1].replace(",", "") if result else stated
    return None


def _equation_before_prose(text: str) -> str | None:
    last = next(reversed(list(_EQUATION.finditer(text))), None)
    if last is None or not _PROSE.search(text[last.end() :]):
        return None
    return last.group(1).replace(",", "")


def _declared_undefined(text: str) -> str | None:
    last = next(reversed(list(_UNDEFINED.finditer(text))), None)
    if last is None or _EQUATION.search(text, last.end()):  # a result stated after it answers
        return None
    return UNDEFINED


def _leading_number(text: str) -> str | None:
    first = _LEADING_NUMBER.match(text)
    return first.group(1).replace(",", "") if first else None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


# the extraction policy: (rule name, the answer it finds or None), tried in order
EXTRACTION_RULES: tuple[tuple[str, Callable[[str], str | None]], ...] = (
    ("boxed", _last_boxed),
    ("hashes", _after_hashes),
    ("statement", _statement),
    ("undefined", _declared_undefined),
    ("equation", _equation_before_prose),
    ("leading", _leading_number),
    ("last_number", _last_number),
)


_CUT_MID_EXPRESSION = re.compile(r"[-+×*/=]\s*$")
_SENTENCE_END = re.compile(r"[.!?\n]")


def finished_text(completion: str) -> str:
    """The completion without an expression it was cut off in (`... So, 5 + `, at the length cap): from
    its last sentence end on, what is left unfinished states nothing."""
    if not _CUT_MID_EXPRESSION.search(completion):
        return completion
    ends = [m.end() for m in _SENTENCE_END.finditer(completion.rstrip())]
    return completion[: ends[-1]] if ends else completion


def extract_with_rule(completion: str) -> tuple[str | None, str | None]:
    """(the final answer a completion states, the name of the rule that found it); (None, None) if none."""
    completion = finished_text(completion)
    for name, rule in EXTRACTION_RULES:
        found = rule(completion)
        if found:
            return found, name
    return None, None


def extract_answer(completion: str) -> str | None:
    """The final answer a completion states, or None if it states none (the policy above)."""
    return extract_with_rule(completion)[0]


def reference_answer(reference: str) -> str:
    """The final answer of a reference as datasets give it: a GSM8K `answer` (worked steps, then
    `#### 72`) or a MATH solution (`... \\boxed{\\frac{1}{2}}`) gives the part the extractor finds; a bare
    answer (`72`, `\\frac{1}{2}`) is kept whole.

    >>> reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 72")
    '72'
    """
    text = str(reference)
    if "####" in text or "\\boxed{" in text:
        found = extract_answer(text)
        if found:
            return found
    return text.strip()


def _math_verify_equal(gold: str, predicted: str) -> bool:
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$")
    if not gold_parsed:
        raise ValueError(f"reference answer {gold!r} cannot be parsed")
    return bool(verify(gold_parsed, parse(f"${predicted}$")))


def plain_number(text: str) -> str:
    """`1,234` -> `1234` (thousands separators, as GSM8K writes large answers); anything else unchanged."""
    return text.replace(",", "") if _NUMBER.fullmatch(text) else text


def answers_match(gold: str, predicted: str | None) -> bool:
    if predicted is None:
        return False
    gold, predicted = plain_number(gold.strip()), plain_number(predicted.strip())
    if UNDEFINED in (gold.lower(), predicted.lower()):  # no number: equal only to itself
        return gold.lower() == predicted.lower()
    if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(predicted):
        return int(gold) == int(predicted)
    return _math_verify_equal(gold, predicted)


@register_reward("math")
def math_reward(completions: list[str], answer: list[str], **_: object) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference's (`reference_answer`: GSM8K's
    `#### 72` and MATH's `\\boxed{}` work as they come) mathematically, else 0.0.

    >>> math_reward(["7+8+0=15;3+4+1=8|85", "so the answer is 84"], answer=["85", "85"])
    [1.0, 0.0]
    """
    return [
        float(answers_match(reference_answer(gold), extract_answer(text)))
        for text, gold in zip(completions, answer)
    ]
