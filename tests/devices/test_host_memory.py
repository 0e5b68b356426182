"""`keep_freed_memory` (devices/host.py): after it, large tensors come from the heap, where freed memory
stays for the next one (glibc's default maps each apart and unmaps it on free); `release_freed_memory`
hands kept memory back. Each case in a fresh interpreter, so this process's allocator is untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys, torch
from everyprompt.devices import keep_freed_memory, release_freed_memory
kept = keep_freed_memory(int(sys.argv[2])) if sys.argv[1] == "keep" else None
heap = []
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        heap = [int(bound, 16) for bound in line.split()[0].split("-")]
block = torch.empty(int(sys.argv[3]) * 2**20, dtype=torch.uint8)  # 96 MiB: a chunk of LM-head logits
for line in open("/proc/self/maps"):  # the heap grew to hold it, or it got a mapping of its own
    if line.rstrip().endswith("[heap]"):
        heap = [int(bound, 16) for bound in line.split()[0].split("-")]
in_heap = bool(heap) and heap[0] <= block.data_ptr() < heap[1]
print(json.dumps({"kept": kept, "in_heap": in_heap, "released": release_freed_memory()}))
"""


def _probe(mode: str, kept_mib: int = 1024, block_mib: int = 96) -> dict:
    """Where a `block_mib` MiB tensor lands after `keep_freed_memory(kept_mib)` (mode "keep") or with
    glibc's defaults (any other mode)."""
    args = [sys.executable, "-c", PROBE, mode, str(kept_mib), str(block_mib)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.long  # 8 s on 2 cores: `make test-long`
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_large_tensors_come_from_the_heap_where_freed_memory_is_kept():
    """glibc's default gives a 96 MiB block a mapping of its own, returned to the OS on free (the next one
    faults its pages in again); kept, it comes from the heap, where freed blocks stay for the next."""
    default, kept = _probe("default"), _probe("keep")
    assert kept["kept"] is True
    assert not default["in_heap"] and kept["in_heap"]
    assert not default["released"] and kept["released"]  # a step's end trims only where memory is kept


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_blocks_above_the_kept_size_get_mappings_of_their_own():
    """`kept_block_mib`: with 64 MiB kept, a 48 MiB block comes from the heap and a 96 MiB one is mapped
    apart (returned to the OS when freed: it cannot leave a hole in the heap)."""
    small, large = _probe("keep", kept_mib=64, block_mib=48), _probe("keep", kept_mib=64, block_mib=96)
    assert small["kept"] is True and large["kept"] is True
    assert small["in_heap"] and not large["in_heap"]


def test_a_kept_size_out_of_range_is_refused():
    from everyprompt.devices import keep_freed_memory

    with pytest.raises(ValueError, match="block_mib must be 1..1024 MiB, got 0"):
        keep_freed_memory(0)


RELEASE = """
import json, torch
from everyprompt.devices import keep_freed_memory, release_freed_memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

keep_freed_memory(1024)  # a 256 MiB block is kept only with blocks that large kept
x = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
pin = torch.ones(16)  # a later small block, so the freed one is not at the heap's top
with_x = resident()
del x
kept = resident()
released = release_freed_memory()
print(json.dumps({"with": with_x, "kept": kept, "after": resident(), "released": released}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_kept_memory_is_handed_back_by_release():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True)
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    block = 256 * 2**20
    assert sizes["released"] is True
    assert sizes["kept"] > sizes["with"] - block // 8  # freed but kept in the process
    assert sizes["after"] < sizes["kept"] - block // 2  # handed back


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2: Linux only")
def test_heap_usage_counts_a_block_while_it_lives():
    import torch

    from everyprompt.devices import heap_usage

    block_bytes = 64 * 2**20
    before = heap_usage()
    if before is None:
        pytest.skip("this C library has no mallinfo2 (glibc before 2.33, or not glibc)")
    block = torch.ones(block_bytes, dtype=torch.uint8)
    during = heap_usage()
    del block
    after = heap_usage()
    # other threads of this process (pytest-xdist's messaging) allocate and free a few bytes meanwhile
    slack = 2**20
    assert during[0] - before[0] >= block_bytes - slack  # handed out, whether from the heap or mapped apart
    assert during[0] - after[0] >= block_bytes - slack  # and counted back when freed
