"""The process a run starts in: its run directory opened (writable, its warnings kept there), the devices
resolved and checked before any work (`learner_device`), and the process-wide settings a config makes
(threads, allocator, freed-memory cache, seeds, and the notes they print); and a failed start's run
directory removed again (`removed_on_failure`)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
from pathlib import Path

import torch
from rich.console import Console

from everyprompt.config import Config, ConfigError
from everyprompt.devices import keep_freed_memory, resolve_device
from everyprompt.devices.bf16 import slow_bf16_note
from everyprompt.devices.cores import CoreShare
from everyprompt.devices.malloc import malloc_note
from everyprompt.errors import InputError
from everyprompt.logs import record_warnings, stop_recording_warnings
from everyprompt.models.kernels import check_kernels
from everyprompt.models.precision import emulates_bf16, training_dtype
from everyprompt.processes import StoppedAtOnce
from everyprompt.run.layout import RunLayout
from everyprompt.trainer.checkpoint import CheckpointError
from everyprompt.trainer.wandb_run import require_wandb

log = logging.getLogger(__name__)


def open_run_dir(run_dir: Path) -> RunLayout:
    """Create the run directory and check that it is writable (fail now, not at the first checkpoint an
    hour in); from now on everyprompt's warnings are kept in it too."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"{run_dir}: cannot write the run directory ({err.strerror or err})") from None
    layout = RunLayout(run_dir)
    record_warnings(layout.warnings)
    return layout


def learner_device(config: Config) -> torch.device:
    """Where this process trains: `model.device` (local backend; the Ray backend's driver keeps its copy on
    the CPU, its learner ranks place themselves). Every device setting is resolved now, so a CUDA device
    that is not there, or GPUs reserved for actors that would leave them idle, stop the run before any
    work with the key named."""
    resolve_device(config.rollout.device, "rollout.device")  # the engine resolves it again where it is built
    device = resolve_device(config.model.device, "model.device")
    cluster = config.cluster
    if cluster.num_gpus > 0:
        settings = {"model.device": config.model.device, "rollout.device": config.rollout.device}
        on_cpu = [key for key, value in settings.items() if value == "cpu"]
        if on_cpu:
            raise ConfigError(
                f"config key 'cluster.num_gpus' is {cluster.num_gpus:g} but {' and '.join(on_cpu)} = cpu: the "
                "GPUs would be reserved and left idle; set the devices to auto (or cuda) or num_gpus to 0"
            )
        if cluster.backend == "local" and not torch.cuda.is_available():
            raise ConfigError(
                f"config key 'cluster.num_gpus' is {cluster.num_gpus:g} but torch sees no CUDA device here "
                "(the local backend runs both sides in this process); run on a GPU machine or set it to 0"
            )
        actors = cluster.rollout_workers + cluster.trainer_ranks
        have = torch.cuda.device_count()
        if cluster.backend == "ray" and cluster.address is None and have < actors * cluster.num_gpus:
            raise ConfigError(
                f"config key 'cluster.num_gpus' is {cluster.num_gpus:g}: {actors} actors need "
                f"{actors * cluster.num_gpus:g} GPUs and this machine has {have} (a local Ray instance); "
                "set cluster.address to a cluster that has them, or num_gpus to 0"
            )
    return torch.device("cpu") if cluster.backend == "ray" else device


def bf16_on_cpu(config: Config, device: torch.device) -> list[str]:
    """The settings that put torch's bfloat16 matmul kernels on the CPU in this run (not the learner's
    products where it emulates them: models/emulated_bf16.py)."""
    keys = []
    learner_bf16 = device.type == "cpu" and training_dtype(config.model.dtype, device) == "bf16"
    if learner_bf16 and not emulates_bf16(device, config.model.dtype, config.model.cpu_bf16):
        keys.append("model.dtype=bf16")
    rollout = resolve_device(config.rollout.device, "rollout.device")
    if rollout.type == "cpu" and config.rollout.precision == "bf16":
        keys.append("rollout.precision=bf16")
    return keys


def set_up_process(config: Config, console: Console) -> torch.device:
    """The config's process-wide settings applied, every device checked (bad ones exit 2 now, before any
    work); the learner's device."""
    if config.logging.wandb.enabled:  # a missing extra fails now, not when the first step logs
        require_wandb()
    if config.threads:
        torch.set_num_threads(config.threads)
    if note := malloc_note(config.malloc):
        console.print(note, markup=False, highlight=False)
    if config.keep_freed_memory:
        keep_freed_memory(config.kept_block_mib)
    device = learner_device(config)  # CUDA asked for and absent: exit 2 now, before any work
    # likewise layer kernels this device cannot run (Liger's off CUDA or not installed, no compiler)
    check_kernels(config.model.kernels, device)
    if note := slow_bf16_note(bf16_on_cpu(config, device)):
        log.warning(note)
        console.print(f"warning: {note}", markup=False, highlight=False)
    if emulates_bf16(device, config.model.dtype, config.model.cpu_bf16):
        console.print(
            f"model.dtype=bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()}): bf16 products on "
            f"float32 kernels, rounded to bf16 (model.cpu_bf16={config.model.cpu_bf16})",
            markup=False,
            highlight=False,
        )
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    return device


@contextlib.contextmanager
def removed_on_failure(layout: RunLayout, created: bool, console: Console):
    """Within it, a failure (or a stop) before any stage made a result removes the run directory `layout`
    (`created` by this start) (saying so unless the failure is bad input, which says its own one line): a failed
    start leaves nothing in runs/. A directory that existed
    before (a resume, a sweep's cell, `--run-dir` of an earlier run), or one holding any result, stays."""
    try:
        yield
    except BaseException as err:
        if created and layout.root.is_dir() and not layout.holds_results():
            stop_recording_warnings()
            shutil.rmtree(layout.root, ignore_errors=True)
            # bad input is said in its one line; a stop or a failure of the run says where its files went
            said = "" if isinstance(err, InputError) else f"removed {layout.root}: nothing to keep"
        elif isinstance(err, StoppedAtOnce) and layout.latest.exists():
            said = f"kept {layout.root}: `everyprompt train --resume {layout.root}` continues from its last checkpoint"
        else:
            said = ""
        if said:
            console.print(said, markup=False, highlight=False)
        raise


@contextlib.contextmanager
def threads_fitted(config: Config):
    """Within it, torch's threads fitted to the free cores (`cpu_threads`: devices/cores.py), where the
    rollout device is the CPU."""
    adaptive = config.cpu_threads == "adaptive"
    if not adaptive or resolve_device(config.rollout.device, "rollout.device").type != "cpu":
        yield
        return
    share = CoreShare(torch.get_num_threads())
    share.fit()
    try:
        yield
    finally:
        torch.set_num_threads(share.limit)
