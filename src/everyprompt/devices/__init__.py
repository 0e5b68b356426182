"""Where tensors live: the one owner of the device choice (`resolve_device`), of the default dtype per
device, of moving a batch's tensors (`to_device`), and of the host allocator's setting (host.py).
`fake_cuda` checks device discipline on a machine without a GPU (fake_cuda.py). The settings' check
(settings.py) imports no torch; the rest loads on first use of its name."""

from everyprompt.devices.host import heap_usage, keep_freed_memory, release_freed_memory
from everyprompt.devices.settings import DEVICE_SETTINGS, DeviceError, check_device_setting

_PLACEMENT = ("default_dtype", "resolve_device", "to_device")  # torch: imported on first access


def __getattr__(name: str):
    if name in _PLACEMENT:
        from everyprompt.devices import placement

        return getattr(placement, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
