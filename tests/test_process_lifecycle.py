"""Process lifecycle: a killed run leaves nothing behind; a signalled run stops cleanly and resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from everyprompt.processes import descendants, is_alive
from tests.conftest import TINY_OVERRIDES


@pytest.mark.long  # 13 s on 2 cores: `make test-long`
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_a_run_killed_during_rl_leaves_no_reward_worker(tmp_path):
    overrides = [*TINY_OVERRIDES, "rl.steps=200", "rewards.workers=2", "checkpoint.every=0"]
    run = subprocess.Popen(
        [sys.executable, "-m", "everyprompt.cli", "train", *overrides, "--run-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600  # a bound on a hang, far above the work
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):  # RL is under way
            assert run.poll() is None and time.monotonic() < deadline, "the run ended or never reached RL"
            time.sleep(0.2)
        workers = descendants(run.pid)
        assert len(workers) >= 2  # the two reward workers (and any helper they started)
    finally:
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
    deadline = time.monotonic() + 30  # a bound, far above the ~1 s the workers take to notice
    while any(is_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in workers if is_alive(p)]
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind 5 s after the kill: {left}"


def _start_train(tmp_path, *extra):
    overrides = [*TINY_OVERRIDES, "checkpoint.every=0", *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "everyprompt.cli", "train", *overrides, "--run-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_lines(process, path: Path, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text().count("\n") >= count):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or never got there"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)],  # same handler
)
def test_a_signal_ends_the_step_checkpoints_and_says_how_to_resume(tmp_path, signum, code):
    run = _start_train(tmp_path, "rl.steps=200")
    try:
        _wait_for_lines(run, tmp_path / "metrics.jsonl", 1)
        run.send_signal(signum)
        _, err = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == code, err
    assert f"continue with: everyprompt train --resume {tmp_path}" in err and "Traceback" not in err
    steps = (tmp_path / "metrics.jsonl").read_text().count("\n")
    assert (tmp_path / "checkpoints" / "latest").resolve().name == f"step_{steps}"


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_a_signal_during_sft_checkpoints_sft_and_the_resume_finishes_it(tmp_path):
    run = _start_train(tmp_path, "sft.steps=100", "sft.checkpoint_every=0", "rl.steps=1")
    try:
        _wait_for_lines(run, tmp_path / "sft" / "metrics.jsonl", 2)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 143 and "after SFT step" in err, err
    (checkpoint,) = (tmp_path / "checkpoints").glob("sft_step_*")
    done = subprocess.run(
        [sys.executable, "-m", "everyprompt.cli", "train", "--resume", str(tmp_path), "sft.steps=100"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"SFTresumesfrom{checkpoint}" in "".join(done.stderr.split())  # the console wraps long lines
    steps = [line for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 100
