"""The device settings a config may name (`model.device`, `rollout.device`), checked without torch:
placement.py resolves them to devices."""

from __future__ import annotations

import re

from everyprompt.errors import InputError

DEVICE_SETTINGS = ("auto", "cpu", "cuda", "cuda:N")
_SETTING = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class DeviceError(InputError):
    """A device setting this machine cannot honour (CUDA asked for, none present) or cannot parse."""


def check_device_setting(setting: str) -> str:
    """`setting` if it is a device setting (a config validator: the key is named by the caller)."""
    if not isinstance(setting, str) or not _SETTING.match(setting):
        raise ValueError(f"expected one of {', '.join(DEVICE_SETTINGS)}, got {setting!r}")
    return setting
