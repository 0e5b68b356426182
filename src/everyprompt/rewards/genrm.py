"""Generative reward model (GenRM): a judge that reasons, then gives a ternary verdict (ALGORITHMS.md
section 5). Equal-quality responses then tie exactly and their group is zero-variance, handled by ZVE,
instead of getting random-sign advantages from a noisy scalar score.

This module holds the verdict contract: the judge is asked to end with a line `Verdict: <label>`, and
`parse_verdict` reads the last verdict it gave. Labels come in two vocabularies: reference grading
(correct / partial / incorrect) and pairwise comparison (better / tie / worse); each maps to a value
(default +1 / 0 / -1). A verdict that cannot be read is None: the row is left out of its group's
statistics and counted, never guessed.
"""

from __future__ import annotations

import re

# label -> canonical verdict; longer phrases first so that "partially correct" and "incorrect" are not
# read as "correct"
ALIASES: dict[str, str] = {
    "partially correct": "partial",
    "partly correct": "partial",
    "not correct": "incorrect",
    "incorrect": "incorrect",
    "wrong": "incorrect",
    "partial": "partial",
    "correct": "correct",
    "right": "correct",
    "better": "better",
    "worse": "worse",
    "tie": "tie",
    "equal": "tie",
    "same": "tie",
}
DEFAULT_VALUES: dict[str, float] = {
    "correct": 1.0,
    "partial": 0.0,
    "incorrect": -1.0,
    "better": 1.0,
    "tie": 0.0,
    "worse": -1.0,
}

_LABEL = "|".join(re.escape(a) for a in sorted(ALIASES, key=len, reverse=True))
# "Verdict: correct", "**Verdict:** [[Incorrect]]", "final verdict = tie", "\boxed{partial}"
_EXPLICIT = re.compile(
    rf"(?:verdict|judg(?:e)?ment|grade)\s*\**\s*[:=]\s*\**\s*[\[\(\"'`]*\s*({_LABEL})\b|\\boxed\{{\s*({_LABEL})\s*\}}",
    re.IGNORECASE,
)
# a last line that is nothing but a label ("Incorrect." / "[[tie]]")
_BARE_LAST_LINE = re.compile(rf"^[\s\*\[\(\"'`]*({_LABEL})[\s\*\]\)\"'`.!]*$", re.IGNORECASE)


def parse_verdict(text: str) -> str | None:
    """The canonical verdict (correct / partial / incorrect / better / tie / worse) the judge gave last,
    or None if it gave none that can be read."""
    found = [m.group(1) or m.group(2) for m in _EXPLICIT.finditer(text)]
    if found:
        return ALIASES[found[-1].lower()]
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if lines:
        bare = _BARE_LAST_LINE.match(lines[-1])
        if bare:
            return ALIASES[bare.group(1).lower()]
    return None


def verdict_value(text: str, values: dict[str, float] | None = None) -> float | None:
    """The reward of a judge output: its verdict's value (`values` overrides the defaults), or None."""
    verdict = parse_verdict(text)
    if verdict is None:
        return None
    table = {**DEFAULT_VALUES, **(values or {})}
    return table[verdict]
