"""The memory figures an SFT step and an RL update log (devices/memory.py): the host's resident peak as
the kernel keeps it, CUDA's peaks per step, and both reaching a run's metrics."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from everyprompt.devices import memory
from everyprompt.devices.memory import memory_metrics, peak_resident_gib
from everyprompt.pipeline import train
from tests.conftest import tiny_config

LINUX = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")

GROW = """
import os, torch
from everyprompt.devices.memory import peak_resident_gib
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 30)
before = resident()
block = torch.ones(512 << 20, dtype=torch.uint8)  # 0.5 GiB, every page written
print(before, resident(), peak_resident_gib())
"""


@LINUX
def test_the_peak_is_the_kernels_high_water_mark():
    status = Path("/proc/self/status").read_text()
    hwm_kib = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
    # the same high-water mark, read a moment apart through two interfaces (the kernel folds its per-CPU
    # page counts into them at different times): they agree within a few hundred KiB
    assert peak_resident_gib() == pytest.approx(hwm_kib / (1 << 20), abs=2 / 1024)


@LINUX
def test_the_peak_rises_by_what_a_fresh_process_touches():
    run = subprocess.run([sys.executable, "-c", GROW], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    before, after, peak = map(float, run.stdout.split())
    # the peak holds what is resident now, the block's half GiB included; no upper bound on the rise: a
    # loaded CI machine saw 0.61 GiB, the first kernel's library pages and threads faulted in beside the block
    assert after - before >= 0.49
    assert peak >= after - 2 / 1024


def test_a_cuda_learner_reports_its_steps_peaks_and_resets_them(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("alloc", d)) or 3 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: calls.append(("reserved", d)) or 5 << 29)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(memory, "peak_resident_gib", lambda: 1.25)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    device = torch.device("cuda:1")
    figures = memory_metrics(device)
    assert figures == {
        "memory/peak_rss_gib": 1.25,
        "memory/cuda_peak_gib": 3.0,
        "memory/cuda_reserved_peak_gib": 2.5,
    }
    assert calls == [("alloc", device), ("reserved", device), ("reset", device)]  # read, then reset
    assert memory_metrics(torch.device("cpu")) == {"memory/peak_rss_gib": 1.25}  # no CUDA call on a CPU
    assert len(calls) == 3


def test_every_sft_and_rl_step_logs_the_learners_peak(tmp_path):
    config = tiny_config()
    train(config, run_dir=tmp_path)
    for log, steps in (
        (tmp_path / "sft" / "metrics.jsonl", config.sft.steps),
        (tmp_path / "metrics.jsonl", config.rl.steps),
    ):
        peaks = [json.loads(line)["memory/peak_rss_gib"] for line in log.read_text().splitlines()]
        assert len(peaks) == steps and all(peak > 0.1 for peak in peaks)
        assert peaks == sorted(peaks)  # a high-water mark never falls
