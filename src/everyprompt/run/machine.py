"""The machine a run's figures came from: its CPU, the kernels torch chose for it, threads and versions.

Two machines of the same kind can give one seed different figures. torch picks its vectorised CPU kernels
by the instruction set the CPU has (AVX-512 or AVX2; the environment variable `ATEN_CPU_CAPABILITY`
overrides the choice), and the two round differently; the thread count changes the order of reductions.
A run is bitwise repeatable on one machine, but a rounding difference in the first SFT step grows over
hundreds of steps into different samples and different held-out figures (docs/runs.md, "Reproducibility").
`summary.json` and the benchmarks' results record this block so that figures can be told apart.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(dtype: str | None = None) -> dict:
    """Cores, the CPU, torch's kernel set (`cpu_capability`) and threads, and torch's version."""
    import torch

    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **({"dtype": dtype} if dtype else {}),
    }
