"""Rollout throughput: engine speed, reward overlap, length-aware scheduling, and an RL step against TRL.

Each comparison runs in one process on the same model, prompts and sampling settings:
  (a) the native and hf engines' tokens/s against transformers' `generate`: the same batch decoding the
      same number of tokens per sequence (the kernels' speed), and a rollout workload (the long-tailed
      length mix of (c), each request cut at its own length; `generate` in batches of the engine's slot
      count, each batch running until its longest request is done, as static batching does);
  (b) rollout + a deliberately slow reward (a 20 ms call per completion, as a remote judge would take),
      scored after generation vs streamed into the RewardPool during it, against rollout alone;
  (c) a long-tailed length mix through a few slots, `fifo` vs `longest_first` admission: wall time and
      idle slot fraction (lengths predicted from a previous visit's history in the pass-rate store);
  (d) one RL step (rollout, rewards, update, weight sync) of everyprompt vs TRL's GRPOTrainer on the
      demo model after SFT, with the same group size, prompts per step, lr and completion cap.

    python -m bench.throughput           # ~10 minutes on 2 CPU cores (trains the SFT checkpoint if missing)
    python -m bench.throughput --tiny    # seconds: a smoke run on a 2-layer model (skips TRL unless --trl)

Writes bench/results/throughput.json; prints the summary table last.

With `--model PATH` (a checkpoint directory or a .gguf file) it measures that model instead
(bench/throughput/model.py: decode at several batch sizes against `generate` and against its floor,
long-tailed lengths, prefill), on `--device` (cpu, cuda, cuda:N) in `--dtype`:

    python -m bench.throughput --model models/smollm2-135m-instruct            # bench/results/throughput_smollm2-135m-instruct.json
    python -m bench.throughput --model models/smollm2-135m-instruct --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import RESULTS, repo_path, write_results
from bench.quality.algorithms import TINY, prepare_sft
from bench.throughput.engine import engine_vs_hf, engine_vs_hf_rollout, short_op
from bench.throughput.floor import compile_cost, compile_probe, decode_floor, training_floor
from bench.throughput.rl import everyprompt_steps, trl_steps
from bench.throughput.rollout import reward_overlap, scheduling
from bench.throughput.setup import load_demo_model

# sizes per comparison: (--tiny smoke run, real run)
SCALES = {
    "batch": (8, 64),  # (a) sequences decoded together (also the slots of the rollout workload)
    "new_tokens": (8, 64),  # (a) tokens per sequence
    "repeats": (1, 2),  # (a), (c) timed calls, fastest kept
    "count": (16, 128),  # (b) completions
    "overlap_repeats": (1, 9),  # (b) interleaved alone / overlapped pairs
    "cap": (8, 64),  # (b) longest completion
    "slots": (4, 32),  # (c) engine slots
    "sched": (32, 256),  # (c) requests
    "short": ((2, 4), (8, 24)),  # (c) lengths of the short 90%
    "long": ((12, 16), (96, 160)),  # (c) lengths of the long 10%
}


def _batches(text: str) -> tuple[int, ...]:
    """`--batches 1,64`: positive batch sizes, ascending."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--trl", action="store_true", help="with --tiny: run the TRL comparison too")
    parser.add_argument("--rl-steps", type=int, default=6, help="RL steps timed per trainer (first dropped)")
    parser.add_argument("--sft-seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--compile-probe", help=argparse.SUPPRESS)  # compile_cost()'s child process
    parser.add_argument("--model", type=Path, help="measure this model (a directory or .gguf) instead")
    parser.add_argument("--device", default="cpu", help="with --model: cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="with --model")
    parser.add_argument("--quick", action="store_true", help="with --model: every size shrunk (smoke runs)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --model: the compiled decode step (rollout.compile=on) measured beside the eager one",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="with --model: the static decode step (CUDA graphs on a CUDA device, eager elsewhere) measured "
        "beside the plain one, and its greedy completions checked against the eager step's",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="with --model --graphs: the static step's bodies through torch.compile too (rollout.compile=on: "
        "Inductor's fused kernels, captured on a CUDA device), timed and counted beside the eager bodies",
    )
    parser.add_argument(
        "--decode-only", action="store_true", help="with --model: decode only (no long-tail or prefill runs)"
    )
    parser.add_argument(
        "--batches",
        type=_batches,
        help="with --model: the decode batches, comma-separated (default 1,8,32,64; --quick 1,4)",
    )
    args = parser.parse_args(argv)
    if args.compile_probe:
        print(json.dumps(compile_probe(*json.loads(args.compile_probe))))
        return 0
    if args.fused and not args.graphs:
        parser.error(
            "--fused times the static step's compiled bodies beside its eager ones: it goes with --graphs"
        )
    if args.model is not None:
        return measure_model(args)
    model_only = (args.quick, args.compile, args.graphs, args.fused, args.decode_only, args.batches)
    if args.device != "cpu" or any(model_only):
        parser.error(
            "--device, --quick, --compile, --graphs, --fused, --decode-only and --batches go with --model (the "
            "demo suite runs on the CPU)"
        )

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    started = time.perf_counter()
    base = ["logging.progress=false", "logging.tensorboard=false", "eval.num_samples=1", "eval.pass_k=1"]
    base += TINY if args.tiny else []
    scale = {key: sizes[0 if args.tiny else 1] for key, sizes in SCALES.items()}
    model, tokenizer, prompts = load_demo_model(base)
    results: dict = {"benchmark": "throughput", "tiny": args.tiny}
    console.print("(a) engine vs transformers generate ...")
    results["engine_vs_hf"] = engine_vs_hf(
        model, tokenizer, prompts, scale["batch"], scale["new_tokens"], scale["repeats"]
    )
    results["engine_vs_hf_rollout"] = engine_vs_hf_rollout(
        model,
        tokenizer,
        prompts,
        scale["batch"],
        scale["sched"],
        scale["short"],
        scale["long"],
        scale["repeats"],
    )
    console.print("(e) the decode step's matmul floor; compile time (cold and warm cache) ...")
    results["decode_floor"] = decode_floor(
        model, tokenizer, prompts, scale["batch"], scale["new_tokens"], results["engine_vs_hf"]
    )
    results["compile"] = compile_cost(
        base, scale["batch"], scale["new_tokens"], results["decode_floor"], cold=not args.tiny
    )
    console.print("(b) rollout + slow reward, overlapped or not ...")
    results["reward_overlap"] = reward_overlap(
        model,
        tokenizer,
        prompts,
        scale["count"],
        scale["cap"],
        workers=[1, 2, 4, 8],
        repeats=scale["overlap_repeats"],
    )
    console.print("(c) long-tailed lengths: fifo vs longest_first ...")
    results["scheduling"] = scheduling(
        model,
        tokenizer,
        prompts,
        scale["sched"],
        scale["slots"],
        scale["short"],
        scale["long"],
        0.1,
        scale["repeats"],
    )
    if not args.tiny or args.trl:
        console.print("(d) RL step: everyprompt vs TRL GRPOTrainer ...")
        work = args.out / "throughput_runs"
        sft_dir = prepare_sft(
            [*base, f"seed={args.sft_seed}"], args.out / "zve_runs" / f"sft_seed{args.sft_seed}"
        )
        rl_base = [*base, f"model.path={sft_dir}", "sft.steps=0", f"seed={args.sft_seed}"]
        ours = everyprompt_steps(rl_base, args.rl_steps, work / "everyprompt")
        theirs = trl_steps(rl_base, args.rl_steps, work / "trl")
        console.print("(e) the RL update's matmul floor ...")
        results["training_floor"] = training_floor(rl_base, work / "floor")
        results["rl_step_vs_trl"] = {
            "everyprompt": ours,
            "trl": theirs,
            "ratio": ours["step_s"] / theirs["step_s"],
            # the floor of that ratio with the update as it is: everyprompt's train phase alone (the same
            # transformers forward / backward TRL runs) against TRL's whole step
            "train_only_ratio": ours["train_s"] / theirs["step_s"],
        }
    results["wall_seconds"] = time.perf_counter() - started
    write_results(args.out / "throughput.json", results, dtype="fp32")

    a, b, c = results["engine_vs_hf"], results["reward_overlap"], results["scheduling"]
    table = Table(title="Rollout throughput (each row: one run, same model, prompts and sampling)")
    for column in ("comparison", "everyprompt", "reference", "ratio", "target"):
        table.add_column(column, justify="right")
    table.add_row(
        f"(a) tokens/s, batch {a['batch']} x {a['new_tokens']} tokens",
        f"{a['native_tokens_per_s']:.0f}",
        f"{a['hf_tokens_per_s']:.0f} (HF generate)",
        f"{a['speedup']:.1f}x",
        ">= 10x",
    )
    table.add_row(
        f"(a) hf engine tokens/s, batch {a['batch']} x {a['new_tokens']} tokens",
        f"{a['hf_engine_tokens_per_s']:.0f}",
        f"{a['hf_tokens_per_s']:.0f} (HF generate)",
        f"{a['hf_engine_vs_generate']:.2f}x",
        ">= 1x",
    )
    r = results["engine_vs_hf_rollout"]
    table.add_row(
        f"(a) hf engine tokens/s, rollout: {r['requests']} requests, {r['slots']} slots",
        f"{r['hf_engine_tokens_per_s']:.0f} ({r['hf_engine_slot_occupancy']:.0%} of slots busy)",
        f"{r['hf_tokens_per_s']:.0f} (HF generate)",
        f"{r['hf_engine_vs_generate']:.2f}x",
        ">= 1x",
    )
    table.add_row(
        f"(a) tokens/s, rollout: {r['requests']} requests, long-tailed lengths, {r['slots']} slots",
        f"{r['native_tokens_per_s']:.0f} ({r['native_slot_occupancy']:.0%} of slots busy)",
        f"{r['hf_tokens_per_s']:.0f} (HF generate, {r['hf_useful_share']:.0%} of rows useful)",
        f"{r['speedup']:.1f}x",
        ">= 10x",
    )
    table.add_row(
        f"(b) rollout + 20 ms reward, s ({b['reward_workers']} workers, {b['workers_needed']} needed)",
        f"{b['rollout_with_overlapped_reward_s']:.2f} overlapped",
        f"{b['rollout_alone_s']:.2f} alone; {b['rollout_then_reward_s']:.2f} serial; extra: "
        f"{b['reward_wait_after_generation_s']:.2f} waiting after generation, "
        f"{b['generation_slowdown_s']:.2f} generation slowed",
        f"{b['overlap_ratio']:.2f}x (serial {b['serial_ratio']:.2f}x; by workers "
        + ", ".join(f"{w}: {v['overlap_ratio']:.2f}x" for w, v in b["by_workers"].items())
        + ")",
        "<= 1.10x",
    )
    table.add_row(
        f"(c) idle slot fraction, {c['requests']} requests / {c['slots']} slots",
        f"{c['longest_first']['idle_slot_fraction']:.1%} longest_first",
        f"{c['fifo']['idle_slot_fraction']:.1%} fifo",
        f"-{c['idle_reduction']:.0%} idle; wall {c['wall_ratio']:.2f}x",
        ">= 25% less idle",
    )
    if "rl_step_vs_trl" in results:
        d = results["rl_step_vs_trl"]
        table.add_row(
            f"(d) RL step, s ({d['everyprompt']['prompts_per_step']} x {d['everyprompt']['group_size']}, "
            f"cap {d['everyprompt']['max_new_tokens']})",
            f"{d['everyprompt']['step_s']:.2f} (rollout {d['everyprompt']['rollout_s']:.2f} of which "
            f"generate {d['everyprompt']['generate_s']:.2f}; train {d['everyprompt']['train_s']:.2f})",
            f"{d['trl']['step_s']:.2f} (TRL GRPOTrainer; generate {d['trl']['generate_s']:.2f})",
            f"{d['ratio']:.2f}x (train phase alone: {d['train_only_ratio']:.2f}x)",
            "<= 0.33x",
        )
    e, k = results["decode_floor"], results["compile"]
    table.add_row(
        f"(e) decode step, ms ({a['batch']} rows; {e['gemms_per_step']} GEMMs, {e['gemm_gflop_per_step']:.3f} GFLOP)",
        f"{e['compiled_step_ms']:.2f} compiled; {e['eager_step_ms']:.2f} eager",
        f"{e['floor_ms']:.2f} (its GEMMs alone, {e['floor_gflops_per_s']:.0f} GFLOP/s)",
        f"{e['compiled_vs_floor']:.2f}x compiled; {e['eager_vs_floor']:.2f}x eager",
        "<= 2x",
    )
    table.add_row(
        "(a) compiled engine tokens/s, same workload",
        f"{a['compiled_tokens_per_s']:.0f}",
        f"{a['hf_tokens_per_s']:.0f} (HF generate)",
        f"{a['compiled_speedup']:.1f}x",
        ">= 5x",
    )
    table.add_row(
        "(e) compile, s (cold cache / warm cache)",
        f"{k['cold']['compile_s']:.1f} / {k['warm']['compile_s']:.1f}",
        f"saves {k['saving_ms_per_step']:.2f} ms per decode step",
        f"pays after {k['cold']['payoff_decode_steps']:.0f} / {k['warm']['payoff_decode_steps']:.0f} steps "
        f"({k['cold']['payoff_eager_decode_s']:.0f} / {k['warm']['payoff_eager_decode_s']:.0f} s eager)",
        "stated",
    )
    if "training_floor" in results:
        f = results["training_floor"]
        table.add_row(
            f"(e) RL update, s ({f['sequences']} sequences, {f['tokens']} tokens; {f['gemms']} GEMMs)",
            f"{f['update_s']:.3f}",
            f"{f['floor_s']:.3f} (its GEMMs alone, {f['floor_gflops_per_s']:.0f} GFLOP/s)",
            f"{f['update_vs_floor']:.2f}x",
            "measured",
        )
    profile = Table(title="(a) where the time goes: one generate call of each engine (torch profiler)")
    for column in (
        "engine",
        "self CPU s",
        "in matmul / attention kernels",
        "operator calls",
        "top operators",
    ):
        profile.add_column(column, justify="right")
    for name, prof in (
        ("everyprompt", a["profile"]["native"]),
        ("everyprompt compiled", a["profile"]["native_compiled"]),
        ("HF generate", a["profile"]["hf"]),
    ):
        profile.add_row(
            name,
            f"{prof['self_cpu_s']:.2f}",
            f"{prof['compute_kernel_share']:.0%}",
            str(prof["operator_calls"]),
            ", ".join(f"{short_op(t['op'])} {t['self_s']:.2f}s" for t in prof["top"][:4]),
        )
    console.print(f"wrote {args.out / 'throughput.json'}")
    console.print(profile)
    console.print(table)
    return 0


def measure_model(args) -> int:
    from bench.throughput.model import model_suite
    from everyprompt.devices.placement import DeviceError, resolve_device

    try:
        device = resolve_device(args.device, "--device")
    except DeviceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.model.exists():
        print(f"error: --model {args.model}: no such file or directory", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results = {
        "benchmark": "throughput_model",
        **model_suite(
            args.model,
            device,
            args.dtype,
            args.quick,
            args.compile,
            args.graphs,
            args.decode_only,
            args.fused,
            args.batches,
        ),
    }
    results["model"] = repo_path(args.model)
    results["wall_seconds"] = time.perf_counter() - started
    name = args.model.name.removesuffix(".gguf")
    out = write_results(
        args.out / f"throughput_{name}{'_' + device.type if device.type != 'cpu' else ''}.json",
        results,
        dtype=args.dtype,
    )
    print(f"wrote {repo_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
