"""The learner's layer kernels (`model.kernels`), by name: how a policy's decoder layers compute in the
learner's forwards and backwards.

- `torch`: torch's own operators, one kernel each (the default);
- `liger`: Liger's Triton RMSNorm, SwiGLU and rotary kernels (models/liger.py; CUDA, the `kernels` extra);
- `compiled`: each decoder layer through torch.compile (models/compiled_layers.py; any device torch's
  compiler serves).

Each entry checks, before any work, that it can run on the learner's device (a `KernelsError` naming the
key otherwise: exit 2 at the CLI) and applies itself to a model already on that device. The config's
`model.kernels` choices are these names (a test checks the two agree); an entry registers itself here
when its module is imported (models/precision.py, which applies them, imports them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from everyprompt.errors import InputError


class KernelsError(InputError):
    """`model.kernels` asks for kernels this device, install or model cannot give."""


@dataclass(frozen=True)
class LayerKernels:
    check: Callable[[torch.device], None]  # raises KernelsError where the kernels cannot run
    apply: Callable[[nn.Module], None]  # puts them in a model on its training device


KERNELS: dict[str, LayerKernels] = {}


def register_kernels(name: str, check: Callable[[torch.device], None], apply: Callable[[nn.Module], None]):
    KERNELS[name] = LayerKernels(check, apply)


def _nothing(_) -> None:
    return None


register_kernels("torch", _nothing, _nothing)


def _entry(name: str) -> LayerKernels:
    if name not in KERNELS:
        raise KernelsError(f"config key 'model.kernels': {name!r} is not one of {', '.join(KERNELS)}")
    return KERNELS[name]


def check_kernels(name: str, device: torch.device) -> None:
    """A KernelsError, before any work, where kernels `name` cannot run on `device` or are not installed."""
    _entry(name).check(device)


def apply_kernels(model: nn.Module, name: str) -> None:
    """Kernels `name` in `model` (on its training device): checked there first."""
    entry = _entry(name)
    entry.check(next(model.parameters()).device)
    entry.apply(model)
