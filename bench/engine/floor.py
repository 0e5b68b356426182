"""The matrix-product floor of a computation: the matrix products (GEMMs) it dispatches, recorded with
their shapes, strides and dtypes, then run alone back to back on operands made once, with nothing in
between. A computation's time as a multiple of its floor says how much of it is arithmetic and how much
is everything else (operator dispatch, pointwise kernels, indexing, Python).

Recorded: aten mm, bmm, addmm, baddbmm, addbmm, matmul (as dispatched: under inference mode a 3-D matmul
arrives whole) and _grouped_mm. Not recorded: attention kernels (scaled_dot_product_attention), softmax,
normalisation, activations, the optimizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = frozenset(
    {
        "aten::mm",
        "aten::bmm",
        "aten::addmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::matmul",
        "aten::_grouped_mm",
    }
)


@dataclass(frozen=True)
class Operand:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor | None = None  # integer operands (grouped offsets) keep their values

    def make(self, device: torch.device | str = "cpu") -> torch.Tensor:
        if self.values is not None:
            return self.values.clone().to(device)
        span = 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride) if size)
        storage = torch.empty(
            span, dtype=self.dtype, device=device
        )  # expanded operands (stride 0) share elements
        storage = storage.normal_() if storage.is_floating_point() else storage.zero_()
        return storage.as_strided(self.shape, self.stride)


def _spec(value):
    if isinstance(value, torch.Tensor):
        keep = None if value.is_floating_point() else value.detach().clone()
        return Operand(tuple(value.shape), tuple(value.stride()), value.dtype, keep)
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(v) for v in value)
    return value


def _make(value, made: dict, key, device):
    if isinstance(value, Operand):
        slot = (key, value.shape, value.stride, value.dtype)
        if slot not in made:
            made[slot] = value.make(device)
        return made[slot]
    if isinstance(value, (list, tuple)):
        return type(value)(_make(v, made, key, device) for v in value)
    return value


@dataclass
class Gemm:
    op: object  # the aten overload
    args: tuple
    kwargs: dict

    def flops(self) -> int:
        """2 x multiply-adds of the product (mm/bmm-shaped operands; matmul as its broadcast)."""
        shapes = [a.shape for a in self.args if isinstance(a, Operand)]
        name = self.op.name()
        if name.endswith(("addmm", "baddbmm", "addbmm")):
            shapes = shapes[1:]
        if len(shapes) < 2:
            return 0
        left, right = shapes[0], shapes[1]
        batch = 1
        for size in left[:-2]:
            batch *= size
        rows = left[-2] if len(left) >= 2 else 1
        return 2 * batch * rows * left[-1] * right[-1]


class GemmRecorder(TorchDispatchMode):
    """Records every GEMM dispatched while active (and runs it)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Gemm] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name() in GEMMS:
            self.calls.append(Gemm(func, _spec(args), _spec(kwargs)))
        return func(*args, **kwargs)


def replay_seconds(
    calls: list[Gemm],
    distinct: bool = True,
    repeats: int = 7,
    loops: int = 20,
    device: torch.device | str = "cpu",
    captured: bool = False,
) -> float:
    """Seconds one pass over `calls` takes alone (the best of `repeats` means over `loops` passes).
    `distinct`: every call gets operands of its own (as in the computation, where each layer has its
    weights and cache); else calls of one shape share operands (less memory; a floor from warm caches,
    so a lower one). `device`: where the operands are made (the time includes waiting for the device).
    `captured` (a CUDA device): the pass captured as one CUDA graph and replayed, so the launches' own
    cost is left out too: the floor a captured decode step is measured against."""
    made: dict = {}
    prepared = [
        (
            call.op,
            _make(call.args, made, i if distinct else 0, device),
            _make(call.kwargs, made, i if distinct else 0, device),
        )
        for i, call in enumerate(calls)
    ]
    best = float("inf")
    with torch.inference_mode():

        def one_pass():
            for op, args, kwargs in prepared:
                op(*args, **kwargs)

        one_pass()  # warm up
        if captured:
            _synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_pass()
            one_pass = graph.replay
        for _ in range(repeats):
            _synchronize(device)
            began = time.perf_counter()
            for _ in range(loops):
                one_pass()
            _synchronize(device)
            best = min(best, (time.perf_counter() - began) / loops)
    return best


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
