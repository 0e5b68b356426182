"""Atomic, verified, resumable checkpoints: HF model + tokenizer + trainer state.

A checkpoint is written into a temporary directory; every file is fsynced, then `manifest.json` (each
file's size and SHA-256) is written last, and the directory is renamed into place; `latest` is a symlink
swapped atomically. A kill at any instant leaves the previous checkpoints whole. On resume a checkpoint
is trusted only if its manifest matches: a truncated or altered file is reported by name, and the run
falls back to the newest complete checkpoint (`pipeline/resume.py` decides where a run starts).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError

from everyprompt.errors import InputError
from everyprompt.processes import is_alive
from everyprompt.run.files import fsync, sha256
from everyprompt.run.layout import LATEST, series

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
SHARDS = "learner_shards"  # a Ray run's optimizer state, written into the checkpoint by its learner ranks
SHARDED = "sharded"  # the key that stands for them in the trainer state

log = logging.getLogger(__name__)


class CheckpointError(InputError):
    """A checkpoint that cannot be written or resumed from; the message names the path and the problem."""


def _write_manifest(directory: Path) -> int:
    """Fsync every file, record each one's size and SHA-256 in the manifest; the checkpoint's bytes."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    for file in files:
        fsync(file)
    entries = {str(f.relative_to(directory)): {"size": f.stat().st_size, "sha256": sha256(f)} for f in files}
    (directory / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))
    fsync(directory / MANIFEST)
    fsync(directory)
    return sum(entry["size"] for entry in entries.values())


def save_checkpoint(
    path: str | Path,
    write_model: Callable[[Path], None],
    state: dict | None,
    keep_last: int = 0,
    latest: bool = True,
    parts: Mapping[str, Callable[[Path], object]] | None = None,
) -> Path:
    """Write the checkpoint at `path` (a run layout's `step_checkpoint(n)`, `sft_checkpoint`, ...): the model
    and tokenizer by `write_model(directory)` (models/io.py's `save_pretrained` bound to them, or a
    learner's `save_model`), with the trainer `state` when given. An RL checkpoint (`latest`, with a state)
    becomes `latest`; `keep_last` prunes the older checkpoints of the same `<prefix>N` series. `parts`: more
    of the state, each made by a function given the checkpoint's directory while it is written, which may
    write files there itself (the Ray learner ranks' optimizer shards; the manifest then covers them) and
    returns what the state holds under its key."""
    final = Path(path)
    root, name = final.parent, final.name
    temporary = root / f".tmp-{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if temporary.exists():
            shutil.rmtree(temporary)
        write_model(temporary.resolve())
        if state is not None:
            state = {**state, **{key: make(temporary.resolve()) for key, make in (parts or {}).items()}}
            torch.save(state, temporary / STATE_FILE)
        size = _write_manifest(temporary)
        if final.exists():  # the same name again (a resumed run's final step): swap, never delete first
            old = root / f".old-{name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(temporary, final)
            shutil.rmtree(old)
        else:
            os.replace(temporary, final)
        fsync(root)
    except BaseException as err:  # whatever stopped the write (a bug, Ctrl-C too): no half-written copy
        shutil.rmtree(temporary, ignore_errors=True)
        if not isinstance(err, (OSError, SafetensorError)):  # safetensors reports a full disk as its own
            raise
        reason = getattr(err, "strerror", None) or err
        raise CheckpointError(
            f"cannot write checkpoint {final}: {reason} ({type(err).__name__}); the previous "
            "checkpoints are untouched"
        ) from None
    if state is not None and latest:
        _point_latest(root, name)
    if keep_last:
        _prune(final, keep_last)
    _warn_if_the_next_cannot_fit(final, size)
    return final


def recover_interrupted_writes(root: Path) -> None:
    """Tidy what writes killed midway left in a checkpoints folder `root`, before a resume reads it (the
    writing process is gone: a live one's are left alone). A `.tmp-NAME-PID` is a checkpoint never moved
    into place: removed (a Ray run's optimizer shards make it as large as the model's state). A
    `.old-NAME-PID` is the earlier checkpoint of the same name, moved aside for its replacement: put back
    where the replacement never arrived, else removed."""
    if not Path(root).is_dir():
        return
    for path in sorted(Path(root).iterdir()):
        kind, _, rest = path.name.partition("-")
        name, _, pid = rest.rpartition("-")
        if kind not in (".tmp", ".old", ".latest") or not pid.isdigit() or is_alive(int(pid)):
            continue
        if kind == ".old" and name and not (path.parent / name).exists():
            os.replace(path, path.parent / name)
            log.warning("%s: put back from %s, where a write killed midway had moved it", name, path.name)
        elif path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
            log.warning("removed %s, left by a checkpoint write killed midway", path.name)
    fsync(Path(root))


def _warn_if_the_next_cannot_fit(final: Path, size: int) -> None:
    """The next checkpoint is written whole before an old one is pruned: warn while there is time to act,
    not when a run dies on a full disk hours later."""
    free = shutil.disk_usage(final.parent).free
    if free < size:
        log.warning(
            "%s takes %.2f GB and only %.2f GB are free on its disk: the next checkpoint will not fit (free "
            "some space, or lower checkpoint.keep_last)",
            final,
            size / 1e9,
            free / 1e9,
        )


def _point_latest(root: Path, name: str) -> None:
    link = root / f".latest-{os.getpid()}"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(name)
    os.replace(link, root / LATEST)
    fsync(root)


def _prune(checkpoint: Path, keep_last: int) -> None:
    current = (checkpoint.parent / LATEST).resolve()
    for path in series(checkpoint)[:-keep_last]:
        if path.resolve() != current:
            shutil.rmtree(path)


def verify_checkpoint(path: str | Path) -> None:
    """CheckpointError naming the first file that is missing, truncated or altered against the manifest."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}, so it was never completely written")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest}: damaged ({err})") from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"{file}: {size} bytes, {expected['size']} expected (truncated or altered)")
        if sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file}: checksum differs from {MANIFEST} (altered or damaged)")


def load_trainer_state(checkpoint: str | Path) -> dict:
    file = Path(checkpoint) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{checkpoint}: {STATE_FILE} is missing, so this checkpoint cannot be resumed")
    try:
        # tensors and plain types only: opening a checkpoint someone sent you cannot run code
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (torch raises many types for a damaged file)
        raise CheckpointError(
            f"{file}: cannot be read ({type(err).__name__}: {err}); the file is damaged"
        ) from None
    optimizer = (state.get("learner") or {}).get("optimizer") or {}
    if SHARDED in optimizer:  # the learner ranks' shards, named relative to the checkpoint
        optimizer[SHARDED] = str(Path(checkpoint).resolve() / optimizer[SHARDED])
    return state


# ------------------------------------------------------------ state that resumes on any number of ranks
def full_weights(model, ignore_frozen: bool = False) -> dict[str, torch.Tensor]:
    """A sharded (`fully_shard`) model's whole weights on CPU, on rank 0 (the other ranks get an empty
    dict); with `ignore_frozen`, without the parameters that do not train. Collective: every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=ignore_frozen)
    return get_model_state_dict(model, options=options)


def portable_optimizer_state(model, optimizer, sharded: bool = False, shards: Path | None = None) -> dict:
    """The optimizer's state keyed by parameter name: loads into a learner of any rank count and sharding.
    Whole by default; sharded (`fully_shard`): collective, and only rank 0 gets it (the others an empty
    dict). With `shards` (a directory inside the checkpoint being written; every rank of the group calls),
    each rank writes its own share there instead (torch.distributed.checkpoint: a file per rank and one of
    metadata), nothing is gathered, and the state holds `{SHARDED: <the directory's name>}`. An optimizer
    that has not stepped yet saves as {}: torch's getter would create its state by a zero-gradient step,
    which counts as Adam's first and so changes every later update (and, called on rank 0 alone, would set
    the ranks' optimizers apart)."""
    if not optimizer.state:  # every rank steps together, so this holds on all of them or on none
        return {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if shards is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=shards)
        return {SHARDED: shards.name}
    options = StateDictOptions(full_state_dict=True, cpu_offload=sharded)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """Load a `portable_optimizer_state` (or, from older checkpoints, a plain `optimizer.state_dict()`,
    keyed by parameter position). {}: saved before the first step, so the new optimizer stays as it is.
    Shards (`{SHARDED: directory}`, made absolute by `load_trainer_state`): every rank of a group calls,
    each reading what it holds; one process reads them whole."""
    if not state:
        return
    if SHARDED in state:
        _load_shards(model, optimizer, Path(state[SHARDED]))
        return
    params = [key for group in state.get("param_groups", []) for key in group.get("params", [])]
    if all(isinstance(key, int) for key in params):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _load_shards(model, optimizer, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"{directory}: the learner's optimizer shards are missing (no .metadata)")
    # the template: this learner's own state in its own sharding (torch makes Adam's state by a step at
    # learning rate 0, which moves no weight; the load then replaces all of it, its step count too)
    template = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # one process reading a group's shards is what it is meant for here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(template, checkpoint_id=directory)
    set_optimizer_state_dict(model, optimizer, template["optimizer"])


def shard_files(directory: Path, rank: int) -> list[str]:
    """The files rank `rank` wrote into a shards directory, as this process sees them."""
    return sorted(path.name for path in Path(directory).glob(f"__{rank}_*.distcp"))
