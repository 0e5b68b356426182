"""GenRM judge throughput: completions judged per second at reward batch size 1 against 16, in one run.

The judge is the demo model (its preset architecture, saved as a checkpoint), decoding greedily through
the rollout engine `auto` picks for it, in one reward worker fed by the RewardPool as a run feeds it.
Both settings judge the same completions with the same judge; greedy decoding makes the outputs, hence
the work, identical (checked). The judge's load is outside the timing (the pool runs it before the
first call).

    python -m bench.engine.genrm            # ~2 minutes on 2 CPU cores
    python -m bench.engine.genrm --tiny     # seconds

Writes bench/results/genrm.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, write_results
from bench.quality.algorithms import TINY


def _judge_checkpoint(overrides: list[str], directory: Path) -> Path:
    from everyprompt.config import load_config
    from everyprompt.models.io import load_model_and_tokenizer, save_pretrained

    config = load_config(None, overrides)
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    save_pretrained(model, tokenizer, directory)
    return directory


def judge_throughput(judge_dir: Path, completions: list[str], batch_size: int, max_new_tokens: int) -> dict:
    from everyprompt.rewards import GenRMJudge
    from everyprompt.rewards.pool import RewardPool

    judge = GenRMJudge(
        str(judge_dir),
        "Question: {question}\nReference: {reference}\nResponse: {response}\nVerdict:",
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    row = {"prompt": "12*7=", "answer": "84"}
    with RewardPool(judge, workers=1, timeout_s=600) as pool:
        pool.submit("warm-up", "84", row)  # the worker loads the judge and answers once
        pool.wait(["warm-up"])
        started = time.perf_counter()
        for key, completion in enumerate(completions):
            pool.submit(key, completion, row)
        rewards = pool.wait(list(range(len(completions))))
        elapsed = time.perf_counter() - started
    return {
        "batch_size": batch_size,
        "completions": len(completions),
        "seconds": elapsed,
        "completions_per_s": len(completions) / elapsed,
        "rewards": rewards,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console(width=140)
    count, new_tokens = (16, 8) if args.tiny else (96, 32)
    completions = [f"{7 * i} because {i}*7 is {7 * i}" for i in range(count)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        judge_dir = _judge_checkpoint(TINY if args.tiny else [], Path(scratch) / "judge")
        one = judge_throughput(judge_dir, completions, 1, new_tokens)
        sixteen = judge_throughput(judge_dir, completions, 16, new_tokens)
    if one["rewards"] != sixteen["rewards"]:
        raise SystemExit("batched and one-at-a-time judging gave different verdicts: not equal work")
    results = {
        "benchmark": "genrm",
        "tiny": args.tiny,
        "judge": "the demo model's preset (random init), greedy, engine auto",
        "judge_max_new_tokens": new_tokens,
        "batch_1": {k: v for k, v in one.items() if k != "rewards"},
        "batch_16": {k: v for k, v in sixteen.items() if k != "rewards"},
        "speedup": sixteen["completions_per_s"] / one["completions_per_s"],
        "same_verdicts": True,
        "wall_seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "genrm.json", results)
    console.print(
        f"GenRM judge, {count} completions, up to {new_tokens} judge tokens each: "
        f"batch 1 {one['completions_per_s']:.1f}/s, batch 16 {sixteen['completions_per_s']:.1f}/s "
        f"({results['speedup']:.1f}x), same verdicts"
    )
    console.print(f"wrote {args.out / 'genrm.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
