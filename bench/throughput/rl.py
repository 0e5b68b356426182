"""(d) of bench/throughput: one RL step of everyprompt against TRL's GRPOTrainer, same model, group size,
prompts per step, learning rate and completion cap, split by phase."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

# ---------------------------------------------------------------- (d) RL step vs TRL
ENGINE_FIGURES = tuple(
    f"rollout/{name}"
    for name in (
        "decode_step_ms",
        "prefill_s",
        "tokens_per_s",
        "slot_occupancy",
        "graph_replays",
        "graph_captures",
        "graph_capture_s",
        "graph_eager_steps",
    )
)


def everyprompt_steps(base: list[str], steps: int, run_dir: Path, config_path: Path | None = None) -> dict:
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    config = load_config(config_path, [*base, f"rl.steps={steps}", "checkpoint.every=0"])
    run = Run(config, run_dir)
    trainer = run.trainer()
    history = trainer.train()
    device = next(trainer.learner.model.parameters()).device
    profiled = rollout_profile(trainer, steps)
    trainer.close()
    times = [m["time/step_s"] for m in history[1:]]  # the first step warms up
    return {
        "step_s": statistics.median(times),
        "step_s_all": [m["time/step_s"] for m in history],
        # each step's phases too: an outlier step says which phase it was (on the H200 two of steps 2-6 took
        # 1.8 and 3.4 s more than the median, not split by phase then: cuDNN's plan for a new width, most
        # likely, docs/gpu-runs.md)
        "rollout_s_all": [m["time/rollout_s"] for m in history],
        "train_s_all": [m["time/train_s"] for m in history],
        "rollout_s": statistics.median(m["time/rollout_s"] for m in history[1:]),
        "generate_s": statistics.median(m["time/generate_s"] for m in history[1:]),
        "train_s": statistics.median(m["time/train_s"] for m in history[1:]),
        "mean_length": statistics.mean(m["rollout/mean_length"] for m in history),
        "prompts_per_step": config.rl.prompts_per_step,
        "group_size": config.rl.group_size,
        "max_new_tokens": config.rollout.max_new_tokens,
        "mini_batches": config.rl.mini_batches,
        "device": str(device),
        "rollout_profile": profiled,
        # CUDA graphs in every step after the first: each step's decode phases run without their graph
        # (0 when the graphs hold), whether a capture was refused, the largest trusted replay's difference
        "graph_eager_steps_by_step": [m.get("rollout/graph_eager_steps") for m in history],
        "graph_failed": max((m.get("rollout/graph_failed", 0.0) for m in history), default=0.0),
        "graph_replay_eps": max((m.get("rollout/graph_replay_eps", 0.0) for m in history), default=0.0),
        # the fused paths, where asked: compiled decode bodies given up (1), learner layers running compiled
        "compile_failed": max((m.get("rollout/compile_failed", 0.0) for m in history), default=0.0),
        "compiled_layers": history[-1].get("actor/compiled_layers"),
        # where the step's time went, each the median over the steps after the first: every phase the
        # trainer times and the engine's own figures (its decode step, CUDA graph captures and replays)
        "medians": {
            key: statistics.median(m[key] for m in history[1:] if key in m)
            for key in history[-1]
            if key.startswith("time/") or key in ENGINE_FIGURES
        },
    }


def rollout_profile(trainer, step: int) -> dict:
    """One more rollout of the trained run (step `step`'s groups), under torch's profiler: its device
    timeline (timeline.py) and the engine's figures for it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.throughput.timeline import describe_timeline, timeline

    device = torch.device(getattr(trainer.rollout.engine, "device", "cpu"))  # an engine in this process
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        batch = trainer.rollout.next_batch(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - began
    row = timeline(prof, wall, device)
    row["completions"] = len(batch)
    print(f"  a profiled rollout: {describe_timeline(row)}", flush=True)
    return row


def trl_steps(
    base: list[str], steps: int, run_dir: Path, config_path: Path | None = None, matched: bool = False
) -> dict:
    """TRL's GRPOTrainer on the recipe (bench/learner/trl_grpo.py). `matched`: its micro-batch is the recipe's
    `rl.micro_batch_size` (gradient accumulation up to the mini-batch, as everyprompt's learner does);
    else one micro-batch holds a whole mini-batch."""
    import torch
    from transformers import TrainerCallback

    from bench.learner.trl_grpo import grpo_config, grpo_trainer, trl_dataset
    from everyprompt.config import load_config
    from everyprompt.models.io import load_model_and_tokenizer
    from everyprompt.pipeline import Run

    config = load_config(config_path, [*base, f"rl.steps={steps}"])
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    dataset = trl_dataset(config, tokenizer, Run(config, run_dir / "prompts").rows.rl())
    rl = config.rl
    args = grpo_config(config, run_dir, steps * rl.mini_batches, matched)
    micro = args.per_device_train_batch_size

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, *_args, **_kwargs):
            self.marks.append(time.perf_counter())

    clock = Clock()
    generate_s: list[float] = []
    generate = model.generate

    def timed_generate(*a, **k):  # TRL samples through the model's own generate: time it
        started = time.perf_counter()
        out = generate(*a, **k)
        generate_s.append(time.perf_counter() - started)
        return out

    model.generate = timed_generate
    trainer = grpo_trainer(model, tokenizer, args, dataset, [clock])
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    trainer.train()
    marks = [started, *clock.marks]
    # one everyprompt step = one generation + `mini_batches` optimizer steps = that many TRL steps
    per = rl.mini_batches
    cycles = [marks[i + per] - marks[i] for i in range(0, len(marks) - per, per)]
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return {
        "step_s": statistics.median(cycles[1:] if len(cycles) > 1 else cycles),
        "step_s_all": cycles,
        "mean_length": statistics.mean(lengths) if lengths else float("nan"),
        "optimizer_steps_per_step": per,
        "micro_batch": micro,
        "generate_s": statistics.median(generate_s[1:] if len(generate_s) > 1 else generate_s)
        if generate_s
        else float("nan"),
        "generate_calls": len(generate_s),
        "device": str(trainer.model.device),
        # accelerate wraps the model's forward in autocast under bf16=True: generate samples through it
        "generate_under_autocast": hasattr(trainer.model, "_original_forward"),
    }
