"""The two simulated reward models of docs/evidence.md's comparison C4, as user reward functions
(`rewards.function=bench.evidence.rewards:scalar_rm`: importable where the run starts from the repository's root).

Both start from the true correctness c (the math reward: 1.0 or 0.0) and misjudge equally often:
- `scalar_rm`: c + e, e ~ N(0, 0.3^2): a correct answer falls below 0.5 (a wrong one above) with
  probability P(e > 0.5) = 1 - Phi(0.5 / 0.3) = 4.78%;
- `genrm`: the ternary verdict +1 (c = 1) or -1 (c = 0), turned to the other verdict with that same
  probability; equal answers tie exactly.

Like a real reward model, each is a fixed function of (question, response): the noise is drawn from a
generator seeded by a hash of the prompt, the reference answer and the completion, so the same response
to the same question always gets the same score, and a run repeats.
"""

from __future__ import annotations

import hashlib
import math
import random

from everyprompt.rewards import math_reward

NOISE_SD = 0.3
# P(e > 0.5) for e ~ N(0, NOISE_SD^2): the scalar model's rate of calls on the wrong side of 0.5
WRONG_CALL = 0.5 * math.erfc(0.5 / NOISE_SD / math.sqrt(2))


def _generator(prompt, answer, completion: str) -> random.Random:
    key = "\x1f".join((str(prompt), str(answer), completion)).encode()
    return random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))


def _prompts(columns: dict, count: int) -> list:
    return list(columns.get("prompt") or [None] * count)


def scalar_rm(completions: list[str], answer: list[str], **columns) -> list[float | None]:
    """c + N(0, NOISE_SD^2), fixed per (prompt, answer, completion)."""
    correct = math_reward(completions, answer=answer)
    prompts = _prompts(columns, len(completions))
    return [
        None if c is None else c + _generator(p, a, text).gauss(0.0, NOISE_SD)
        for c, p, a, text in zip(correct, prompts, answer, completions)
    ]


def genrm(completions: list[str], answer: list[str], **columns) -> list[float | None]:
    """+1 / -1 by correctness, the other verdict with probability WRONG_CALL, fixed per (prompt, answer,
    completion)."""
    correct = math_reward(completions, answer=answer)
    prompts = _prompts(columns, len(completions))
    out: list[float | None] = []
    for c, p, a, text in zip(correct, prompts, answer, completions):
        if c is None:
            out.append(None)
            continue
        right = c == 1.0
        if _generator(p, a, text).random() < WRONG_CALL:
            right = not right
        out.append(1.0 if right else -1.0)
    return out
