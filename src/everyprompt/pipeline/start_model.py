"""The starting policy of a run: the configured model, after the SFT stage when `sft.steps` > 0 (a finished
SFT checkpoint reused, one cut short continued: `pipeline/resume.py`), on the learner's device with the
kernels it trains with; and the one-line notes a start prints (the engine that will decode it, how the
first prompt of each stage is rendered)."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import torch
from rich.console import Console

from everyprompt.config import Config
from everyprompt.data.formatting import prompt_format_of
from everyprompt.data.rows import ConfigRows
from everyprompt.models.io import load_model_and_tokenizer, load_pretrained, save_pretrained
from everyprompt.models.lora import load_adapter, lora_base_dtype
from everyprompt.models.precision import training_kernels
from everyprompt.pipeline.resume import sft_start
from everyprompt.rollout import resolve_engine
from everyprompt.rollout.stops import stop_token_ids
from everyprompt.run.layout import RunLayout
from everyprompt.trainer import run_sft, save_checkpoint
from everyprompt.trainer.checkpoint import load_trainer_state


class PromptDisplay:
    """Prints, once per stage, how the stage's first prompt is rendered (what the model sees)."""

    def __init__(self, console: Console, env_name: str | None):
        self.console, self.env_name = console, env_name
        self.shown: set[str] = set()

    def show(self, prompt_format, stage: str, row: dict, text: str | None = None):
        """`row` as `prompt_format` renders it (or `text` when given: an episode's first messages), the
        first time `stage` asks; returns the format."""
        if stage not in self.shown:
            self.shown.add(stage)
            how = f"data.format={prompt_format.name}" if text is None else f"env.name={self.env_name}"
            self.console.print(f"{stage} prompt 1 as the model sees it ({how}):")
            shown = prompt_format.text(row) if text is None else text
            self.console.print(repr(shown), markup=False, highlight=False)
        return prompt_format


class WarmStart:
    def __init__(
        self,
        config: Config,
        layout: RunLayout,
        device: torch.device,
        rows: ConfigRows,
        display: PromptDisplay,
    ):
        self.config, self.layout, self.device = config, layout, device
        self.rows, self.display = rows, display

    def model(self):
        """The starting policy and its tokenizer."""
        config = self.config
        start = sft_start(self.layout, config.sft.steps)
        # a LoRA base nothing trains first is read as it will be held (`model.frozen_dtype`)
        base = lora_base_dtype(config, self.device) if config.model.lora.enabled else torch.float32
        if start.finished is not None:
            model, tokenizer = load_pretrained(start.finished, dtype=base)
            return self.prepare(model), tokenizer
        sft_rows = self.rows.sft() if config.sft.steps else []  # bad SFT data fails before any loading
        if start.partial is not None:
            model, tokenizer = load_pretrained(start.partial)
            resume = load_trainer_state(start.partial)
            self.display.console.print(f"SFT resumes from {start.partial} at step {resume['step']}")
        else:
            dtype = base if not config.sft.steps else torch.float32
            model, tokenizer = load_model_and_tokenizer(config.model, config.seed, dtype)
            resume = None
        self.announce_engine(model.config)  # before any training: a model no engine runs stops here
        self.prepare(model)
        if config.sft.steps:
            self._sft(model, tokenizer, sft_rows, resume)
        return model, tokenizer

    def resumed(self, checkpoint: Path):
        """The policy of an RL checkpoint, its tokenizer, and the KL reference (None: the learner copies or
        uses its own base): a LoRA policy is its adapter on the run's own base (SFT or model.path)."""
        if self.config.model.lora.enabled:
            base, tokenizer = self.model()
            return load_adapter(base, checkpoint, lora_base_dtype(self.config, self.device)), tokenizer, None
        model, tokenizer = load_pretrained(checkpoint)
        self.prepare(model)
        reference = self.model()[0] if self.config.rl.kl.estimator else None
        return model, tokenizer, reference

    def _sft(self, model, tokenizer, rows: list[dict], resume: dict | None) -> None:
        config = self.config
        prompt_format = prompt_format_of(config, tokenizer, stop_token_ids(model, tokenizer))
        run_sft(
            model,
            tokenizer,
            rows,
            config.sft,
            config.seed,
            self.layout.root,
            logging=config.logging,
            pack_sequences=config.model.pack_sequences,
            dtype=config.model.dtype,
            cpu_bf16=config.model.cpu_bf16,
            resume=resume,
            prompt_format=self.display.show(prompt_format, "SFT", rows[0]),
        )
        save_checkpoint(self.layout.sft_checkpoint, partial(save_pretrained, model, tokenizer), state=None)
        for stale in self.layout.sft_step_checkpoints():
            shutil.rmtree(stale)

    def prepare(self, model):
        """The policy on the learner's device, with the kernels it trains with (`training_kernels`)."""
        return training_kernels(model.to(self.device), self.config.model)

    def announce_engine(self, model_config) -> str:
        """The engine that will decode this model (UnsupportedModelError if the configured one cannot),
        printed once with why when `auto` chose it."""
        configured = self.config.rollout.engine
        engine = resolve_engine(configured, model_config, self.config.rollout.precision)
        how = (
            f"auto: the fastest engine for {model_config.model_type}"
            if configured == "auto"
            else "configured"
        )
        self.display.console.print(f"rollout engine: {engine} ({how})")
        return engine
