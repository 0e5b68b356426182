"""The memory figures every RL update and SFT step logs: how much the learner's process has held.

- `memory/peak_rss_gib`: the process's resident high-water mark since it started (the kernel's
  `ru_maxrss`), host memory, in GiB. It only grows: a step that needed more than any before raises it.
  Under Ray it is the learner rank's process (rank 0's figures are the ones logged), not the driver's.
- `memory/cuda_peak_gib`, `memory/cuda_reserved_peak_gib`, where the learner is on a CUDA device: what
  torch's caching allocator had allocated (tensors) and reserved (tensors and its cache) at most during
  the step, in GiB; the peaks are reset after each reading, so each step reports its own.
"""

from __future__ import annotations

import resource
import sys

import torch

GIB = 1 << 30
# ru_maxrss is in KiB on Linux, in bytes on macOS
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def peak_resident_bytes() -> int:
    """The process's resident high-water mark so far, in bytes (the benches' `peak_rss_bytes` too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT


def peak_resident_gib() -> float:
    """The process's resident high-water mark so far, in GiB."""
    return peak_resident_bytes() / GIB


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The step's memory figures for a learner on `device` (module docstring); resets CUDA's peaks."""
    figures = {"memory/peak_rss_gib": peak_resident_gib()}
    # (a learner on CUDA has initialised it; the fake CUDA device of the CPU tests has not, and has no
    # allocator to ask)
    if device.type == "cuda" and torch.cuda.is_initialized():
        figures["memory/cuda_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        figures["memory/cuda_reserved_peak_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    return figures
