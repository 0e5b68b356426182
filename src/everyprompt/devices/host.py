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
`release_freed_memory` hands the free pages back to the OS, and every process that keeps them calls it
where its step ends (an RL step, an SFT step, a learner rank's update, a rollout worker's generate call):
reuse within a step, where the same shapes recur (micro-batches, chunks, decode steps), none across
steps. Off with `keep_freed_memory: false` in the config.

Which blocks are kept is a size (`kept_block_mib`): a block above it still gets a mapping of its own and goes
back to the OS when freed. Kept blocks fragment within a step too: freed activations leave holes the
backward's differently sized tensors do not fit, and the heap grows past what is in use (SmolLM2's update
at group size 16: 8.5 GiB resident for at most 5.0 GiB of live blocks, docs/performance.md). The smaller the
kept blocks, the closer the resident set stays to what is in use, and the more page faults a step pays.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top stays until `release_freed_memory`
_kept = False  # whether this process keeps freed memory (release is a no-op otherwise)


def _glibc(name: str):
    """glibc's function `name` through ctypes, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), name, None)  # (musl has neither mallopt nor malloc_trim)


def keep_freed_memory(block_mib: int = 1024) -> bool:
    """Set glibc malloc's mmap threshold to `block_mib` MiB (blocks up to it come from, and are freed back
    into, the heap) and raise its trim threshold, for this process; False where the C library is not glibc
    or refuses the size (nothing changed there)."""
    global _kept
    if not 1 <= block_mib <= 1024:
        raise ValueError(f"block_mib must be 1..1024 MiB, got {block_mib}")
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    threshold = block_mib << 20
    _kept = bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def release_freed_memory() -> bool:
    """At the end of a step: return the free pages of the heap to the OS (glibc's `malloc_trim`) if this
    process keeps freed memory; True if it did. A few milliseconds; the next large tensors fault their
    pages in again."""
    trim = _glibc("malloc_trim") if _kept else None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
