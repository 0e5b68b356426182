"""Torch's threads fitted to the cores other processes leave free (devices/cores.py): the count from a
phase's figures, worked by hand, and the figures from /proc."""

from __future__ import annotations

import pytest
import torch

from everyprompt.devices import cores


def test_the_threads_are_the_free_cores_rounded_with_a_spare_share_never_above_the_limit():
    share = cores.CoreShare(limit=2, cores=2)
    assert share.threads(0.0) == 2  # quiet
    assert share.threads(0.5) == 1  # int(2 - 0.5 + 0.4) = int(1.9) = 1
    assert share.threads(0.55) == 1
    assert share.threads(0.35) == 2  # int(2.05) = 2: a share of under 0.4 of a core leaves both
    assert share.threads(0.65) == 1  # int(2 - 0.65 + 0.4) = int(1.75) = 1
    assert share.threads(1.0) == 1  # one busy process: int(1.4) = 1
    assert share.threads(3.0) == 1  # never below one
    assert cores.CoreShare(limit=8, cores=16).threads(2.0) == 8  # never above the run's threads
    assert cores.CoreShare(limit=16, cores=16).threads(2.3) == 14  # int(16 - 2.3 + 0.4) = int(14.1)


def test_the_others_are_the_machine_s_busy_time_less_this_process_s_over_the_wall_time(monkeypatch):
    ticks = {"busy": 1000, "own": 400, "wall": 10.0}
    monkeypatch.setattr(cores, "_busy_ticks", lambda: ticks["busy"])
    monkeypatch.setattr(cores, "_own_ticks", lambda: ticks["own"])
    monkeypatch.setattr(cores.time, "perf_counter", lambda: ticks["wall"])
    share = cores.CoreShare(limit=2, cores=2)
    share.ticks = 100  # clock ticks a second
    # 4 s: the machine busy for 800 ticks (2 cores' worth), this process 400 of them: others 1.0 core
    ticks.update(busy=1800, own=800, wall=14.0)
    assert share.measure() == pytest.approx(1.0)
    # the next 2 s: 380 busy ticks, 360 ours: others 0.1 core
    ticks.update(busy=2180, own=1160, wall=16.0)
    assert share.measure() == pytest.approx(0.1)
    assert share.threads(share.others) == 2


def test_fit_sets_torch_s_threads_in_the_calling_thread(monkeypatch):
    before = torch.get_num_threads()
    share = cores.CoreShare(limit=2, cores=2)
    try:
        monkeypatch.setattr(share, "measure", lambda: 1.0)
        assert share.fit() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(share, "measure", lambda: 0.0)
        assert share.fit() == 2 and torch.get_num_threads() == 2
        assert cores.CoreShare(limit=1, cores=2).fit() == 1  # one thread given: nothing measured
    finally:
        torch.set_num_threads(before)


def test_the_figures_are_read_from_proc_where_it_exists():
    if cores._busy_ticks() is None:
        pytest.skip("no /proc/stat here: the threads stay as given")
    assert cores._busy_ticks() > 0 and cores._own_ticks() >= 0
    share = cores.CoreShare(limit=2)
    share.measure()  # waits out the first window, then a figure
    assert share.measured and share._last.busy > 0
