"""docs/gpu.md's decode-step table from a lent GPU's `dense` (or `moe`) result: what the suite's
bench/throughput wrote (throughput_<model>_cuda.json), as a markdown table, so the docs are regenerated
from the committed JSON instead of copied by hand.

    python -m bench.gpu.gpu_tables bench/results/gpu_h200_2026-11-28/throughput_smollm2-135m-instruct_cuda.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (row label, the decode row's key, its format); a missing key (an older result) prints as "-"
ROWS = (
    ("decode step with graphs, ms", "graphs_step_ms", "{:.2f}"),
    (
        "the same, reading each step's tokens before sending its forward, ms",
        "graphs_step_ms_read_first",
        "{:.2f}",
    ),
    ("decode step with graphs and compiled bodies, ms", "fused_graphs_step_ms", "{:.2f}"),
    ("decode step without (plain), ms", "step_ms", "{:.1f}"),
    ("its matmuls, eager / captured, ms", ("floor_ms", "captured_floor_ms"), "{:.1f} / {:.2f}"),
    ("tokens/s with graphs", "graphs_tokens_per_s", "{:.0f}"),
    ("transformers `generate`, tokens/s", "generate_tokens_per_s", "{:.0f}"),
    ("engine with graphs / `generate`", "graphs_speedup", "{:.1f}x"),
    ("capture, s (once per bucket)", "graph_capture_s", "{:.2f}"),
)


def _cell(row: dict, keys: tuple[str, ...], fmt: str) -> str:
    if not all(k in row for k in keys):
        return "-"
    if keys[0].startswith("fused_") and row.get("fused_compile_failed"):
        return "compile failed"  # the figure is the eager bodies' (the step fell back)
    return fmt.format(*(row[k] for k in keys))


def table(result: dict, title: str) -> str:
    """The markdown table of `result`'s decode rows (one column a batch), with the kernels a layer where
    the result counted them."""
    rows = result["decode"]
    lines = [
        f"| {title} | " + " | ".join(f"batch {row['batch']}" for row in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
    ]
    for label, key, fmt in ROWS:
        keys = key if isinstance(key, tuple) else (key,)
        if not any(all(k in row for k in keys) for row in rows):
            continue
        cells = [_cell(row, keys, fmt) for row in rows]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    counted = {row["batch"]: row for row in result.get("step_kernels", []) if row.get("per_step")}
    if counted:
        cells = [
            f"{counted[row['batch']]['per_layer']:.1f}" if row["batch"] in counted else "-" for row in rows
        ]
        lines.append("| kernels a layer (the step's over its layers) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", type=Path, help="a throughput_<model>_cuda.json")
    parser.add_argument("--title", help="the table's corner cell (default: the model, its dtype, the GPU)")
    args = parser.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
        result["decode"]
    except (OSError, ValueError, KeyError) as err:
        parser.error(f"{args.result}: not a throughput result with decode rows ({err})")
    machine = result.get("machine", {})
    title = args.title or f"{Path(result['model']).name}, {machine.get('dtype', '?')}"
    print(table(result, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
