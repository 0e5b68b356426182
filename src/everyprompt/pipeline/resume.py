"""Where a run starts: fresh, resumed from a cut-short phase, or warm-started from a finished one.

- SFT: a finished `sft` checkpoint that verifies is reused (a damaged one is named in a warning and SFT
  runs again); else a cut-short SFT continues from its newest complete `sft_step_N`; else SFT starts.
- RL (`everyprompt train --resume RUN`): from the newest `step_N` that verifies (`latest` points to it
  unless the run died between writing it and moving the link). A run cut short before RL's first
  checkpoint restarts RL from its beginning, reusing a finished SFT stage and offline filter: the pass
  rates that attempt recorded are discarded.

A checkpoint is trusted only if its manifest verifies (`trainer/checkpoint.py`). A resume first tidies
what a checkpoint write killed midway left behind (`recover_interrupted_writes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from everyprompt.hub import is_hub_name, resolve_model
from everyprompt.models.catalog import fetch_hint
from everyprompt.models.gguf import check_file, is_gguf
from everyprompt.run.layout import RunLayout, find_checkpoint
from everyprompt.trainer.checkpoint import CheckpointError, recover_interrupted_writes, verify_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTStart:
    """How the SFT stage starts: `finished` (reuse it, no SFT to run) or `partial` (continue it) or
    neither (train from the configured model)."""

    finished: Path | None = None
    partial: Path | None = None


def newest_complete(candidates: list[Path]) -> tuple[Path | None, list[str]]:
    """The newest of `candidates` (oldest first) that verifies, and what was wrong with the newer ones
    (each also named in a warning)."""
    problems = []
    for candidate in reversed(candidates):
        try:
            verify_checkpoint(candidate)
            return candidate, problems
        except CheckpointError as err:
            problems.append(str(err))
            log.warning("not resuming from %s: %s", candidate.name, err)
    return None, problems


def sft_start(layout: RunLayout, sft_steps: int) -> SFTStart:
    """Where the SFT stage of the run in `layout` starts (nothing to find when `sft_steps` is 0)."""
    if not sft_steps:
        return SFTStart()
    if layout.sft_checkpoint.is_dir():
        try:
            verify_checkpoint(layout.sft_checkpoint)
            return SFTStart(finished=layout.sft_checkpoint)
        except CheckpointError as err:
            log.warning("the SFT checkpoint is damaged (%s); SFT runs again", err)
    return SFTStart(partial=newest_complete(layout.sft_step_checkpoints())[0])


def latest_complete_checkpoint(layout: RunLayout) -> Path:
    """The RL checkpoint a resume starts from; CheckpointError if none verifies."""
    found, problems = newest_complete(layout.step_checkpoints())
    if found is None:
        why = "; ".join(problems) if problems else "none was written"
        raise CheckpointError(f"{layout.checkpoints}: no complete checkpoint to resume from ({why})")
    if problems:
        log.warning("resuming from %s, the newest complete checkpoint", found)
    return found


def rl_start(layout: RunLayout, resume: bool) -> Path | None:
    """The checkpoint RL resumes from, or None when RL starts at its beginning (a fresh run, or a resumed
    one that never wrote an RL checkpoint: then its recorded pass rates are discarded first)."""
    if not resume:
        return None
    recover_interrupted_writes(layout.checkpoints)  # a write killed midway: its leftovers first
    if not layout.step_checkpoints():
        layout.pass_rates.unlink(missing_ok=True)
        return None
    return latest_complete_checkpoint(layout)


def resolve_checkpoint(path: str | Path) -> Path:
    """A model from itself (a checkpoint directory or a GGUF file), a run directory, a `checkpoints/`
    directory, or a Hugging Face Hub id that is not a local path (its cached or fetched snapshot)."""
    if is_hub_name(path):
        return resolve_model(path, "CHECKPOINT", fetch_hint(Path(path)))
    if is_gguf(path):
        check_file(Path(path))  # a missing or foreign file is named here, before anything is written
        return Path(path).resolve()
    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"{path}: no checkpoint there (looked for config.json in it, latest/, checkpoints/latest/; "
            "or give a .gguf file)"
        )
    return found
