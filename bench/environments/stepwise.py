"""Step-wise episodes on the native engine: each turn joining one running call as its environment answers
(`env.stepwise_schedule=continuous`, envs/turns.py) against round by round (`rounds`: every episode's turn
t, then every environment, then turn t + 1), the reference, measured in the same run on the same episodes.

The model: a Qwen3-MoE of hidden 256, 4 layers, 8 experts (top 2) with random weights over a 300-token
chat tokenizer whose template drops earlier thinking (so episodes train step-wise), float32 on the CPU.
32 episodes of `--turns` turns decode in a pool of 16 rows, sampling at temperature 1 (seeded), a turn
ending at the letter "e" or at `--max-new-tokens`; each environment answers after a delay drawn
uniformly from [0, `--latency`] seconds (a tool, a sandbox, a judge; 0: answers at once), seeded per
episode and turn. The same episodes run both ways, alternating for `--rounds`, for each latency;
reported: the wall seconds of each (medians), their ratio, and whether both sampled the same turns
(hashes of every turn's tokens: they should).

    python -m bench.environments.stepwise            # ~1 minute on 2 CPU cores
    python -m bench.environments.stepwise --tiny     # seconds: 8 episodes, hidden 64, 2 layers (the test's)

Writes bench/results/stepwise.json (`--out` to write elsewhere).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.common import RESULTS, repo_path, write_results
from everyprompt.envs import StepResult
from everyprompt.envs.stepwise import StepwiseEpisode, generate_stepwise
from everyprompt.models.tokenizer import DROPS_THINKING_TEMPLATE, build_chat_tokenizer
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine

CORPUS = ["<think> so 6 times 7 </think> The answer is 42. Try again. user assistant"] * 20
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)  # fmt: skip


class Delayed:
    """An environment that answers each turn after a seeded random delay, 'Try again.' until its last."""

    def __init__(self, turns: int, latency: float, seed: int):
        self.turns, self.limit, self.latency, self.draw = 0, turns, latency, random.Random(seed)

    def init(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turns += 1
        time.sleep(self.draw.uniform(0, self.latency))
        if self.turns >= self.limit:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "Try again."}])


def build(shape: dict, rows: int):
    tokenizer = build_chat_tokenizer(CORPUS, vocab_size=300)
    tokenizer.chat_template = DROPS_THINKING_TEMPLATE
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=None, eos_token_id=tokenizer.eos_token_id, norm_topk_prob=True,
                                  **shape)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that the text varies by token
        for tensor in model.parameters():
            if tensor.dim() >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return NativeEngine.from_model(model, tokenizer, batch_size=rows), tokenizer


def run(
    engine, tokenizer, schedule: str, episodes: int, turns: int, latency: float, max_new_tokens: int
) -> dict:
    """One run of the episodes, scheduled `schedule` (`env.stepwise_schedule`: continuous or rounds)."""
    requests = []
    for i in range(episodes):
        env = Delayed(turns, latency, seed=i)
        row = {"prompt": f"What is {i} x 7?"}
        episode = StepwiseEpisode(env, tokenizer, row, max_turns=turns, schedule=schedule)
        requests.append(GenerationRequest(i, episode.prompt_ids, seed=i, episode=episode))
    params = SamplingParams(max_new_tokens, temperature=1.0, stop=("e",))
    began = time.perf_counter()
    done = sorted(generate_stepwise(engine, requests, params), key=lambda c: c.request_id)
    wall = time.perf_counter() - began
    sampled = [[turn.token_ids for turn in c.turns] for c in done]
    return {
        "wall_s": round(wall, 3),
        "turns": sum(len(c.turns) for c in done),
        "tokens": sum(len(t) for c in sampled for t in c),
        "tokens_digest": hashlib.sha256(str(sampled).encode()).hexdigest()[:16],
    }


def compare(engine, tokenizer, setting: tuple, rounds: int) -> dict:
    """Both schedules on the same episodes, alternating for `rounds`: their runs and the medians' ratio."""
    sides: dict[str, list[dict]] = {"continuous": [], "rounds": []}
    for _ in range(rounds):
        for schedule, rows in sides.items():
            rows.append(run(engine, tokenizer, schedule, *setting))
    wall = {name: round(statistics.median(r["wall_s"] for r in rows), 3) for name, rows in sides.items()}
    digests = {r["tokens_digest"] for rows in sides.values() for r in rows}
    return {
        "latency_s": setting[2],
        "continuous_wall_s": wall["continuous"],
        "rounds_wall_s": wall["rounds"],
        "ratio": round(wall["continuous"] / wall["rounds"], 3),
        "same_turns": len(digests) == 1,
        "turns": sides["continuous"][0]["turns"],
        "tokens": sides["continuous"][0]["tokens"],
        "runs": sides,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="8 episodes of a tiny model: seconds")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.3],
                        help="an environment's longest delay, seconds (one comparison each)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each schedule, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS / "stepwise.json")
    args = parser.parse_args(argv)
    engine, tokenizer = build(TINY if args.tiny else MODEL, 4 if args.tiny else 16)
    episodes = 8 if args.tiny else 32
    run(engine, tokenizer, "continuous", 2, 2, 0.0, 8)  # warm-up: first calls allocate
    compared = []
    for latency in args.latency:
        compared.append(
            compare(engine, tokenizer, (episodes, args.turns, latency, args.max_new_tokens), args.rounds)
        )
        print(" ".join(f"{k}={v}" for k, v in compared[-1].items() if k != "runs"), flush=True)
    model = "tiny" if args.tiny else "qwen3-moe hidden 256, 4 layers"
    settings = dict(
        episodes=episodes, turns=args.turns, max_new_tokens=args.max_new_tokens, rows=engine.batch_size
    )
    path = write_results(args.out, {"model": model, "settings": settings, "compared": compared})
    print(f"wrote {repo_path(path)}")


if __name__ == "__main__":
    main()
