"""Named phases of a loop for torch's profiler: `phase("prefill")` marks the code inside it as the range
`everyprompt/prefill` while a profiler records, and costs nothing otherwise (a check of the profiler's
state, no operator dispatched). The native engine's decode loop marks its phases (prefill, extend, sample,
forward, and read: waiting for a step's tokens), so a profile of a rollout can say during which phase the device was idle
(bench/throughput/timeline.py)."""

from __future__ import annotations

import contextlib

import torch

PREFIX = "everyprompt/"


def phase(name: str):
    """The profiler range `everyprompt/<name>` while a profiler records, else a context that does nothing."""
    # torch's own flag of a running profiler (private; where a release drops it, the range is always made:
    # correct, a few microseconds a phase)
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()
