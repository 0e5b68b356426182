"""Host memory: which freed CPU blocks the process keeps for reuse, and when it hands them back.

glibc's malloc serves a block above its mmap threshold with a fresh `mmap` and hands it back to the OS on
free; the next tensor of that size faults in every page again, zero-filled by the kernel. Its default
threshold moves (up to 32 MiB) with the blocks freed. `keep_freed_memory(block_mib)` fixes it: blocks up
to `block_mib` MiB come from the heap and stay there when freed, for the next tensor; larger ones get a
mapping of their own. Kept blocks fragment: freed activations leave holes that the backward's differently
sized tensors do not fit, and the heap grows past what is in use. So the size trades page faults against
resident memory (bench/learner/heap_trace.py, SmolLM2-135M's RL step on 2 cores, docs/performance.md): with 1
GiB kept (`kept_block_mib`'s default), the recipe's step peaked at 8.09 GiB resident for at most 4.94 GiB
in use, its update 17.5 s; with 4 MiB, 6.50 GiB for 5.00 GiB, the update 19.7 s in that run and 26.2 s
in another: a run short of memory sets 4, the default keeps the speed. `release_freed_memory` hands
the free pages back to the OS where a step ends (an RL step, an SFT step, a learner rank's update, a
rollout worker's generate call): reuse within a step, none across. Off with `keep_freed_memory: false`
in the config (glibc's defaults). Another malloc preloaded (the config's `malloc`, devices/malloc.py) has
its own size classes and no such trade: these settings then do nothing.
"""

from __future__ import annotations

import ctypes
import sys

from everyprompt.devices.malloc import running_malloc

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
    into, the heap) and raise its trim threshold, for this process; False where the C library is not glibc,
    another malloc is preloaded (devices/malloc.py), or glibc refuses the size (nothing changed there)."""
    global _kept
    if not 1 <= block_mib <= 1024:
        raise ValueError(f"block_mib must be 1..1024 MiB, got {block_mib}")
    mallopt = _glibc("mallopt")
    if mallopt is None or running_malloc() != "glibc":  # another malloc preloaded: glibc's is not used
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


class _MallInfo2(ctypes.Structure):  # malloc.h's `struct mallinfo2` (glibc 2.33 and later)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_usage() -> tuple[int, int] | None:
    """(bytes malloc has handed out and not had back, bytes free inside the heap) of this process, from
    glibc's `mallinfo2`; None where the C library lacks it. A resident set well above the first is the
    heap's fragmentation (bench/learner/heap_trace.py)."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks  # (a mapped block is in use until freed)
