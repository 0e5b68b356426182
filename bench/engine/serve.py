"""`everyprompt serve` under load: the same chat requests one at a time and all at once (continuous batching),
through the official `openai` client against a server process, as a user would run it.

    python -m bench.engine.serve --model models/smollm2-135m-instruct          # the real model (make smollm2)
    python -m bench.engine.serve                                                # a tiny random model (smoke run)

Reported: completion tokens/s one at a time (on a server of one row) and all at once (on a server of as
many rows as requests): their ratio is what continuous batching buys. Also each
request's latency at that concurrency, and how many greedy answers are the same both ways (the engine's
batch invariance on real weights: sampling noise never depends on the batch; the logits of one row may
differ in their last bits between batch shapes). A few answers are printed to be read.

Writes bench/results/serve_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, repo_path, write_results
from bench.quality.algorithms import TINY
from everyprompt.processes import first_line


def tiny_checkpoint(directory: Path) -> Path:
    """A random-init tiny chat MoE saved as a checkpoint (the smoke run's model)."""
    from everyprompt.config import load_config
    from everyprompt.models import load_model_and_tokenizer

    overrides = ["model.preset=tiny-chat-moe", *TINY]
    model, tokenizer = load_model_and_tokenizer(load_config(None, overrides).model, seed=0)
    path = directory / "tiny-chat"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def questions(count: int) -> list[str]:
    return [f"What is {12 + 7 * i} + {35 + 11 * i}? Answer briefly." for i in range(count)]


class ServerProcess:
    def __init__(self, model: Path, *flags: str):
        import httpx

        command = [sys.executable, "-m", "everyprompt.cli", "serve", str(model), "--port", "0", *flags]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = first_line(self.process, 600)
        if "serving" not in line:
            raise RuntimeError(f"the server did not start: {line}{self.process.stderr.read()[-3000:]}")
        self.base = line.strip().rsplit(" ", 1)[-1]
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(self.base.removesuffix("/v1") + "/health", timeout=5)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("the server did not answer") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def ask_all(
    base: str, prompts: list[str], max_tokens: int
) -> tuple[float, list[tuple[str, int, float]]]:
    """All `prompts` at once: the wall time and per request (text, completion tokens, latency)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)

    async def one(prompt: str):
        began = time.perf_counter()
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
        )
        return answer.choices[0].message.content, answer.usage.completion_tokens, time.perf_counter() - began

    began = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()  # inside the loop: its connections must not outlive it
    return time.perf_counter() - began, list(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory or .gguf (default: tiny)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once (default 32)")
    parser.add_argument(
        "--sequential", type=int, default=8, help="of them, sent one at a time first (default 8)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model if args.model is not None else tiny_checkpoint(Path(scratch))
        if not model.exists():
            parser.error(f"--model {model}: no such checkpoint (make smollm2 fetches SmolLM2)")
        prompts = questions(args.concurrency)
        flags = ["--max-tokens", str(args.max_tokens), "--max-prompt-tokens", "256"]
        # one at a time on a server of one row (on a CPU every row is computed at every step, so a wider
        # server would charge a lone request for its idle rows): the fair reference
        server = ServerProcess(model, "--batch-size", "1", *flags)
        try:
            asyncio.run(ask_all(server.base, prompts[:1], 4))  # warm-up: first calls allocate
            sequential = []
            began = time.perf_counter()
            for prompt in prompts[: args.sequential]:
                _, [result] = asyncio.run(ask_all(server.base, [prompt], args.max_tokens))
                sequential.append(result)
            sequential_s = time.perf_counter() - began
        finally:
            server.stop()
        server = ServerProcess(model, "--batch-size", str(args.concurrency), *flags)
        try:
            asyncio.run(ask_all(server.base, prompts[:2], 4))
            concurrent_s, together = asyncio.run(ask_all(server.base, prompts, args.max_tokens))
        finally:
            server.stop()
    seq_tokens = sum(tokens for _, tokens, _ in sequential)
    conc_tokens = sum(tokens for _, tokens, _ in together)
    latencies = sorted(latency for _, _, latency in together)
    same = sum(a[0] == b[0] for a, b in zip(sequential, together))
    name = model.name if args.model is not None else "tiny-chat"
    summary = {
        "benchmark": "serve",
        "model": repo_path(model) if args.model is not None else "tiny random chat MoE (smoke run)",
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "sequential": {
            "requests": len(sequential),
            "completion_tokens": seq_tokens,
            "seconds": sequential_s,
            "tokens_per_s": seq_tokens / sequential_s,
        },
        "concurrent": {
            "requests": len(together),
            "completion_tokens": conc_tokens,
            "seconds": concurrent_s,
            "tokens_per_s": conc_tokens / concurrent_s,
            "latency_p50_s": statistics.median(latencies),
            "latency_max_s": latencies[-1],
        },
        "throughput_ratio": (conc_tokens / concurrent_s) / (seq_tokens / sequential_s),
        "same_greedy_answers": f"{same} of {len(sequential)}",
        "examples": [{"prompt": p, "answer": a[0]} for p, a in zip(prompts[:3], together[:3])],
    }
    path = write_results(args.out / f"serve_{name}.json", summary)
    print(
        f"sequential: {summary['sequential']['tokens_per_s']:.1f} tokens/s ({len(sequential)} requests); "
        f"{len(together)} at once: {summary['concurrent']['tokens_per_s']:.1f} tokens/s "
        f"({summary['throughput_ratio']:.2f}x), latency p50 {summary['concurrent']['latency_p50_s']:.1f} s, "
        f"max {latencies[-1]:.1f} s; greedy answers the same both ways: {summary['same_greedy_answers']}"
    )
    for example in summary["examples"]:
        print(f"  {example['prompt']!r} -> {example['answer']!r}")
    print(f"wrote {repo_path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
