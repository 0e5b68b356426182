"""The Ray checkpoint bench (bench/ray_checkpoint.py) end to end, in a process of its own: it starts and
ends its own Ray instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from everyprompt.processes import descendants
from tests.distributed.conftest import needs_ray
from tests.distributed.test_cli_ray import _alive, _ray_processes

ROOT = Path(__file__).resolve().parents[2]


@needs_ray
@pytest.mark.slow  # two set-ups of two Ray learner ranks: under a minute on 2 cores
def test_the_checkpoint_bench_measures_both_ways_and_leaves_nothing(tmp_path):
    before = _ray_processes()
    out = tmp_path / "ray_checkpoint.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.ray_checkpoint", "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    setups = json.loads(out.read_text())["setups"]
    assert set(setups) == {"2 ranks ddp", "2 ranks fsdp2"}
    for name, row in setups.items():
        gathered, mine = row["gathered into the driver"], row["written by the ranks"]
        # the weights and AdamW's two moments came through Ray before; nothing does now
        assert gathered["to_driver_mib"] == pytest.approx(3 * row["weights_mib"], rel=0.05), name
        assert mine["to_driver_mib"] < 0.1 and mine["checkpoint_s"] > 0, name
        assert {"driver_private_vs_gathered", "checkpoint_s_vs_gathered"} <= set(mine), name
        # the driver let its copy of the weights go: about their size came back
        assert row["driver_released_mib"] > 0.5 * row["weights_mib"], name
    # new since, and not this process's own Ray instance's (its workers start as the tests need them)
    own = descendants(os.getpid())
    started = {pid: t for pid, t in _ray_processes().items() if before.get(pid) != t and pid not in own}
    deadline = time.monotonic() + 15  # a process ray.shutdown stopped exits shortly after
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(started), "the bench's Ray processes outlived it"
