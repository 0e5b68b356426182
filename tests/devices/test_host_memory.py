"""`keep_freed_memory` (devices/host.py): after it, large tensors made again where freed ones were cost no
page faults; without it, every one does; `release_freed_memory` hands kept memory back. Each case in a
fresh interpreter, so this process's allocator is untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys, torch
from everyprompt.devices import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
hidden, head = torch.ones(512, 576), torch.ones(576, 49152)
faults = []
for _ in range(5):  # a chunk of LM-head logits (96 MiB), made and freed, as a training step does
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    hidden @ head
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_freed_large_tensors_are_reused_without_page_faults():
    pages = 512 * 49152 * 4 // 4096
    default, kept = _faults("default"), _faults("keep")
    assert kept["kept"] is True
    assert min(default["faults"]) > pages // 2  # glibc's default: fresh pages every time
    # kept: most are made in freed memory (glibc's aligned allocation sometimes needs a few bytes more
    # than a freed block holds, so some still take fresh pages)
    assert sum(kept["faults"][1:]) < sum(default["faults"][1:]) / 2


RELEASE = """
import json, torch
from everyprompt.devices import keep_freed_memory, release_freed_memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

keep_freed_memory()
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
