"""What an environment's observation costs the native engine's multi-turn rollout: each observation fed in
one forward from its row's length (rollout/native/extend.py), against the decode steps its model tokens
take, measured in the same run.

The model has SmolLM2-135M's shape (Llama: hidden 576, 30 layers, 9 query and 3 key/value heads, MLP 1536)
with random weights and the character tokenizer's vocabulary (100 tokens, where SmolLM2's is 49,152: the
head is smaller, the layers the same), float32 on the CPU, the eager plain step. 16 episodes decode
together, sampling at temperature 1 (seeded), a turn ending at any of three stop characters (about one
token in 33 with these weights); each of the first three turns is answered with an observation of
`--observation` random characters, the fourth ends the episode; `max_new_tokens` caps every completion.

Reported per observation length: wall seconds of the generate call, the model's and the environments'
tokens, decode steps, the extend forwards and their seconds, and the ratio that says what an observation
token costs against a decoded token: (extend seconds / observation tokens) / (decode seconds / model
tokens). A ratio of 1 is what feeding an observation one token a decode step cost, by construction.

`--against REV` measures the engine of git revision REV too (a temporary worktree on the probe's
PYTHONPATH), each side in a process of its own, alternating for `--rounds`; the ratio is this tree's wall
time over REV's (medians), and the completions' tokens are hashed to check that both sampled the same
sequences (they should: the sampler's noise follows each row's count of tokens either way).

    python -m bench.environments.episodes --against fc847b5   # ~9 minutes on 2 CPU cores: the engine that fed an
                                                 # observation a token a decode step, as reference
    python -m bench.environments.episodes                     # ~1.5 minutes: this tree alone
    python -m bench.environments.episodes --tiny              # seconds: 2 layers of hidden 64 (the test's)

Writes bench/results/episodes.json (`--out` to write elsewhere).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.common import RESULTS, ROOT, repo_path, run_probe, write_results
from everyprompt.models.tokenizer import build_char_tokenizer
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128)  # fmt: skip
STOPS = ("q", "Z", "%")
ANSWERED_TURNS = 3


class Answers:
    """An environment that answers each of the first `ANSWERED_TURNS` turns with `length` random characters'
    tokens (seeded per episode), then ends the episode."""

    def __init__(self, tokens: list[int], length: int, seed: int):
        self.draw, self.tokens, self.length, self.turns = random.Random(seed), tokens, length, 0
        self.reward, self.error, self.error_reason = None, None, None  # the Episode protocol's

    def turn_ended(self, token_ids: list[int]) -> list[int] | None:
        self.turns += 1
        if self.turns > ANSWERED_TURNS:
            return None
        return [self.draw.choice(self.tokens) for _ in range(self.length)]


def build(shape: dict) -> tuple[NativeEngine, object]:
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, **shape)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return NativeEngine.from_model(model, tokenizer, batch_size=16), tokenizer


def run(engine, tokenizer, observation: int, max_new_tokens: int) -> dict:
    printable = [tokenizer.convert_tokens_to_ids(c) for c in "abcdefghijklmnoprstuvwxyz0123456789+-*=. "]
    requests = [
        GenerationRequest(
            i,
            tokenizer(f"Problem {i}: what is {i * 37} + {i * 11}?").input_ids,
            seed=i,
            episode=Answers(printable, observation, seed=i),
        )  # fmt: skip
        for i in range(16)
    ]
    params = SamplingParams(max_new_tokens, temperature=1.0, stop=STOPS)
    began = time.perf_counter()
    completions = sorted(engine.generate(requests, params), key=lambda c: c.request_id)
    wall = time.perf_counter() - began
    stats = engine.stats
    model_tokens = sum(
        len(c.token_ids) if c.completion_mask is None else int(c.completion_mask.sum()) for c in completions
    )
    observed = sum(len(c.token_ids) for c in completions) - model_tokens
    decode_s = stats["decode_step_ms"] * stats["decode_steps"] / 1000
    extend_s = stats.get("extend_s")  # absent where observations were fed a token a decode step
    digest = hashlib.sha256(str([c.token_ids for c in completions]).encode()).hexdigest()[:16]
    row = {
        "observation": observation,
        "wall_s": round(wall, 3),
        "model_tokens": model_tokens,
        "observation_tokens": observed,
        "decode_steps": int(stats["decode_steps"]),
        "decode_s": round(decode_s, 3),
        "extends": stats.get("extends"),
        "extend_s": None if extend_s is None else round(extend_s, 3),
        "tokens_digest": digest,
    }
    if extend_s is not None and observed and model_tokens:
        row["observation_token_cost"] = round((extend_s / observed) / (decode_s / model_tokens), 4)
    return row


def measure(tiny: bool, lengths: list[int], max_new_tokens: int) -> list[dict]:
    """One process's rows (the probe: this tree's engine, or another's on PYTHONPATH)."""
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    engine, tokenizer = build(TINY if tiny else SMOLLM2)
    run(engine, tokenizer, 4, 64)  # warm-up: first calls allocate
    rows = []
    for length in lengths:
        rows.append(run(engine, tokenizer, length, max_new_tokens))
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr, flush=True)
    return rows


@contextmanager
def checkout(revision: str):
    """A detached worktree of `revision` (removed after): the reference engine's source."""
    folder = Path(tempfile.mkdtemp(prefix="everyprompt-reference-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(folder), revision],
                   check=True)  # fmt: skip
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def compare(rows: list[dict], reference: list[dict]) -> list[dict]:
    """Per observation length: the wall time against the reference's (medians over rounds), and whether
    both sampled the same tokens."""
    out = []
    for length in sorted({row["observation"] for row in rows}):
        mine = [row for row in rows if row["observation"] == length]
        theirs = [row for row in reference if row["observation"] == length]
        wall, against = (round(statistics.median(r["wall_s"] for r in side), 3) for side in (mine, theirs))
        out.append({
            "observation": length,
            "wall_s": wall,
            "reference_wall_s": against,
            "ratio": round(wall / against, 3),
            "decode_steps": mine[0]["decode_steps"],
            "reference_decode_steps": theirs[0]["decode_steps"],
            "same_tokens": {r["tokens_digest"] for r in mine} == {r["tokens_digest"] for r in theirs},
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers of hidden 64: seconds")
    parser.add_argument("--observation", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--against", metavar="REV", help="also measure the engine of this git revision")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS / "episodes.json")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(measure(*json.loads(args.probe))))
        return
    probe = [args.tiny, args.observation, args.max_new_tokens]
    rows, reference = [], []
    with checkout(args.against) if args.against else nullcontext() as tree:
        env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree / "src")}
        for _ in range(args.rounds if args.against else 1):
            rows += run_probe(__file__, "--probe", probe, env=None)
            if tree is not None:
                reference += run_probe(__file__, "--probe", probe, env=env)
    payload = {"model": "tiny" if args.tiny else "smollm2-135m shape", "rows": rows}
    if args.against:
        payload |= {
            "reference": args.against,
            "reference_rows": reference,
            "compared": compare(rows, reference),
        }
        for entry in payload["compared"]:
            print(" ".join(f"{k}={v}" for k, v in entry.items()))
    path = write_results(args.out, payload)
    print(f"wrote {repo_path(path)}")


if __name__ == "__main__":
    main()
