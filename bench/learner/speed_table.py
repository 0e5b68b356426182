"""The README's speed table, generated from the model benchmarks' results (bench/results/throughput_*.json
written by `bench/throughput --model PATH`, and the RL step against TRL from rl_step_*.json written by
`bench/learner/rl_step.py --model PATH`); tests/test_bench.py fails when the README and the results disagree.

    python -m bench.learner.speed_table        # rewrites the table between the README's speed-table markers
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import RESULTS, ROOT

README = ROOT / "README.md"
# the table's TRL: glibc's allocator defaults and the recipe's micro-batch (other runs are kept apart)
KEPT = "everyprompt's keep_freed_memory"
MARKERS = ("<!-- speed-table -->", "<!-- /speed-table -->")


def model_results(folder: Path = RESULTS, device: str = "cpu") -> list[dict]:
    """The full (not --quick) model benchmark results in `folder` measured on `device` (its type: the
    README's table is the CPU's; GPU figures are in docs/gpu.md), largest model last."""
    found = []
    for path in sorted(folder.glob("throughput_*.json")):
        payload = json.loads(path.read_text())
        on = payload.get("device", "cpu").split(":")[0]
        if payload.get("benchmark") == "throughput_model" and not payload.get("quick") and on == device:
            found.append(payload)
    return sorted(found, key=lambda p: (p["parameters"], p["model"]))


def rl_step_results(folder: Path = RESULTS, device: str = "cpu") -> list[dict]:
    """The RL-step benchmark results (both trainers measured) in `folder` measured on `device` (its type:
    the README's table is the CPU's; a GPU's are in docs/gpu.md), by model."""
    found = [json.loads(path.read_text()) for path in sorted(folder.glob("rl_step_*.json"))]
    return [
        p
        for p in found
        if p.get("benchmark") == "rl_step"
        and p.get("everyprompt", {}).get("device", "cpu").split(":")[0] == device
        and "step_ratio" in p
        and p.get("trl_allocator") != KEPT
        and p.get("trl_micro_batch") == "matched"
        and p.get("rollout_precision", "matched") == "matched"
    ]


def rl_step_table(results: list[dict]) -> str:
    lines = [
        "| model | RL step, s: everyprompt / TRL `GRPOTrainer` | time | peak memory, GiB: everyprompt / TRL "
        "| memory | set-up |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        ours, trl = result["everyprompt"], result["trl"]
        gib = 2**30
        lines.append(
            f"| {Path(result['model']).name} | {ours['step_s']:.1f} / {trl['step_s']:.1f} "
            f"| **{result['step_ratio']:.2f}x** | {ours['peak_rss_bytes'] / gib:.2f} / "
            f"{trl['peak_rss_bytes'] / gib:.2f} | **{result['memory_ratio']:.2f}x** "
            f"| {ours['prompts_per_step']} prompts x {ours['group_size']} samples, {ours['max_new_tokens']} "
            f"new tokens at most, `{result['config']}`{_extra(result)}{_malloc(ours)} |"
        )
    lines.append(
        "\n`python -m bench.learner.rl_step --model PATH` (each trainer in its own process, micro-batches of the "
        "recipe's size on both sides, first step dropped)."
    )
    return "\n".join(lines)


def _malloc(ours: dict) -> str:
    """everyprompt's malloc where its probe ran on another than glibc's (the config's `malloc`)."""
    name = ours.get("malloc", "glibc")
    return "" if name == "glibc" else f"; everyprompt on {name}"


def _extra(result: dict) -> str:
    """The set-up's overrides (`--set`, both sides'; then everyprompt's own), as the table's set-up column
    names them."""
    given = [*(result.get("overrides") or []), *(result.get("everyprompt_overrides") or [])]
    return (" with " + ", ".join(f"`{o}`" for o in given)) if given else ""


def readme_section(results: list[dict], rl_steps: list[dict]) -> str:
    """What goes between the README's markers: the engine table, then the RL-step table if measured."""
    return table(results) + ("\n\n" + rl_step_table(rl_steps) if rl_steps else "")


def _compiled_floor(result: dict) -> str:
    """The compiled step against its matmuls, after the eager one, when it was measured."""
    if not result.get("compiled"):
        return ""
    return f" (compiled {_per_batch(result['decode'], 'compiled_step_vs_floor', '.2f')}x)"


def _per_batch(rows: list[dict], key: str, fmt: str) -> str:
    return " / ".join(format(row[key], fmt) for row in rows)


def table(results: list[dict]) -> str:
    compiled = any(result.get("compiled") for result in results)  # `--compile`: its column too
    lines = [
        "| model | decode tokens/s at batch "
        + " / ".join(str(r["batch"]) for r in results[0]["decode"])
        + " | vs `generate`, equal work "
        + ("| compiled step vs `generate` " if compiled else "")
        + "| decode step vs its matmuls alone | long-tailed rollout vs `generate` "
        "| prefill tokens/s at " + " / ".join(str(r["length"]) for r in results[0]["prefill"]) + " tokens |",
        "|---|---|---|---|---|---|" + ("---|" if compiled else ""),
    ]
    for result in results:
        decode, prefill, tail = result["decode"], result["prefill"], result["long_tail"]
        name = Path(result["model"]).name
        with_compiled = ""
        if compiled:
            with_compiled = (
                f"| {_per_batch(decode, 'compiled_speedup', '.2f')}x " if result.get("compiled") else "| - "
            )
        lines.append(
            f"| {name} ({result['parameters'] / 1e6:.0f}M, {result['model_type']}) "
            f"| {_per_batch(decode, 'native_tokens_per_s', '.0f')} "
            f"| {_per_batch(decode, 'speedup', '.2f')}x "
            + with_compiled
            + f"| {_per_batch(decode, 'step_vs_floor', '.2f')}x{_compiled_floor(result)} "
            f"| {tail['speedup']:.1f}x ({tail['requests']} requests, {tail['slots']} slots) "
            f"| {_per_batch(prefill, 'native_tokens_per_s', '.0f')} |"
        )
    machine = results[0]["machine"]
    lines.append(
        f"\n{machine.get('cpu', 'CPU')}, {machine.get('torch_threads')} torch threads, torch {machine.get('torch')}, "
        f"{machine.get('dtype')}, device {results[0]['device']}; `python -m bench.throughput --model PATH`, "
        "then `python -m bench.learner.speed_table`."
    )
    return "\n".join(lines)


def section(text: str) -> str:
    start, end = (text.index(marker) for marker in MARKERS)
    return text[start + len(MARKERS[0]) : end].strip("\n")


def write_readme(results: list[dict], rl_steps: list[dict], readme: Path = README) -> None:
    text = readme.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    body = readme_section(results, rl_steps)
    readme.write_text(text[: start + len(MARKERS[0])] + "\n" + body + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the benchmarks' results (bench/results)")
    parser.add_argument("--readme", type=Path, default=README, help="the page whose table is rewritten (README.md)")
    args = parser.parse_args(argv)
    found = model_results(args.results)
    if not found:
        sys.exit(f"no model benchmark results in {args.results} (run bench/throughput --model PATH)")
    if not args.readme.is_file():
        sys.exit(f"--readme {args.readme}: no such page")
    write_readme(found, rl_step_results(args.results), args.readme)
    print(f"wrote the speed table of {len(found)} model(s) into {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
