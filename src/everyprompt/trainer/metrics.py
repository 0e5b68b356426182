"""Metrics: `metrics.jsonl` (one object per step, namespaced keys), TensorBoard, and a progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rich.console import Console
from rich.progress import TextColumn

from everyprompt.logs import progress as progress_display
from everyprompt.run.layout import RunLayout

# Metrics shown on the progress bar: key -> short label.
BAR_FIELDS = {
    "sft/loss": "loss",
    "reward/mean": "reward",
    "reward/accuracy": "acc",
    "rollout/tokens_per_s": "tok/s",
    "distill/reverse_kl": "kl-to-teacher",  # rl.teacher: how far the student's samples are from the teacher
}


def _format(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}"


def keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite a metrics.jsonl with only its records of steps <= `step` (and no torn last line), atomically."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(kept), encoding="utf-8")
    os.replace(temporary, path)


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        description: str,
        *,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = True,
        console: Console | None = None,
        wandb=None,
        run_root: str | Path | None = None,
    ):
        """`wandb`: a WandbConfig; with its project set, the records go to wandb too, one wandb run per
        `description` (phase) under `run_root` (the run directory; default `run_dir`)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console(stderr=True)
        path = RunLayout(self.run_dir).metrics
        if path.is_file():  # a resumed run: its steps after `start_step` are logged again
            keep_records_up_to(path, start_step)
        self._jsonl = path.open("a", encoding="utf-8")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(RunLayout(self.run_dir).tensorboard))
        self._wandb = None
        if wandb is not None and wandb.enabled:
            from everyprompt.trainer.wandb_run import WandbRun

            self._wandb = WandbRun(wandb, Path(run_root or run_dir), description.lower())
        self._total, self._description = total_steps, description
        self._progress = None
        self._no_signal = 0
        self._print_every = max(1, total_steps // 10)
        if progress:
            self._progress = progress_display(self.console, TextColumn("{task.fields[postfix]}"))
            self._task = self._progress.add_task(
                description, total=total_steps, completed=start_step, postfix=""
            )
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(step, record)
        postfix = "  ".join(
            f"{label} {_format(metrics[key])}" for key, label in BAR_FIELDS.items() if key in metrics
        )
        self._no_signal += int(metrics.get("actor/no_signal_update", 0))
        if self._no_signal:  # steps whose batch had nothing to learn from: no optimizer step was taken
            postfix += f"  no-signal steps {self._no_signal}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, postfix=postfix)
            if not self.console.is_terminal and (step % self._print_every == 0 or step == self._total):
                self.console.print(f"{self._description} step {step}/{self._total}  {postfix}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.close()
        self._jsonl.close()
