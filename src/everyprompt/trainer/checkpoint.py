"""Atomic, resumable checkpoints: HF model + tokenizer + trainer state, written to a temporary
directory, then renamed; `latest` is a symlink swapped atomically, so a kill never leaves it corrupt."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from everyprompt.models.io import save_pretrained

STATE_FILE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the path and what is missing."""


def write_json_atomic(path: str | Path, data) -> None:
    """Write JSON to a temporary file beside `path`, then rename: a kill leaves the old file or the new."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data, indent=2))
    os.replace(temporary, path)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path, name: str, model, tokenizer, state: dict | None, keep_last: int = 0
) -> Path:
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    temporary = root / f".tmp-{name}-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    save_pretrained(model, tokenizer, temporary)
    if state is not None:
        torch.save(state, temporary / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    if state is not None:
        _point_latest(root, name)
        if keep_last:
            _prune(root, keep_last)
    return final


def _point_latest(root: Path, name: str) -> None:
    link = root / f".latest-{os.getpid()}"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(name)
    os.replace(link, root / "latest")


def _step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted((p for p in root.glob("step_*") if p.name.split("_", 1)[1].isdigit()), key=_step_of)
    current = (root / "latest").resolve()
    for path in steps[:-keep_last]:
        if path.resolve() != current:
            shutil.rmtree(path)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself, a run directory, or a `checkpoints/` directory."""
    path = Path(path)
    for candidate in (path, path / "latest", path / "checkpoints" / "latest"):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    raise CheckpointError(
        f"{path}: no checkpoint there (looked for config.json in it, latest/, checkpoints/latest/)"
    )


def load_trainer_state(checkpoint: str | Path) -> dict:
    file = Path(checkpoint) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{checkpoint}: {STATE_FILE} is missing, so this checkpoint cannot be resumed")
    try:
        # tensors and plain types only: opening a checkpoint someone sent you cannot run code
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (torch raises many types for a damaged file)
        raise CheckpointError(
            f"{file}: cannot be read ({type(err).__name__}: {err}); the file is damaged"
        ) from None
