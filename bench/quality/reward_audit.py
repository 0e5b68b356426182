"""How often the math reward reads a chat model's answer otherwise than a person does (docs/rewards.md).

    python -m bench.quality.reward_audit sample RUN/eval/completions.jsonl ... --count 100 --out SHEET.jsonl
    # a person fills in each row's `reader_answer` (the final answer the completion states, null if none)
    python -m bench.quality.reward_audit score SHEET.jsonl          # the misread rate under today's reward

`sample` draws `count` completions (seeded, spread evenly over the files given: `everyprompt eval`'s
completions.jsonl of runs) into a sheet with what the reward reads and scores today. `score` compares, row
by row, the reward's score with the score of the person's reading (the same comparison with the
reference: `answers_match`), and counts a **misread** where they differ; rows where both read something
different but score alike (both wrong) are counted apart, as readings that differ without changing a
reward, and the misreads of the scores the runs recorded (the reward as it was then). The sheet is the record: `reader_answer` and `reader_note` are a person's, the rest is recomputed."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from bench.common import repo_path


def sample(files: list[Path], count: int, seed: int = 0) -> list[dict]:
    """`count` rows drawn evenly from `files` (completions.jsonl), each with its source and today's reading."""
    from everyprompt.rewards.math import extract_with_rule

    rng = random.Random(seed)
    per, extra = divmod(count, len(files))
    rows = []
    for index, path in enumerate(files):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for row in rng.sample(lines, per + (index < extra)):
            found, rule = extract_with_rule(row["completion"])
            rows.append(
                {
                    "source": repo_path(path),
                    "prompt": row["prompt"],
                    "completion": row["completion"],
                    "answer": row["answer"],
                    "extracted_answer": found,
                    "rule": rule,
                    "reward": row["reward"],
                    "reader_answer": None,
                    "reader_note": "",
                }
            )
    return rows


def score(rows: list[dict]) -> dict:
    """The reward's readings and scores against a person's, row by row, under today's reward."""
    from everyprompt.rewards.math import answers_match, extract_answer, math_reward, reference_answer

    misread, differ, recorded = [], [], []
    for index, row in enumerate(rows):
        reward = math_reward([row["completion"]], answer=[row["answer"]])[0]
        reader = row["reader_answer"]
        reader_score = float(reader is not None and answers_match(reference_answer(row["answer"]), reader))
        found = extract_answer(row["completion"])
        same_reading = (
            (found is None) if reader is None else (found is not None and answers_match(reader, found))
        )
        if row["reward"] != reader_score:  # as the run's evaluation scored it
            recorded.append(index)
        if reward != reader_score:
            misread.append(index)
        elif not same_reading:
            differ.append(index)
    return {
        "rows": len(rows),
        "misread": len(misread),
        "misread_rate": len(misread) / len(rows) if rows else None,
        "misread_rows": misread,
        "misread_as_recorded": len(recorded),  # by the reward the runs were evaluated with
        "misread_as_recorded_rows": recorded,
        "readings_differ_same_score": differ,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    take = commands.add_parser("sample", help="draw completions into a sheet for a person to read")
    take.add_argument("files", type=Path, nargs="+")
    take.add_argument("--count", type=int, default=100)
    take.add_argument("--seed", type=int, default=0)
    take.add_argument("--out", type=Path, required=True)
    judge = commands.add_parser("score", help="the misread rate of a read sheet under today's reward")
    judge.add_argument("sheet", type=Path)
    args = parser.parse_args(argv)
    if args.command == "sample":
        rows = sample(args.files, args.count, args.seed)
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} rows to {args.out}: fill in each reader_answer")
        return 0
    rows = [json.loads(line) for line in args.sheet.read_text().splitlines() if line.strip()]
    result = score(rows)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
