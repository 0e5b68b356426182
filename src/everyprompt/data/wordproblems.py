"""GSM8K-style word problems, generated: a question in English and an `answer` in GSM8K's own layout
(worked steps with `<<a+b=c>>` calculator notes, then `#### N`). They are the data of the CPU-sized twins
of real recipes (configs/*-cpu.yaml) and the corpus their locally trained tokenizer learns from; nothing
here is from GSM8K itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Eva", "Ben"]
THINGS = ["apples", "books", "coins", "stamps", "pencils", "shells", "cards", "marbles"]


def word_problem(rng: random.Random) -> dict[str, str]:
    """One problem: {"question", "answer"} with the final number after `####`."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    kind = rng.choice(["more", "less", "times"])
    if kind == "more":
        question = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        steps, result = f"{name} has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} {thing}.", a + b
    elif kind == "less":
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
        steps, result = f"{a}-{b} = <<{a}-{b}={a - b}>>{a - b} {thing} are left.", a - b
    else:
        a, b = a % 9 + 2, b % 9 + 2
        question = f"{name} has {a} bags with {b} {thing} in each. How many {thing} is that?"
        steps, result = f"{a}*{b} = <<{a}*{b}={a * b}>>{a * b} {thing}.", a * b
    return {"question": question, "answer": f"{steps}\n#### {result}"}


def word_problems(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [word_problem(rng) for _ in range(count)]


def tokenizer_corpus(count: int = 2000, seed: int = 7) -> list[str]:
    """Text a twin's tokenizer is trained on: questions and worked answers of generated problems."""
    return [f"{p['question']} {p['answer']}" for p in word_problems(count, seed)]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
