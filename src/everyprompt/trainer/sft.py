"""Supervised warm start on worked solutions: next-token loss on the completion tokens only."""

from __future__ import annotations

import random
import signal
import time
from functools import partial
from pathlib import Path

import torch

from everyprompt.config import LoggingConfig, SFTConfig
from everyprompt.data.datasets import DataError
from everyprompt.data.formatting import PlainFormat
from everyprompt.devices import release_freed_memory
from everyprompt.devices.memory import memory_metrics
from everyprompt.models.io import save_pretrained
from everyprompt.models.precision import autocast
from everyprompt.processes import GracefulStop, StopRequested
from everyprompt.run.layout import RunLayout
from everyprompt.trainer.checkpoint import save_checkpoint
from everyprompt.trainer.learner_side.logprobs import check_packing, token_logprobs
from everyprompt.trainer.learner_side.optim import build_optimizer, build_scheduler
from everyprompt.trainer.metrics import MetricsLogger


def sft_batch(
    tokenizer, rows: list[dict], prompt_format=None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """input_ids [B, L] (prompt + solution + turn end, right-padded; `prompt_format.sft_example`), the
    target mask [B, L - 1] (1 on the predictions of the solution and turn-end tokens only), lengths."""
    prompt_format = prompt_format or PlainFormat(tokenizer)
    sequences, starts = [], []
    for row in rows:
        ids, start = prompt_format.sft_example(row)
        sequences.append(ids)
        starts.append(start - 1)
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (sequence, start) in enumerate(zip(sequences, starts)):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        mask[i, start : len(sequence) - 1] = 1.0
    return input_ids, mask, [len(s) for s in sequences]


def run_sft(
    model,
    tokenizer,
    rows: list[dict],
    sft: SFTConfig,
    seed: int,
    run_dir: str | Path,
    *,
    logging: LoggingConfig,
    pack_sequences: bool = True,
    resume: dict | None = None,
    prompt_format=None,
    dtype: str = "fp32",
    cpu_bf16: str = "auto",
) -> list[dict[str, float]]:
    """Train `sft.steps` steps on random batches of `rows` (each needs `prompt` and `solution`).

    With `pack_sequences` the forward pass packs each batch (see `token_logprobs`), after checking on
    two rows that packing leaves this model's log-probs unchanged. Every `sft.checkpoint_every` steps
    the model, optimizer, schedule and data order are saved as `checkpoints/sft_step_N`; `resume` (the
    state of such a checkpoint, with `model` loaded from it) continues from there. `prompt_format`
    (data.formatting) renders the examples (default: plain text); `dtype` is `model.dtype` and
    `cpu_bf16` `model.cpu_bf16` (models/precision.py).
    """
    missing = [i for i, row in enumerate(rows) if not row.get("solution")]
    if missing:
        raise DataError(f"SFT needs a `solution` on every row; row {missing[0] + 1} has none")
    prompt_format = prompt_format or PlainFormat(tokenizer)
    if pack_sequences:
        examples = [prompt_format.sft_example(row)[0] for row in rows[:2]]
        check_packing(model, examples, tokenizer.pad_token_id)
    rng = random.Random(seed)
    optimizer = build_optimizer(model, sft.lr, sft.weight_decay)
    scheduler = build_scheduler(optimizer, sft.warmup_steps, sft.steps, "cosine")
    start = 0
    if resume is not None:
        start = resume["step"]
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        rng.setstate(_python_state(resume["data_rng"]))
    logger = MetricsLogger(
        RunLayout(run_dir).sft.root,
        sft.steps,
        "SFT",
        start_step=start,
        progress=logging.progress,
        tensorboard=logging.tensorboard,
        wandb=logging.wandb,
        run_root=run_dir,
    )
    model.train()
    device = next(model.parameters()).device
    history = []
    try:
        with GracefulStop() as stop:
            for step in range(start + 1, sft.steps + 1):
                started = time.perf_counter()
                batch = rng.sample(rows, min(sft.batch_size, len(rows)))
                with autocast(model, dtype, cpu_bf16):  # the backward outside: autocast records its casts
                    loss = _sft_loss(model, tokenizer, batch, pack_sequences, prompt_format)
                metrics = _sft_step(model, loss, optimizer, scheduler)
                release_freed_memory()  # reuse within a step, not across (devices/host.py)
                metrics["time/step_s"] = time.perf_counter() - started
                metrics.update(memory_metrics(device))
                logger.log(step, metrics)
                history.append(metrics)
                stopping = stop.signum is not None and step < sft.steps
                if stopping or (
                    sft.checkpoint_every and step % sft.checkpoint_every == 0 and step < sft.steps
                ):
                    state = {
                        "step": step,
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "data_rng": rng.getstate(),
                    }
                    save_checkpoint(
                        RunLayout(run_dir).sft_step_checkpoint(step),
                        partial(save_pretrained, model, tokenizer),
                        state,
                        keep_last=1,
                        latest=False,
                    )
                if stopping:
                    raise StopRequested(
                        stop.signum,
                        f"stopped by {signal.Signals(stop.signum).name} after SFT step {step}; checkpoint "
                        f"written; continue with: everyprompt train --resume {run_dir}",
                    )
    finally:
        logger.close()
    return history


def _sft_loss(model, tokenizer, rows, pack_sequences: bool, prompt_format) -> torch.Tensor:
    """The next-token loss on the worked solutions of `rows` (token mean)."""
    input_ids, mask, lengths = sft_batch(tokenizer, rows, prompt_format)
    device = next(model.parameters()).device
    input_ids, mask = input_ids.to(device), mask.to(device)
    logp, _ = token_logprobs(
        model, input_ids, lengths=lengths if pack_sequences else None, pad_id=tokenizer.pad_token_id
    )
    return -(logp * mask).sum() / mask.sum()


def _sft_step(model, loss: torch.Tensor, optimizer, scheduler) -> dict[str, float]:
    """One optimizer step on `loss`."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    loss_value, norm = torch.stack([loss.detach().float(), grad_norm.float()]).tolist()  # one read back
    return {"sft/loss": loss_value, "sft/grad_norm": norm, "sft/lr": scheduler.get_last_lr()[0]}


def _python_state(state) -> tuple:
    """random.Random state back from a checkpoint (which stores its tuple as lists)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
