"""`everyprompt train ... cluster.backend=ray` from the command line: it runs, and a run killed with SIGKILL
leaves no process behind (its local Ray instance included); without Ray installed, a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from everyprompt.cli import main
from everyprompt.config import ConfigError
from everyprompt.distributed.runtime import require_ray
from tests.conftest import TINY_OVERRIDES
from tests.distributed.conftest import needs_ray

RAY_RUN = (
    *TINY_OVERRIDES,
    "sft.steps=0",
    "cluster.backend=ray",
    "cluster.rollout_workers=2",
    "cluster.trainer_ranks=2",
)


def _ray_processes() -> dict[int, int]:
    """Ray's processes on this machine (servers, agents, workers): pid -> start time."""
    from everyprompt.distributed.reaper import _start_time

    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if command.startswith(b"ray::") or b"/site-packages/ray/" in command:
            started = _start_time(int(entry.name))
            if started is not None:
                found[int(entry.name)] = started
    return found


def _alive(processes: dict[int, int]) -> set[int]:
    """Those of `processes` still running as themselves (same start time: not a reused pid)."""
    from everyprompt.distributed.reaper import _start_time

    return {pid for pid, started in processes.items() if _start_time(pid) == started}


def _wait_for_steps(child, metrics: Path, count: int) -> None:
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= count):
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"the Ray run logged fewer than {count} steps in 180 s"
        time.sleep(0.3)


def _start(argv: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "everyprompt.cli", "train", *argv]
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )


def _kill_and_check_nothing_is_left(child, started: dict[int, int]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 30
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(started) == set(), f"left running after SIGKILL: {sorted(_alive(started))}"


# one worker and one rank: the processes that must end are of the same kinds, fewer to start
ONE_EACH = [*TINY_OVERRIDES, "sft.steps=0", "cluster.backend=ray", "rl.steps=200", "checkpoint.every=0"]


# slow (about 35 s; `make test-slow`): a killed run leaving nothing is checked without Ray in tests/test_process_lifecycle.py
@pytest.mark.slow
@needs_ray
def test_a_ray_run_killed_with_sigkill_leaves_nothing(tmp_path):
    before = _ray_processes()  # another test's Ray instance may be up: only new processes count
    run = tmp_path / "run"
    child = _start([*ONE_EACH, "--run-dir", str(run)])
    started: dict[int, int] = {}
    try:
        _wait_for_steps(child, run / "metrics.jsonl", 1)
        started = {pid: t for pid, t in _ray_processes().items() if before.get(pid) != t}
        kinds = {(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]) for pid in _alive(started)}
        assert {b"ray::RolloutWorker", b"ray::LearnerRank"} <= {k.split(b".")[0].strip() for k in kinds}, (
            kinds
        )
    finally:
        _kill_and_check_nothing_is_left(child, started)


@pytest.mark.slow
@needs_ray
def test_a_ray_run_stops_on_ctrl_c_and_resumes(tmp_path):
    """Ctrl-C (SIGINT to the run's process group) ends the step and checkpoints, as in one process; the
    run resumes from it on the Ray backend."""
    before = _ray_processes()
    run = tmp_path / "run"
    child = _start([*ONE_EACH, "--run-dir", str(run)])
    try:
        _wait_for_steps(child, run / "metrics.jsonl", 1)
        os.killpg(child.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole job's group
        assert child.wait(timeout=120) == 130
        said = child.stderr.read().decode()
        assert f"everyprompt train --resume {run}" in said, said[-2000:]
    finally:
        child.kill()
        child.wait()
    stopped_at = len((run / "metrics.jsonl").read_text().splitlines())
    assert (run / "checkpoints" / f"step_{stopped_at}").is_dir()
    child = _start(["--resume", str(run)])
    try:
        _wait_for_steps(child, run / "metrics.jsonl", stopped_at + 1)
    finally:
        _kill_and_check_nothing_is_left(
            child, {pid: t for pid, t in _ray_processes().items() if before.get(pid) != t}
        )


def test_backend_ray_without_ray_installed_is_a_config_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(ConfigError, match=r"cluster.backend.*pip install 'everyprompt\[ray\]'"):
        require_ray()
    assert main(["train", *RAY_RUN, "--run-dir", str(tmp_path)]) == 2
    assert "pip install 'everyprompt[ray]'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize(
    "bad, says",
    [
        ("cluster.rollout_workers=2", "need cluster.backend=ray"),
        pytest.param(
            "cluster.num_gpus=1",
            "torch sees no CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
        ("cluster.num_gpus=1 model.device=cpu", "reserved and left idle"),
        pytest.param(
            "cluster.backend=ray cluster.num_gpus=1",
            "2 actors need 2 GPUs",
            marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs"),
        ),
        ("model.device=tpu", "expected one of auto, cpu, cuda, cuda:N"),
        ("cluster.trainer_sharding=zero3", "'ddp' or 'fsdp2'"),
        ("cluster.backend=slurm", "'local' or 'ray'"),
    ],
)
def test_bad_cluster_settings_are_config_errors(bad, says, tmp_path, capsys):
    assert main(["train", *TINY_OVERRIDES, *bad.split(), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert ("cluster" in err or "device" in err) and says in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()  # stopped before any work
