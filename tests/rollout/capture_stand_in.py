"""torch.cuda's capture machinery stood in for on the CPU, so that `StepGraphs._capture` (graphs.py) runs
for real: streams that wait on nothing, a capture context in which the body runs eagerly, a graph class of
the test's choosing, no memory pool and no memory."""

from __future__ import annotations

import contextlib

import torch


class _Stream:
    def wait_stream(self, other):
        pass


def stand_in_capture(monkeypatch, graph_class) -> None:
    """Within the test, `torch.cuda.CUDAGraph` is `graph_class` (its `replay` decides what the "graph"
    writes) and the rest of the capture machinery does nothing."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **options: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
