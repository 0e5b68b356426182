"""Peak memory and time of the trainer's log-prob pass: the model's full logits against the chunked LM head
(`model.logprob_chunk`, trainer/learner_side/head.py), without gradients (old and reference log-probs) and with them
(the update's forward and backward).

Each measurement runs in a process of its own: the model is loaded, the batch made, the process's peak
resident set reset (/proc/self/clear_refs), then the pass runs; its memory is the peak minus the resident
set before it (after a one-row pass has paid the one-time costs: kernel caches, gradient buffers).
Batches are `--rows` sequences of `--length` tokens, the last `--completion` of them the
targets the loss reads (as a rollout's completion).

    python -m bench.learner.memory --model models/smollm2-135m-instruct          # 64 x 256 tokens; minutes
    python -m bench.learner.memory --model models/smollm2-135m-instruct --rows 16 --grad-rows 8

Writes bench/results/memory_<model>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import RESULTS, parse_probing, repo_path, run_probe, write_results


def _resident(field: str) -> int:
    """VmRSS or VmHWM of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def probe(
    model_path: str, rows: int, length: int, completion: int, chunk: int, grad: bool, dtype: str
) -> dict:
    """One pass in this process (see the module docstring)."""
    import torch

    from everyprompt.config import ModelConfig
    from everyprompt.models.io import load_model_and_tokenizer
    from everyprompt.models.precision import autocast
    from everyprompt.trainer.learner_side.logprobs import token_logprobs

    model, _ = load_model_and_tokenizer(ModelConfig(path=model_path, dtype=dtype), 0)
    model.train(grad).requires_grad_(grad)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    first = [length - completion - 1] * rows

    def run(count: int) -> None:
        with torch.set_grad_enabled(grad), autocast(model, dtype):
            logp, _ = token_logprobs(
                model,
                input_ids[:count],
                lengths=[length] * count,
                pad_id=0,
                chunk=chunk,
                first_targets=first[:count],
            )
            if grad:
                logp[:, first[0] :].sum().backward()
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in training

    run(1)  # one-time costs (kernel caches, the gradient buffers) before the measured pass
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    before = _resident("VmRSS")
    began = time.perf_counter()
    run(rows)
    seconds = time.perf_counter() - began
    peak = _resident("VmHWM")
    return {
        "rows": rows,
        "length": length,
        "completion": completion,
        "chunk": chunk,
        "grad": grad,
        "seconds": seconds,
        # the kernel updates the peak mark from per-thread counters that lag by a few pages, so a pass
        # that adds nothing (a tiny model, freed memory reused) can read a page below its RSS: 0 then
        "peak_bytes": max(0, peak - before),
        "resident_before": before,
    }


def measure(model: Path, rows: int, length: int, completion: int, chunk: int, grad: bool, dtype: str) -> dict:
    return run_probe(__file__, "--probe", [str(model), rows, length, completion, chunk, grad, dtype])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=False)
    parser.add_argument("--rows", type=int, default=64, help="sequences in the no-gradient pass")
    parser.add_argument("--grad-rows", type=int, default=8, help="sequences in the pass with gradients")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--completion", type=int, default=128, help="the targets read: the last N tokens")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parse_probing(parser, argv, probe)
    if args is None:
        return 0
    started = time.perf_counter()
    rows = []
    for grad, count in ((False, args.rows), (True, args.grad_rows)):
        for chunk in (0, args.chunk):
            row = measure(args.model, count, args.length, args.completion, chunk, grad, args.dtype)
            rows.append(row)
            print(
                f"{'with' if grad else 'no'} gradients, {count} x {args.length}, "
                f"{'full logits' if chunk == 0 else f'chunk {chunk}'}: peak +{row['peak_bytes'] / 2**30:.2f} GiB, "
                f"{row['seconds']:.2f} s"
            )
    results = {"benchmark": "memory", "model": repo_path(args.model), "passes": rows}
    results["wall_seconds"] = time.perf_counter() - started
    out = write_results(
        args.out / f"memory_{args.model.name.removesuffix('.gguf')}.json", results, args.dtype
    )
    print(f"wrote {repo_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
