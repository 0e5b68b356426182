"""Train/inference mismatch: engine precision x router replay, on the demo model after SFT.

For each engine precision (fp32, bf16, fp8) and replay mode (off, r3), samples RL batches from the SFT
checkpoint and measures the trainer's (fp32) old-policy pass against the engine that sampled: routing
agreement, |dlogp| overall and on tokens whose routing flipped, k3 KL, share of ratios > 2. Below fp32,
per token and MoE layer, the router perturbation (L2 distance between the engine's router logits, as its
decode steps computed them, and the trainer's) and how much larger it is after a token's first flipped
layer than on unflipped tokens: how a flip compounds through later layers, and whether replay stops it.
Under r3, the tokens that flipped without replay are compared with unflipped tokens of the same entropy,
and of the same entropy, sampled-token log-prob and router perturbation (the precision error that makes
a route flip, which replay does not remove). Then a short RL run per fp8 cell shows whether training
stays stable.

    python -m bench.engine.mismatch               # ~10 minutes on 2 CPU cores (trains the SFT checkpoint if missing)
    python -m bench.engine.mismatch --tiny        # seconds: a smoke run on a 2-layer model
    python -m bench.engine.mismatch --config configs/smollm2-moe.yaml --name mismatch_smollm2_moe \
        --set model.dtype=fp32 --precisions bf16 --batches 4   # a config's own model as it is (~12 min)

Writes bench/results/NAME.json (`--name`, default mismatch; per-token data: bench/results/NAME_runs/*/tokens.pt);
prints the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import RESULTS, repo_path, write_results
from bench.engine.mismatch_analysis import (
    downstream_ratio,
    flipped_token_analysis,
    record_router_logits,
    router_perturbation,
)
from bench.quality.algorithms import TINY, nan_mean, prepare_sft
from everyprompt.models.replay import same_expert_sets

KEYS = (
    "mismatch/routing_agreement",
    "mismatch/flipped_token_fraction",
    "mismatch/logp_abs_diff",
    "mismatch/logp_abs_diff_flipped",
    "mismatch/logp_abs_diff_unflipped",
    "mismatch/k3_kl",
    "mismatch/ratio_above_2",
)


def measure(
    base: list[str],
    precision: str,
    replay: str,
    batches: int,
    run_dir: Path,
    flipped: list | None = None,
    config: Path | None = None,
) -> dict:
    """Mismatch metrics over `batches` RL batches. With replay off, fills `flipped` with each batch's
    completions and per-token, per-layer flip mask; with r3 and `flipped` given, also reports |dlogp| on
    exactly those tokens (the engine draws the same samples in both cells: same weights, seeds and
    precision). Below fp32, both cells also measure the router perturbation per token and layer, and
    how much larger it is after a token's first flip than on unflipped tokens (`downstream_ratio`)."""
    import torch

    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    # eager decoding throughout: `rollout.compile=auto` switches to the compiled step after a number of
    # seconds, whose kernels round differently in bf16, so the off and r3 cells would sample differently
    overrides = [
        *base,
        f"rollout.precision={precision}",
        f"rl.router_replay={replay}",
        "rl.old_logprobs=recompute",
        "rollout.compile=off",
    ]
    trainer = Run(load_config(config, overrides), run_dir).trainer()
    # an fp32 engine flips nothing (the trainer's arithmetic up to kernel order): no per-token passes
    per_token = precision != "fp32" and flipped is not None
    engine_logits = record_router_logits(trainer.engine) if per_token else None
    per_batch, tokens = [], []
    for index in range(batches):
        if engine_logits is not None:
            engine_logits.clear()
        batch = trainer.rollout.next_batch(index)  # a step's seeds: fresh samples, same weights
        stats = trainer.learner.old_logprobs(batch)  # the measured pass: fp32 trainer vs the engine
        per_batch.append({k: stats.get(k, float("nan")) for k in KEYS})
        if replay == "off" and flipped is not None:
            mask = []  # the old-policy pass above ran without replay: its routes are the trainer's own
            for prompt, mine, engine in zip(batch.prompt_ids, batch.old_routes, batch.routed_experts):
                n = len(engine)
                mask.append(~same_expert_sets(mine[:n], engine)[len(prompt) - 1 :])  # [T, L_moe]
            flipped.append((batch.completion_ids, torch.cat(mask)))
        elif replay == "r3" and flipped and batch.completion_ids != flipped[index][0]:
            raise RuntimeError("the off and r3 cells sampled different completions; cannot compare per token")
        if per_token and (replay == "off" or flipped):
            tokens.append(
                {
                    "diff": (torch.cat(batch.old_logprobs) - torch.cat(batch.rollout_logprobs)).abs(),
                    "flipped_layers": flipped[index][1],  # [N, L_moe], as the off cell saw them
                    "entropy": torch.cat(batch.rollout_entropies),
                    "logprob": torch.cat(batch.rollout_logprobs),
                    "perturbation_layers": router_perturbation(
                        trainer, batch, engine_logits, replayed=replay == "r3"
                    ),
                }
            )
    result = {key: nan_mean([b[key] for b in per_batch]) for key in KEYS}
    if tokens:
        tokens = {key: torch.cat([t[key] for t in tokens]) for key in tokens[0]}
        torch.save(tokens, run_dir / "tokens.pt")  # per completion token, for further analysis
        if tokens["flipped_layers"].any():
            result["downstream_perturbation_ratio"] = downstream_ratio(
                tokens["perturbation_layers"], tokens["flipped_layers"]
            )
            if replay == "r3":
                result.update(
                    flipped_token_analysis(
                        tokens["diff"],
                        tokens["flipped_layers"].any(-1),
                        tokens["entropy"],
                        tokens["perturbation_layers"].amax(-1),
                        tokens["logprob"],
                    )
                )
    return result


def _ratio(cell: dict, name: str) -> str:
    """'ratio (low-high)' of a flipped-token ratio, '-' where the cell has none."""
    if name not in cell:
        return "-"
    low, high = cell[f"{name}_ci95"]
    return f"{cell[name]:.2f} ({low:.2f}-{high:.2f})"


def _flipped_vs_unflipped(cell: dict) -> str:
    """|dlogp| on flipped / unflipped tokens: this cell's own flips, or under r3 the off cell's."""
    if "flipped_tokens" in cell:
        flipped, unflipped = (
            cell["logp_abs_diff_on_off_flipped_tokens"],
            cell["logp_abs_diff_on_off_unflipped_tokens"],
        )
    else:
        flipped, unflipped = cell["mismatch/logp_abs_diff_flipped"], cell["mismatch/logp_abs_diff_unflipped"]
    if flipped != flipped:  # nothing flipped
        return "-"
    return f"{flipped:.2e} / {unflipped:.2e} ({flipped / unflipped:.2f}x)"


def short_rl(
    base: list[str], precision: str, replay: str, steps: int, run_dir: Path, config: Path | None = None
) -> dict:
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    overrides = [
        *base,
        f"rollout.precision={precision}",
        f"rl.router_replay={replay}",
        "rl.old_logprobs=recompute",
        f"rl.steps={steps}",
        "checkpoint.every=0",
    ]
    run = Run(load_config(config, overrides), run_dir)
    trainer = run.trainer()
    history = trainer.train()
    final = run.evaluate(trainer.engine, trainer.tokenizer)
    finite = all(v == v for m in history for k, v in m.items() if k.startswith(("loss/", "actor/")))
    return {
        "steps": len(history),
        "final_greedy_accuracy": final["greedy_accuracy"],
        "reward_first": nan_mean([m["reward/accuracy"] for m in history[: max(1, steps // 4)]]),
        "reward_last": nan_mean([m["reward/accuracy"] for m in history[-max(1, steps // 4) :]]),
        "logp_abs_diff_mean": nan_mean([m.get("mismatch/logp_abs_diff", float("nan")) for m in history]),
        "all_finite": finite,
    }


def summary_table(payload: dict):
    from rich.table import Table

    cells = payload["cells"]
    trainer = payload.get("trainer_dtype", "fp32")
    table = Table(title=f"Trainer ({trainer}) vs engine: mismatch per precision and replay mode")
    for column in (
        "precision",
        "replay",
        "routing agreement",
        "flipped tokens",
        "|dlogp|",
        "|dlogp| flipped / unflipped (r3: on off's flips)",
        "r3 flipped / entropy-matched unflipped (95% CI)",
        "r3 flipped / entropy + log-prob + perturbation matched (95% CI)",
        "the same, |dlogp| capped at its 99.9th pct",
        "router error after a flip (x unflipped)",
        "k3 KL",
        "ratio > 2",
        "fp8 RL: acc first->last, final greedy",
    ):
        table.add_column(column, justify="right")
    for cell in cells:
        rl = cell.get("rl")
        downstream = cell.get("downstream_perturbation_ratio")
        table.add_row(
            cell["precision"],
            cell["replay"],
            f"{cell['mismatch/routing_agreement']:.4f}",
            f"{cell['mismatch/flipped_token_fraction']:.3f}",
            f"{cell['mismatch/logp_abs_diff']:.2e}",
            _flipped_vs_unflipped(cell),
            _ratio(cell, "flipped_over_matched_ratio"),
            _ratio(cell, "flipped_over_fully_matched_ratio"),
            _ratio(cell, "flipped_over_fully_matched_ratio_capped"),
            "-" if downstream is None else f"{downstream:.2f}",
            f"{cell['mismatch/k3_kl']:.2e}",
            f"{cell['mismatch/ratio_above_2']:.4f}",
            "-"
            if rl is None
            else f"{rl['reward_first']:.2f}->{rl['reward_last']:.2f}, {rl['final_greedy_accuracy']:.1%}"
            + ("" if rl["all_finite"] else " (non-finite!)"),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=24, help="RL batches measured per cell")
    parser.add_argument(
        "--rl-steps", type=int, default=20, help="RL steps of the fp8 stability runs (0: none)"
    )
    parser.add_argument("--precisions", default="fp32,bf16,fp8", help="engine precisions measured")
    parser.add_argument("--sft-seed", type=int, default=1)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the measured runs (prompts, samples); default: --sft-seed",
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="measure this config's model (e.g. configs/smollm2-moe.yaml) as it is, instead of the demo "
        "model after SFT",
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of every measured run"
    )
    parser.add_argument(
        "--name", default="mismatch", help="results file bench/results/NAME.json, runs under NAME_runs/"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the table of the saved results and exit")
    args = parser.parse_args(argv)

    from rich.console import Console

    from everyprompt.config import load_config

    console = Console(width=200)
    if args.table:
        console.print(summary_table(json.loads((args.out / f"{args.name}.json").read_text())))
        return 0
    started = time.perf_counter()
    base = ["eval.num_samples=1", "eval.pass_k=1", "logging.progress=false", "logging.tensorboard=false"]
    base += TINY if args.tiny else []
    base += args.set
    work = args.out / f"{args.name}_runs"
    work.mkdir(parents=True, exist_ok=True)
    seed = args.sft_seed if args.seed is None else args.seed
    if args.config is None:  # the demo model after SFT; a config's own model is measured as it is
        sft = prepare_sft(
            [*base, f"seed={args.sft_seed}"], work.parent / "zve_runs" / f"sft_seed{args.sft_seed}"
        )
        base.append(f"model.path={sft}")
    base += ["sft.steps=0", f"seed={seed}"]
    measured = load_config(args.config, base).model
    trainer_dtype = measured.dtype
    cells = []
    for precision in args.precisions.split(","):
        flipped: list = []
        for replay in ("off", "r3"):
            console.print(f"measuring {precision} / replay {replay} ...")
            cell = {"precision": precision, "replay": replay}
            cell.update(
                measure(
                    base,
                    precision,
                    replay,
                    args.batches,
                    work / f"{precision}_{replay}",
                    flipped,
                    args.config,
                )
            )
            if precision == "fp8" and args.rl_steps > 0:
                cell["rl"] = short_rl(
                    base, precision, replay, args.rl_steps, work / f"rl_{precision}_{replay}", args.config
                )
            cells.append(cell)
    payload = {
        "benchmark": "mismatch",
        "config": None if args.config is None else repo_path(args.config),
        "overrides": args.set,
        "trainer_dtype": trainer_dtype,
        "model": repo_path(measured.path),
        "batches": args.batches,
        "seed": seed,
        "cells": cells,
        "tiny": args.tiny,
        "wall_seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results = write_results(args.out / f"{args.name}.json", payload, dtype=f"{trainer_dtype} trainer")
    console.print(f"wrote {results}")
    console.print(summary_table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
