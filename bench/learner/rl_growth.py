"""How the RL step's time and peak memory grow with the group size and with the completion length:
everyprompt against TRL's GRPOTrainer at each point, each trainer in a process of its own (bench/learner/rl_step.py
measures one point), on the recipe `--config` (configs/smollm2.yaml) with `model.path=--model`.

The points: group sizes `--groups` at the recipe's completion cap, and completion caps `--lengths` at the
recipe's group size; both trainers with the recipe's micro-batch size (TRL by gradient accumulation). A
chat model stops on its own, so a cap bounds the length without setting it: the table and the plot give
the mean length each trainer actually generated.

    python -m bench.learner.rl_growth --model models/smollm2-135m-instruct     # ~30 minutes on 2 cores

Writes bench/results/rl_growth_<model>.json and rl_growth_<model>.png.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.common import ProbeFailed, recipe_parser, repo_path, require_model, write_results
from bench.learner.rl_step import bench_overrides, matched_precision, measure

TRAINERS = ("everyprompt", "trl")


def points(config: Path, groups: list[int], lengths: list[int]) -> list[dict]:
    """The grid: (axis, value, overrides) with the recipe's own point measured once."""
    from everyprompt.config import load_config

    recipe = load_config(config, [])
    grid = [{"axis": "group_size", "value": g, "set": [f"rl.group_size={g}"]} for g in groups]
    grid += [{"axis": "max_new_tokens", "value": n, "set": [f"rollout.max_new_tokens={n}"]} for n in lengths]
    for point in grid:  # what the other axis is held at
        point["group_size"] = point["value"] if point["axis"] == "group_size" else recipe.rl.group_size
        point["max_new_tokens"] = (
            point["value"] if point["axis"] == "max_new_tokens" else recipe.rollout.max_new_tokens
        )
    return grid


def attempt(trainer: str, config: Path, overrides: list[str], steps: int) -> dict:
    """`measure`, or what stopped it: a trainer that runs out of memory at a point is a finding, not
    the end of the benchmark (the kernel's OOM killer ends it with signal 9)."""
    try:
        return measure(trainer, config, overrides, steps)
    except ProbeFailed as err:
        print(f"  {trainer} failed: {err.how}", flush=True)
        return {"failed": err.how}


def _cells(ours: dict, trl: dict) -> list[str]:
    """The row's measured cells; a failed trainer's cells say so."""
    gib = 2**30

    def each(key, fmt, scale=1.0):
        return " / ".join(
            "failed" if "failed" in side else format(side[key] / scale, fmt) for side in (ours, trl)
        )

    def ratio(key):
        return "" if "failed" in ours or "failed" in trl else f"{ours[key] / trl[key]:.2f}x"

    return [
        each("mean_length", ".0f"),
        each("step_s", ".1f"),
        ratio("step_s"),
        each("peak_rss_bytes", ".2f", gib),
        ratio("peak_rss_bytes"),
    ]


def table(results: list[dict]) -> str:
    lines = [
        "| group size | cap | mean length (ours / TRL) | step s (ours / TRL) | ratio | peak GiB (ours / TRL) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results:
        cells = [str(row["group_size"]), str(row["max_new_tokens"]), *_cells(row["everyprompt"], row["trl"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex="col")
    for column, axis in enumerate(("group_size", "max_new_tokens")):
        rows = sorted((r for r in results if r["axis"] == axis), key=lambda r: r["value"])
        x = [r["value"] for r in rows]
        for trainer in TRAINERS:
            done = [r for r in rows if "failed" not in r[trainer]]
            xs = [r["value"] for r in done]
            axes[0, column].plot(xs, [r[trainer]["step_s"] for r in done], "o-", label=trainer)
            axes[1, column].plot(
                xs, [r[trainer]["peak_rss_bytes"] / 2**30 for r in done], "o-", label=trainer
            )
            for r in rows:
                if "failed" in r[trainer]:  # where a trainer could not run the point
                    for axis_ in axes[:, column]:  # (signal 9: the kernel's out-of-memory killer)
                        axis_.annotate(
                            f"{trainer}: {r[trainer]['failed']}",
                            (r["value"], 0.92),
                            xycoords=("data", "axes fraction"),
                            ha="right",
                            fontsize=8,
                            color="tab:red",
                        )
        axes[0, column].set_ylabel("seconds a step")
        axes[1, column].set_ylabel("peak resident memory, GiB")
        axes[1, column].set_xlabel("group size" if axis == "group_size" else "completion cap, tokens")
        for row in axes[:, column]:
            row.set_xscale("log", base=2)
            row.set_xticks(x, [str(v) for v in x])
            row.grid(alpha=0.3)
            row.legend()
    figure.suptitle("RL step on the same model: everyprompt and TRL's GRPOTrainer (2 CPU cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = recipe_parser(__doc__)
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--lengths", type=int, nargs="+", default=[48, 96, 192])
    parser.add_argument(
        "--steps", type=int, default=2, help="steps per trainer and point (the first dropped)"
    )
    args = require_model(parser, parser.parse_args(argv))
    base = bench_overrides(args.model, args.set)
    started = time.perf_counter()
    measured: dict[tuple[int, int], dict] = {}  # the recipe's own point is on both axes: measured once
    results = []
    for point in points(args.config, args.groups, args.lengths):
        key = (point["group_size"], point["max_new_tokens"])
        if key not in measured:
            print(f"group size {key[0]}, cap {key[1]} ...", flush=True)
            measured[key] = {t: attempt(t, args.config, [*base, *point["set"]], args.steps) for t in TRAINERS}
        results.append({**point, **measured[key]})
        print(table(results[-1:]).splitlines()[-1], flush=True)
    name = args.model.name.removesuffix(".gguf")
    out = args.out / f"rl_growth_{name}.json"
    payload = {
        "benchmark": "rl_growth",
        "model": repo_path(args.model),
        "config": repo_path(args.config),
        "overrides": args.set,
        "steps": args.steps,
        "trl_allocator": "glibc defaults",
        "trl_micro_batch": "matched",  # measure()'s default: TRL's micro-batch is the recipe's
        # measure()'s default: everyprompt decodes in TRL's arithmetic
        "everyprompt_overrides": matched_precision(args.config, base),
        "points": results,
        "wall_seconds": time.perf_counter() - started,
    }
    write_results(out, payload)
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {repo_path(out)} and {repo_path(out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
