"""Whether bfloat16 is fast on this CPU. With AVX-512 (BF16 or AMX) torch's CPU matmuls run bf16 at least as
fast as fp32; without them bf16 is emulated: on an AMD EPYC with AVX2 only, a [512 x 576] x [576 x 1536]
product took 788 ms in bf16 against 12 ms in fp32 (one thread), so a recipe that trains under bf16
autocast there (configs/smollm2.yaml) did not finish its first RL step in 20 CPU-minutes. A run that asks
for bf16 on the CPU measures it once (a 512-wide product, under a second at worst): where it is slow the
learner computes its bf16 products on float32 kernels (`model.cpu_bf16=auto`, models/emulated_bf16.py), and
the run warns of the bf16 left on torch's slow kernels (`model.cpu_bf16=native`, the engine's
`rollout.precision=bf16`)."""

from __future__ import annotations

import functools
import time

import torch

SLOW = 4.0  # bf16 this many times slower than fp32: worth a warning
SIZE = 512  # smaller products hide it: at 256 bf16 was only 1.6x fp32 on that CPU, at 512 12x


@functools.cache
def cpu_bf16_slowdown() -> float:
    """How many times an fp32 matmul a bf16 one takes on this CPU (best of three, square SIZE products),
    on torch's own kernels wherever it is first asked (not under autocast, nor a torch-function mode such
    as the learner's bf16 emulation, either of which would measure something else)."""
    with torch.autocast("cpu", enabled=False), torch._C.DisableTorchFunction():
        return _slowdown()


def _slowdown() -> float:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(SIZE, SIZE, generator=generator), torch.randn(SIZE, SIZE, generator=generator)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # warm-up
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            x @ y
            best = min(best, time.perf_counter() - start)
        seconds[dtype] = best
    return seconds[torch.bfloat16] / max(seconds[torch.float32], 1e-9)


def slow_bf16_note(keys: list[str], slowdown: float | None = None) -> str | None:
    """A warning for the settings `keys` that put bf16 on the CPU, when bf16 is slow here; else None."""
    if not keys:
        return None
    slowdown = cpu_bf16_slowdown() if slowdown is None else slowdown
    if slowdown < SLOW:
        return None
    return (
        f"{' and '.join(keys)}: a bf16 matmul takes {slowdown:.0f}x an fp32 one on this CPU "
        f"({torch.backends.cpu.get_cpu_capability()}: no fast bf16 instructions), so this run will be slow; "
        f"set {' '.join(key.replace('bf16', 'fp32') for key in keys)} here (a recipe's timings were measured "
        "on a CPU with AVX-512)"
    )
