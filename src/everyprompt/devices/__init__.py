"""Where tensors live: the one owner of the device choice (`resolve_device`), of the default dtype per
device, of moving a batch's tensors (`to_device`), and of the host allocator's setting (host.py).
`fake_cuda` checks device discipline on a machine without a GPU (fake_cuda.py)."""

from everyprompt.devices.host import heap_usage, keep_freed_memory, release_freed_memory
from everyprompt.devices.placement import (
    DEVICE_SETTINGS,
    DeviceError,
    check_device_setting,
    default_dtype,
    resolve_device,
    to_device,
)

__all__ = [
    "DEVICE_SETTINGS",
    "DeviceError",
    "check_device_setting",
    "default_dtype",
    "heap_usage",
    "keep_freed_memory",
    "release_freed_memory",
    "resolve_device",
    "to_device",
]
