"""Host memory: large CPU tensors reuse freed memory instead of asking the OS for fresh pages.

glibc's malloc serves a block above its mmap threshold (at most 32 MiB by default) with a fresh `mmap` and
hands it back to the OS on free; the next tensor of that size faults in every page again, zero-filled by the
kernel. A training step on a real model makes many such tensors (a chunk of LM-head logits is 100 MB, an
embedding's gradient as much), and on a 2-core CPU the page faults cost as much as the arithmetic on
them: SmolLM2-135M's training micro-batch (16 sequences, bf16 autocast) took 5.0 s with glibc's defaults,
4.3 s with freed blocks kept (docs/performance.md). `keep_freed_memory` raises both thresholds so freed
blocks stay in the process for the next tensor, as PyTorch's CUDA caching allocator does on a GPU and
jemalloc or tcmalloc (preloaded) do on the CPU. Kept blocks can fragment, so the resident memory would creep
up over a run (SmolLM2's recipe: +2.3 GiB over 12 steps with freed blocks kept for the whole run);
`release_freed_memory` hands the free pages back to the OS, and the trainer calls it once a step: reuse
within a step, where the same shapes recur (micro-batches, chunks, decode steps), none across steps. Off
with `keep_freed_memory: false` in the config.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # blocks up to 1 GiB come from (and return to) the heap


def keep_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds for this process; False where the C library is not
    glibc (nothing changed there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))


def release_freed_memory() -> bool:
    """Return the free pages of the heap to the OS (glibc's `malloc_trim`); False where the C library is
    not glibc. A few milliseconds; the next large tensors fault their pages in again."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
