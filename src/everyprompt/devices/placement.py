"""The device a setting names (`model.device`, `rollout.device`): `auto` is the first CUDA device when
torch sees one, else the CPU; `cpu`; `cuda` (the current CUDA device, or the one Ray gave the process);
`cuda:N`. A CUDA setting on a machine without CUDA is an error before any work, never a quiet CPU run.

A resolved CUDA device always carries its index (`cuda:0`, not `cuda`): tensors made on it compare equal
to the model's own, and code that asks `tensor.device == device` means what it says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from everyprompt.devices.settings import DEVICE_SETTINGS, DeviceError, check_device_setting  # noqa: F401


def resolve_device(setting: str, key: str = "model.device") -> torch.device:
    """The torch device for `setting` (the config key `key`, named in errors)."""
    try:
        check_device_setting(setting)
    except ValueError as err:
        raise DeviceError(f"config key '{key}': {err}") from None
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"config key '{key}' is {setting!r} but torch sees no CUDA device here "
            f"(torch {torch.__version__}, built {'with' if torch.backends.cuda.is_built() else 'without'} "
            "CUDA); use cpu or auto, or run on a machine with a GPU"
        )
    index = torch.cuda.current_device() if setting in ("auto", "cuda") else int(setting.split(":")[1])
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"config key '{key}' is {setting!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def default_dtype(device: torch.device) -> str:
    """The training dtype a device defaults to: bf16 on CUDA (tensor cores), fp32 on the CPU (bf16 there
    is fast only where the CPU has AMX or AVX512-BF16: set `model.dtype=bf16` after measuring)."""
    return "bf16" if device.type == "cuda" else "fp32"


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a tensor the caller made and does not write again) on `device` without waiting for the
    device: on a GPU through pinned memory (torch's caching host allocator keeps the block until the copy
    has run), so the host neither stalls the stream nor waits for it, as a blocking upload does (torch
    synchronises the stream after one). On the CPU, `host` itself."""
    if device.type == "cpu":
        return host
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def copy_later(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function giving `tensor` on the host. On a GPU the copy is queued now, into pinned memory, and the
    function waits for that copy alone (an event), not for work queued after it: a loop can send the device
    its next work first and read meanwhile. Elsewhere it copies when called (the caller leaves `tensor`
    unwritten in between)."""
    if tensor.device.type != "cuda" or not torch.cuda.is_available():
        return tensor.cpu
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)  # on the stream of the tensor's device (cuda:1 need not be current)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))

    def read() -> torch.Tensor:
        copied.synchronize()
        return host

    return read


def read_later(tensor: torch.Tensor) -> Callable[[], list]:
    """`copy_later`, its values as a host list."""
    copied = copy_later(tensor)
    return lambda: copied().tolist()


def to_device(tensors: dict, device: torch.device) -> dict:
    """A copy of a dict of tensors (lists of tensors too) with each on `device` (non-blocking from pinned
    memory; a no-op on the CPU)."""
    if device.type == "cpu":
        return tensors

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, list):
            return [move(v) for v in value]
        return value

    return {key: move(value) for key, value in tensors.items()}
