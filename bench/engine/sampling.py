"""Sampling cost: `sample_tokens` (temperature, nucleus filter, counter-based noise, argmax, log-prob and
entropy) eager against its compiled graph (the one the native engine's `rollout.compile` uses), on
random logits of the demo's vocabulary and of a 32k-token one, 64 rows, with and without top-p.

    python -m bench.engine.sampling     # about a minute on 2 CPU cores (the compile included)

Writes bench/results/sampling.json; prints a table. Both paths must pick the same tokens.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.common import RESULTS, write_results


def _mean_ms(fn, loops: int = 50) -> float:
    fn()
    fn()
    began = time.perf_counter()
    for _ in range(loops):
        fn()
    return 1000 * (time.perf_counter() - began) / loops


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, nargs="+", default=[100, 32000], help="vocabulary sizes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from everyprompt.rollout.native.compiled import _configure_inductor
    from everyprompt.rollout.sampling import sample_tokens

    _configure_inductor()
    compiled = torch.compile(sample_tokens, fullgraph=True)
    rows = []
    with torch.inference_mode():
        for vocab in args.vocab:
            for top_p in (1.0, 0.9):
                logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab))
                seeds, positions = torch.arange(64), torch.arange(64)
                for tensor in (logits, seeds, positions):
                    torch._dynamo.mark_dynamic(tensor, 0)
                call = (logits, seeds, positions, 1.0, top_p, False)
                eager_out, compiled_out = sample_tokens(*call), compiled(*call)
                rows.append(
                    {
                        "vocab": vocab,
                        "top_p": top_p,
                        "rows": 64,
                        "eager_ms": _mean_ms(lambda call=call: sample_tokens(*call)),
                        "compiled_ms": _mean_ms(lambda call=call: compiled(*call)),
                        "same_tokens": bool(torch.equal(eager_out[0], compiled_out[0])),
                        "logprob_max_abs_diff": float((eager_out[1] - compiled_out[1]).abs().max()),
                    }
                )
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "sampling.json", {"benchmark": "sampling", "rows": rows})
    table = Table(title="sample_tokens, 64 rows: eager vs compiled (ms per call)")
    for column in ("vocabulary", "top-p", "eager", "compiled", "ratio", "same tokens"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["vocab"]),
            f"{row['top_p']:.1f}",
            f"{row['eager_ms']:.2f}",
            f"{row['compiled_ms']:.2f}",
            f"{row['eager_ms'] / row['compiled_ms']:.1f}x",
            str(row["same_tokens"]),
        )
    Console(width=120).print(table)
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
