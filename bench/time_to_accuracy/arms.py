"""C7's arms, each trained for the same seconds of its training clock (clock.py) from its first step, with
snapshots of the policy at the marks: everyprompt through `RLTrainer.train(hooks=...)`, TRL's
GRPOTrainer (bench/learner/trl_grpo.py) through a callback, on the same prompts in the same order."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT
from bench.time_to_accuracy.clock import Snapshots, TrainingClock

RECIPE = ROOT / "configs" / "smollm2.yaml"
GPU_RECIPE = ROOT / "configs" / "smollm2-gpu.yaml"
# the most steps a run may take: its clock reaches the budget long before (a run that gets here fails)
MAX_STEPS = 2000


@dataclass(frozen=True)
class Arm:
    trainer: str  # "everyprompt" or "trl"
    config: Path  # the recipe it trains with (TRL: the settings it is given)


ARMS = {
    "trl": Arm("trl", RECIPE),
    "recipe": Arm("everyprompt", RECIPE),
    "gpu": Arm("everyprompt", GPU_RECIPE),
}


def plan_order(config, rows: list[dict], steps: int) -> list[dict]:
    """The rows everyprompt's prompt plan draws in its first `steps` steps, in order, one per prompt (its
    groups are `rl.group_size` samples of each): TRL is given them in this order, unshuffled."""
    from everyprompt.trainer.rollout_side.plan import PromptPlan

    plan = PromptPlan(config, rows, lambda _prompt: None)
    return [rows[i] for _ in range(steps) for i in plan.take(config.rl.prompts_per_step, None)]


class BudgetHook:
    """everyprompt's side of the clock (trainer.StepHook): starts it before the first step, snapshots the
    policy at the marks and ends the run at the budget."""

    def __init__(self, snapshots: Snapshots):
        self.snapshots = snapshots

    def on_train_begin(self, trainer) -> None:
        self.snapshots.clock.start()

    def after_step(self, trainer, metrics: dict) -> bool:
        return self.snapshots.after_step(trainer.step)


def train_everyprompt(config, out: Path, marks: list[float]) -> dict:
    """One everyprompt run of `config` until its clock reaches the last of `marks`."""
    from everyprompt.pipeline import Run

    trainer = Run(config, out / "run").trainer()
    snapshots = Snapshots(  # the learner writes the policy, as into a checkpoint (whichever backend)
        TrainingClock(),
        marks,
        out / "snapshots",
        lambda d: trainer.learner.save_model(trainer.model, trainer.tokenizer, Path(d)),
    )
    try:
        history = trainer.train(hooks=[BudgetHook(snapshots)])
        device = str(next(trainer.learner.model.parameters()).device)
    finally:
        trainer.close()
    return {
        "snapshots": snapshots.taken,
        "rl_steps": trainer.step,
        "train_seconds": snapshots.clock.elapsed(),
        "step_s_median": statistics.median(m["time/step_s"] for m in history),
        "device": device,
    }


def train_trl(config, out: Path, marks: list[float]) -> dict:
    """TRL's GRPOTrainer on `config`'s settings until its clock reaches the last of `marks`: the prompts in
    everyprompt's order, everyprompt's AdamW and learning-rate schedule (the same betas, warm-up and
    constant rate), the math reward as a plain reward function."""
    import torch
    from transformers import TrainerCallback

    from bench.learner.trl_grpo import grpo_config, grpo_trainer, trl_dataset, trl_on_cpu
    from everyprompt.models.io import load_model_and_tokenizer, save_pretrained
    from everyprompt.pipeline import Run
    from everyprompt.trainer.learner_side.optim import build_optimizer, build_scheduler

    rl = config.rl
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    if not trl_on_cpu(config):  # on its card before the optimizer sees it (fused AdamW, as ours there)
        model.to(torch.device("cuda", torch.cuda.current_device()))
    rows = plan_order(config, Run(config, out / "prompts").rows.rl(), MAX_STEPS)  # (Run: a folder of its own)
    dataset = trl_dataset(config, tokenizer, rows)
    args = grpo_config(config, out / "run", MAX_STEPS * rl.mini_batches, matched=True, shuffle=False)
    optimizer = build_optimizer(model, rl.lr, rl.weight_decay)
    scheduler = build_scheduler(optimizer, rl.warmup_steps, rl.steps, rl.lr_schedule)
    # TRL trains the model object it is given (one device: accelerate does not wrap it): snapshot that
    snapshots = Snapshots(
        TrainingClock(), marks, out / "snapshots", lambda d: save_pretrained(model, tokenizer, d)
    )
    per = rl.mini_batches  # TRL's optimizer steps in one everyprompt step (one generation)
    steps_ended: list[float] = []

    class Budget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            snapshots.clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per == 0:  # a whole generation's updates done
                steps_ended.append(snapshots.clock.elapsed())
                if snapshots.after_step(state.global_step // per):
                    control.should_training_stop = True

    trainer = grpo_trainer(model, tokenizer, args, dataset, [Budget()], (optimizer, scheduler))
    torch.manual_seed(config.seed)
    trainer.train()
    # a copy trained would have left the snapshots holding the untrained weights: the cell fails then
    if trainer.accelerator.unwrap_model(trainer.model) is not model:
        raise RuntimeError("TRL trained a copy of the model; the snapshots hold the untrained one")
    step_s = [b - a for a, b in zip([0.0, *steps_ended], steps_ended, strict=False)]
    return {
        "snapshots": snapshots.taken,
        "rl_steps": trainer.state.global_step // per,
        "train_seconds": snapshots.clock.elapsed(),
        "step_s_median": statistics.median(step_s),
        "device": str(trainer.model.device),
    }


TRAINERS = {"everyprompt": train_everyprompt, "trl": train_trl}
