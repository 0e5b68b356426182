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

    python bench/mismatch.py               # ~10 minutes on 2 CPU cores (trains the SFT checkpoint if missing)
    python bench/mismatch.py --tiny        # seconds: a smoke run on a 2-layer model

Writes bench/results/mismatch.json (per-token data: bench/results/mismatch_runs/*/tokens.pt); prints the
table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from algorithms import TINY, nan_mean, prepare_sft, repo_path  # noqa: E402
from everyprompt.models.replay import same_expert_sets  # noqa: E402

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
    base: list[str], precision: str, replay: str, batches: int, run_dir: Path, flipped: list | None = None
) -> dict:
    """Mismatch metrics over `batches` RL batches. With replay off, fills `flipped` with each batch's
    completions and per-token, per-layer flip mask; with r3 and `flipped` given, also reports |dlogp| on
    exactly those tokens (the engine draws the same samples in both cells: same weights, seeds and
    precision). Below fp32, both cells also measure the router perturbation per token and layer, and
    how much larger it is after a token's first flip than on unflipped tokens (`downstream_ratio`)."""
    import torch

    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    overrides = [
        *base,
        f"rollout.precision={precision}",
        f"rl.router_replay={replay}",
        "rl.old_logprobs=recompute",
    ]
    trainer = Run(load_config(None, overrides), run_dir).trainer()
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


def downstream_ratio(perturbation, flipped) -> float:
    """How a route flip compounds through the later layers: over tokens whose first flip is at MoE layer
    f < L - 1, the mean router perturbation at layers f+1..L-1, divided by the unflipped tokens' mean at
    those same layers. perturbation [N, L] float, flipped [N, L] bool. Without replay a flip sends the
    token through other experts and the later layers' inputs drift apart (ratio above 1); with replay
    the later layers see only the precision error (ratio 1)."""
    import torch

    layers = flipped.shape[1]
    any_flip = flipped.any(-1)
    first = torch.where(
        any_flip, flipped.float().argmax(-1), torch.full_like(any_flip, layers, dtype=torch.long)
    )
    later = torch.arange(layers)[None, :] > first[:, None]  # [N, L]: layers after the first flip
    chosen = any_flip & (first < layers - 1)
    if not chosen.any() or any_flip.all():
        return float("nan")
    control = perturbation[~any_flip].mean(0)  # [L]: unflipped tokens' mean per layer
    weight = later[chosen].float()
    return float((perturbation[chosen] * weight).sum() / (control[None, :] * weight).sum())


def record_router_logits(engine) -> dict:
    """Make every `engine.generate` call also record the router logits of each token it feeds (as the
    decode steps that sampled it computed them); returns the dict they land in, keyed by (prompt ids,
    completion ids)."""
    from dataclasses import replace

    store: dict = {}
    generate = engine.generate

    def recording(requests, params):
        for completion in generate(requests, replace(params, record_router_logits=True)):
            store[(tuple(completion.prompt_ids), tuple(completion.token_ids))] = completion.router_logits
            yield completion

    engine.generate = recording
    return store


def router_perturbation(trainer, batch, engine_logits: dict, replayed: bool = True):
    """Per completion token and MoE layer [N, L_moe]: how far the engine's router logits are from the
    trainer's at that token's position (L2 distance). With the engine's routes replayed (`replayed`)
    both compute the same network, and the distance is the precision error at the routers' input, what
    makes a top-k choice flip and what replay cannot remove; without, it also holds the drift that
    earlier flips caused. The engine's logits are those its decode steps computed while
    sampling (`record_router_logits`), so the distance is exactly the one the sampled routes saw."""
    import torch

    from everyprompt.models.replay import RouterReplay

    model = trainer.model
    replay, out = RouterReplay(model), []
    trainer_logits: list = []
    hooks = [
        r.register_forward_hook(lambda _m, _i, o: trainer_logits.append(o[0].float())) for r in replay.routers
    ]
    try:
        for prompt, completion, routes in zip(batch.prompt_ids, batch.completion_ids, batch.routed_experts):
            ids = prompt + completion
            engine = engine_logits[(tuple(prompt), tuple(completion))]  # [len(ids) - 1, L_moe, E]
            trainer_logits.clear()
            with torch.no_grad(), replay.replay(routes) if replayed else nullcontext():
                model(input_ids=torch.tensor([ids[:-1]]))
            distance = torch.stack(
                [
                    (engine[:, layer] - t.reshape(engine[:, layer].shape)).norm(dim=-1)
                    for layer, t in enumerate(trainer_logits)
                ],
                dim=1,
            )  # [len(ids) - 1, L_moe]
            out.append(distance[len(prompt) - 1 :])
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(out)


def _ranks(values, reference):
    """Each value's empirical CDF position within `reference` (0..1)."""
    import torch

    ordered = torch.sort(reference).values.contiguous()
    return torch.searchsorted(ordered, values.contiguous()).float() / len(ordered)


def _matched_control(mask, features, control_diff, neighbours: int):
    """Per flipped token (`mask`), the mean |dlogp| of the `neighbours` unflipped tokens nearest to it in
    `features` (per-token tensors, each as its rank among the unflipped tokens' values)."""
    import torch

    flipped_features = torch.stack([_ranks(f[mask], f[~mask]) for f in features], dim=1)
    control_features = torch.stack([_ranks(f[~mask], f[~mask]) for f in features], dim=1)
    means = []
    for chunk in torch.split(flipped_features, 256):
        nearest = torch.cdist(chunk, control_features).topk(neighbours, largest=False).indices
        means.append(control_diff[nearest].mean(-1))
    return torch.cat(means)


def _ratio_ci(flipped_diff, control, resamples: int) -> list[float]:
    """95% bootstrap interval of mean(flipped) / mean(matched control), resampling the flipped tokens."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(resamples):
        pick = torch.randint(len(flipped_diff), (len(flipped_diff),), generator=generator)
        ratios.append(float(flipped_diff[pick].mean() / control[pick].mean()))
    return torch.quantile(torch.tensor(ratios), torch.tensor([0.025, 0.975])).tolist()


def flipped_token_analysis(
    diff,
    mask,
    entropy,
    perturbation=None,
    logprob=None,
    neighbours: int = 10,
    resamples: int = 2000,
    cap_quantile: float = 0.999,
) -> dict:
    """r3's |dlogp| on the tokens whose routing flipped without replay, against unflipped tokens.

    Raw means first. |dlogp| grows steeply with the token's entropy and flips are not spread evenly over
    entropies, so each flipped token is also compared with the `neighbours` unflipped tokens nearest to it
    in engine entropy; and, with `perturbation` (see `router_perturbation`), nearest in entropy and router
    perturbation together (both as ranks): flips happen where the precision error is largest, and a
    token with a larger precision error has a larger |dlogp| whatever its routing. With `logprob` too (the
    engine's log-prob of the sampled token), nearest in all three: how far a given logit error moves a
    token's log-prob depends on that token's probability (the rare samples carry most of the mean). Each
    is a property of the token fixed before any trainer pass. That last ratio is also given with every
    |dlogp| capped at its `cap_quantile` quantile over all tokens, flipped or not. The ratios' 95%
    intervals come from resampling the flipped tokens."""
    import torch

    flipped_diff, flipped_entropy = diff[mask], entropy[mask]
    control_entropy, control_diff = entropy[~mask], diff[~mask]
    # entropy alone: the `neighbours` unflipped tokens around each flipped one in entropy order
    order = torch.argsort(control_entropy)
    start = (
        torch.searchsorted(control_entropy[order].contiguous(), flipped_entropy.contiguous())
        - neighbours // 2
    )
    start = start.clamp(0, len(order) - neighbours)
    sorted_diff = control_diff[order]
    by_entropy = torch.stack([sorted_diff[start + i] for i in range(neighbours)]).mean(0)
    result = {
        "flipped_tokens": int(mask.sum()),
        "tokens": len(mask),
        "logp_abs_diff_on_off_flipped_tokens": float(flipped_diff.mean()),
        "logp_abs_diff_on_off_unflipped_tokens": float(control_diff.mean()),
        "logp_abs_diff_entropy_matched_unflipped": float(by_entropy.mean()),
        "flipped_over_matched_ratio": float(flipped_diff.mean() / by_entropy.mean()),
        "flipped_over_matched_ratio_ci95": _ratio_ci(flipped_diff, by_entropy, resamples),
        "median_logp_abs_diff_on_off_flipped_tokens": float(flipped_diff.median()),
        "median_logp_abs_diff_on_off_unflipped_tokens": float(control_diff.median()),
        "entropy_flipped": float(flipped_entropy.mean()),
        "entropy_unflipped": float(control_entropy.mean()),
    }
    if perturbation is not None:
        flipped_p, control_p = perturbation[mask], perturbation[~mask]
        both = _matched_control(mask, (entropy, perturbation), control_diff, neighbours)
        result.update(
            {
                "router_perturbation_flipped": float(flipped_p.mean()),
                "router_perturbation_unflipped": float(control_p.mean()),
                "logp_abs_diff_perturbation_matched_unflipped": float(both.mean()),
                "flipped_over_perturbation_matched_ratio": float(flipped_diff.mean() / both.mean()),
                "flipped_over_perturbation_matched_ratio_ci95": _ratio_ci(flipped_diff, both, resamples),
            }
        )
        if logprob is not None:
            features = (entropy, logprob, perturbation)
            full = _matched_control(mask, features, control_diff, neighbours)
            # the same with every |dlogp| capped at the sample's 99.9th percentile: a single token can
            # move the mean (a rare sample at a position the model never trained on can differ by ~10
            # nats between fp8 and fp32 weights), the cap keeps the comparison about the typical token
            cap = float(torch.quantile(diff, cap_quantile))
            capped_full = _matched_control(mask, features, control_diff.clamp(max=cap), neighbours)
            capped_flipped = flipped_diff.clamp(max=cap)
            result.update(
                {
                    "logp_abs_diff_fully_matched_unflipped": float(full.mean()),
                    "flipped_over_fully_matched_ratio": float(flipped_diff.mean() / full.mean()),
                    "flipped_over_fully_matched_ratio_ci95": _ratio_ci(flipped_diff, full, resamples),
                    "logp_abs_diff_cap": cap,
                    "flipped_over_fully_matched_ratio_capped": float(
                        capped_flipped.mean() / capped_full.mean()
                    ),
                    "flipped_over_fully_matched_ratio_capped_ci95": _ratio_ci(
                        capped_flipped, capped_full, resamples
                    ),
                }
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


def short_rl(base: list[str], precision: str, replay: str, steps: int, run_dir: Path) -> dict:
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
    run = Run(load_config(None, overrides), run_dir)
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
    table = Table(title="Trainer (fp32) vs engine: mismatch per precision and replay mode")
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
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the table of the saved results and exit")
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console(width=200)
    if args.table:
        console.print(summary_table(json.loads((args.out / "mismatch.json").read_text())))
        return 0
    started = time.perf_counter()
    base = ["eval.num_samples=1", "eval.pass_k=1", "logging.progress=false", "logging.tensorboard=false"]
    base += TINY if args.tiny else []
    work = args.out / "mismatch_runs"
    work.mkdir(parents=True, exist_ok=True)
    sft_dir = prepare_sft(
        [*base, f"seed={args.sft_seed}"], work.parent / "zve_runs" / f"sft_seed{args.sft_seed}"
    )
    seed = args.sft_seed if args.seed is None else args.seed
    base += [f"model.path={sft_dir}", "sft.steps=0", f"seed={seed}"]
    cells = []
    for precision in args.precisions.split(","):
        flipped: list = []
        for replay in ("off", "r3"):
            console.print(f"measuring {precision} / replay {replay} ...")
            cell = {"precision": precision, "replay": replay}
            cell.update(
                measure(base, precision, replay, args.batches, work / f"{precision}_{replay}", flipped)
            )
            if precision == "fp8" and args.rl_steps > 0:
                cell["rl"] = short_rl(
                    base, precision, replay, args.rl_steps, work / f"rl_{precision}_{replay}"
                )
            cells.append(cell)
    payload = {
        "benchmark": "mismatch",
        "sft_checkpoint": repo_path(sft_dir),
        "batches": args.batches,
        "seed": seed,
        "cells": cells,
        "tiny": args.tiny,
        "wall_seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mismatch.json").write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {args.out / 'mismatch.json'}")
    console.print(summary_table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
