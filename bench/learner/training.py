"""Training set-ups side by side: peak memory and step time of full fp32, bf16 autocast (as `auto` computes
it on this CPU, and on torch's own bf16 kernels), gradient checkpointing and LoRA, on the model of the CPU
twin (configs/gsm8k-qwen3-moe-cpu.yaml).

Each set-up runs in a fresh process: the model and optimizer are built, the process's peak-RSS mark is
reset (Linux /proc/self/clear_refs), then `--steps` training steps (forward, backward, AdamW step) run on
the same batches of the twin's chat-formatted worked solutions. Reported per set-up: the memory a step
adds above the built model (peak RSS minus RSS before the first step), the process's RSS then, the
bytes its parameters hold (a LoRA policy's base in `model.frozen_dtype`, as a run holds it), the trainable
parameters, and the median step time (the first step dropped). Ratios are against fp32 in the
same run (the first set-up measured when `--setups` leaves fp32 out).

    python -m bench.learner.training               # ~1 minute on 2 CPU cores
    python -m bench.learner.training --tiny        # seconds: a smaller batch

Writes bench/results/training.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, write_results
from bench.setups import measure_each  # bench/setups.py

TWIN = ROOT / "configs" / "gsm8k-qwen3-moe-cpu.yaml"

FULL = ["model.lora.enabled=false"]  # the twin trains adapters; the full set-ups train every weight
SETUPS = {
    "fp32": FULL,
    "bf16": [*FULL, "model.dtype=bf16"],  # cpu_bf16 auto: float32 kernels where bf16's are slow
    "bf16, torch's kernels": [*FULL, "model.dtype=bf16", "model.cpu_bf16=native"],
    "fp32 + checkpointing": [*FULL, "model.gradient_checkpointing=true"],
    "LoRA": ["model.lora.enabled=true"],
    "LoRA + bf16": ["model.lora.enabled=true", "model.dtype=bf16"],  # frozen_dtype auto: fp32 on a CPU
    "LoRA + bf16, base in bf16": ["model.lora.enabled=true", "model.dtype=bf16", "model.frozen_dtype=bf16"],
    "LoRA + bf16 + checkpointing": [
        "model.lora.enabled=true",
        "model.dtype=bf16",
        "model.gradient_checkpointing=true",
    ],
}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(overrides: list[str], batch_size: int, steps: int) -> dict:
    """One set-up's figures (run in a process of its own: see `main`)."""
    import torch

    from everyprompt.config import load_config
    from everyprompt.data.datasets import load_prompt_file
    from everyprompt.data.formatting import prompt_format_of
    from everyprompt.models.experts import select_moe_kernel
    from everyprompt.models.io import load_model_and_tokenizer
    from everyprompt.models.lora import apply_lora
    from everyprompt.models.precision import autocast, enable_gradient_checkpointing, frozen_dtype
    from everyprompt.trainer.learner_side.optim import build_optimizer
    from everyprompt.trainer.sft import _sft_loss

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = load_config(str(TWIN), overrides)
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    select_moe_kernel(model, config.model.moe_kernel)
    if config.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if config.model.lora.enabled:
        model = apply_lora(model, config.model.lora, frozen_dtype(config.model, torch.device("cpu")))
    model.train()
    optimizer = build_optimizer(model, 1e-3, 0.0)
    rows = load_prompt_file(ROOT / config.data.train_file, config.data.columns, require=("solution",))
    prompt_format = prompt_format_of(config, tokenizer)
    if len(rows) < steps * batch_size:
        raise SystemExit(
            f"--steps {steps} x --batch-size {batch_size} needs {steps * batch_size} rows; "
            f"{config.data.train_file} has {len(rows)}"
        )
    batches = [rows[i * batch_size : (i + 1) * batch_size] for i in range(steps)]
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _rss_kib("VmRSS")
    times = []
    for batch in batches:
        started = time.perf_counter()
        with autocast(model, config.model.dtype, config.model.cpu_bf16):
            loss = _sft_loss(model, tokenizer, batch, True, prompt_format)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return {
        "step_memory_mib": (_rss_kib("VmHWM") - before) / 1024,
        "rss_before_mib": before / 1024,
        "weights_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "step_s": statistics.median(times[1:]),
        "loss": float(loss.detach()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this set-up, print JSON
    args = parser.parse_args(argv)
    batch_size, steps = (8, 3) if args.tiny else (args.batch_size, args.steps)
    if args.one is not None:
        print(json.dumps(measure(SETUPS[args.one], batch_size, steps)))
        return 0
    extra = ["--batch-size", str(batch_size), "--steps", str(steps)]
    results = measure_each(__file__, args.setups, extra, timeout_s=600)
    reference = results[args.setups[0]]
    for figures in results.values():
        figures["step_memory_vs_fp32"] = figures["step_memory_mib"] / reference["step_memory_mib"]
        figures["step_time_vs_fp32"] = figures["step_s"] / reference["step_s"]
    payload = {
        "config": str(TWIN.relative_to(ROOT)),
        "batch_size": batch_size,
        "steps": steps,
        "setups": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "training.json", payload)
    print(
        f"{'set-up':30} {'weights':>9} {'step memory':>12} {'vs fp32':>8} {'step s':>8} {'vs fp32':>8} "
        f"{'trainable':>10}"
    )
    for name, f in results.items():
        print(
            f"{name:30} {f['weights_mib']:7.2f}Mi {f['step_memory_mib']:10.1f}Mi {f['step_memory_vs_fp32']:8.2f} "
            f"{f['step_s']:8.3f} {f['step_time_vs_fp32']:8.2f} {f['trainable_parameters']:10d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
